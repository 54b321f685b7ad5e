"""HAP: shapes, permutation invariance, pipeline layers vs the whole model, learning on MUTAG,
baselines, the TU loader's scratch copy and the cross-validation experiment's outputs."""

from __future__ import annotations

import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch_geometric.loader import DataLoader

from analysis.hap_experiment import merge_results, run_hap_experiment
from analysis.hap_protocol import DatasetPlan, Protocol, carry_over, parse_plan, run_protocol, splits
from analysis.hap_report import holm, paired_tests
from exec.hap.baselines import METHODS, build_classifier
from exec.hap.data import TU_URL, dense_batch, graph_labels, load_tu, majority_accuracy
from exec.hap.model import CONTENT_MODES, HAP, MOA, HAPConfig, hop_distances, pack_graph, unpack_graph
from exec.hap.train import SizeBucketedBatches, TrainConfig, fit, fit_tuned
from exec.workloads import get_workload, run_layers
from traces.errors import ConfigError

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def mutag(tmp_path_factory: pytest.TempPathFactory):
    return load_tu("MUTAG", cache_dir=tmp_path_factory.mktemp("tu"))


def random_graphs(batch: int, nodes: int, features: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Padded random undirected graphs of different sizes (the first graph fills all ``nodes``)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, nodes + 1, (batch,), generator=gen)
    sizes[0] = nodes
    mask = torch.arange(nodes) < sizes.unsqueeze(1)
    upper = (torch.rand(batch, nodes, nodes, generator=gen) < 0.3).float().triu(1)
    adj = (upper + upper.transpose(1, 2)) * mask.unsqueeze(1) * mask.unsqueeze(2)
    x = torch.randn(batch, nodes, features, generator=gen) * mask.unsqueeze(-1)
    return x, adj, mask


def test_output_shapes_and_levels() -> None:
    torch.manual_seed(0)
    model = HAP(HAPConfig(in_features=5, num_classes=3, hidden=8, clusters=(6, 2)))
    x, adj, mask = random_graphs(4, 10, 5, seed=0)
    assert model(x, adj, mask).shape == (4, 3)
    assert model.embed(x, adj, mask).shape == (4, 16)
    x1, adj1, mask1 = model.levels[0](x, adj, mask)
    assert x1.shape == (4, 6, 8) and adj1.shape == (4, 6, 6) and bool(mask1.all())
    loss = model.content_loss.detach()
    assert loss.dim() == 0 and 0 <= float(loss) <= 2


def test_pack_unpack_round_trip() -> None:
    x, adj, mask = random_graphs(3, 7, 4, seed=1)
    packed = pack_graph(x, adj, mask)
    assert packed.shape == (3, 7, 4 + 7 + 1)
    x2, adj2, mask2 = unpack_graph(packed)
    assert torch.equal(x2, x) and torch.equal(adj2, adj) and torch.equal(mask2, mask)


def test_graph_embedding_is_invariant_to_node_permutation() -> None:
    torch.manual_seed(1)
    model = HAP(HAPConfig(in_features=5, num_classes=2, hidden=16, clusters=(5, 2))).eval()
    x, adj, mask = random_graphs(5, 12, 5, seed=2)
    reference = model.embed(x, adj, mask)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        # a different permutation per graph, padding included (padded slots end up scattered)
        perm = torch.stack([torch.randperm(12, generator=gen) for _ in range(5)])
        rows = torch.arange(5).unsqueeze(1)
        px, pmask = x[rows, perm], mask[rows, perm]
        padj = adj[rows.unsqueeze(2), perm.unsqueeze(2), perm.unsqueeze(1)]
        torch.testing.assert_close(model.embed(px, padj, pmask), reference, atol=1e-5, rtol=1e-5)
    # ...but it does see the structure: rewiring one graph changes its embedding
    rewired = adj.clone()
    rewired[0] = 1 - rewired[0] - torch.eye(12)
    assert not torch.allclose(model.embed(x, rewired, mask)[0], reference[0], atol=1e-4)


def test_padding_does_not_change_the_embedding() -> None:
    torch.manual_seed(2)
    model = HAP(HAPConfig(in_features=3, num_classes=2, hidden=8, clusters=(4, 2))).eval()
    x, adj, mask = random_graphs(3, 9, 3, seed=4)
    n = int(mask[1].sum())
    alone = model.embed(x[1:2, :n], adj[1:2, :n, :n], mask[1:2, :n])
    torch.testing.assert_close(model.embed(x, adj, mask)[1:2], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["hap-tiny", "hap-mutag"])
def test_workload_layers_chained_equal_the_full_model(name: str) -> None:
    wl = get_workload(name)
    layers = wl.build_layers(seed=5)
    assert wl.layer_names() == ["level0", "level1", "readout"]
    model = HAP(wl.model_config).eval()
    for i, level in enumerate(model.levels):
        level.load_state_dict(layers[i].level.state_dict())
    model.readout.load_state_dict(layers[-1].readout.state_dict())
    batch = wl.make_batch(6, seed=7)
    x, adj, mask = unpack_graph(batch.inputs)
    torch.testing.assert_close(run_layers(layers, batch.inputs), model(x, adj, mask), atol=1e-6, rtol=1e-5)
    # two-way pipeline partition: bit for bit the same as the whole
    first, second = wl.build_layers(0, 1, seed=5), wl.build_layers(1, wl.num_layers, seed=5)
    assert torch.equal(run_layers(second, run_layers(first, batch.inputs)), run_layers(layers, batch.inputs))
    loss = wl.loss(run_layers(layers, batch.inputs), batch.targets)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_workload_batches_are_deterministic_and_build_on_meta() -> None:
    wl = get_workload("hap-mutag")
    a, b, c = wl.make_batch(4, seed=1), wl.make_batch(4, seed=1), wl.make_batch(4, seed=2)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs)
    assert a.inputs.shape == (4, 28, 7 + 28 + 1) and set(a.targets.tolist()) <= {0, 1}
    tiny = get_workload("hap-tiny", hidden=32, clusters=[6, 3])
    layers = tiny.build_layers(device="meta")
    assert all(p.device.type == "meta" for p in layers.parameters())
    out = run_layers(layers, tiny.make_batch(5, device="meta").inputs)  # shapes without data
    assert out.shape == (5, 2) and out.device.type == "meta"
    with pytest.raises(ConfigError, match="workload"):
        get_workload("hap-tiny", depth=3)
    with pytest.raises(ConfigError, match="MUTAG"):
        get_workload("hap-mutag", in_features=3)


def test_hap_learns_mutag_beyond_the_majority_class(mutag) -> None:
    from sklearn.model_selection import train_test_split

    labels = graph_labels(mutag)
    train, test = train_test_split(torch.arange(len(mutag)).numpy(), test_size=0.25, stratify=labels.numpy(),
                                   random_state=0)
    train, val = train_test_split(train, test_size=0.15, stratify=labels[train].numpy(), random_state=0)
    config = TrainConfig(epochs=40, clusters=(9, 3))
    result = fit("hap", mutag, torch.as_tensor(train), torch.as_tensor(val), torch.as_tensor(test), config)
    majority = majority_accuracy(labels[torch.as_tensor(test)])
    assert result.test_accuracy > majority, (result, majority)


def test_every_baseline_gives_logits_and_a_finite_regulariser(mutag) -> None:
    batch = next(iter(DataLoader(mutag, batch_size=8)))
    for method in METHODS:
        torch.manual_seed(0)
        model = build_classifier(method, mutag.num_features, mutag.num_classes, hidden=16, clusters=(6, 2))
        logits, aux = model(batch)
        assert logits.shape == (8, 2) and aux.dim() == 0 and torch.isfinite(aux), method
        (logits.sum() + aux).backward()
    with pytest.raises(ConfigError, match="method"):
        build_classifier("gin", 7, 2)


def test_loader_reads_a_scratch_copy_and_never_writes_next_to_the_data(tmp_path: Path, mutag) -> None:
    x, adj, mask = dense_batch(next(iter(DataLoader(mutag, batch_size=4))))
    assert mutag.num_features == 7 and mutag.num_classes == 2 and len(mutag) == 188
    assert x.shape[-1] == 7 and adj.shape[1] == adj.shape[2] == x.shape[1] and mask.dtype == torch.bool
    assert torch.bincount(graph_labels(mutag)).tolist() == [63, 125]  # MUTAG README: 63 / 125
    source = tmp_path / "source"
    (source / "MUTAG").mkdir(parents=True)
    original = Path(mutag.root) / "MUTAG" / "raw"
    (source / "MUTAG" / "raw").symlink_to(original)  # stand-in for a read-only user copy
    before = sorted(p.name for p in (source / "MUTAG").iterdir())
    again = load_tu("MUTAG", data_root=source, cache_dir=tmp_path / "cache")
    assert len(again) == 188 and (tmp_path / "cache" / "MUTAG" / "processed").is_dir()
    assert sorted(p.name for p in (source / "MUTAG").iterdir()) == before
    with pytest.raises(ConfigError, match="dataset"):
        load_tu("NOPE", data_root=source, cache_dir=tmp_path / "cache")


def test_mutag_and_ptc_mr_ship_with_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARATWIN_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    ptc = load_tu("PTC_MR", cache_dir=tmp_path / "scratch")
    assert len(ptc) == 344 and ptc.num_features == 18  # PTC_MR README: 344 graphs, 18 node labels
    assert torch.bincount(graph_labels(ptc)).tolist() == [192, 152]
    package_tu = Path(__file__).resolve().parents[1] / "exec" / "data" / "TU"
    assert not (package_tu / "PTC_MR" / "processed").exists()  # built in the scratch copy only


def _write_tu(root: Path, name: str, attributes: list[float]) -> None:
    """A two-graph TU data set (a triangle and an edge) with one continuous node attribute."""
    raw = root / name / "raw"
    raw.mkdir(parents=True)
    edges = [(1, 2), (2, 1), (2, 3), (3, 2), (1, 3), (3, 1), (4, 5), (5, 4)]
    (raw / f"{name}_A.txt").write_text("".join(f"{a}, {b}\n" for a, b in edges))
    (raw / f"{name}_graph_indicator.txt").write_text("1\n1\n1\n2\n2\n")
    (raw / f"{name}_graph_labels.txt").write_text("1\n2\n")
    (raw / f"{name}_node_labels.txt").write_text("0\n1\n0\n1\n1\n")
    (raw / f"{name}_node_attributes.txt").write_text("".join(f"{v}\n" for v in attributes))


def test_continuous_attributes_are_standardized_and_paratwin_data_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # PROTEINS-like: one continuous attribute with a wide range, then the one-hot node labels.
    _write_tu(tmp_path / "user" / "TU", "PROTEINS", [-538.0, 798.0, 10.0, 3.0, 0.5])
    monkeypatch.setenv("PARATWIN_DATA", str(tmp_path / "user"))
    dataset = load_tu("PROTEINS", cache_dir=tmp_path / "scratch")
    attribute = dataset._data.x[:, 0]
    assert abs(float(attribute.mean())) < 1e-5 and abs(float(attribute.std()) - 1) < 1e-5
    assert dataset.num_features == 3 and len(dataset) == 2  # 1 attribute + 2 one-hot labels
    raw = load_tu("PROTEINS", cache_dir=tmp_path / "scratch2", standardize=False)._data.x[:, 0]
    assert raw.tolist() == [-538.0, 798.0, 10.0, 3.0, 0.5]


def test_a_large_data_set_offline_is_one_line_naming_the_variable_and_the_url(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARATWIN_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    asked: list[str] = []

    def offline(url, *args, **kwargs):
        asked.append(url if isinstance(url, str) else url.full_url)
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(ConfigError) as info:
        load_tu("ENZYMES", cache_dir=tmp_path / "scratch")
    message = str(info.value)
    assert asked == [f"{TU_URL}/ENZYMES.zip"]
    assert "\n" not in message and "PARATWIN_DATA" in message and f"{TU_URL}/ENZYMES.zip" in message
    assert "put a copy under $PARATWIN_DATA/TU/ENZYMES/raw/ (ENZYMES_A.txt" in message  # where the files go


def test_size_bucketed_batches_cover_every_graph_once_per_epoch() -> None:
    sizes = torch.tensor([5, 600, 30, 7, 7, 120, 64, 3] * 10)
    sampler = SizeBucketedBatches(sizes, batch_size=8, seed=0, pool=2)
    first, second = list(sampler), list(sampler)
    for epoch in (first, second):
        assert sorted(i for b in epoch for i in b) == list(range(len(sizes)))
        assert all(len(b) <= 8 and (len(b) == 1 or len(b) * int(sizes[b].max()) <= 64 * 8) for b in epoch)
    assert first != second  # reshuffled each epoch


def test_experiment_writes_tables_and_figures_and_resumes(tmp_path: Path, mutag) -> None:
    summary = run_hap_experiment(["MUTAG"], ["hap", "gcn-mean"], folds=2, epochs=1, out_dir=tmp_path,
                                 cache_dir=Path(mutag.root), verbose=False)
    assert list(summary["variant"]) == ["gcn-mean", "hap"]  # the methods' order, not the order asked
    assert set(summary.columns) >= {"dataset", "variant", "accuracy_mean", "accuracy_std", "n", "max_epochs"}
    assert (summary["n"] == 2).all() and summary["accuracy_mean"].between(0, 1).all()
    per_fold = pd.read_csv(tmp_path / "folds.csv")
    assert len(per_fold) == 4 and set(per_fold["fold"]) == {0, 1}
    assert len(pd.read_csv(tmp_path / "curves.csv")) == 4  # one epoch per fit
    results = (tmp_path / "results.md").read_text()
    assert "| hap |" in results and "| MUTAG | gcn-mean | 2 |" in results  # the paired test row
    assert "| MUTAG | 2 | 2 | 2 | complete |" in results  # one seed x 2 folds, this run's own protocol
    for stem in ("hap_accuracy", "hap_curves"):
        for suffix in ("png", "pdf"):
            assert (tmp_path / f"{stem}.{suffix}").stat().st_size > 1000
        assert (tmp_path / f"{stem}.csv").is_file()
    # a rerun finds every fold done and appends nothing
    before = (tmp_path / "folds.csv").read_text()
    run_hap_experiment(["MUTAG"], ["hap", "gcn-mean"], folds=2, epochs=1, out_dir=tmp_path,
                       cache_dir=Path(mutag.root), verbose=False)
    assert (tmp_path / "folds.csv").read_text() == before
    with pytest.raises(ConfigError, match="protocol"):  # same folds, other knobs: refused, not mixed
        run_hap_experiment(["MUTAG"], ["hap"], folds=2, epochs=2, out_dir=tmp_path, cache_dir=Path(mutag.root),
                           verbose=False)
    with pytest.raises(ConfigError, match="methods"):
        run_hap_experiment(["MUTAG"], ["hap", "gin"], out_dir=tmp_path)
    with pytest.raises(ConfigError, match="folds"):
        run_hap_experiment(["MUTAG"], None, folds=1, out_dir=tmp_path)
    with pytest.raises(ConfigError, match="plan"):
        parse_plan("MUTAG:three", 10, ["hap"])
    assert parse_plan("NCI1:1x2:15", 100, ["hap"]) == DatasetPlan("NCI1", (0,), 2, 10, 15, ("hap",))


def test_hop_distances_on_a_path_are_capped_beyond_the_reach() -> None:
    n = 6
    adj = torch.zeros(1, n, n)
    for i in range(n - 1):
        adj[0, i, i + 1] = adj[0, i + 1, i] = 1.0
    dist = hop_distances(adj, hops=3)[0]
    assert dist[0].tolist() == [0, 1, 2, 3, 4, 4]  # 4 = "beyond 3 hops"
    assert torch.equal(dist, dist.T)
    assert hop_distances(adj, hops=1)[0][2].tolist() == [2, 1, 0, 1, 2, 2]


def _path_batch(n: int = 6, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    adj = torch.zeros(1, n, n)
    for i in range(n - 1):
        adj[0, i, i + 1] = adj[0, i + 1, i] = 1.0
    return torch.randn(1, n, dim, generator=torch.Generator().manual_seed(0)), adj, torch.ones(1, n, dtype=torch.bool)


@pytest.mark.parametrize("masked", [True, False])
def test_moa_mask_limits_the_reach_and_unmasked_reaches_every_node(masked: bool) -> None:
    torch.manual_seed(0)
    h, adj, mask = _path_batch()
    moa = MOA(8, hops=1, masked=masked)
    queries = torch.randn(1, 3, 8)
    far = h.clone()
    far[0, 4] += 5.0  # node 4 is 4 hops from node 0
    near, moved = moa(h, adj, mask, queries), moa(far, adj, mask, queries)
    assert torch.allclose(near[0, 1:4].sum(-1), torch.ones(3))  # a soft assignment per node
    changed = not torch.allclose(near[0, 0], moved[0, 0])
    assert changed is (not masked), "node 0's assignment sees node 4 only without the hop mask"


def test_gcont_global_is_shared_per_graph_is_not_and_none_has_no_content_loss() -> None:
    torch.manual_seed(0)
    x, adj, mask = random_graphs(4, 9, 5, seed=4)
    for content in CONTENT_MODES:
        model = HAP(HAPConfig(in_features=5, num_classes=2, hidden=8, clusters=(4, 2), content=content))
        model(x, adj, mask)
        guide = model.levels[0].content
        h = torch.randn(4, 9, 8)
        queries = guide.queries(guide.summarize(h, mask))
        if content == "global":  # one learned C for every graph: the queries do not depend on the graph
            assert queries.shape == (1, 4, 8) and torch.equal(queries[0], guide.patterns)
            model.content_loss.backward()
            assert guide.patterns.grad is not None and guide.patterns.grad.abs().sum() > 0
        elif content == "per-graph":
            assert queries.shape == (4, 4, 8) and not torch.allclose(queries[0], queries[1])
        else:
            assert float(model.content_loss) == 0.0
    with pytest.raises(ConfigError, match="content"):
        HAP(HAPConfig(in_features=5, num_classes=2, content="local"))
    with pytest.raises(ConfigError, match="hops"):
        HAP(HAPConfig(in_features=5, num_classes=2, hops=0))


def test_tuning_tests_the_best_validation_candidate_and_early_stopping_stops(mutag) -> None:
    labels = graph_labels(mutag).numpy()
    _, train, val, test = next(splits(labels, 10, 0))
    idx = [torch.as_tensor(a) for a in (train, val, test)]
    still = TrainConfig(epochs=3, lr=1e-9, clusters=(9, 3))  # learns nothing
    moving = TrainConfig(epochs=3, lr=1e-2, clusters=(9, 3))
    alone = [fit("gcn-max", mutag, *idx, c, seed=1) for c in (still, moving)]
    tuned = fit_tuned("gcn-max", mutag, *idx, [still, moving], seed=1)
    best = max(alone, key=lambda r: r.val_accuracy)
    assert tuned.val_accuracy == best.val_accuracy and tuned.config == best.config
    assert tuned.test_accuracy == best.test_accuracy  # same seed, same candidate: same model
    stopped = fit("gcn-max", mutag, *idx, TrainConfig(epochs=60, lr=0.0, patience=3, clusters=(9, 3)), seed=1)
    assert stopped.epochs_run < 60 and stopped.epochs_run - stopped.best_epoch == 3
    assert len(stopped.curve) == stopped.epochs_run


def test_paired_tests_find_a_consistent_winner_and_not_a_tie() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for fold in range(10):
        base = 0.7 + 0.05 * rng.standard_normal()
        for variant, shift in (("hap", 0.05), ("gcn-mean", 0.0), ("same", 0.05)):
            rows.append({"dataset": "D", "variant": variant, "seed": 0, "fold": fold, "test_accuracy": base + shift})
    tests = paired_tests(pd.DataFrame(rows)).set_index("other")
    assert tests.loc["gcn-mean", "wins"] == 10 and tests.loc["gcn-mean", "p_wilcoxon"] < 0.01
    assert tests.loc["same", "ties"] == 10 and tests.loc["same", "p_wilcoxon"] == 1.0
    assert tests.loc["gcn-mean", "p_holm"] >= tests.loc["gcn-mean", "p_wilcoxon"]
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])


def test_the_cli_runs_named_seeds_only_and_they_equal_those_seeds_of_a_full_run(
        tmp_path: Path, mutag, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--seeds 2`` runs seed 2 alone (not 0..S-1), on the same folds as seed 2 of a 3-seed run."""
    from analysis.hap_experiment import main
    from analysis.hap_protocol import parse_seeds

    # The CLI's TU cache is $TMPDIR's: this test's own, not the machine's (another run may be reading it).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    knobs = ["--methods", "gcn-mean", "--lr", "0.001", "--epochs", "1", "--patience", "0"]
    main(["run", "--out", str(tmp_path / "named"), "--plan", "MUTAG:1x1", "--seeds", "2", *knobs])
    named = pd.read_csv(tmp_path / "named" / "folds.csv")
    assert list(named["seed"]) == [2]
    assert (tmp_path / "paratwin-tu-cache" / "MUTAG" / ".built").is_file()
    main(["run", "--out", str(tmp_path / "all"), "--plan", "MUTAG:3x1", *knobs])
    every = pd.read_csv(tmp_path / "all" / "folds.csv")
    assert sorted(every["seed"]) == [0, 1, 2]
    assert every[every["seed"] == 2]["test_accuracy"].item() == named["test_accuracy"].item()
    assert parse_seeds(["1-2", "4"]) == (1, 2, 4)
    assert parse_plan("ENZYMES", 100, ["hap"], (1, 2)).seeds == (1, 2)
    for bad in (["one"], ["-1"], ["2-1"], ["1", "1-2"]):
        with pytest.raises(ConfigError, match="seeds"):
            parse_seeds(bad)
    with pytest.raises(ConfigError, match="seeds"):  # a plan's seed count that contradicts the named seeds
        parse_plan("ENZYMES:3x10", 100, ["hap"], (1, 2))


def test_plans_sharing_a_variant_run_it_once_and_merge_keeps_one_row_per_key(tmp_path: Path, mutag) -> None:
    protocol = Protocol((DatasetPlan("MUTAG", (0,), 1, 2, 1, ("hap", "gcn-mean")),
                         DatasetPlan("MUTAG", (0,), 1, 2, 1, ("hap", "hap-aux0"))), lrs=(1e-3,), patience=0)
    run_protocol(protocol, tmp_path / "a", cache_dir=Path(mutag.root), verbose=False)
    folds = pd.read_csv(tmp_path / "a" / "folds.csv")
    assert sorted(folds["variant"]) == ["gcn-mean", "hap", "hap-aux0"]  # hap once, not once per plan
    single = Protocol((DatasetPlan("MUTAG", (0,), 1, 2, 1, ("hap",)),), lrs=(1e-3,), patience=0)
    run_protocol(single, tmp_path / "b", cache_dir=Path(mutag.root), verbose=False)
    merge_results([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    merged = pd.read_csv(tmp_path / "m" / "folds.csv")
    assert len(merged) == 3 and not merged.duplicated(["dataset", "variant", "seed", "fold"]).any()
    curves = pd.read_csv(tmp_path / "m" / "curves.csv")
    assert len(curves) == 3 and set(curves["variant"]) == {"gcn-mean", "hap", "hap-aux0"}


def test_assignment_sharpness_reads_uniform_and_one_hot_assignments(mutag) -> None:
    from analysis.hap_diagnostics import level_sharpness

    torch.manual_seed(0)
    model = build_classifier("hap", mutag.num_features, mutag.num_classes, hidden=16, clusters=(6, 2))
    loader = DataLoader(mutag[:8], batch_size=4)
    for level in model.model.levels:  # zero cluster queries: every node spread evenly over the clusters
        torch.nn.init.zeros_(level.content.patterns)
    rows = level_sharpness(model, loader)
    assert [round(r["normalised_entropy"], 6) for r in rows] == [1.0, 1.0]
    assert [round(r["mutual_information"], 6) for r in rows] == [0.0, 0.0]
    assert rows[0]["max_probability"] == pytest.approx(1 / 6)
    for level in model.model.levels:  # huge queries: (almost) one cluster per node
        torch.nn.init.normal_(level.content.patterns, std=100.0)
    assert all(r["normalised_entropy"] < 0.2 for r in level_sharpness(model, loader))


def test_assignment_statistics_tell_one_shared_row_from_a_split() -> None:
    from analysis.hap_diagnostics import assignment_stats

    mask = torch.ones(1, 4, dtype=torch.bool)
    shared = torch.tensor([[[1.0, 0.0]] * 4])  # sharp rows, every node in cluster 0: still a mean readout
    entropy, information, top = assignment_stats(shared, mask)
    assert float(entropy) == pytest.approx(0.0, abs=1e-6) and float(information) == pytest.approx(0.0, abs=1e-6)
    split = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]])
    assert float(assignment_stats(split, mask)[1]) == pytest.approx(1.0, abs=1e-6)
    assert float(top) == 1.0


def test_first_level_assignment_splits_the_nodes_at_init_and_after_training(mutag) -> None:
    """The first version's S was uniform (normalised entropy 0.99999, node-cluster information ~1e-6)
    at initialisation and stayed so: assignment logits ~0.02 apart, a stationary point (docs/hap.md).
    With the centred, normalised key the nodes split over the clusters, and training keeps them split."""
    from analysis.hap_diagnostics import level_sharpness

    labels = graph_labels(mutag).numpy()
    _fold, train, val, _test = next(splits(labels, 10, 0))
    train, val = torch.as_tensor(train), torch.as_tensor(val)
    config = TrainConfig(epochs=8, clusters=(9, 3))
    from exec.hap.train import graph_loader, train_model

    loader = DataLoader(mutag[train[:64]], batch_size=32)
    torch.manual_seed(0)
    untrained = build_classifier("hap", mutag.num_features, mutag.num_classes, 64, config.clusters)
    first = level_sharpness(untrained, loader)[0]
    assert first["normalised_entropy"] < 0.95 and first["mutual_information"] > 0.05
    model, *_ = train_model("hap", mutag, train, val, config, 0)
    trained = level_sharpness(model, graph_loader(mutag, train, 32, False, 0))[0]
    assert trained["normalised_entropy"] < 0.95 and trained["mutual_information"] > 0.05


def test_edge_pooling_in_rounds_equals_the_library_one_edge_at_a_time(mutag) -> None:
    """The ``edge`` baseline's matching runs as tensor rounds (exec/hap/edge_matching.py); its pooled
    graph, scores and gradients must be the library loop's, ties and self-loops included."""
    from torch_geometric.nn import EdgePooling

    from exec.hap.edge_matching import make_edge_pooling

    batch = next(iter(DataLoader(mutag[:16], batch_size=16)))
    loops = torch.arange(0, batch.num_nodes, 7).repeat(2, 1)  # a few self-loops, as a coarsened graph has
    edge_index = torch.cat([batch.edge_index, loops], dim=1)
    gen = torch.Generator().manual_seed(3)
    fast, slow = make_edge_pooling(mutag.num_features), EdgePooling(mutag.num_features)
    slow.load_state_dict(fast.state_dict())
    raw = torch.rand(edge_index.shape[1], generator=gen)
    for scores in (raw, (raw * 3).floor() / 3):  # distinct scores, then three levels with many ties
        results = []
        for pool in (fast, slow):
            x = batch.x.clone().requires_grad_(True)
            score = scores.clone().requires_grad_(True)
            new_x, new_edges, new_batch, info = pool._merge_edges(x, edge_index, batch.batch, score)
            (new_x * torch.arange(new_x.numel()).view_as(new_x)).sum().backward()
            results.append((new_x, new_edges, new_batch, info.cluster, info.new_edge_score, x.grad, score.grad))
        for got, want in zip(*results, strict=True):
            assert got.shape == want.shape and torch.allclose(got.double(), want.double(), atol=1e-6)
        assert results[0][0].shape[0] < batch.num_nodes * 0.7  # it did merge most nodes in pairs


def test_late_best_share_counts_fits_whose_best_epoch_is_within_the_patience_of_the_cap() -> None:
    from analysis.hap_report import late_best_markdown, summary

    rows = [{"dataset": "D", "variant": v, "seed": 0, "fold": f, "test_accuracy": 0.5, "best_epoch": best,
             "epochs_run": 100, "max_epochs": 100, "patience": 20, "grid_size": 1, "seconds": 1.0}
            for v, bests in (("hap", (80, 81, 95, 30)), ("sag", (10, 20, 30, 40))) for f, best in enumerate(bests)]
    table = summary(pd.DataFrame(rows))
    assert table.set_index("variant")["late_best_share"].to_dict() == {"hap": 0.5, "sag": 0.0}  # 80 is not late
    assert "| hap | 50% |" in late_best_markdown(table) and "| sag | 0% |" in late_best_markdown(table)


def test_the_report_says_which_datasets_the_protocol_covers_and_marks_the_rest_partial() -> None:
    """A dataset counts as complete only when every method finished the protocol's 3 x 10 (seed, fold)
    pairs; one method short of a pair leaves that pair out, and the dataset partial."""
    from analysis.hap_report import complete_folds, coverage, coverage_markdown

    methods = ["hap", "sag"]
    rows = [{"dataset": d, "variant": v, "seed": s, "fold": f, "test_accuracy": 0.5}
            for d in ("FULL", "SHORT") for v in methods for s in range(3) for f in range(10)]
    rows = [r for r in rows if not (r["dataset"] == "SHORT" and r["variant"] == "sag" and r["seed"] == 2)]
    table = coverage(complete_folds(pd.DataFrame(rows), methods), methods, planned_pairs=30)
    got = table.set_index("dataset")[["pairs", "seeds", "status"]].to_dict("index")
    assert got == {"FULL": {"pairs": 30, "seeds": 3, "status": "complete"},
                   "SHORT": {"pairs": 20, "seeds": 2, "status": "partial"}}
    text = coverage_markdown(table)
    assert "| FULL | 30 | 30 | 2 | complete |" in text and "| SHORT | 20 | 30 | 2 | **partial" in text


def test_a_larger_cap_carries_the_fits_early_stopping_ended_and_equals_a_fresh_run(tmp_path: Path, mutag) -> None:
    """Raising the epoch cap: the carried run (early-stopped fits copied, capped fits trained again)
    equals a run with the larger cap from scratch, row for row and curve for curve."""
    def protocol(cap: int) -> Protocol:  # lr 0.05, patience 1: some fits stop early within 5 epochs, some do not
        return Protocol((DatasetPlan("MUTAG", (0,), 3, 10, cap, ("gcn-mean", "topk")),), lrs=(0.05,), patience=1)

    cache = Path(mutag.root)
    run_protocol(protocol(5), tmp_path / "cap5", cache_dir=cache, verbose=False)
    run_protocol(protocol(9), tmp_path / "fresh9", cache_dir=cache, verbose=False)
    before = (tmp_path / "cap5" / "folds.csv").read_bytes()
    counts = carry_over(protocol(9), tmp_path / "cap5", tmp_path / "carried9")
    assert counts["carried"] >= 1 and counts["rerun"] >= 1 and counts["kept"] == 0  # both paths taken
    run_protocol(protocol(9), tmp_path / "carried9", cache_dir=cache, verbose=False)
    assert (tmp_path / "cap5" / "folds.csv").read_bytes() == before  # the source is only read
    columns = ["test_accuracy", "val_accuracy", "best_epoch", "epochs_run", "max_epochs"]
    fresh, carried = (pd.read_csv(tmp_path / d / "folds.csv").set_index(["variant", "fold"]).sort_index()
                      for d in ("fresh9", "carried9"))
    pd.testing.assert_frame_equal(carried[columns], fresh[columns])
    assert (fresh["epochs_run"] > 5).any()  # a capped fit did go on, so carrying it would have been wrong
    keys = ["variant", "fold", "epoch"]
    fresh_curves, carried_curves = (pd.read_csv(tmp_path / d / "curves.csv").sort_values(keys).reset_index(drop=True)
                                    for d in ("fresh9", "carried9"))
    pd.testing.assert_frame_equal(carried_curves, fresh_curves)
    with pytest.raises(ConfigError, match="carry_from"):
        carry_over(protocol(9), tmp_path / "carried9", tmp_path / "carried9")

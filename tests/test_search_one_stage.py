"""What ``paratwin search`` writes and how it treats a one-stage plan (session 15, issue-9w): a plan with
one pipeline stage is enumerated once (as 1F1B; every schedule's one-stage plan simulates to its time),
its time breakdown agrees field by field between the estimate and the engine (session 15, issue-9z: TP with
recompute, and a tied embedding's pipeline too; each kind defined once, docs/search.md), a search that
simulates none of its best reports no best plan, and summary.json records
every input of the search, so that its best.yaml simulates to the recorded time and the space reads back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from analysis.search_report import ranked_frame, write_search
from sim.compile import check_schedule
from sim.plan import Plan
from sim.schedules import SCHEDULES
from sim.search import (
    SAME_ONE_STAGE,
    Ranked,
    SearchSpace,
    estimate_phase,
    one_stage_schedule,
    search,
    simulate_candidate,
)
from sim.simulate import simulate
from traces.errors import ConfigError, NoPlanFits

REPO = Path(__file__).resolve().parent.parent

# Two A100s: the shapes dp 2 and tp 2 have one stage, pp 2 two. The distributed optimizer all-gathers the
# parameters after its step (what the engine's breakdown left in the bubble before).
TWO_GPUS = {"name": "a100-2", "nodes": 1, "devices_per_node": 2, "device": "A100-80GB", "intra_node_link": "nvlink3"}
SPACE = SearchSpace("gpt2-small", TWO_GPUS, global_batch=8, dtype="fp16", max_micro_batch=2, fractions=(),
                    tp_overlaps=(0,), bucket_mbs=(25.0,), max_chunks=2, refine_shapes=0,
                    gradient_syncs=("allreduce", "distopt"))


@pytest.fixture(scope="module")
def result():
    return search(SPACE, top_k=400, sample=0, workers=1)  # every survivor simulated


def test_a_one_stage_plan_is_listed_once(result) -> None:
    one_stage = [r for r in result.ranked if r.candidate.pp == 1]
    assert one_stage and {(r.candidate.schedule, r.candidate.chunks) for r in one_stage} == {
        ("1f1b", 1), ("interleaved-1f1b", 2)}
    assert result.pruned[SAME_ONE_STAGE] > 0
    pipelined = {r.candidate.schedule for r in result.ranked if r.candidate.pp > 1}
    assert {"gpipe", "zb-h1", "zb-v", "dualpipev"} <= pipelined
    # no two ranked rows are the same plan: without the schedule column, no one-stage row repeats
    frame = ranked_frame(result)
    settings = frame.loc[frame["pp"] == 1, "dp":"p2p"].drop(columns=["schedule"])
    assert not settings.duplicated().any()


def test_every_schedule_runs_a_one_stage_plan_as_the_kept_one_does(result) -> None:
    """Why one schedule per chunk count stands for all at pp 1: on every one-stage plan of the search (each
    memory policy, gradient sync, micro-batch), each other schedule simulates to the kept one's time, with
    a peak no lower."""
    compared = 0
    for kept in (r for r in result.ranked if r.candidate.pp == 1):
        assert kept.simulated is not None and kept.candidate.schedule == one_stage_schedule(kept.candidate.chunks)
        for name, info in SCHEDULES.items():
            if name == kept.candidate.schedule or not info.min_chunks <= kept.candidate.chunks <= (
                    info.max_chunks or kept.candidate.chunks):
                continue
            try:
                check_schedule(name, 1, kept.candidate.microbatches, kept.candidate.chunks)
                other = simulate(result.plan_of(replace(kept.candidate, schedule=name)))
            except ConfigError:
                continue  # e.g. Merak's schedules need two stages; selective recompute with a split backward
            assert other.iteration_s == pytest.approx(kept.simulated.iteration_s, rel=1e-9), (
                name, kept.candidate.describe())
            assert max(m.peak_bytes for m in other.memory.values()) >= max(kept.simulated.peak_bytes), name
            compared += 1
    assert compared >= 20


def breakdown(r: Ranked) -> dict[str, tuple[float, float]]:
    """Each kind of the breakdown as (estimate, engine), one definition for both (docs/search.md)."""
    e, s = r.estimate, r.simulated
    assert s is not None
    return {"compute": (e.compute_s + e.tp_comm_s, s.compute_s), "recompute": (e.recompute_s, s.recompute_s),
            "bubble": (e.bubble_s + e.p2p_s, s.bubble_s), "gradient sync": (e.dp_comm_s, s.exposed_comm_s),
            "optimizer": (e.optimizer_s, s.optimizer_s), "iteration": (e.iteration_s, s.iteration_s)}


def test_a_one_stage_breakdown_agrees_between_estimate_and_engine(result) -> None:
    # dense embeddings (a sharded one's lookups are in no field of the estimate: docs/search.md)
    one_stage = [r for r in result.ranked if r.candidate.pp == 1 and dict(r.candidate.embedding)["method"] == "dense"]
    assert {dict(r.candidate.gradient_sync)["method"] for r in one_stage if r.candidate.dp == 2} == {
        "allreduce", "distopt"}
    # TP with recompute: the recompute's TP all-reduces are recompute in both (the estimate had them in compute)
    tp_recompute = [r for r in one_stage if r.candidate.tp == 2 and r.simulated.recompute_s > 0]
    assert tp_recompute and all(r.estimate.tp_comm_s > 0 for r in tp_recompute)
    for r in one_stage:
        for name, (estimate, engine) in breakdown(r).items():
            assert estimate == pytest.approx(engine, rel=1e-6, abs=1e-9), (r.candidate.describe(), name)


def test_a_pipeline_breakdown_is_the_critical_ranks_in_both(result) -> None:
    """At pp > 1 the estimate reported its bottleneck rank's compute and its tail rank's step, the engine its
    busiest rank's: they moved time between bubble and step (1F1B: 0.013 ms; interleaved, `time` partition,
    full recompute: 0.24 ms) and, in the V schedules, between compute and recompute (ZB-V full mb1x8: compute
    129.9 against 124.1 ms). Both now report the critical rank's (sim.critical_rank): every kind agrees, within
    the tolerance the iteration itself is held to, on every pipelined plan of the space."""
    pipelined = [r for r in result.ranked if r.candidate.pp == 2]
    schedules = {r.candidate.schedule for r in pipelined}
    assert {"1f1b", "interleaved-1f1b", "zb-v", "dualpipev"} <= schedules
    # the plans that moved time before: a V schedule with full recompute, interleaved with a `time` partition
    assert any(r.candidate.schedule == "zb-v" and r.simulated.recompute_s > 0 for r in pipelined)
    assert any(r.candidate.schedule == "interleaved-1f1b" and r.candidate.partition == "time"
               and r.simulated.recompute_s > 0 for r in pipelined)
    for r in pipelined:
        figures = breakdown(r)
        for side in (0, 1):  # one rank's kinds make up the iteration
            parts = sum(value[side] for name, value in figures.items() if name != "iteration")
            assert parts == pytest.approx(figures["iteration"][side], rel=1e-9), (r.candidate.describe(), side)
        for name, (estimate, engine) in figures.items():
            assert estimate == pytest.approx(engine, rel=1e-6, abs=1e-9), (r.candidate.describe(), name)


def test_a_sharded_embeddings_breakdown_agrees_between_estimate_and_engine(result) -> None:
    """The lookups' exposed all-to-all, before the forwards, was in no field of the estimate (only in its
    iteration) and in the engine's bubble (issue-9z). Since issue-9v every sharded plan agrees, each kind:
    under distopt (the engine's step took all the dense parameters: 1.825 against 3.001 ms), in interleaved
    1F1B (the estimate let the other chunk's buckets pass the push, which the engine's collective stream runs
    first: gradient sync 0.48 against 1.32 ms), and EmbRace 2D's two steps (the engine's gradient sync ended at
    the tables' step and left the buckets' wait in the bubble, 0.01 against 1.31 ms)."""
    sharded = [r for r in result.ranked if dict(r.candidate.embedding)["method"] != "dense"]
    assert {(dict(r.candidate.embedding)["method"], dict(r.candidate.gradient_sync)["method"], r.candidate.schedule)
            for r in sharded} == {(method, sync, schedule) for method in ("ps", "embrace")
                                  for sync in ("allreduce", "distopt") for schedule in ("1f1b", "interleaved-1f1b")}
    for r in sharded:
        figures = breakdown(r)
        assert figures["bubble"][1] > 0, r.candidate.describe()  # the lookups' wait, with no pipeline bubble
        assert figures["gradient sync"][1] > 0.1e-3, r.candidate.describe()  # the buckets, exposed
        for name, (estimate, engine) in figures.items():
            assert estimate == pytest.approx(engine, rel=1e-6, abs=1e-9), (r.candidate.describe(), name)


def test_a_tied_embedding_pipeline_breakdown_agrees_between_estimate_and_engine() -> None:
    """The tied embedding's all-reduce (pp > 1, first and last stage) is gradient sync in both: the estimate
    had it in the optimizer step, the engine's breakdown between the last backward and the step. At dp 1 it
    is the whole gradient sync. Both report the critical rank's breakdown (sim.critical_rank): until
    issue-9v the estimate's step was its tail rank's and the engine's its busiest rank's, and bubble and
    optimizer could only be compared together."""
    tied = replace(SPACE, workload_options={"tied_embedding": True})
    phase = estimate_phase(tied, top_k=0, workers=1)
    plans = [r for r in phase.survivors if r.candidate.dp == 1 and r.candidate.pp == 2
             and r.candidate.schedule in ("1f1b", "gpipe") and dict(r.candidate.embedding)["method"] == "dense"]
    assert len(plans) >= 4
    for r in plans:
        r.simulated = simulate_candidate(r.candidate, phase.base, phase.probe.costs, phase.name)
        figures = breakdown(r)
        assert figures["gradient sync"][1] > 0, r.candidate.describe()  # the tied all-reduce, exposed
        for name, (estimate, engine) in figures.items():
            assert estimate == pytest.approx(engine, rel=1e-6, abs=1e-9), (r.candidate.describe(), name)


def test_a_tied_embedding_beside_embraces_prefetch_is_gradient_sync_in_both() -> None:
    """EmbRace 2D with a tied embedding (dp 2, pp 2 on four A100s): the tied all-reduce runs after the buckets
    and before the prefetched lookups, the tables' step beside it. The estimate had it in the dense step
    (gradient sync 0.15 against 0.55 ms) and, under distopt, its iteration 0.085 ms over the engine's."""
    four = {**TWO_GPUS, "name": "a100-4", "devices_per_node": 4}
    space = replace(SPACE, cluster=four, max_micro_batch=1, workload_options={"tied_embedding": True})
    phase = estimate_phase(space, top_k=0, workers=1)
    plans = [r for r in phase.survivors if r.candidate.dp == 2 and r.candidate.pp == 2
             and r.candidate.schedule in ("1f1b", "interleaved-1f1b") and dict(r.candidate.memory)["policy"] == "none"
             and dict(r.candidate.embedding)["method"] == "embrace"]
    assert {dict(r.candidate.gradient_sync)["method"] for r in plans} == {"allreduce", "distopt"}
    for r in plans:
        r.simulated = simulate_candidate(r.candidate, phase.base, phase.probe.costs, phase.name)
        for name, (estimate, engine) in breakdown(r).items():
            assert estimate == pytest.approx(engine, rel=1e-6, abs=1e-9), (r.candidate.describe(), name)


def test_a_search_that_simulates_none_of_its_best_reports_no_best_plan(tmp_path) -> None:
    """--simulate-top 0 printed a "best plan" and wrote best.yaml: the fastest of the random agreement sample,
    no choice of the search."""
    from analysis.search_report import run_search

    found = run_search(SPACE, top=3, simulate_top=0, sample=3, out=tmp_path / "out", workers=1)
    assert len(found.simulated) == 3 and found.best is None
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["best"] is None and summary["simulated"] == 3
    assert not (tmp_path / "out" / "best.yaml").exists()


def test_the_summary_records_the_whole_search_and_its_best_plan_simulates_to_it(tmp_path) -> None:
    space = replace(SPACE, global_batch=None, p2p=("async", "blocking"),
                    workload_options={"grad_accumulation": "autograd"})
    found = search(space, top_k=6, sample=2, seed=3, workers=1)
    paths = write_search(found, tmp_path)
    summary = json.loads(paths["summary"].read_text())
    record = summary["search"]
    assert SearchSpace.from_record(record["space"]) == replace(space, global_batch=found.global_batch)
    assert record["space"]["p2p"] == ["async", "blocking"]
    assert record["space"]["workload_options"] == {"grad_accumulation": "autograd"}
    assert {k: record[k] for k in ("top_k", "sample", "seed", "bounded", "world_size")} == {
        "top_k": 6, "sample": 2, "seed": 3, "bounded": False, "world_size": 2}
    assert record["cluster"]["devices_per_node"] == 2 and record["cluster"]["device"]["name"] == "A100-80GB"
    best = found.best
    assert best is not None
    assert summary["best_settings"]["p2p"] == best.candidate.p2p
    assert summary["best_settings"] == ranked_frame(found).iloc[0].loc["dp":"p2p"].to_dict()
    plan = Plan.load(paths["best"])
    assert plan.schedule.p2p == best.candidate.p2p and plan.workload_options == {"grad_accumulation": "autograd"}
    assert simulate(plan).iteration_s == pytest.approx(summary["best_engine_s"], rel=1e-12)
    # the recorded space reruns the search to the same best plan
    again = search(SearchSpace.from_record(record["space"]), top_k=6, sample=0, workers=1)
    assert again.best is not None and again.best.candidate == best.candidate
    assert pd.read_parquet(paths["ranked"])["p2p"].isin(["async", "blocking"]).all()


def test_the_best_plan_names_its_cluster_and_profile_by_absolute_paths(tmp_path, monkeypatch) -> None:
    """`paratwin search --cluster rb/mycluster.yaml` wrote `cluster: rb/mycluster.yaml` into best.yaml, which then
    worked only from the directory the search ran in; a relative cluster path is refused naming that directory."""
    (tmp_path / "rb").mkdir()
    (tmp_path / "rb" / "mycluster.yaml").write_text(json.dumps({"cluster": TWO_GPUS}))
    monkeypatch.chdir(tmp_path)
    found = search(replace(SPACE, cluster="rb/mycluster.yaml"), top_k=3, sample=0, workers=1)
    paths = write_search(found, Path("rb") / "s")
    elsewhere = tmp_path / "rb" / "s"
    monkeypatch.chdir(elsewhere)
    plan = Plan.load(paths["best"].name)
    assert plan.cluster == str(tmp_path / "rb" / "mycluster.yaml")
    assert simulate(plan).iteration_s == pytest.approx(found.best.simulated.iteration_s, rel=1e-12)
    with pytest.raises(ConfigError, match=rf"'rb/mycluster.yaml' is neither a preset nor a YAML file \(a relative "
                                          rf"path is read from the current directory, {elsewhere}\)"):
        simulate(plan.replace(cluster="rb/mycluster.yaml"))
    profiled = Plan.from_dict({"workload": "gpt-tiny", "profile": "p"}).with_absolute_paths()
    assert profiled.profile == str(elsewhere / "p") and profiled.cluster == "local-cpu-2"  # a preset stays a name


def test_a_space_record_with_an_unknown_field_is_refused() -> None:
    with pytest.raises(ConfigError, match="search.space: unknown field.*max_pp"):
        SearchSpace.from_record({"workload": "gpt2-small", "cluster": "dgx-a100-8", "max_pp": 4})


@pytest.mark.parametrize("batch", [0, -4])
def test_a_global_batch_below_one_is_refused(batch: int) -> None:
    """0 was taken for "not given" and searched 2 x the devices without a word."""
    with pytest.raises(ConfigError, match=r"global_batch: must be a positive integer, got .*2 x the devices \(4\)"):
        search(replace(SPACE, global_batch=batch), top_k=1, sample=0)


@pytest.mark.parametrize(("changes", "message"), [
    ({"gradient_syncs": ()}, "gradient_syncs: no values: no plan can be enumerated"),  # "no plan fits" of 0
    ({"partitions": ()}, "partitions: no values"),
    ({"micro_batch_sizes": ()}, "micro_batch_sizes: no values"),
    ({"p2p": ()}, "p2p: no values"),  # an IndexError inside the branch and bound
    ({"p2p": ("sync",)}, "p2p: unknown mode(s) ['sync']"),
    ({"bucket_mbs": (0.0,)}, "bucket_mbs: 0.0 is not a positive number"),  # a pydantic ValidationError traceback
    ({"micro_batch_sizes": (0,)}, "micro_batch_sizes: 0 is not a positive whole number"),  # 0 plans, "no fit"
    ({"max_tp": 0}, "max_tp: must be a whole number >= 1, got 0"),  # read as "not given"
])
def test_a_search_space_choice_no_plan_can_take_is_refused_when_made(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        replace(SPACE, **changes)
    assert message in str(error.value) and "(fix: " in str(error.value)


def test_an_output_folder_that_is_a_file_is_refused_before_the_search(tmp_path) -> None:
    from analysis.search_report import run_search

    taken = tmp_path / "runs"
    taken.write_text("kept")
    # an unknown cluster would fail the search itself: the folder is checked first (it failed after the search)
    with pytest.raises(ConfigError, match="--out: .* is a file, not a folder"):
        run_search(replace(SPACE, cluster="no-such-cluster"), top=1, simulate_top=1, sample=0, out=taken)
    assert taken.read_text() == "kept"


def test_a_search_where_no_plan_fits_writes_its_outputs_and_says_why(tmp_path) -> None:
    """It printed "no simulated plan fits in memory" and exited 0, when nothing had been simulated."""
    from analysis.search_report import run_search

    tight = SearchSpace("gpt-175b", "dgx-a100-8", global_batch=8, max_micro_batch=1, fractions=(), tp_overlaps=(0,),
                        bucket_mbs=(25.0,), max_chunks=2)
    with pytest.raises(NoPlanFits, match=r"no plan fits in memory: of [\d,]+ plans considered, [\d,]+ do not fit by "
                                         r"the estimate and 0 of 0 simulated") as error:
        run_search(tight, top=3, simulate_top=3, sample=0, out=tmp_path / "out")
    assert error.value.exit_code == 3
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["best"] is None and summary["pruned"]["does not fit in memory (estimate)"] > 0
    assert not (tmp_path / "out" / "best.yaml").exists()


def test_a_search_where_no_plan_fits_removes_the_best_yaml_an_earlier_search_wrote(tmp_path, capsys) -> None:
    """It left the earlier search's best.yaml beside its own summary (best: null), and the hint printed then,
    paratwin simulate DIR/best.yaml, simulated the other model's plan."""
    from analysis.search_report import run_search

    out = tmp_path / "out"
    run_search(SPACE, top=1, simulate_top=2, sample=0, out=out)
    assert (out / "best.yaml").is_file()
    tight = SearchSpace("gpt-175b", "dgx-a100-8", global_batch=8, max_micro_batch=1, fractions=(), tp_overlaps=(0,),
                        bucket_mbs=(25.0,), max_chunks=2)
    with pytest.raises(NoPlanFits):
        run_search(tight, top=3, simulate_top=3, sample=0, out=out)
    assert not (out / "best.yaml").exists()
    assert json.loads((out / "summary.json").read_text())["best"] is None
    assert f"no plan fits in memory: no best.yaml written; removed {out / 'best.yaml'}, an earlier search's best " \
           "plan (dp" in " ".join(capsys.readouterr().out.split())


def test_simulate_refuses_an_output_file_before_simulating(tmp_path) -> None:
    taken = tmp_path / "taken"
    taken.write_text("kept")
    done = subprocess.run([sys.executable, "-m", "analysis.cli", "simulate",
                           str(REPO / "examples" / "plans" / "gpt-8.3b-a100-64-merak.yaml"), "--out", str(taken)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert f"error: --out: {taken} is a file, not a folder" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr and taken.read_text() == "kept"


@pytest.mark.parametrize(("option", "value"), [("--simulate-top", "-3"), ("--sample", "-2"), ("--top", "-1"),
                                               ("--workers", "0"), ("--global-batch", "0")])
def test_search_refuses_a_count_below_its_least_before_searching(option: str, value: str) -> None:
    """--simulate-top -3 simulated all but the last 3 plans; the others were taken as 0 or the default."""
    done = subprocess.run([sys.executable, "-m", "analysis.cli", "search", "--workload", "gpt2-small", "--cluster",
                           "dgx-a100-8", option, value], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2, done.stderr + done.stdout
    # one line naming the option and its least value, as every refusal (typer drew a box without a fix)
    assert (done.stdout + done.stderr).startswith(f"error: {option}: Input should be greater than or equal to "), \
        done.stderr + done.stdout
    assert f", not '{value}')" in done.stdout and "Traceback" not in done.stderr


@pytest.mark.parametrize("asked", [{"top_k": -1}, {"sample": -1}])
def test_search_in_python_refuses_a_negative_count(asked: dict) -> None:
    with pytest.raises(ConfigError, match=f"{next(iter(asked))}: must be 0 or more"):
        search(SPACE, **{"top_k": 1, "sample": 0, **asked})


def test_a_small_models_peaks_read_in_mib(tmp_path: Path) -> None:
    """GiB to one decimal printed 0.0 for every stage of a small model (found by an outside-in review)."""
    done = subprocess.run([sys.executable, "-m", "analysis.cli", "search", "--workload", "gpt-tiny", "--cluster",
                           "dgx-a100-8", "--top", "3", "--out", str(tmp_path / "s")], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("│")[-2].split() for line in done.stdout.splitlines() if line.startswith("│ 1 │")]
    assert "peak MiB per stage" in done.stdout and rows and all(float(v) > 0 for v in rows[0])

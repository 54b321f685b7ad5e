"""How sharp HAP's cluster assignments are after training: if S stays near uniform, X' = S^T H is
about the mean of the node embeddings for every cluster and the pooling is a mean readout, whatever
MOA and GCont do (which would explain ablations that change nothing).

``assignment_sharpness`` trains HAP on one fold (the protocol's split, seed and early stopping) and
reports, per level, the mean normalised entropy H(S_i) / log K over the real nodes (1 = uniform,
0 = one cluster per node), the node-cluster mutual information (0 = every node has the same row,
so the coarsening is a mean readout even when the rows are sharp) and the mean largest assignment
probability. ``--epochs 0`` reports the model at initialisation.

Run: ``python -m analysis.hap_diagnostics --dataset MUTAG --epochs 100``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch
from torch import Tensor

from exec.hap.data import dense_batch, graph_labels, load_tu
from exec.hap.train import TrainConfig, graph_loader, train_model

from .hap_protocol import VARIANTS, candidates, clusters_for, splits


def assignment_stats(s: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per graph of a batch: normalised mean row entropy, normalised node-cluster mutual information
    and mean largest probability of an assignment S [B, N, K] over the real nodes ``mask`` [B, N].

    The mutual information I = H(mean_i S_i) - mean_i H(S_i) is 0 both when S is uniform and when
    every node has the same row (each cluster is then the same weighted mean of the nodes, a mean
    readout); it is log K (1 normalised) when the nodes split one-hot and evenly over the clusters.
    """
    k = s.shape[-1]
    m = mask.to(s.dtype)
    count = m.sum(1).clamp(min=1)
    row_entropy = -(s.clamp(min=1e-12).log() * s).sum(-1)  # [B, N]
    mean_entropy = (row_entropy * m).sum(1) / count
    mean_row = (s * m.unsqueeze(-1)).sum(1) / count.unsqueeze(-1)  # [B, K]
    entropy_of_mean = -(mean_row.clamp(min=1e-12).log() * mean_row).sum(-1)
    top = (s.max(-1).values * m).sum(1) / count
    return mean_entropy / math.log(k), (entropy_of_mean - mean_entropy) / math.log(k), top


@torch.no_grad()
def level_sharpness(model, loader) -> list[dict[str, float]]:
    """Per level of a trained DenseHAP, averaged over graphs: normalised row entropy of S, normalised
    node-cluster mutual information, and mean largest assignment probability."""
    hap = model.model.eval()
    sums = [[0.0, 0.0, 0.0, 0] for _ in hap.levels]
    for batch in loader:
        x, adj, mask = dense_batch(batch)
        for i, level in enumerate(hap.levels):
            captured = {}
            handle = level.moa.register_forward_hook(lambda _m, _a, out, c=captured: c.update(s=out))
            x, adj, mask_next = level(x, adj, mask)
            handle.remove()
            for j, value in enumerate(assignment_stats(captured["s"], mask)):
                sums[i][j] += float(value.sum())
            sums[i][3] += captured["s"].shape[0]
            mask = mask_next
    return [{"level": i, "normalised_entropy": e / n, "mutual_information": mi / n, "max_probability": m / n}
            for i, (e, mi, m, n) in enumerate(sums)]


def assignment_sharpness(name: str, variant: str = "hap", epochs: int = 100, seed: int = 0,
                         patience: int = 20) -> list[dict[str, float]]:
    dataset = load_tu(name)
    labels = graph_labels(dataset).numpy()
    fold, train, val, _test = next(splits(labels, 10, seed))
    base = replace(TrainConfig(), epochs=epochs, patience=patience, clusters=clusters_for(dataset))
    config = candidates(VARIANTS[variant], base, (1e-3,))[0]
    model, _best, best_epoch, _curve = train_model(VARIANTS[variant].method, dataset, torch.as_tensor(train),
                                              torch.as_tensor(val), config, seed * 1000 + fold)
    rows = level_sharpness(model, graph_loader(dataset, torch.as_tensor(train), config.batch_size, False, 0))
    for row, k in zip(rows, config.clusters, strict=True):
        row.update(clusters=k, best_epoch=best_epoch, variant=variant, dataset=name)
    return rows


def initial_logits_and_gradients(name: str, graphs: int = 64, seed: int = 0) -> list[dict[str, float]]:
    """At initialisation (default clusters, seed ``seed``), on the first ``graphs`` graphs: per level,
    the std over clusters of the assignment logits (log S, centred per node) and the gradient norm
    of one loss step on MOA's assignment weight, on C and on the level's first GCN weight."""
    from torch_geometric.loader import DataLoader

    from exec.hap.baselines import build_classifier

    dataset = load_tu(name)
    torch.manual_seed(seed)
    model = build_classifier("hap", dataset.num_features, dataset.num_classes, TrainConfig().hidden,
                             clusters_for(dataset), TrainConfig().dropout)
    batch = next(iter(DataLoader(dataset[:graphs], batch_size=graphs)))
    captured: dict[int, tuple[Tensor, Tensor]] = {}
    handles = [level.moa.register_forward_hook(lambda _m, a, out, i=i: captured.update({i: (out, a[2])}))
               for i, level in enumerate(model.model.levels)]
    logits, aux = model(batch)
    for handle in handles:
        handle.remove()
    (torch.nn.functional.cross_entropy(logits, batch.y) + aux).backward()
    rows = []
    for i, level in enumerate(model.model.levels):
        s, mask = captured[i]
        log_s = s[mask].detach().clamp(min=1e-12).log()
        rows.append({"level": i, "logit_std": float((log_s - log_s.mean(-1, keepdim=True)).std(-1).mean()),
                     "grad_assign": float(level.moa.assign.weight.grad.norm()),
                     "grad_C": float(level.content.patterns.grad.norm()),
                     "grad_first_gcn": float(level.convs[0].linear.weight.grad.norm())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="MUTAG")
    parser.add_argument("--variants", nargs="+", default=["hap", "hap-pergraph"])
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--label", default="", help="a tag for the rows (e.g. the code version)")
    parser.add_argument("--csv", type=Path, help="append the rows to this CSV")
    parser.add_argument("--init-gradients", action="store_true",
                        help="only the logit scale and gradients at initialisation (seconds)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.init_gradients:
        for row in initial_logits_and_gradients(args.dataset):
            print(row, flush=True)
        return
    for variant in args.variants:
        rows = assignment_sharpness(args.dataset, variant, args.epochs)
        for row in rows:
            row.update(label=args.label, epochs=args.epochs)
            print(row, flush=True)
        if args.csv:
            frame = pd.DataFrame(rows)
            frame.to_csv(args.csv, mode="a", header=not args.csv.exists(), index=False)


if __name__ == "__main__":
    main()

"""How sharp HAP's cluster assignments are after training: if S stays near uniform, X' = S^T H is
about the mean of the node embeddings for every cluster and the pooling is a mean readout, whatever
MOA and GCont do (which would explain ablations that change nothing).

``assignment_sharpness`` trains HAP on one fold (the protocol's split, seed and early stopping) and
reports, per level, the mean normalised entropy H(S_i) / log K over the real nodes (1 = uniform,
0 = one cluster per node) and the mean largest assignment probability.

Run: ``python -m analysis.hap_diagnostics --dataset MUTAG --epochs 100``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import torch

from exec.hap.data import dense_batch, graph_labels, load_tu
from exec.hap.train import TrainConfig, graph_loader, train_model

from .hap_protocol import VARIANTS, candidates, clusters_for, splits


@torch.no_grad()
def level_sharpness(model, loader) -> list[dict[str, float]]:
    """Per level of a trained DenseHAP: mean normalised entropy and mean max probability of S's rows."""
    hap = model.model.eval()
    sums = [[0.0, 0.0, 0] for _ in hap.levels]
    for batch in loader:
        x, adj, mask = dense_batch(batch)
        for i, level in enumerate(hap.levels):
            captured = {}
            handle = level.moa.register_forward_hook(lambda _m, _a, out, c=captured: c.update(s=out))
            x, adj, mask_next = level(x, adj, mask)
            handle.remove()
            s = captured["s"][mask]  # real nodes' rows [n, K]
            k = s.shape[-1]
            entropy = -(s.clamp(min=1e-12).log() * s).sum(-1) / math.log(k)
            sums[i][0] += float(entropy.sum())
            sums[i][1] += float(s.max(-1).values.sum())
            sums[i][2] += s.shape[0]
            mask = mask_next
    return [{"level": i, "normalised_entropy": e / n, "max_probability": m / n}
            for i, (e, m, n) in enumerate(sums)]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="MUTAG")
    parser.add_argument("--variants", nargs="+", default=["hap", "hap-pergraph"])
    parser.add_argument("--epochs", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for variant in args.variants:
        for row in assignment_sharpness(args.dataset, variant, args.epochs):
            print(row, flush=True)


if __name__ == "__main__":
    main()

"""Train and evaluate one graph classifier on one split (used by the CV experiment and the tests).

Model selection is honest: the epoch whose weights are evaluated on the test graphs is the one with
the best accuracy on a validation split carved out of the training graphs (ties: lower validation
loss); the test graphs are never looked at during training or selection. ``fit_tuned`` trains every
candidate of a hyper-parameter grid the same way and tests only the candidate with the best
validation accuracy. Training stops early after ``patience`` epochs with neither a better validation
epoch nor a lower validation loss (accuracy on a few dozen validation graphs jumps by chance early
on, the loss is smoother, so a chance peak does not end training while the model still improves);
the per-epoch curve (training loss, validation accuracy and loss) is returned.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .baselines import build_classifier
from .batching import FlatGraphs, GraphLoader


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 40
    batch_size: int = 32
    # Adam lr: 1e-3 gave the higher mean validation accuracy over all six methods on both MUTAG and
    # PROTEINS than 1e-2 (the GIN protocol's value); both runs are reported in docs/hap.md.
    lr: float = 1e-3
    weight_decay: float = 1e-4
    hidden: int = 64
    clusters: tuple[int, ...] = (16, 4)
    dropout: float = 0.5
    aux_weight: float = 1.0  # weight of the method's own regulariser (HAP's content loss, DiffPool, ...)
    patience: int = 0  # stop after this many epochs without a better val epoch or val loss (0: never)
    hap: tuple[tuple[str, object], ...] = ()  # HAPConfig options (hops, masked, content) for "hap"


@dataclass(frozen=True)
class EpochRecord:
    epoch: int
    train_loss: float  # mean cross-entropy + aux over the epoch's batches (train mode)
    val_accuracy: float
    val_loss: float  # cross-entropy


@dataclass(frozen=True)
class FitResult:
    test_accuracy: float
    val_accuracy: float
    best_epoch: int
    seconds: float
    epochs_run: int = 0
    curve: tuple[EpochRecord, ...] = ()
    config: TrainConfig | None = None  # the candidate that was tested (fit_tuned)


class SizeBucketedBatches:
    """Shuffled mini-batches of graphs of similar size, reshuffled every epoch (seeded).

    Dense methods (HAP, DiffPool) pad a batch to its largest graph and pay N^2 per padded graph;
    PROTEINS has graphs of 4 to 620 nodes, so random batches of 32 would pay for 620-node padding
    almost every step (15x the unpadded cost). Each epoch the graphs are shuffled, cut into pools of
    ``pool`` batches and sorted by size inside a pool; batches are then cut greedily with at most
    ``batch_size`` graphs and at most ``node_budget`` padded nodes (graphs x largest graph), and the
    batches are shuffled. Every method gets the same batches.
    """

    def __init__(
        self, sizes: Tensor, batch_size: int, seed: int, pool: int = 8, node_budget: int = 0
    ) -> None:
        self.sizes, self.batch_size, self.pool = sizes.tolist(), batch_size, pool
        self.node_budget = node_budget or 64 * batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def _cut(self, chunk: list[int]) -> list[list[int]]:
        batches: list[list[int]] = [[]]
        for i in sorted(chunk, key=lambda j: self.sizes[j]):  # ascending: the newest graph is the largest
            current = batches[-1]
            padded = (len(current) + 1) * self.sizes[i]
            if current and (len(current) == self.batch_size or padded > self.node_budget):
                batches.append([])
            batches[-1].append(i)
        return batches

    def __iter__(self):
        order = torch.randperm(len(self.sizes), generator=self.generator).tolist()
        step = self.batch_size * self.pool
        batches = [b for start in range(0, len(order), step) for b in self._cut(order[start : start + step])]
        for i in torch.randperm(len(batches), generator=self.generator).tolist():
            yield batches[i]


# How graph_loader builds batches: "flat" cuts them from the dataset's flat tensors (exec/hap/batching.py,
# the same batches and global-RNG draws, faster); "pyg" is torch_geometric's DataLoader, kept as the
# reference the equality test and benchmarks/hap_fit_speed.py compare against.
BATCHING = "flat"
# Adam's update over all parameters at once (torch's "foreach" form) instead of a Python loop over
# them, which is torch's CPU default. On CPU each foreach op runs the single-tensor form's op on each
# tensor in turn (same ops, same order, same scalars), so the parameters are the same bit for bit;
# it saves the loop's per-parameter dispatch (docs/hap.md, "Speed"). False: the loop (the tests' reference).
ADAM_FOREACH = True


def graph_loader(dataset, index: Tensor, batch_size: int, shuffle: bool, seed: int):
    """Training batches (``shuffle``: size-bucketed, reshuffled every epoch) or evaluation batches
    (graphs sorted by size, cut every ``batch_size``; order does not matter, similar sizes pad less)."""
    index = torch.as_tensor(index)
    if BATCHING == "pyg":
        return _library_loader(dataset, index, batch_size, shuffle, seed)
    index = torch.as_tensor(list(dataset.indices()), dtype=torch.long)[index]  # ids in the whole data set
    sizes = _graph_sizes(dataset)[index]
    graphs = _flat_graphs(dataset)
    if not shuffle:  # the same batches every epoch: built once
        order = index[torch.argsort(sizes, stable=True)]
        chunks = [list(range(start, min(start + batch_size, len(order)))) for start in range(0, len(order), batch_size)]
        return GraphLoader(graphs, order, chunks, fixed=True)
    return GraphLoader(graphs, index, SizeBucketedBatches(sizes, batch_size, seed), fixed=False)


def _library_loader(dataset, index: Tensor, batch_size: int, shuffle: bool, seed: int):
    from torch_geometric.loader import DataLoader

    subset = dataset[index]
    sizes = torch.tensor([graph.num_nodes for graph in subset])
    if not shuffle:
        return DataLoader(subset[torch.argsort(sizes, stable=True)], batch_size=batch_size)
    return DataLoader(subset, batch_sampler=SizeBucketedBatches(sizes, batch_size, seed))


def _graph_sizes(dataset) -> Tensor:
    """Nodes per graph of the whole data set (ignoring a subset's indices), from its slices."""
    ptr = dataset.slices["x"]
    return ptr[1:] - ptr[:-1]


def _flat_graphs(dataset) -> FlatGraphs:
    """One ``FlatGraphs`` per dataset object (a fit builds three loaders on it; a run many fits)."""
    cached = getattr(dataset, "_paratwin_flat", None)
    if cached is None:
        cached = FlatGraphs(dataset)
        dataset._paratwin_flat = cached
    return cached


@torch.no_grad()
def evaluate(model: nn.Module, loader) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) over every graph of ``loader``."""
    model.eval()
    correct, loss, count = 0, 0.0, 0
    for batch in loader:
        logits, _ = model(batch)
        correct += int((logits.argmax(-1) == batch.y).sum())
        loss += float(F.cross_entropy(logits, batch.y, reduction="sum"))
        count += batch.num_graphs
    return correct / count, loss / count


def train_model(
    method: str, dataset, train_idx: Tensor, val_idx: Tensor, config: TrainConfig, seed: int
) -> tuple[nn.Module, tuple[float, float], int, list[EpochRecord]]:
    """Train with early stopping; return the model at its best validation epoch and the curve."""
    torch.manual_seed(seed)
    model = build_classifier(
        method, dataset.num_features, dataset.num_classes, config.hidden, config.clusters, config.dropout,
        hap=dict(config.hap),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                 foreach=ADAM_FOREACH)
    train = graph_loader(dataset, train_idx, config.batch_size, True, seed)
    val = graph_loader(dataset, val_idx, config.batch_size, False, seed)
    best = (-1.0, float("inf"))
    best_state, best_epoch = copy.deepcopy(model.state_dict()), 0
    curve: list[EpochRecord] = []
    lowest_loss, last_progress = float("inf"), 0
    for epoch in range(1, config.epochs + 1):
        model.train()
        total, steps = 0.0, 0
        for batch in train:
            logits, aux = model(batch)
            loss = F.cross_entropy(logits, batch.y) + config.aux_weight * aux
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, steps = total + float(loss.detach()), steps + 1
        val_acc, val_loss = evaluate(model, val)
        curve.append(EpochRecord(epoch, total / max(steps, 1), val_acc, val_loss))
        if val_loss < lowest_loss:  # still learning: a new lowest validation loss resets the patience
            lowest_loss, last_progress = val_loss, epoch
        if (val_acc, -val_loss) > (best[0], -best[1]):
            best, best_epoch, last_progress = (val_acc, val_loss), epoch, epoch
            best_state = copy.deepcopy(model.state_dict())
        elif config.patience and epoch - last_progress >= config.patience:
            break
    model.load_state_dict(best_state)
    return model, best, best_epoch, curve


def fit(
    method: str,
    dataset,
    train_idx: Tensor,
    val_idx: Tensor,
    test_idx: Tensor,
    config: TrainConfig,
    seed: int = 0,
) -> FitResult:
    """Train ``method`` on ``train_idx``, pick the epoch on ``val_idx``, report accuracy on ``test_idx``."""
    return fit_tuned(method, dataset, train_idx, val_idx, test_idx, [config], seed)


def fit_tuned(
    method: str,
    dataset,
    train_idx: Tensor,
    val_idx: Tensor,
    test_idx: Tensor,
    candidates: list[TrainConfig],
    seed: int = 0,
) -> FitResult:
    """Train every candidate config; test only the one with the best validation accuracy (ties: loss).

    Every candidate starts from the same seed. The returned curve and epoch count are the chosen
    candidate's; ``seconds`` covers all candidates (the cost of the tuning budget).
    """
    start = time.perf_counter()
    chosen = None
    for config in candidates:
        model, best, best_epoch, curve = train_model(method, dataset, train_idx, val_idx, config, seed)
        if chosen is None or (best[0], -best[1]) > (chosen[1][0], -chosen[1][1]):
            chosen = (model, best, best_epoch, curve, config)
    if chosen is None:
        raise ValueError("fit_tuned needs at least one candidate config")
    model, best, best_epoch, curve, config = chosen
    test_acc, _ = evaluate(model, graph_loader(dataset, test_idx, config.batch_size, False, seed))
    return FitResult(test_acc, best[0], best_epoch, time.perf_counter() - start, len(curve), tuple(curve), config)

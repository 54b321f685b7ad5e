"""Time of a run of layers under tensor parallelism with Merak's sub-pipelined TP.

Each layer is (compute seconds, all-reduce seconds, parts): its compute splits into ``parts``
equal pieces, each followed by an all-reduce of its output (2 for a transformer block: attention
and MLP). Level 0 runs compute and all-reduces back to back. Levels 1-3 split the micro-batch in
two halves so one half's all-reduce overlaps the other half's compute, on two resources (compute
and communication) with each half's next piece waiting for its own previous all-reduce:
level 1 overlaps within each piece, level 2 across the pieces of a layer (attention and MLP),
level 3 across consecutive layers (a layer's MLP all-reduce under the next layer's attention).
Halving the matmuls is assumed not to lower their efficiency.
"""

from __future__ import annotations

from collections.abc import Sequence


def _two_halves(pieces: Sequence[tuple[float, float]]) -> list[float]:
    """Finish time after each piece when two half-batches flow through compute then comm."""
    compute_free = comm_free = 0.0
    ready = [0.0, 0.0]
    finish = []
    for compute, comm in pieces:
        for half in (0, 1):
            compute_end = max(compute_free, ready[half]) + compute / 2
            compute_free = compute_end
            comm_end = max(comm_free, compute_end) + comm / 2
            comm_free = ready[half] = comm_end
        finish.append(comm_free)
    return finish


def tp_segments_time(layers: Sequence[tuple[float, float, int]], level: int) -> list[float]:
    """Per-layer durations (summing to the run's total) for the given overlap level."""
    pieces_of = [[(c / n, a / n)] * n for c, a, n in layers]
    if level == 0:
        return [c + a for c, a, _ in layers]
    if level == 1:
        return [sum(_two_halves([piece])[-1] for piece in pieces) for pieces in pieces_of]
    if level == 2:
        return [_two_halves(pieces)[-1] for pieces in pieces_of]
    flat = [piece for pieces in pieces_of for piece in pieces]
    finish = _two_halves(flat)
    durations, previous, position = [], 0.0, 0
    for pieces in pieces_of:
        position += len(pieces)
        durations.append(finish[position - 1] - previous)
        previous = finish[position - 1]
    return durations

"""DeepSpeed's TrainSchedule as its pipeline engine runs it, in max-plus time (docs/accuracy.md, "The
DeepSpeed pipeline engine's mechanics").

``deepspeed/runtime/pipe/schedule.py`` (DeeperSpeed eb7f5cff; the same TrainSchedule in microsoft/DeepSpeed
1fc74cb9c) runs 2 (m + pp - 1) steps on every stage; a step is either a forward or a backward of one
micro-batch (or idle), its exchanges first: a forward step receives the activation from the previous stage
and sends the previous step's gradient back to it, a backward step sends the previous step's activation on
and receives the gradient from the next stage. Every exchange is blocking and ends only when both of its
ends have posted it (``p2p.py``: a broadcast in a two-rank group, or ``dist.send`` / ``dist.recv``), in the
order each pair posts them. Stage costs are fixed: forward F, backward (with recompute) B, the last stage
``head`` times heavier. Printed beside the iteration: plain 1F1B without lockstep, (pp - 1)(F + B) +
m (F + B)(1 + head), the bottleneck stage's work plus the fill and drain the simulator prices.

    python scripts/deepspeed_lockstep.py PP M [--head 0.06] [--forward 1] [--backward 3]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _micro_batch(step: int, stage: int, stages: int) -> tuple[int, bool]:
    """(micro-batch, is it a forward) of ``stage`` at ``step``: forwards where step and stage have the same
    parity, the micro-batch index lagging the step by the stage's depth."""
    if (step + stage) % 2 == 0:
        return step // 2 - stage // 2, True
    if step % 2 == 0:
        return step // 2 - stages + (stage + 1) // 2, False
    return (step - 1) // 2 - stages + 1 + stage // 2, False


Op = tuple[str, int]  # ("X", peer stage) an exchange, ("F" | "B", micro-batch) a compute


def stage_ops(stage: int, stages: int, m: int) -> list[Op]:
    """One stage's exchanges and computes, step by step, as TrainSchedule.steps yields them."""
    valid = lambda j: 0 <= j < m  # noqa: E731
    ops: list[Op] = []
    previous = -1
    for step in range(2 * (m + stages - 1)):
        mb, forward = _micro_batch(step, stage, stages)
        peer = stage - 1 if forward else stage + 1
        if 0 <= peer < stages:
            # forward: RecvActivation(mb), SendGrad(previous); backward: SendActivation(previous), RecvGrad(mb)
            ops += [("X", peer)] * (valid(mb) + valid(previous))
        if valid(mb):
            ops.append(("F" if forward else "B", mb))
        previous = mb
    return ops


def iteration(stages: int, m: int, cost: Callable[[int, str], float]) -> float:
    """The last stage to finish: each exchange ends when both ends have posted their n-th exchange on
    that pair (no transfer time: what lockstep alone adds)."""
    programs = [stage_ops(s, stages, m) for s in range(stages)]
    position, clock = [0] * stages, [0.0] * stages
    count: list[dict[int, int]] = [{} for _ in range(stages)]
    posted: dict[tuple[int, int, int], float] = {}  # (stage, peer, n) -> when stage posted it
    moved = True
    while moved:
        moved = False
        for s in range(stages):
            while position[s] < len(programs[s]):
                kind, arg = programs[s][position[s]]
                if kind != "X":
                    clock[s] += cost(s, kind)
                else:
                    n = count[s].get(arg, 0)
                    posted.setdefault((s, arg, n), clock[s])
                    if (arg, s, n) not in posted:
                        break
                    clock[s] = max(posted[(s, arg, n)], posted[(arg, s, n)])
                    count[s][arg] = n + 1
                position[s] += 1
                moved = True
    if any(position[s] < len(programs[s]) for s in range(stages)):
        raise RuntimeError(f"the exchanges deadlock at positions {position}")
    return max(clock)


def plain_1f1b(stages: int, m: int, forward: float, backward: float, head: float) -> float:
    return (stages - 1) * (forward + backward) + m * (forward + backward) * (1 + head)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pp", type=int)
    p.add_argument("m", type=int)
    p.add_argument("--head", type=float, default=0.0, help="the last stage's extra work, a fraction")
    p.add_argument("--forward", type=float, default=1.0)
    p.add_argument("--backward", type=float, default=3.0, help="recompute + backward")
    a = p.parse_args()
    cost = lambda s, kind: (a.forward if kind == "F" else a.backward) * (1 + (a.head if s == a.pp - 1 else 0.0))  # noqa: E731
    plain = plain_1f1b(a.pp, a.m, a.forward, a.backward, a.head)
    print(f"lockstep {iteration(a.pp, a.m, cost):.4f}  plain 1F1B {plain:.4f}")


if __name__ == "__main__":
    main()

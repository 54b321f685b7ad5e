"""Megatron-LM v2.5's interleaved 1F1B as it exchanges, in max-plus time (docs/accuracy.md, section 17).

Each pipeline rank runs the order of ``megatron/schedules.py``, ``forward_backward_pipelining_with_interleaving``
at tag v2.5: warm-up forwards, then forward + backward + one batched exchange per step, then cool-down
backwards; every exchange is blocking and a transfer starts only when both of its ends have posted
(the rendezvous the simulator's Program does not express). Stage costs are fixed: a chunk's forward F,
its backward (with recompute) B, the last virtual stage's both ``head`` times heavier. It prints the
iteration beside the ideal interleaved one, N (F + B) + (pp - 1)(F + B) with N = m v, plus the head's
m (F + B) head where it is set: equal when lockstep costs nothing beyond what the simulator prices.

    python scripts/megatron_lockstep.py PP V M [--head 0.2] [--exchange-s 0]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

Tag = tuple[str, int, int]  # ("act" | "grad", consumer stage, micro-batch)
Op = tuple  # ("F" | "B", chunk) or ("X", sends, receives)


def _chunk(k: int, pp: int, v: int, forward: bool) -> int:
    c = (k % (pp * v)) // pp
    return c if forward else v - 1 - c


def _microbatch(k: int, pp: int, v: int) -> int:
    return (k // (pp * v)) * pp + k % pp


def _tags(r: int, pp: int, v: int, k: int, forward: bool) -> tuple[Tag | None, Tag | None]:
    """(what the k-th forward / backward of rank r sends, what it needs received), None at the ends."""
    stage = _chunk(k, pp, v, forward) * pp + r
    mb, last = _microbatch(k, pp, v), pp * v - 1
    if forward:
        return (("act", stage + 1, mb) if stage < last else None), (("act", stage, mb) if stage > 0 else None)
    return (("grad", stage - 1, mb) if stage > 0 else None), (("grad", stage, mb) if stage < last else None)


def rank_ops(r: int, pp: int, v: int, m: int) -> list[Op]:
    """Rank r's computes and exchanges, in v2.5's order (warm-up, steady 1F1B, cool-down)."""
    n = m * v
    warmup = min((pp - r - 1) * 2 + (v - 1) * pp, n)
    ops: list[Op] = []
    first_recv = _tags(r, pp, v, 0, True)[1]
    if first_recv:
        ops.append(("X", [], [first_recv]))

    def exchange(sends: list[Tag | None], recvs: list[Tag | None]) -> None:
        ops.append(("X", [t for t in sends if t], [t for t in recvs if t]))

    for k in range(warmup):
        ops.append(("F", _chunk(k, pp, v, True)))
        recvs = [_tags(r, pp, v, k + 1, True)[1]] if k + 1 < n else []
        if k == warmup - 1 and warmup < n:
            recvs.append(_tags(r, pp, v, 0, False)[1])
        exchange([_tags(r, pp, v, k, True)[0]], recvs)
    for i in range(n - warmup):
        fk, bk = i + warmup, i
        ops += [("F", _chunk(fk, pp, v, True)), ("B", _chunk(bk, pp, v, False))]
        recvs = [_tags(r, pp, v, fk + 1, True)[1] if fk + 1 < n else None,
                 _tags(r, pp, v, bk + 1, False)[1] if bk + 1 < n else None]
        exchange([_tags(r, pp, v, fk, True)[0], _tags(r, pp, v, bk, False)[0]], recvs)
    for k in range(n - warmup, n):
        ops.append(("B", _chunk(k, pp, v, False)))
        exchange([_tags(r, pp, v, k, False)[0]], [_tags(r, pp, v, k + 1, False)[1] if k + 1 < n else None])
    return ops


def iteration_s(pp: int, v: int, m: int, cost: Callable[[int, str, int], float], exchange_s: float) -> float:
    """The last rank's end: each transfer of an exchange ends ``exchange_s`` after both ends posted it."""
    programs = [rank_ops(r, pp, v, m) for r in range(pp)]
    position, clock = [0] * pp, [0.0] * pp
    posted: dict[tuple[str, Tag], float] = {}
    moved = True
    while moved:
        moved = False
        for r in range(pp):
            while position[r] < len(programs[r]):
                op = programs[r][position[r]]
                if op[0] != "X":
                    clock[r] += cost(r, op[0], op[1])
                    position[r] += 1
                    continue
                _, sends, recvs = op
                for tag in sends:
                    posted.setdefault(("S", tag), clock[r])
                for tag in recvs:
                    posted.setdefault(("R", tag), clock[r])
                pairs = [(("S", t), ("R", t)) for t in sends + recvs]
                if any(a not in posted or b not in posted for a, b in pairs):
                    break  # a peer has not reached this exchange yet
                clock[r] = max([clock[r]] + [max(posted[a], posted[b]) + exchange_s for a, b in pairs])
                position[r] += 1
                moved = True
    if any(position[r] < len(programs[r]) for r in range(pp)):
        raise RuntimeError("the exchanges deadlocked")
    return max(clock)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pp", type=int)
    parser.add_argument("v", type=int)
    parser.add_argument("m", type=int, help="micro-batches per iteration (a multiple of pp)")
    parser.add_argument("--head", type=float, default=0.0, help="last virtual stage's extra share of F and B")
    parser.add_argument("--exchange-s", type=float, default=0.0)
    args = parser.parse_args()
    f, b = 1.0, 3.0  # a chunk's forward, and its backward with the forward re-run

    def cost(r: int, kind: str, chunk: int) -> float:
        base = f if kind == "F" else b
        return base * (1 + args.head) if r == args.pp - 1 and chunk == args.v - 1 else base

    got = iteration_s(args.pp, args.v, args.m, cost, args.exchange_s)
    n = args.m * args.v
    ideal = (n + args.pp - 1) * (f + b) + args.m * args.head * (f + b)
    print(f"pp {args.pp} v {args.v} m {args.m} head {args.head}: lockstep {got:.1f}, ideal {ideal:.1f}")


if __name__ == "__main__":
    main()

"""Plan search speed and quality at paper scale: GPT-175B on 1,024 GPUs.

    python benchmarks/search_speed.py [--cluster a100-1024|h100-1024] [--global-batch 1536] [--sample 30]
        [--exhaustive | --compare]

Prints plans considered, estimated, simulated and the wall time of each phase (goal: >= 10,000
considered and the best 50 simulated within 60 s on the 2-core development machine), the
estimate/engine agreement (Spearman on a random sample, goal >= 0.95; the engine's verdict on the
estimate's top picks), the winner, and the engine's time for the Megatron-LM-style configuration
(tp 8, pp 16, dp 8, 1F1B, full recompute, micro-batch 1: ``examples/plans/gpt-175b-h100-1024.yaml``)
on the same cluster and batch for comparison, each with the engine's breakdown of the critical rank's
iteration (the kinds of ``paratwin search``'s "why the winner wins"; docs/search.md discusses the
difference).

``a100-1024`` is 128 DGX A100 nodes (8 x A100-80GB over NVLink3, 8 x HDR InfiniBand per node), the
hardware class of Narayanan et al. (SC'21); it is not a preset, so it is spelled inline here.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

A100_1024 = {"nodes": 128, "devices_per_node": 8, "device": "A100-80GB", "intra_node_link": "nvlink3",
             "inter_node_link": "ib-hdr", "nics_per_node": 8}


def breakdown_text(kinds: Any) -> str:
    """The engine's breakdown of the critical rank's iteration (``sim.engine_breakdown``), in seconds."""
    return (f"compute {kinds.compute_s:.3f}, recompute {kinds.recompute_s:.3f}, bubble (incl. p2p) "
            f"{kinds.bubble_s:.3f}, exposed gradient sync {kinds.exposed_comm_s:.3f}, optimizer step "
            f"{kinds.optimizer_s:.3f} s")


def main() -> None:
    from sim.engine_breakdown import engine_breakdown
    from sim.plan import Plan
    from sim.search import SearchSpace, search
    from sim.simulate import simulate

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", default="a100-1024", help="a100-1024 (inline, DGX A100) or a preset")
    parser.add_argument("--global-batch", type=int, default=1536)
    parser.add_argument("--top", type=int, default=50)
    parser.add_argument("--sample", type=int, default=30)
    parser.add_argument("--workers", type=int, default=None, help="engine processes (default: one per core)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--exhaustive", action="store_true",
                        help="estimate every plan (the search before branch and bound; same best plans)")
    parser.add_argument("--compare", action="store_true",
                        help="run the exhaustive estimate too (no engine) and check it picks the same best --top")
    args = parser.parse_args()
    cluster = A100_1024 if args.cluster == "a100-1024" else args.cluster
    dtype = "fp16"

    started = time.perf_counter()
    space = SearchSpace("gpt-175b", cluster, global_batch=args.global_batch, dtype=dtype)
    result = search(space, top_k=args.top, sample=args.sample, workers=args.workers,
                    bound=False if args.exhaustive else None)
    wall = time.perf_counter() - started
    t = result.timings
    print(f"GPT-175B on {args.cluster} ({result.world_size} GPUs), global batch {result.global_batch}, {dtype}")
    print(f"considered {result.considered:,}; pruned {sum(result.pruned.values()):,} "
          f"({', '.join(f'{k}: {v:,}' for k, v in result.pruned.most_common())}); estimated {len(result.ranked):,}")
    print(f"estimate {t['estimate_s']:.1f} s + engine on the best {result.top_k}: {t['engine_top_s']:.1f} s = "
          f"{t['estimate_s'] + t['engine_top_s']:.1f} s; agreement sample ({args.sample} plans) "
          f"{t['engine_sample_s']:.1f} s; total {wall:.1f} s")
    figures: dict = {}
    if args.compare:  # the exhaustive estimate in this run: its time, and whether it picks the same plans
        from sim.search import estimate_phase

        began = time.perf_counter()
        every = estimate_phase(space, top_k=args.top, workers=args.workers, bound=False)
        seconds = time.perf_counter() - began
        mine = result.estimated_top
        same = [r.candidate for r in every.survivors[:len(mine)]] == [r.candidate for r in mine]
        print(f"exhaustive estimate: {len(every.survivors):,} estimated in {seconds:.1f} s "
              f"({seconds / max(t['estimate_s'], 1e-9):.1f}x the bounded {t['estimate_s']:.1f} s); "
              f"same best {len(mine)} handed to the engine: {same}")
        figures["exhaustive"] = {"estimated": len(every.survivors), "estimate_s": seconds, "same_top": same}
    a = result.agreement
    if a is not None:
        print(f"Spearman estimate vs engine: {a.spearman_sample:.3f} on {a.sample_size} random plans "
              f"(median |error| {a.time_error_median:.1%} time, {a.memory_error_median:.1%} memory); "
              f"{a.spearman_top:.3f} within the estimate's best {result.top_k}")
        print(f"estimate's pick: engine rank {a.estimate_best_engine_rank}, {a.estimate_best_slowdown:+.2%} vs the "
              f"engine's best (estimate rank {a.engine_best_estimate_rank}); top-10 overlap {a.top10_overlap}")
    best = result.best
    figures.update({"considered": result.considered, "estimated": len(result.ranked), "timings": t,
                    "agreement": a.__dict__ if a else None})
    if best is not None and best.simulated is not None:
        print(f"winner: {best.candidate.describe()}: {best.simulated.iteration_s:.3f} s/iteration, "
              f"MFU {best.simulated.mfu:.1%}, peak {max(best.simulated.peak_bytes) / 2**30:.1f} GiB")
        print(f"  breakdown: {breakdown_text(best.simulated)}")
        figures["winner"] = {"plan": best.candidate.describe(), "iteration_s": best.simulated.iteration_s,
                             "mfu": best.simulated.mfu}
    megatron = Plan.from_dict({
        "name": "megatron-175b", "workload": "gpt-175b", "cluster": cluster, "dtype": dtype,
        "parallelism": {"dp": 8, "tp": 8, "pp": 16},
        "schedule": {"name": "1f1b", "micro_batch": 1, "microbatches": args.global_batch // 8},
        "memory": {"policy": "full"}})
    ref = simulate(megatron)
    print(f"Megatron-style tp 8, pp 16, dp 8, 1F1B, full recompute, mb 1: {ref.iteration_s:.3f} s/iteration, "
          f"MFU {ref.mfu:.1%}, peak {ref.peak_memory_bytes / 2**30:.1f} GiB")
    print(f"  breakdown: {breakdown_text(engine_breakdown(ref.table, ref.iteration_s))}")
    figures["megatron_style"] = {"iteration_s": ref.iteration_s, "mfu": ref.mfu}
    interleaved = megatron.replace(parallelism={"chunks": 2}, schedule={"name": "interleaved-1f1b"})
    ref2 = simulate(interleaved)
    print(f"  the same with interleaved-1f1b x2: {ref2.iteration_s:.3f} s/iteration, MFU {ref2.mfu:.1%}")
    print(f"  breakdown: {breakdown_text(engine_breakdown(ref2.table, ref2.iteration_s))}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=2, default=str)


if __name__ == "__main__":
    main()

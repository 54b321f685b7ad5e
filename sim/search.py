"""Plan search: enumerate plans for a workload on a cluster, prune what cannot work, rank the rest
with the fast estimate (``sim.estimate``), simulate the best with the engine, and report how well the
estimate and the engine agree.

Every choice comes from a registry, so a new registration is searched without touching this file:
schedules from ``sim.schedules.SCHEDULES`` (chunks from each ``ScheduleInfo.min_chunks/max_chunks``),
memory policies from ``sim.memory.MEMORY_POLICIES`` (each with its default settings, plus a few values
of every bounded fraction field, e.g. stage-aware's ``ratio``; an optimising policy, ``per_plan``
such as ``optimal``, is built only for the estimate's best ``refine_shapes`` plan shapes, one
optimisation each), gradient-sync methods from
``sim.gradient_sync.GRADIENT_SYNC`` (each with a few bucket sizes, kept when its ``check`` accepts
the plan), embedding methods from ``sim.embedding.EMBEDDING_METHODS`` (sharded ones with dp > 1 on a
workload with embedding tables, priced by ``sim.embedding.estimate_terms``). A policy
whose settings have a required field with no default (``per-stage``'s explicit
list) cannot be spelled without a guess and is listed as not enumerated.

Pruning reasons are counted by the ``ConfigError`` field that refuses the plan (the same checks
``sim.compile`` makes: TP divisibility, pp x chunks <= layers, schedule preconditions, gradient-sync
checks, the simulator's size limit) or "does not fit in memory (estimate)". Equivalent spellings are
not enumerated twice: TP overlap levels only with tp > 1, bucket sizes only with dp > 1, and one
memory policy for schedules that fix their own recomputation (Merak's).

Pure Python: no torch, no simpy here (the engine is imported only to simulate). Worker processes
fork from the process's forkserver (``traces.forkserver``), which imports torch for a later launch.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from dataclasses import fields as dataclass_fields
from typing import Any

from sim.cluster import load_cluster
from sim.compile import (
    MAX_INSTRUCTIONS,
    ResolvedPlan,
    check_schedule,
    check_tp,
    instructions_upper_bound,
    resolve_plan,
)
from sim.embedding import EMBEDDING_METHODS, EmbeddingTerms, embedding_tables, estimate_terms
from sim.engine_breakdown import engine_breakdown
from sim.estimate import Estimate, Estimator, _layout, spearman
from sim.gradient_sync import GRADIENT_SYNC
from sim.implementations import expand_implementation
from sim.memory import MEMORY_POLICIES
from sim.partition import balanced_partition, uniform_partition
from sim.plan import Plan
from sim.schedules import SCHEDULES
from sim.search_bound import BOUNDED, Cutoff, best_first, beyond
from sim.workloads import EXEC_ONLY_OPTIONS, transformer_config, workload_family
from traces.errors import ConfigError
from traces.worker_pool import WorkerPool

DOES_NOT_FIT = "does not fit in memory (estimate)"
SAME_SPLIT = "parallelism.partition (same stages as an earlier partition)"
SAME_PLAN = "memory.policy (an optimising policy that chose what an enumerated one does)"
REFUSED = "memory.policy (the policy refuses this plan: MemoryPolicy.problem)"
# A one-stage plan (pp 1) has no pipeline: every schedule runs each micro-batch's forward and backward on
# the one rank, so the search enumerates one schedule per chunk count (the chunks still split the layers
# into virtual stages: a stage's gradient buckets start after its last backward, and a per-stage memory
# policy sees each): 1F1B for one chunk (the order holding the fewest micro-batches' activations; GPipe
# holds them all) and interleaved 1F1B for more (the one schedule that allows every count). Measured
# (session 15, issue-9w; tests/test_search_one_stage.py): on the analytic A100 model every other schedule's
# one-stage plan simulates to the kept one's time with a peak no lower. On a profiled CPU (gpt-tiny,
# local-cpu-2, dp 2, one bucket) ZB-V x2 was 4.4 ms (0.17%) faster in the engine than the rest, 2,541.8
# against 2,546.1 ms, from one term: the replicas' wait at the gradient all-reduce (sim.meeting) sums the
# profile's spreads of its second chunk's separately timed input and weight halves, not the whole
# backward's; the estimate prices it as the rest. A difference in a noise model, not in the schedule.
ONE_STAGE_SCHEDULES = {1: "1f1b"}  # chunks -> the schedule a one-stage plan is enumerated with
ONE_STAGE_CHUNKED = "interleaved-1f1b"  # for any other chunk count
SAME_ONE_STAGE = "schedule.name (one stage: the same plan as 1f1b, or interleaved-1f1b with as many chunks)"

Progress = Callable[[str, int, int | None], None]  # (phase, done, total or None)


@dataclass(frozen=True)
class SearchSpace:
    """What to search: the job (workload, cluster, batch, dtype) and how finely to enumerate."""

    workload: str
    cluster: str | dict[str, Any]
    global_batch: int | None = None  # default: 2 x the cluster's devices
    dtype: str = "fp16"
    workload_options: dict[str, Any] = field(default_factory=dict)
    profile: str | None = None
    max_tp: int | None = None  # default: devices per node (TP all-reduces stay on NVLink)
    max_micro_batch: int = 8
    micro_batch_sizes: tuple[int, ...] | None = None  # exactly these (e.g. the profiled one); default: divisors
    max_chunks: int = 4  # for schedules whose chunk count has no upper bound
    partitions: tuple[str, ...] = ("uniform", "time")
    fractions: tuple[float, ...] = (0.25, 0.5, 0.75)  # extra values of a policy's bounded fraction fields
    refine_shapes: int = 20  # best plan shapes that per-plan memory policies (optimisers) are built for
    lossy_gradient_sync: bool = False  # also methods that change the gradients (fp16, top-k, S2, PowerSGD)
    gradient_syncs: tuple[str, ...] | None = None  # exactly these methods (lossy ones too); default: every exact one
    tp_overlaps: tuple[int, ...] = (0, 1, 2, 3)
    bucket_mbs: tuple[float, ...] = (25.0, 100.0)
    swap: tuple[float | None, ...] = (None,)  # swap fractions to try (None: no swap)
    # schedule.p2p modes to try on pipelined plans; ("async", "blocking") also tries Megatron-LM 2021's
    # blocking exchanges. The estimate prices each as the engine runs it: under blocking the compute after
    # a send waits for its transfer (``sim.estimate_pipeline.weighted_run``), so across nodes a blocking
    # plan ranks below its async twin by what the engine adds (docs/accuracy.md section 17); the search's
    # plans send whole tensors (no scatter/gather, whose all-gather a blocking plan would also wait for).
    p2p: tuple[str, ...] = ("async",)

    def __post_init__(self) -> None:
        _check_choices(self)
        # workload_options.implementation (sim.implementations) expanded once, as a plan expands it, so
        # the estimate, the plans built and their simulation all see the options it stands for.
        object.__setattr__(self, "workload_options",
                           expand_implementation(self.workload_options, workload_family(self.workload)))

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> SearchSpace:
        """The space that ``summary.json`` of ``paratwin search`` records under ``search.space`` (its JSON
        lists back to tuples), to rerun a search as it ran."""
        unknown = sorted(set(record) - {f.name for f in dataclass_fields(cls)})
        if unknown:
            raise ConfigError("search.space", f"unknown field(s) {', '.join(unknown)}",
                              "pass a record written by paratwin search (summary.json's search.space)")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in record.items()})


# A space's choice tuples that must hold at least one value (None, where allowed, is the default); an empty
# one enumerated no plan, and the search then said "no plan fits in memory" (p2p=(): an IndexError).
_NON_EMPTY = ("partitions", "tp_overlaps", "bucket_mbs", "swap", "p2p", "micro_batch_sizes", "gradient_syncs")


def _check_choices(space: SearchSpace) -> None:
    """Refuse, when the space is made, a choice that no plan can take (ConfigError naming the field)."""
    for name in _NON_EMPTY:
        value = getattr(space, name)
        if value is not None and len(value) == 0:
            raise ConfigError(name, "no values: no plan can be enumerated",
                              f"give at least one, or leave {name} out for its default")
    for name in ("max_tp", "max_micro_batch", "max_chunks"):  # max_tp=0 was read as "not given"
        value = getattr(space, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(name, f"must be a whole number >= 1, got {value!r}", f"leave {name} out for its default")
    for name, values, kinds in (("micro_batch_sizes", space.micro_batch_sizes or (), int),
                                ("bucket_mbs", space.bucket_mbs, (int, float))):
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, kinds) or not v > 0]
        if bad:  # bucket_mbs=(0,) was a pydantic ValidationError traceback from inside the enumeration
            raise ConfigError(name, f"{bad[0]!r} is not a positive {'whole ' if kinds is int else ''}number",
                              f"give {name} values > 0")
    unknown_p2p = sorted(set(space.p2p) - {"async", "blocking"})
    if unknown_p2p:
        raise ConfigError("p2p", f"unknown mode(s) {unknown_p2p}", "use 'async' and/or 'blocking'")


@dataclass(frozen=True, slots=True)
class Candidate:
    dp: int
    tp: int
    pp: int
    chunks: int
    partition: str
    tp_overlap: int
    schedule: str
    micro_batch: int
    microbatches: int
    memory: tuple[tuple[str, Any], ...]
    gradient_sync: tuple[tuple[str, Any], ...]
    embedding: tuple[tuple[str, Any], ...] = (("method", "dense"),)
    p2p: str = "async"

    def sections(self) -> dict[str, Any]:
        return {
            "parallelism": {"dp": self.dp, "tp": self.tp, "pp": self.pp, "chunks": self.chunks,
                            "partition": self.partition, "tp_overlap": self.tp_overlap},
            "schedule": {"name": self.schedule, "micro_batch": self.micro_batch,
                         "microbatches": self.microbatches, **({"p2p": self.p2p} if self.p2p != "async" else {})},
            "memory": _unfreeze(self.memory),
            "gradient_sync": _unfreeze(self.gradient_sync),
            "embedding": _unfreeze(self.embedding),
        }

    def describe(self) -> str:
        memory = " ".join(f"{v}" if k == "policy" else f"{k}={v}" for k, v in self.memory)
        sync = " ".join(f"{v}" if k == "method" else f"{k}={v}" for k, v in self.gradient_sync)
        embedding = dict(self.embedding)
        tables = "" if embedding.get("method") == "dense" else " embedding " + " ".join(
            f"{v}" if k == "method" else f"{k}={v}" for k, v in self.embedding)
        chunks = f" x{self.chunks}" if self.chunks > 1 else ""
        p2p = "" if self.p2p == "async" else f" p2p={self.p2p}"
        return (f"dp{self.dp} tp{self.tp} pp{self.pp} {self.schedule}{chunks} mb{self.micro_batch}x"
                f"{self.microbatches} {self.partition} ov{self.tp_overlap} {memory} {sync}{tables}{p2p}")


def _freeze(settings: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in settings.items())


def _unfreeze(settings: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in settings}


@dataclass
class Simulated:
    """The engine's figures for one candidate."""

    iteration_s: float
    samples_per_s: float
    tokens_per_s: float
    mfu: float
    peak_bytes: tuple[int, ...]  # per pipeline rank
    capacity_bytes: int
    oom: bool
    compute_s: float  # the critical rank's (sim.critical_rank): forward + backward (TP communication inside)
    recompute_s: float
    bubble_s: float
    exposed_comm_s: float  # after its last backward, before its optimizer step
    optimizer_s: float  # the step and what follows it on the rank (the distributed optimizer's all-gather)
    wall_s: float


@dataclass
class Ranked:
    candidate: Candidate
    estimate: Estimate
    simulated: Simulated | None = None
    # (shape, group, leaf): the position in the exhaustive enumeration, which orders equal estimates
    order: tuple[int, ...] = field(default=(), compare=False)


@dataclass
class Agreement:
    sample_size: int
    spearman_sample: float  # estimate vs engine on a random sample of survivors
    spearman_top: float  # estimate vs engine on the simulated top K
    estimate_best_engine_rank: int  # 1 = the estimate's pick is the engine's best of the top K
    engine_best_estimate_rank: int
    estimate_best_slowdown: float  # engine time of the estimate's pick / engine's best - 1
    top10_overlap: int  # of the estimate's top 10 (of K), how many are in the engine's top 10
    memory_error_median: float  # |estimate peak / engine peak - 1| over the sample
    time_error_median: float  # |estimate / engine - 1| over the sample


@dataclass
class SearchResult:
    space: SearchSpace
    world_size: int
    global_batch: int
    considered: int
    pruned: Counter
    ranked: list[Ranked]  # every survivor: the simulated ones in engine order (OOM last), then by estimate
    sampled: list[Ranked]  # the random sample for the agreement figures
    agreement: Agreement | None
    not_enumerated: dict[str, str]  # choice -> why it is not enumerated
    timings: dict[str, float]
    base: dict[str, Any]  # the plan fields every candidate shares
    top_k: int = 0  # how many of the estimate's best were simulated
    estimated_top: list[Ranked] = field(default_factory=list)  # those, in estimate order
    # how the search ran beyond its space: top_k and sample asked for, the sample's seed, branch and bound
    settings: dict[str, Any] = field(default_factory=dict)
    # pruning reason -> (problem, fix) of one plan a check refused under it
    pruned_why: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def simulated(self) -> list[Ranked]:
        return [r for r in self.ranked if r.simulated is not None]

    @property
    def estimate_only(self) -> bool:
        """Asked to simulate none of the estimate's best (``top_k`` 0; not a search where no plan survived)."""
        return self.settings.get("top_k", self.top_k) == 0

    @property
    def best(self) -> Ranked | None:
        """The engine's fastest fitting plan of those simulated. None where the search simulated none of the
        estimate's best (``top_k`` 0): its random sample is drawn for the agreement figures only, and its
        fastest plan is no choice of the search (docs/search.md)."""
        if self.estimate_only:
            return None
        fitting = [r for r in self.simulated if not r.simulated.oom]  # type: ignore[union-attr]
        return fitting[0] if fitting else None

    def plan_of(self, candidate: Candidate, name: str | None = None) -> Plan:
        return Plan.from_dict({**self.base, "name": name or self.base["name"], **candidate.sections()})


# ---------------------------------------------------------------------------------------------
# Enumeration


def one_stage_schedule(chunks: int) -> str:
    """The schedule a one-stage plan with ``chunks`` virtual stages is enumerated with (``ONE_STAGE_SCHEDULES``)."""
    return ONE_STAGE_SCHEDULES.get(chunks, ONE_STAGE_CHUNKED)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def memory_variants(space: SearchSpace, pp_chunks: int) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every registered memory policy with its defaults, plus each bounded fraction field at the
    space's fractions; policies that need a setting with no default are reported, not guessed."""
    variants, skipped = [], {}
    for name, kind in MEMORY_POLICIES.items():
        fields = {k: f for k, f in kind.config.model_fields.items() if k not in ("policy", "swap")}
        required = [k for k, f in fields.items() if f.is_required()]
        if required:
            skipped[f"memory.policy {name}"] = f"needs {', '.join(required)} (no default to enumerate)"
            continue
        base = {"policy": name}
        options = [base]
        for key, info in fields.items():
            if info.annotation is not float:
                continue
            low = next((m.ge for m in info.metadata if getattr(m, "ge", None) is not None), None)
            high = next((m.le for m in info.metadata if getattr(m, "le", None) is not None), None)
            if low is None or high is None or not (low >= 0 and high <= 1):
                continue
            options += [{**base, key: value} for value in space.fractions
                        if low <= value <= high and value != info.default]
        for option in options:
            for swap in space.swap:
                variants.append(option if swap is None else {**option, "swap": [swap] * pp_chunks})
    return variants, skipped


def sync_variants(space: SearchSpace) -> tuple[list[dict[str, Any]], dict[str, str]]:
    variants, skipped = [], {}
    unknown = sorted(set(space.gradient_syncs or ()) - set(GRADIENT_SYNC))
    if unknown:
        raise ConfigError("gradient_syncs", f"no gradient-sync method {', '.join(map(repr, unknown))}",
                          f"name registered ones: {', '.join(GRADIENT_SYNC)}")
    for name, method in GRADIENT_SYNC.items():
        if space.gradient_syncs is not None and name not in space.gradient_syncs:
            skipped[f"gradient_sync.method {name}"] = "not among the methods asked for (--gradient-sync)"
            continue
        if not method.exact and not space.lossy_gradient_sync and space.gradient_syncs is None:
            skipped[f"gradient_sync.method {name}"] = ("lossy: it changes the gradients, which an iteration "
                                                       "time does not show (--lossy-gradient-sync to include)")
            continue
        fields = {k: f for k, f in method.config.model_fields.items() if k != "method"}
        required = [k for k, f in fields.items() if f.is_required()]
        if required:
            skipped[f"gradient_sync.method {name}"] = f"needs {', '.join(required)} (no default to enumerate)"
            continue
        if "bucket_mb" in fields:
            variants += [{"method": name, "bucket_mb": float(b)} for b in space.bucket_mbs]
        else:
            variants.append({"method": name})
    return variants, skipped


def embedding_variants(space: SearchSpace) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every registered embedding method with its defaults; sharded ones only for a workload that
    has embedding tables."""
    variants, skipped = [], {}
    has_tables = bool(embedding_tables(space.workload, dict(space.workload_options)))
    for name, method in EMBEDDING_METHODS.items():
        fields = {k: f for k, f in method.config.model_fields.items() if k != "method"}
        required = [k for k, f in fields.items() if f.is_required()]
        if required:
            skipped[f"embedding.method {name}"] = f"needs {', '.join(required)} (no default to enumerate)"
        elif method.sharded and not has_tables:
            skipped[f"embedding.method {name}"] = f"{space.workload} has no embedding table to shard"
        else:
            variants.append({"method": name})
    return variants, skipped


def factorisations(world: int, max_tp: int) -> Iterator[tuple[int, int, int]]:
    """(dp, tp, pp) with dp x tp x pp = world and tp <= max_tp."""
    for tp in _divisors(world):
        if tp > max_tp:
            continue
        for pp in _divisors(world // tp):
            yield world // (tp * pp), tp, pp


def schedule_chunks(space: SearchSpace) -> list[tuple[str, int]]:
    pairs = []
    for name, info in SCHEDULES.items():
        high = info.max_chunks if info.max_chunks is not None else max(space.max_chunks, info.min_chunks)
        pairs += [(name, c) for c in range(info.min_chunks, high + 1)]
    return pairs


# ---------------------------------------------------------------------------------------------
# The search


@dataclass
class _ShapePlans:
    """What one (dp, tp, pp) shape contributes: plans considered, pruned by reason, survivors."""

    considered: int = 0
    pruned: Counter = field(default_factory=Counter)
    survivors: list[Ranked] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    why: dict[str, tuple[str, str]] = field(default_factory=dict)  # reason -> a refusal's (problem, fix)


@dataclass(frozen=True)
class PlanGroup:
    """The plans of one shape that share micro-batch, schedule, chunks and partition (what the lower
    bound ``Estimator.group_bound`` needs): their other choices as the enumeration nests them, so
    leaf i of the group is a fixed plan."""

    order: tuple[int, int]  # (shape index, group index in the shape's enumeration)
    bound: float  # lower bound of every plan's estimated iteration time
    dp: int
    tp: int
    pp: int
    chunks: int
    partition: str
    schedule: str
    micro_batch: int
    microbatches: int
    split: tuple[tuple[int, ...], ...]
    memories: tuple[dict[str, Any], ...]
    methods: tuple[dict[str, Any], ...]
    embeddings: tuple[dict[str, Any], ...]
    overlaps: tuple[int, ...]
    p2ps: tuple[str, ...]

    @property
    def leaves(self) -> int:
        return len(self.memories) * len(self.methods) * len(self.embeddings) * len(self.overlaps) * len(self.p2ps)


class _Enumerator:
    """Enumerates, prunes and estimates the plans of one (dp, tp, pp) shape at a time, with the
    caches (partitions, memory policies, checks, the estimator's) of the process it runs in."""

    def __init__(self, space: SearchSpace, base: dict[str, Any], global_batch: int, probe: ResolvedPlan) -> None:
        self.space, self.base, self.global_batch = space, base, global_batch
        self.costs, self.comm, self.transformer = probe.costs, probe.comm, probe.transformer
        self.estimator = Estimator(probe.costs, probe.comm, space.dtype, space.workload, space.workload_options)
        self.layers = probe.costs.num_layers
        self.syncs, self.skipped = sync_variants(space)
        self.embeddings, skipped_embeddings = embedding_variants(space)
        self.skipped.update(skipped_embeddings)
        self.embedding_terms: dict[tuple, EmbeddingTerms | None | str] = {}
        self.pairs = schedule_chunks(space)
        self.partitions: dict[tuple[int, str], list[tuple[int, ...]]] = {}
        self.policies: dict[tuple, Any] = {}
        self.checks: dict[tuple, ConfigError | None] = {}
        # pruning reason -> the words of the first refusal counted under it: a search whose checks prune
        # every plan says why and what to change (analysis.search_report), not just a field name
        self.why: dict[str, tuple[str, str]] = {}  # (problem, fix)

    def refused(self, problem: ConfigError | str) -> str:
        """The pruning reason of a plan refused by ``problem`` (a ConfigError's field), its words kept."""
        if isinstance(problem, str):  # a reason of the search's own (its words are the reason)
            return problem
        self.why.setdefault(problem.field, (problem.problem, problem.fix))
        return problem.field

    def stage_layers(self, stages: int, partition: str) -> list[tuple[int, ...]]:
        key = (stages, partition)
        if key not in self.partitions:
            ranges = (uniform_partition(self.layers, stages) if partition == "uniform"
                      else balanced_partition(self.costs.layer_weights(partition), stages))
            self.partitions[key] = [tuple(range(a, b)) for a, b in ranges]
        return self.partitions[key]

    def shape(self, dp: int, tp: int, pp: int, shape_index: int = 0) -> _ShapePlans:
        """Every plan of the shape, each estimated (the exhaustive search)."""
        out, groups = self.groups(dp, tp, pp, shape_index)
        for group in groups:
            part = self.expand(group)
            out.pruned.update(part.pruned)
            out.survivors += part.survivors
        out.why = dict(self.why)  # to the parent process, from a worker
        return out

    def groups(self, dp: int, tp: int, pp: int, shape_index: int = 0) -> tuple[_ShapePlans, list[PlanGroup]]:
        """The shape's plans counted and pruned by the checks that need no memory policy, and the rest
        as groups of one (micro-batch, schedule, chunks, partition), in enumeration order."""
        space, out, groups = self.space, _ShapePlans(skipped=dict(self.skipped)), []
        per_replica = self.global_batch // dp if self.global_batch % dp == 0 else 0
        micro_batches = [b for b in _divisors(per_replica) if b <= space.max_micro_batch
                         and (space.micro_batch_sizes is None or b in space.micro_batch_sizes)] if per_replica else []
        tp_reason = _tp_problem(tp, self.transformer, space.workload)
        for micro_batch in micro_batches:
            m = per_replica // micro_batch
            for schedule, chunks in self.pairs:
                info = SCHEDULES[schedule]
                memories, skipped_memory = memory_variants(space, pp * chunks)
                out.skipped.update(skipped_memory)
                memories = [v for v in memories if not MEMORY_POLICIES[v["policy"]].per_plan]  # see refine()
                if info.recompute_is_schedule:  # the schedule decides recomputation; one policy says it
                    memories = [v for v in memories if v["policy"] == memories[0]["policy"]][: len(space.swap)]
                partitions = space.partitions if pp * chunks > 1 else space.partitions[:1]
                overlaps = space.tp_overlaps if tp > 1 else (0,)
                methods = self.syncs if dp > 1 else _one_per_method(self.syncs)
                # sharding over data-parallel ranks needs two of them: with dp 1 only unsharded methods
                embeddings = self.embeddings if dp > 1 else [
                    e for e in self.embeddings if not EMBEDDING_METHODS[e["method"]].sharded]
                p2ps = space.p2p if pp > 1 else ("async",)  # one stage has no exchanges to block on
                leaves = len(memories) * len(overlaps) * len(methods) * len(embeddings) * len(p2ps)
                out.considered += leaves * len(partitions)
                problem = tp_reason or _shape_problem(schedule, pp, m, chunks, self.layers)
                reason = self.refused(problem) if problem else None
                if not reason and pp == 1 and schedule != one_stage_schedule(chunks):
                    reason = SAME_ONE_STAGE
                if reason:
                    out.pruned[reason] += leaves * len(partitions)
                    continue
                # the least share of the parameters a step updates (the distributed optimizer's 1/dp)
                share = min((1.0 / dp if GRADIENT_SYNC[dict(sync)["method"]].shards_optimizer and dp > 1 else 1.0
                             for sync in methods), default=1.0)
                seen_splits: list[list[tuple[int, ...]]] = []
                for partition in partitions:
                    split = self.stage_layers(pp * chunks, partition)
                    if split in seen_splits:  # e.g. time-balanced = uniform on identical layers
                        out.pruned[SAME_SPLIT] += leaves
                        continue
                    seen_splits.append(split)
                    bound = self.estimator.group_bound(pp, chunks, info.placement, micro_batch, m, split, tp,
                                                       share)
                    groups.append(PlanGroup(
                        (shape_index, len(groups)), bound, dp, tp, pp, chunks, partition, schedule, micro_batch, m,
                        tuple(split), tuple(memories), tuple(methods), tuple(embeddings), tuple(overlaps),
                        tuple(p2ps)))
        return out, groups

    def expand(self, group: PlanGroup, limit: float | None = None, only: set[int] | None = None) -> _ShapePlans:
        """The group's plans pruned and estimated. With a ``limit`` (branch and bound; may be infinite), a
        plan is screened first (``Estimator.screen``): one that does not fit is dropped before its time is
        worked out, and one whose lower bound is above ``limit`` is counted under ``BOUNDED``; ``only``:
        just these leaves (indices into the group's enumeration order)."""
        g, base, out = group, self.base, _ShapePlans()
        dp, tp, pp, chunks, partition, schedule = g.dp, g.tp, g.pp, g.chunks, g.partition, g.schedule
        split = list(g.split)
        k = len(g.p2ps)
        per_memory = len(g.methods) * len(g.embeddings) * len(g.overlaps) * k
        for mi, memory in enumerate(g.memories):
            first = mi * per_memory
            if only is not None and not any(first <= i < first + per_memory for i in only):
                continue
            shape = {"parallelism": {"dp": dp, "tp": tp, "pp": pp, "chunks": chunks, "partition": partition},
                     "schedule": {"name": schedule, "micro_batch": g.micro_batch, "microbatches": g.microbatches},
                     "memory": memory}
            key = (pp, chunks, partition, schedule, _freeze(memory))
            policy = self.policies.get(key)
            if policy is None:
                plan = Plan.from_dict({**base, **shape})
                policy = self.policies[key] = MEMORY_POLICIES[memory["policy"]].build(
                    plan, split, self.costs, self.comm.capacity_bytes)
            if policy.problem:  # e.g. selective checkpointing under a split-backward schedule
                out.pruned[REFUSED] += per_memory
                continue
            leaf = first
            for sync in g.methods:
                per_sync = len(g.embeddings) * len(g.overlaps) * k
                problem = _sync_problem(sync, base, shape, self.checks)
                if problem:
                    out.pruned[self.refused(problem)] += per_sync
                    leaf += per_sync
                    continue
                for embedding in g.embeddings:
                    terms = self.embedding_of(embedding, shape, split)
                    if isinstance(terms, str):
                        out.pruned[terms] += len(g.overlaps) * k
                        leaf += len(g.overlaps) * k
                        continue
                    first_level = None
                    for level in g.overlaps:
                        here, leaf = leaf, leaf + k
                        if only is not None and not any(here <= i < leaf for i in only):
                            continue
                        asked = dict(schedule=schedule, dp=dp, tp=tp, pp=pp, chunks=chunks,
                                     micro_batch=g.micro_batch, microbatches=g.microbatches, stage_layers=split,
                                     policy=policy, tp_overlap=level, sync_method=sync["method"],
                                     bucket_mb=sync.get("bucket_mb", 25.0), embedding=terms)
                        if limit is not None:  # memory and the bound for any level first, then this level's
                            first_level = first_level or self.estimator.screen(**{**asked, "tp_overlap": g.overlaps[0]})
                            if not first_level.fits:
                                out.pruned[DOES_NOT_FIT] += k
                                continue
                            if beyond(first_level.any_level_bound_s, limit) or beyond(
                                    self.estimator.screen(**asked).lower_bound_s, limit):
                                out.pruned[BOUNDED] += k
                                continue
                        # one estimate per p2p mode: a blocking send's transfer is on its sender's path
                        # (``sim.estimate_pipeline.weighted_run``); the memory, so ``fits``, is the same
                        try:  # e.g. row sparsity not measured for this many windows
                            estimates = [(i, p2p, self.estimator.estimate(**asked, p2p=p2p))
                                         for i, p2p in enumerate(g.p2ps) if only is None or here + i in only]
                        except ConfigError as exc:
                            out.pruned[self.refused(exc)] += k
                            continue
                        if not estimates[0][2].fits:
                            out.pruned[DOES_NOT_FIT] += k
                            continue
                        out.survivors.extend(Ranked(
                            Candidate(dp, tp, pp, chunks, partition, level, schedule, g.micro_batch, g.microbatches,
                                      _freeze(memory), _freeze(sync), _freeze(embedding), p2p), estimate,
                            order=(*g.order, here + i))
                            for i, p2p, estimate in estimates)
        return out

    def refine(self, ranked: list[Ranked], shapes: int) -> _ShapePlans:
        """Per-plan memory policies (optimisers, ``MemoryPolicyKind.per_plan``) for the first
        ``shapes`` plan shapes (everything but the memory policy) of ``ranked``: each policy built for
        each shape and estimated with its gradient sync, embedding method and TP overlap."""
        out = _ShapePlans()
        seen: set[Candidate] = set()
        # what every enumerated policy of a shape predicts: an optimiser's plan equal to one is a duplicate
        predicted: dict[Candidate, set[tuple]] = {}
        for r in ranked:
            predicted.setdefault(replace(r.candidate, memory=()), set()).add(
                (r.estimate.iteration_s, r.estimate.peak_bytes))
        for r in ranked:
            c = r.candidate
            shape_of = replace(c, memory=())
            if shape_of in seen:
                continue
            if len(seen) == shapes:
                break
            seen.add(shape_of)
            split = self.stage_layers(c.pp * c.chunks, c.partition)
            memories, _ = memory_variants(self.space, c.pp * c.chunks)
            for memory in (v for v in memories if MEMORY_POLICIES[v["policy"]].per_plan):
                out.considered += 1
                candidate = replace(c, memory=_freeze(memory))
                plan = Plan.from_dict({**self.base, **candidate.sections()})
                try:
                    policy = MEMORY_POLICIES[memory["policy"]].build(plan, split, self.costs, self.comm.capacity_bytes)
                except ConfigError as exc:
                    out.pruned[self.refused(exc)] += 1
                    continue
                terms = self.embedding_of(_unfreeze(c.embedding), {k: v for k, v in candidate.sections().items()
                                                                  if k in ("parallelism", "schedule")}, split)
                estimate = self.estimator.estimate(
                    schedule=c.schedule, dp=c.dp, tp=c.tp, pp=c.pp, chunks=c.chunks, micro_batch=c.micro_batch,
                    microbatches=c.microbatches, stage_layers=split, policy=policy, tp_overlap=c.tp_overlap,
                    sync_method=dict(c.gradient_sync)["method"], bucket_mb=dict(c.gradient_sync).get("bucket_mb", 25.0),
                    embedding=None if isinstance(terms, str) else terms, p2p=c.p2p)
                if not estimate.fits:
                    out.pruned[DOES_NOT_FIT] += 1
                    continue
                if (estimate.iteration_s, estimate.peak_bytes) in predicted[shape_of]:
                    out.pruned[SAME_PLAN] += 1  # e.g. memory to spare: the optimum keeps everything
                    continue
                out.survivors.append(Ranked(candidate, estimate))
        return out

    def embedding_of(self, embedding: dict[str, Any], shape: dict[str, Any],
                     split: list[tuple[int, ...]]) -> EmbeddingTerms | None | str:
        """The estimate's terms for sharded tables (None for unsharded ones), or the field of the
        ConfigError that refuses the plan. One per shape: the memory policy does not change them."""
        method = EMBEDDING_METHODS[embedding["method"]]
        if not method.sharded and method.check is None:
            return None
        key = (_freeze(embedding), repr({k: v for k, v in shape.items() if k != "memory"}))
        if key not in self.embedding_terms:
            try:
                plan = Plan.from_dict({**self.base, **shape, "embedding": embedding})
                if method.check is not None:
                    method.check(plan)
                info = SCHEDULES[plan.schedule.name]
                rank_of, stages_of = _layout(plan.pp, plan.chunks, info.placement)
                self.embedding_terms[key] = estimate_terms(plan, split, self.comm, self.costs, list(rank_of),
                                                           list(stages_of)) if method.sharded else None
            except ConfigError as exc:
                self.embedding_terms[key] = self.refused(exc)
        return self.embedding_terms[key]


# Below this many (shape, schedule, chunks) combinations the estimate takes about as long as starting
# worker processes (about 2 s for two on the development machine, which import the simulator and
# resolve the cost model), so it runs in this process.
MIN_PARALLEL_COMBINATIONS = 400


def _estimate_all(shapes: list[tuple[int, int, int]], here: _Enumerator, probe_plan: dict[str, Any],
                  workers: int | None) -> Iterator[_ShapePlans]:
    """Each shape's plans, in ``shapes`` order (so the result is the one-process result)."""
    workers = min(workers or os.cpu_count() or 1, len(shapes))
    if workers <= 1 or len(shapes) * len(here.pairs) < MIN_PARALLEL_COMBINATIONS:
        for i, (dp, tp, pp) in enumerate(shapes):
            yield here.shape(dp, tp, pp, i)
        return
    # Ctrl-C stops the workers at once (traces.worker_pool); it waited for every queued shape.
    with WorkerPool(workers, initializer=_worker_start,
                    initargs=(probe_plan, here.space, here.base, here.global_batch)) as pool:
        # Largest pipelines first (their unit-cost runs dominate), so no worker is left with the
        # longest at the end; results are taken back in the given order.
        order = sorted(range(len(shapes)), key=lambda i: -shapes[i][2])
        futures = {i: pool.submit(_worker_shape, shapes[i], i) for i in order}
        for i in range(len(shapes)):
            yield futures[i].result()




# Below this many plans in groups the search estimates every plan (the exhaustive ranking and pruning
# counts are cheap there, and ``paratwin search`` writes them); above it, with top_k > 0, it estimates
# only the plans that can be among the best (sim.search_bound).
MIN_BOUNDED_PLANS = 20_000


@dataclass
class EstimatePhase:
    """What the search hands the engine: every estimated plan in estimate order (``survivors``, the
    refined ones included), the counts, and what the rest of the search reuses."""

    considered: int
    pruned: Counter
    survivors: list[Ranked]
    skipped: dict[str, str]
    bounded: bool  # branch and bound (else every plan was estimated)
    groups: list[PlanGroup]
    enumerator: _Enumerator
    base: dict[str, Any]
    probe_plan: dict[str, Any]
    probe: ResolvedPlan
    world: int
    global_batch: int
    name: str
    why: dict[str, tuple[str, str]] = field(default_factory=dict)  # pruning reason -> (problem, fix)


def estimate_phase(space: SearchSpace, top_k: int = 50, workers: int | None = None, bound: bool | None = None,
                   progress: Progress | None = None) -> EstimatePhase:
    """Enumerate, prune and estimate (exhaustively, or by branch and bound for the best ``top_k``: see
    ``search``), then build the optimising memory policies for the best shapes."""
    cluster = load_cluster(space.cluster)
    world = cluster.world_size
    if space.global_batch is not None and (isinstance(space.global_batch, bool) or not isinstance(
            space.global_batch, int) or space.global_batch < 1):  # 0 was read as "not given": 2 x the devices
        raise ConfigError("global_batch", f"must be a positive integer, got {space.global_batch!r}",
                          f"give the samples per iteration, or leave it out for 2 x the devices ({2 * world})")
    global_batch = space.global_batch or 2 * world
    max_tp = space.max_tp or cluster.devices_per_node
    name = f"search-{space.workload}-{cluster.name}"
    base = {"name": name, "workload": space.workload, "workload_options": dict(space.workload_options),
            "cluster": space.cluster, "profile": space.profile, "dtype": space.dtype}
    # One resolve for the shared pieces: the cost model and the communication model.
    probe_plan = {**base, "parallelism": _probe_parallelism(space, world, max_tp)}
    probe = resolve_plan(Plan.from_dict(probe_plan))

    shapes = list(factorisations(world, max_tp))
    pruned: Counter = Counter()
    survivors: list[Ranked] = []
    skipped: dict[str, str] = {}
    why: dict[str, tuple[str, str]] = {}  # from worker processes; this process's are here.why
    considered = 0
    here = _Enumerator(space, base, global_batch, probe)
    groups: list[PlanGroup] = []
    if bound is not False and top_k > 0:
        for i, (dp, tp, pp) in enumerate(shapes):
            part, found = here.groups(dp, tp, pp, i)
            considered += part.considered
            pruned.update(part.pruned)
            skipped.update(part.skipped)
            groups += found
        if bound is None and sum(g.leaves for g in groups) < MIN_BOUNDED_PLANS:
            groups, considered, pruned, skipped = [], 0, Counter(), {}
        else:
            bound = True
    if bound and top_k > 0:
        cutoff = Cutoff(top_k, space.refine_shapes, lambda c: replace(c, memory=()))
        found_pruned, survivors, _ = best_first(groups, cutoff, here.expand)
        pruned.update(found_pruned)
        if progress:
            progress("estimate", considered, None)
    else:
        bound = False
        for part in _estimate_all(shapes, here, probe_plan, workers):
            considered += part.considered
            pruned.update(part.pruned)
            survivors += part.survivors
            skipped.update(part.skipped)
            why.update(part.why)
            if progress:
                progress("estimate", considered, None)
    # Optimising memory policies, for the best shapes only (one build each is an optimisation).
    survivors.sort(key=_estimate_order)
    refined = here.refine(survivors, space.refine_shapes)
    considered += refined.considered
    pruned.update(refined.pruned)
    survivors += refined.survivors
    survivors.sort(key=_estimate_order)
    return EstimatePhase(considered, pruned, survivors, skipped, bool(bound), groups, here, base, probe_plan, probe,
                         world, global_batch, name, {**why, **here.why})


def search(space: SearchSpace, top_k: int = 50, sample: int = 30, seed: int = 0,
           progress: Progress | None = None, workers: int | None = None, bound: bool | None = None) -> SearchResult:
    """Enumerate, prune, estimate, simulate the best ``top_k`` and a random ``sample`` of survivors
    (for the agreement figures). The engine runs in ``workers`` processes (default: one per core), and
    so does the exhaustive estimate, when there is enough work to repay starting them; the result is
    the same as in one process.

    ``bound``: estimate only plans whose lower bound can reach the best ``top_k`` (branch and bound,
    ``sim.search_bound``, in this process): the same best ``top_k`` and refined shapes as the
    exhaustive search, with fewer plans estimated (``ranked`` holds those; the rest are counted under
    ``BOUNDED``) and the random sample drawn from every plan, then estimated. Default: on when
    ``top_k`` > 0 and the space has at least ``MIN_BOUNDED_PLANS`` plans past the structural checks."""
    for name, value in (("top_k", top_k), ("sample", sample)):
        if value < 0:  # a negative top_k sliced all but the last plans for the engine
            raise ConfigError(name, f"must be 0 or more, got {value}", "give how many plans to simulate")
    started = time.perf_counter()
    phase = estimate_phase(space, top_k, workers, bound, progress)
    considered, pruned, survivors, skipped = phase.considered, phase.pruned, phase.survivors, phase.skipped
    base, probe_plan, probe, name, here = phase.base, phase.probe_plan, phase.probe, phase.name, phase.enumerator
    world, global_batch, groups = phase.world, phase.global_batch, phase.groups
    estimated_at = time.perf_counter()

    # The engine on the estimate's best K, then on a random sample of the rest.
    rng = random.Random(seed)
    top = survivors[:top_k]
    if phase.bounded:
        sampled = _sample_groups(groups, here, sample, rng)
        known = {r.candidate: r for r in survivors}
        for j, r in enumerate(sampled):
            if r.candidate in known:
                sampled[j] = known[r.candidate]
            else:  # estimated now, so ranked; the bound had counted it
                survivors.append(r)
                pruned[BOUNDED] -= 1
        survivors.sort(key=_estimate_order)
    else:
        sampled = rng.sample(survivors, min(sample, len(survivors))) if sample else []
    rest = survivors[top_k:]
    to_run = top + [r for r in sampled if r not in top]
    top_done_at = estimated_at
    simulated = _simulate_all([r.candidate for r in to_run], base, probe_plan, probe.costs, name, workers, progress)
    for i, (ranked, outcome) in enumerate(zip(to_run, simulated, strict=True)):
        ranked.simulated = outcome
        if i == len(top) - 1:
            top_done_at = time.perf_counter()
    simulated_at = time.perf_counter()

    agreement = _agreement(top, sampled) if top else None
    done = sorted((r for r in survivors if r.simulated is not None),
                  key=lambda r: (r.simulated.oom, r.simulated.iteration_s))  # type: ignore[union-attr]
    ranked = done + [r for r in rest if r.simulated is None]
    timings = {"estimate_s": estimated_at - started, "engine_top_s": top_done_at - estimated_at,
               "engine_sample_s": simulated_at - top_done_at, "total_s": simulated_at - started}
    return SearchResult(space, world, global_batch, considered, pruned, ranked, sampled, agreement, skipped,
                        timings, base, len(top), top,
                        {"top_k": top_k, "sample": sample, "seed": seed, "bounded": phase.bounded}, phase.why)


def _estimate_order(r: Ranked) -> tuple[float, tuple[int, ...]]:
    """By estimate; equal estimates in enumeration order (optimised policies last), as a stable sort
    of the exhaustive enumeration orders them."""
    return (r.estimate.iteration_s, r.order or (math.inf,))


def _sample_groups(groups: list[PlanGroup], here: _Enumerator, sample: int, rng: random.Random) -> list[Ranked]:
    """``sample`` plans drawn uniformly from the plans that survive pruning and fit, by rejection: a
    random leaf of the groups, estimated (at most 200 draws per plan asked for)."""
    import bisect
    import itertools

    ends = list(itertools.accumulate(g.leaves for g in groups))
    drawn: set[int] = set()
    sampled: list[Ranked] = []
    for _ in range(200 * sample):
        if len(sampled) == sample or not ends or len(drawn) == ends[-1]:
            break
        leaf = rng.randrange(ends[-1])
        if leaf in drawn:
            continue
        drawn.add(leaf)
        i = bisect.bisect_right(ends, leaf)
        part = here.expand(groups[i], only={leaf - (ends[i - 1] if i else 0)})
        sampled += part.survivors
    return sampled


def _one_per_method(syncs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen, kept = set(), []
    for sync in syncs:
        if sync["method"] not in seen:
            seen.add(sync["method"])
            kept.append(sync)
    return kept


def _probe_parallelism(space: SearchSpace, world: int, max_tp: int) -> dict[str, int]:
    """The degrees of the plan that resolves the shared cost and communication models: all data parallel,
    or, for a workload run sequence-parallel (which needs tp > 1: sim.compile.check_tp), the smallest
    tensor-parallel degree it allows. The search then prunes every shape whose tp it refuses."""
    if not space.workload_options.get("sequence_parallel"):
        return {"dp": world}
    exec_only = EXEC_ONLY_OPTIONS.get(workload_family(space.workload) or "", ())
    transformer = transformer_config(space.workload, **{k: v for k, v in space.workload_options.items()
                                                        if k not in exec_only})
    tp = next((t for t in range(2, max_tp + 1) if world % t == 0 and _tp_problem(t, transformer, space.workload)
               is None), None)
    if tp is None:
        raise ConfigError("workload_options.sequence_parallel",
                          f"no tensor-parallel degree in 2..{max_tp} dividing {world} devices suits {space.workload}",
                          "raise max_tp, or search without sequence_parallel")
    return {"dp": world // tp, "tp": tp}


def _tp_problem(tp: int, transformer: Any, workload: str) -> ConfigError | None:
    try:
        check_tp(tp, transformer, workload)
    except ConfigError as exc:
        return exc
    return None


def _shape_problem(schedule: str, pp: int, m: int, chunks: int, layers: int) -> ConfigError | str | None:
    if pp * chunks > layers:
        return "parallelism: pp x chunks"
    try:
        check_schedule(schedule, pp, m, chunks)
    except ConfigError as exc:
        return exc
    if instructions_upper_bound(pp, chunks, m) > MAX_INSTRUCTIONS:
        return "parallelism.pp, chunks, schedule.microbatches (simulator size limit)"
    return None


def _sync_problem(sync: dict[str, Any], base: dict[str, Any], shape: dict[str, Any],
                  cache: dict[tuple, ConfigError | None]) -> ConfigError | None:
    method = GRADIENT_SYNC[sync["method"]]
    if method.check is None:
        return None
    key = (sync["method"], repr(shape))
    if key not in cache:
        try:
            method.check(Plan.from_dict({**base, **shape, "gradient_sync": sync}))
            cache[key] = None
        except ConfigError as exc:
            cache[key] = exc
    return cache[key]


# Plans per worker below which starting processes (a second or two each) does not pay.
MIN_PLANS_PER_WORKER = 4


def _simulate_all(candidates: list[Candidate], base: dict[str, Any], probe_plan: dict[str, Any], costs: Any,
                  name: str, workers: int | None, progress: Progress | None) -> Iterator[Simulated]:
    """The engine's figures for each candidate, yielded in order as they finish (so the caller can
    time the top K). The simulations are independent, so they run in parallel processes."""
    total = len(candidates)
    workers = min(workers or os.cpu_count() or 1, max(1, total // MIN_PLANS_PER_WORKER))
    if workers <= 1:
        for i, candidate in enumerate(candidates):
            if progress:
                progress("engine", i, total)
            yield simulate_candidate(candidate, base, costs, f"{name}-{i}")
    else:
        # Not fork (traces.forkserver.pool_context): no fork of a process that may run threads (a progress
        # bar's refresher); Ctrl-C stops the workers at once (traces.worker_pool).
        with WorkerPool(workers, initializer=_worker_start, initargs=(probe_plan,)) as pool:
            futures = [pool.submit(_worker_simulate, candidate, base, f"{name}-{i}")
                       for i, candidate in enumerate(candidates)]
            for i, future in enumerate(futures):
                if progress:
                    progress("engine", i, total)
                yield future.result()
    if progress:
        progress("engine", total, total)


# A worker process resolves the cost model once (it holds caches that do not pickle; rebuilding it
# is cheaper than shipping it) and, for the estimate, keeps one enumerator whose caches its shapes share.
_worker_costs: Any = None
_worker_enumerator: _Enumerator | None = None


def _worker_start(probe_plan: dict[str, Any], space: SearchSpace | None = None, base: dict[str, Any] | None = None,
                  global_batch: int = 0) -> None:
    global _worker_costs, _worker_enumerator
    probe = resolve_plan(Plan.from_dict(probe_plan))
    _worker_costs = probe.costs
    if space is not None and base is not None:
        _worker_enumerator = _Enumerator(space, base, global_batch, probe)


def _worker_shape(shape: tuple[int, int, int], index: int = 0) -> _ShapePlans:
    assert _worker_enumerator is not None
    return _worker_enumerator.shape(*shape, index)


def _worker_simulate(candidate: Candidate, base: dict[str, Any], name: str) -> Simulated:
    return simulate_candidate(candidate, base, _worker_costs, name)


def simulate_candidate(candidate: Candidate, base: dict[str, Any], costs: Any, name: str) -> Simulated:
    """The engine's figures for one candidate, its breakdown's kinds as docs/search.md defines them."""
    from sim.engine import EngineOptions
    from sim.simulate import simulate

    plan = Plan.from_dict({**base, "name": name, **candidate.sections()})
    result = simulate(plan, costs=costs, options=EngineOptions(layer_rows=False))
    pipeline_rank = {rank: rank // (plan.tp * plan.dp) for rank in result.memory}
    peaks = [0] * plan.pp
    for rank, memory in result.memory.items():
        peaks[pipeline_rank[rank]] = max(peaks[pipeline_rank[rank]], memory.peak_bytes)
    capacity = min(m.capacity_bytes for m in result.memory.values())
    # the critical rank's breakdown, as the estimate's (sim.critical_rank)
    kinds = engine_breakdown(result.table, result.iteration_s)
    return Simulated(result.iteration_s, result.samples_per_s, result.tokens_per_s, result.mfu, tuple(peaks),
                     capacity, result.oom, kinds.compute_s, kinds.recompute_s, kinds.bubble_s, kinds.exposed_comm_s,
                     kinds.optimizer_s, result.wall_s)


def _agreement(top: list[Ranked], sampled: list[Ranked]) -> Agreement:
    def engine(r: Ranked) -> float:
        return r.simulated.iteration_s  # type: ignore[union-attr]

    est_order = top  # already in estimate order
    eng_order = sorted(top, key=engine)
    best_pick = est_order[0]
    engine_best = eng_order[0]
    top10_est = {id(r) for r in est_order[:10]}
    top10_eng = {id(r) for r in eng_order[:10]}
    mem_errors = sorted(abs(max(r.estimate.peak_bytes) / max(r.simulated.peak_bytes) - 1)  # type: ignore[union-attr]
                        for r in sampled if max(r.simulated.peak_bytes))  # type: ignore[union-attr]
    time_errors = sorted(abs(r.estimate.iteration_s / engine(r) - 1) for r in sampled)
    return Agreement(
        sample_size=len(sampled),
        spearman_sample=spearman([r.estimate.iteration_s for r in sampled], [engine(r) for r in sampled]),
        spearman_top=spearman([r.estimate.iteration_s for r in top], [engine(r) for r in top]),
        estimate_best_engine_rank=eng_order.index(best_pick) + 1,
        engine_best_estimate_rank=est_order.index(engine_best) + 1,
        estimate_best_slowdown=engine(best_pick) / engine(engine_best) - 1,
        top10_overlap=len(top10_est & top10_eng),
        memory_error_median=_median(mem_errors),
        time_error_median=_median(time_errors),
    )


def _median(values: list[float]) -> float:
    if not values:
        return math.nan
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def resolved_for(result: SearchResult, candidate: Candidate) -> ResolvedPlan:
    """The candidate resolved as the simulator and the runtime would (it compiles)."""
    return resolve_plan(result.plan_of(candidate))

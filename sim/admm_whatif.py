"""What-if model of SP- vs AP-ADMMiRNN at worker counts this machine cannot run (simpy, no torch).

Both modes follow ``exec/admm/parallel.py``:

* SP: every iteration each worker computes on its shard, then the statistics are summed with
  ring all-reduces. An iteration ends when the slowest worker's compute plus the all-reduces
  end, so every iteration pays the maximum of ``workers`` compute draws. Ring all-reduce of S
  bytes over n ranks (alpha-beta model, Patarasuk & Yuan 2009 / Thakur et al. 2005):
  ``2 (n-1) alpha + 2 (n-1)/n * S / B``.
* AP: a parameter server. Each worker computes, pushes S bytes over the server's ingress link,
  the server applies one update (serialized on the server), and sends the newest weights back
  over its egress link, but only once the worker is at most ``staleness`` iterations ahead of
  the slowest worker (stale synchronous parallel). Transfers to and from the server each take
  ``alpha + S / B`` and queue on the server's links, so the server becomes the bottleneck when
  many workers push at once; that cost is in the model, not left out.

Compute times per worker and iteration are drawn from a distribution with mean ``compute_s``
(from a measured run) and coefficient of variation ``straggler_cv``: ``lognormal`` (default) or
``gamma``; ``straggler_cv = 0`` is deterministic.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import simpy

from traces.errors import ConfigError

# Defaults: the ``eth-10g`` link of sim/data/hardware.yaml. Bandwidth: 10 Gbit/s Ethernet line
# rate (IEEE 802.3ae-2002) = 1.25e9 bytes/s. Latency: that catalog's 30 us estimate for kernel TCP
# sockets (not a datasheet value; measure with exec/commbench and pass alpha_s).
DEFAULT_BANDWIDTH_BPS = 10e9 / 8
DEFAULT_ALPHA_S = 30e-6


def ring_allreduce_s(workers: int, size_bytes: float, alpha_s: float, bandwidth_Bps: float) -> float:
    """Alpha-beta cost of one ring all-reduce of ``size_bytes`` over ``workers`` ranks."""
    if workers <= 1:
        return 0.0
    return 2 * (workers - 1) * alpha_s + 2 * (workers - 1) / workers * size_bytes / bandwidth_Bps


@dataclass
class _ComputeDraw:
    mean_s: float
    cv: float
    distribution: str
    rng: random.Random

    def __call__(self) -> float:
        if self.cv <= 0:
            return self.mean_s
        if self.distribution == "lognormal":
            sigma2 = math.log1p(self.cv**2)
            return self.rng.lognormvariate(math.log(self.mean_s) - sigma2 / 2, math.sqrt(sigma2))
        shape = 1 / self.cv**2  # gamma with mean k * theta and cv 1/sqrt(k)
        return self.rng.gammavariate(shape, self.mean_s / shape)


def _validate(workers: int, compute_s: float, param_bytes: float, mode: str, staleness: int, alpha_s: float,
              bandwidth_Bps: float, iterations: int, straggler_cv: float, distribution: str) -> None:
    checks = [
        ("workers", workers >= 1, "use at least 1 worker"),
        ("compute_s", compute_s > 0, "use a positive compute time per iteration"),
        ("param_bytes", param_bytes >= 0, "use a non-negative message size"),
        ("mode", mode in ("sp", "ap"), "use 'sp' or 'ap'"),
        ("staleness", staleness >= 0, "use 0 or more"),
        ("alpha_s", alpha_s >= 0, "use a non-negative latency"),
        ("bandwidth_Bps", bandwidth_Bps > 0, "use a positive bandwidth in bytes/s"),
        ("iterations", iterations >= 1, "use at least 1 iteration"),
        ("straggler_cv", straggler_cv >= 0, "use a non-negative coefficient of variation"),
        ("distribution", distribution in ("lognormal", "gamma"), "use 'lognormal' or 'gamma'"),
    ]
    for name, ok, fix in checks:
        if not ok:
            raise ConfigError(name, "invalid value for the ADMMiRNN what-if", fix)


def _run_sp(env: simpy.Environment, workers: int, draw: _ComputeDraw, iterations: int, allreduce_s: float,
            done: list[float]) -> simpy.events.ProcessGenerator:
    for _ in range(iterations):
        yield env.all_of([env.timeout(draw()) for _ in range(workers)])  # barrier at the all-reduce
        yield env.timeout(allreduce_s)
        done.append(env.now)


class _Server:
    """Parameter server state of the AP model: worker clocks and replies held back by SSP."""

    def __init__(self, env: simpy.Environment, workers: int, staleness: int, transfer_s: float,
                 update_s: float) -> None:
        self.env, self.staleness, self.transfer_s, self.update_s = env, staleness, transfer_s, update_s
        self.clocks = [0] * workers
        self.held: dict[int, simpy.Event] = {}
        self.ingress, self.egress = simpy.Resource(env, 1), simpy.Resource(env, 1)
        self.cpu = simpy.Resource(env, 1)
        self.gaps: list[int] = []

    def push(self, worker: int, reply: simpy.Event) -> simpy.events.ProcessGenerator:
        with self.ingress.request() as link:
            yield link
            yield self.env.timeout(self.transfer_s)
        with self.cpu.request() as cpu:
            yield cpu
            yield self.env.timeout(self.update_s)
            self.clocks[worker] += 1
            self.held[worker] = reply
            slowest = min(self.clocks)
            self.gaps.append(max(self.clocks) - slowest)
            for w in sorted(self.held):
                if self.clocks[w] - slowest <= self.staleness:
                    self.env.process(self._send(self.held.pop(w)))

    def _send(self, reply: simpy.Event) -> simpy.events.ProcessGenerator:
        with self.egress.request() as link:
            yield link
            yield self.env.timeout(self.transfer_s)
        reply.succeed()


def _run_ap_worker(env: simpy.Environment, server: _Server, worker: int, draw: _ComputeDraw, iterations: int,
                   done: list[float]) -> simpy.events.ProcessGenerator:
    for _ in range(iterations):
        yield env.timeout(draw())
        reply = env.event()
        env.process(server.push(worker, reply))
        yield reply
    done.append(env.now)


def simulate_admm_parallel(
    workers: int,
    compute_s: float,
    param_bytes: float,
    mode: str = "sp",
    staleness: int = 2,
    alpha_s: float = DEFAULT_ALPHA_S,
    bandwidth_Bps: float = DEFAULT_BANDWIDTH_BPS,
    iterations: int = 100,
    straggler_cv: float = 0.0,
    seed: int = 0,
    *,
    allreduces_per_iteration: int = 2,
    server_update_s: float = 0.0,
    distribution: str = "lognormal",
) -> dict[str, float | int | str]:
    """Simulated time for every worker to finish ``iterations`` iterations.

    ``compute_s``: mean local compute of one worker iteration (seconds). ``param_bytes``: bytes a
    worker contributes per iteration (SP: summed by ``allreduces_per_iteration`` ring
    all-reduces, the alpha term paid per all-reduce; AP: pushed to the server and, as weights, the
    same order of bytes pulled back). ``server_update_s``: the server's time per weight update.

    Returns the time, iterations per second (per worker: one SP iteration is one iteration of
    every worker), the mean communication time charged per iteration (SP) and the mean/max clock
    gap between fastest and slowest worker (AP).
    """
    _validate(workers, compute_s, param_bytes, mode, staleness, alpha_s, bandwidth_Bps, iterations,
              straggler_cv, distribution)
    env = simpy.Environment()
    draw = _ComputeDraw(compute_s, straggler_cv, distribution, random.Random(seed))
    done: list[float] = []
    result: dict[str, float | int | str] = {"mode": mode, "workers": workers, "iterations": iterations,
                                            "compute_s": compute_s, "param_bytes": param_bytes,
                                            "straggler_cv": straggler_cv, "staleness": staleness}
    if mode == "sp":
        share = param_bytes / allreduces_per_iteration
        comm = allreduces_per_iteration * ring_allreduce_s(workers, share, alpha_s, bandwidth_Bps)
        env.process(_run_sp(env, workers, draw, iterations, comm, done))
        env.run()
        result.update(comm_s_per_iteration=comm, mean_gap=0.0, max_gap=0)
    else:
        server = _Server(env, workers, staleness, alpha_s + param_bytes / bandwidth_Bps, server_update_s)
        for w in range(workers):
            env.process(_run_ap_worker(env, server, w, draw, iterations, done))
        env.run()
        result.update(comm_s_per_iteration=2 * (alpha_s + param_bytes / bandwidth_Bps),
                      mean_gap=sum(server.gaps) / len(server.gaps), max_gap=max(server.gaps))
    time_s = max(done)
    result.update(time_s=time_s, iterations_per_s=iterations / time_s)
    return result

"""The memory-bound kernels of unfused attention, timed on the device at hand, against the rate the
analytic model gives them (issue 9, docs/accuracy.md section 11).

The kernel model prices every memory-bound kernel at ``memory_bandwidth x mem_eff`` (sim/analytic.py),
a copy's rate. Unfused attention's softmax and dropout run over b a s^2 / t elements, and the dropout
draws a random number per element; whether they reach a copy's rate decides how much of the SC'21
rows' remaining error is in attention. Each kernel is timed on an attention-score-shaped tensor and
its bytes counted as ``sim.analytic.kernel_times`` counts them (e: the element's bytes; dropout's mask
one byte per element), so ``achieved / datasheet`` reads against the model's rate: ``mem_eff`` for the
copy, ``EfficiencyCurve.attention_mem_eff`` (``attn_mem_eff``, None = mem_eff) for softmax and dropout.

    python scripts/kernel_rates.py --out runs/kernel_rates            # on a CUDA GPU (gpu_check runs it)
    python scripts/kernel_rates.py --smoke --out /tmp/kernel-rates    # tiny tensors on this CPU (tests)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd

# (batch x heads, sequence) of the score tensors: gpu_check's GPT cases (micro-batch 4, 12 and 16
# heads at sequence 1,024 and 2,048); the smoke shape is small enough for a test.
GPU_SHAPES = [(4 * 12, 1024), (4 * 16, 2048)]
SMOKE_SHAPES = [(4, 64)]


def kernels(torch, e: int) -> dict[str, tuple[Callable, float]]:  # noqa: ANN001 (torch is the module)
    """name -> (function of the score tensor and its gradient, bytes moved per element as the model
    counts them: sim/analytic.py kernel_times, unfused attention)."""
    functional = torch.nn.functional

    def softmax_backward(x, y, dy):  # noqa: ANN001, ANN202
        return torch._softmax_backward_data(dy, y, -1, x.dtype)

    def dropout_backward(x, y, dy):  # noqa: ANN001, ANN202
        return dy * y  # the saved mask (here y stands for it) times the incoming gradient

    return {
        "copy": (lambda x, y, dy: x.clone(), 2 * e),
        "softmax forward": (lambda x, y, dy: torch.softmax(x, dim=-1), 2 * e),
        "softmax backward": (softmax_backward, 3 * e),
        "dropout forward": (lambda x, y, dy: functional.dropout(x, 0.1, training=True), 2 * e + 1),
        "dropout backward": (dropout_backward, 2 * e + 1),
    }


def time_call(torch, call: Callable[[], object], repeats: int, cuda: bool) -> list[float]:  # noqa: ANN001
    """Seconds of each of ``repeats`` calls after two warm-up calls (CUDA events on a GPU)."""
    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
    return times


def measure(catalog_device: str | None, repeats: int) -> pd.DataFrame:
    """Time the kernels on the GPU, priced as the catalog's ``catalog_device``; None: tiny tensors on the CPU."""
    import torch

    from sim.analytic import default_for
    from sim.hardware import get_device

    cuda = catalog_device is not None
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    e = torch.tensor([], dtype=dtype).element_size()
    if cuda:  # the datasheet figure and the rates the model prices this GPU with
        spec = get_device(catalog_device)
        curve = default_for(spec, "bf16")
        datasheet, mem_eff, attn_mem_eff = spec.memory_bandwidth_Bps, curve.mem_eff, curve.attention_mem_eff
    else:  # the analytic model does not price CPUs
        datasheet = mem_eff = attn_mem_eff = float("nan")
    rows = []
    for batch_heads, s in (GPU_SHAPES if cuda else SMOKE_SHAPES):
        x = torch.randn(batch_heads, s, s, device=device, dtype=dtype)
        y = torch.softmax(x, dim=-1)
        dy = torch.randn_like(x)
        for name, (kernel, per_element) in kernels(torch, e).items():
            times = time_call(torch, functools.partial(kernel, x, y, dy), repeats, cuda)
            seconds = statistics.median(times)
            moved = per_element * x.numel()
            rows.append({"kernel": name, "batch_heads": batch_heads, "seq": s, "dtype": str(dtype).split(".")[-1],
                         "bytes": moved, "median_s": seconds, "min_s": min(times), "max_s": max(times),
                         "achieved_GBps": moved / seconds / 1e9, "datasheet_GBps": datasheet / 1e9,
                         "fraction_of_datasheet": moved / seconds / datasheet,
                         # a copy at mem_eff; softmax and dropout at EfficiencyCurve.attention_mem_eff
                         "model_mem_eff": mem_eff if name == "copy" else attn_mem_eff})
        del x, y, dy
    return pd.DataFrame(rows)


def write(table: pd.DataFrame, out: Path, device: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "kernel_rates.csv", index=False)
    lines = [f"# Memory-bound attention kernels on {device} ({time.strftime('%Y-%m-%d')})", "",
             "| kernel | b x a | seq | median (ms) | spread (min-max, ms) | GB/s | of datasheet | model's rate |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    lines += [f"| {r.kernel} | {r.batch_heads} | {r.seq} | {r.median_s * 1e3:.3f} | {r.min_s * 1e3:.3f}-"
              f"{r.max_s * 1e3:.3f} | {r.achieved_GBps:.0f} | {r.fraction_of_datasheet:.2f} | {r.model_mem_eff:.2f} |"
              for r in table.itertuples()]
    (out / "kernel_rates.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/kernel_rates"))
    parser.add_argument("--smoke", action="store_true", help="tiny tensors on the CPU: the same steps, for tests")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device-name", default=None, help="the hardware catalog's device (default: from the GPU)")
    args = parser.parse_args(argv)
    from sim.hardware import gpu_at_hand
    from traces.errors import ConfigError

    if args.smoke:
        write(measure(None, args.repeats), args.out, "cpu")
        return 0
    try:
        cuda_name, catalog_device = gpu_at_hand(args.device_name)
    except ConfigError as exc:
        print(f"kernel_rates: {exc}", file=sys.stderr)
        return 2
    write(measure(catalog_device, args.repeats), args.out, f"{cuda_name} (priced as {catalog_device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

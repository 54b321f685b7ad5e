"""Profile every gradient-sync method's encode + decode on the CUDA GPU at hand, in the format of
sim/data/codec_rates.csv (issue 11): the simulator then prices the codec of plans on that GPU at
the measured rate instead of the memory bandwidth (a lower bound; docs/compression.md).

    python scripts/gpu_codec.py --out runs/gpu_codec                 # on a CUDA machine, ~1-2 minutes
    python scripts/gpu_codec.py --out runs/gpu_codec --update        # and merge the rows into sim/data
    python scripts/gpu_codec.py --smoke --out /tmp/gpu-codec         # the same steps on this CPU (tests)

GPU: lstm-lm (Zaremba's medium LSTM on WikiText-2's 33,278 words, sparse embedding, 20 windows:
the workload of analysis/compression_figures.py) on the GPU, rows named after the hardware
catalog's device (sim/data/hardware.yaml), taken from the GPU's name or ``--device-name``.
Smoke: lstm-tiny with a sparse embedding on the CPU, rows named ``local-cpu``. Writes
``codec_rates.csv`` under ``--out``; ``--update`` also replaces that device's rows in
sim/data/codec_rates.csv. CI never runs the GPU case.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

SMOKE_PLAN = {"name": "gpu-codec-smoke", "workload": "lstm-tiny", "workload_options": {"sparse": True,
              "data": "wikitext-2"}, "cluster": {"preset": "local-cpu-2"}, "schedule": {"micro_batch": 8,
                                                                                         "microbatches": 1}}


def gpu_plan(device: str) -> dict:
    """The lstm-lm plan on one GPU of the catalog's ``device``."""
    return {"name": "gpu-codec-lstm-lm", "workload": "lstm-lm", "workload_options": {"sparse": True,
            "data": "wikitext-2"}, "cluster": {"nodes": 1, "devices_per_node": 1, "device": device},
            "schedule": {"micro_batch": 20, "microbatches": 1}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_codec"))
    parser.add_argument("--smoke", action="store_true", help="lstm-tiny on the CPU: the same steps, for tests")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device-name", default=None, help="the hardware catalog's device (default: from the GPU)")
    parser.add_argument("--update", action="store_true", help="also write the rows into sim/data/codec_rates.csv")
    args = parser.parse_args(argv)

    from analysis.compression_codec import measure, write_rates
    from sim.gradient_sync import CODEC_FILE
    from sim.hardware import gpu_at_hand
    from sim.plan import Plan
    from traces.errors import ConfigError

    if args.smoke:
        torch_device, name, plan = "cpu", args.device_name or "local-cpu", SMOKE_PLAN
    else:
        try:
            name = gpu_at_hand(args.device_name)[1]
        except ConfigError as exc:
            print(f"gpu_codec: {exc}", file=sys.stderr)
            return 2
        torch_device, plan = "cuda", gpu_plan(name)
    rows = measure(Plan.from_dict(plan), args.repeats, torch_device, name)
    args.out.mkdir(parents=True, exist_ok=True)
    write_rates(rows, args.out / "codec_rates.csv")
    if args.update:
        write_rates(rows, CODEC_FILE)
    print(f"wrote {args.out / 'codec_rates.csv'}{' and ' + str(CODEC_FILE) if args.update else ''}: "
          f"{len(rows)} methods on {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

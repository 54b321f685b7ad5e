"""scripts/gpu_codec.py takes the same steps on this CPU (--smoke) as on a GPU: every method's
encode + decode timed on the workload's real gradients, rows in sim/data/codec_rates.csv's format.
The GPU case itself never runs in CI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sim.gradient_sync import CODEC_FILE, GRADIENT_SYNC
from tests.script_module import load_script
from traces.commented_csv import read_rows

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_codec.py"


def test_gpu_codec_smoke_writes_rates_in_the_simulators_format(tmp_path: Path) -> None:
    shipped = CODEC_FILE.read_text()
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--repeats", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_rows(tmp_path / "codec_rates.csv")
    # every method that encodes (the dense all-reduce and the distributed optimizer, which only
    # reduce-scatters, have no memory phase), for the named device
    assert sorted(r["method"] for r in rows) == sorted(set(GRADIENT_SYNC) - {"allreduce", "distopt"})
    assert {r["device"] for r in rows} == {"local-cpu"}
    assert all(float(r["rate_Bps"]) > 0 and int(r["memory_bytes"]) > 0 for r in rows)
    assert set(rows[0]) == set(read_rows(CODEC_FILE)[0])  # the columns sim.gradient_sync reads
    assert CODEC_FILE.read_text() == shipped  # without --update the shipped rates stay


def test_gpu_names_map_to_the_hardware_catalog() -> None:
    module = load_script("scripts/gpu_codec.py")
    assert module.catalog_name("NVIDIA H200", 141 * 2**30) == "H200"
    assert module.catalog_name("NVIDIA A100-SXM4-80GB", 80 * 2**30) == "A100-80GB"
    assert module.catalog_name("NVIDIA A100-PCIE-40GB", 40 * 2**30) == "A100-40GB"
    assert module.catalog_name("NVIDIA L4", 24 * 2**30) is None
    from sim.hardware import get_device

    for name in ("H200", "H100-SXM", "V100-32GB", "RTX3090", "A100-80GB", "A100-40GB"):
        get_device(name)  # each is in the catalog

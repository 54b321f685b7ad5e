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
    """The names CUDA reports on the machines these scripts run on, to the catalog's device; a board the
    catalog does not hold (an H100 PCIe has other memory and clocks than the SXM part) is not guessed."""
    from sim.hardware import catalog_device_for_gpu, get_device

    assert catalog_device_for_gpu("NVIDIA H200", 141 * 2**30) == "H200"
    assert catalog_device_for_gpu("NVIDIA H100 80GB HBM3", 80 * 2**30) == "H100-SXM"
    assert catalog_device_for_gpu("NVIDIA H100 PCIe", 80 * 2**30) is None
    assert catalog_device_for_gpu("NVIDIA A100-SXM4-80GB", 80 * 2**30) == "A100-80GB"
    assert catalog_device_for_gpu("NVIDIA A100-PCIE-40GB", 40 * 2**30) == "A100-40GB"
    assert catalog_device_for_gpu("NVIDIA L4", 24 * 2**30) is None
    for name in ("H200", "H100-SXM", "V100-32GB", "RTX3090", "A100-80GB", "A100-40GB"):
        get_device(name)  # each is in the catalog


def test_gpu_plans_are_priced_as_the_gpu_at_hand() -> None:
    """gpu_check and gpu_codec planned every GPU as an H200 (the preset h200-1), so an H100 check would
    have compared its runs with an H200's what-if: the plans now take the catalog's device."""
    from sim.cluster import load_cluster
    from sim.plan import Plan

    def priced_as(plan: dict) -> str:
        return load_cluster(Plan.from_dict(plan).cluster).device.name

    check, codec = load_script("scripts/gpu_check.py"), load_script("scripts/gpu_codec.py")
    for device in ("H100-SXM", "H200"):
        assert priced_as(check.plan_for("gpt2-small seq 1024", "gpt2-small", {"seq": 1024}, 4, device)) == device
        assert priced_as(codec.gpu_plan(device)) == device
    assert priced_as(check.plan_for("gpt-tiny seq 32", "gpt-tiny", {"seq": 32}, 2, None)) == "local-cpu"

"""A plan whose ranks need more memory than this machine has is refused before any rank starts, with
what it needs and what is there (exec.host_fit), instead of the OOM killer choosing a process."""

from __future__ import annotations

from pathlib import Path

import pytest

from exec import host_fit
from exec.contract import compile_for_run
from exec.launcher import run_plan
from sim.plan import Plan
from traces.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "plans"
LOCAL_PLANS = ["gpt-tiny-pp2-1f1b.yaml", "gpt-tiny-pp2-tp2.yaml", "gpt-tiny-dp2.yaml", "lstm-tiny-dp2.yaml",
               "gpt-tiny-pp2-swap.yaml"]


def test_memory_available_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24730000 kB\nMemFree:         1000 kB\nMemAvailable:   2048 kB\n")
    assert host_fit.available_bytes(meminfo) == 2048 * 1024
    assert host_fit.available_bytes(tmp_path / "absent") is None


@pytest.mark.parametrize("name", LOCAL_PLANS)
def test_the_quick_bound_is_above_the_ledger(name: str) -> None:
    """The ledger runs only where the quick bound comes near the memory available: so the bound must
    never be below what the ledger says (a plan it lets through unchecked could not need more)."""
    executable = compile_for_run(Plan.load(EXAMPLES / name))
    ledger = host_fit.ledger_bytes(executable)
    assert 0 < ledger <= host_fit.quick_upper_bytes(executable)


def test_refused_exactly_when_the_ranks_need_more_than_is_available() -> None:
    executable = compile_for_run(Plan.load(EXAMPLES / "gpt-tiny-pp2-1f1b.yaml"))
    needed = host_fit.ledger_bytes(executable)
    host_fit.check_host_memory(executable, available=needed)  # fits exactly: runs
    with pytest.raises(ConfigError, match=r"^workload: 'gpt-tiny' on 2 ranks needs about 0\.0 GiB .* \(fix: run a "
                                          r"smaller workload"):
        host_fit.check_host_memory(executable, available=needed - 1)


def test_run_refuses_before_any_rank_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_fit, "available_bytes", lambda: 2**20)  # a machine with 1 MiB free
    with pytest.raises(ConfigError, match=r"needs about .* GiB at the ranks' peaks .* 0\.0 GiB available"):
        run_plan(EXAMPLES / "gpt-tiny-pp2-1f1b.yaml", out_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()

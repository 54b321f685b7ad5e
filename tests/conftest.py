"""Fixtures shared by several test modules: expensive, deterministic setup built once per session."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def folder_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by relative path."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture(scope="session")
def gpt_tiny_profile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """gpt-tiny's layers measured on this CPU (micro-batch 1, 1 warm-up + 3 repeats, no op timeline).

    Measured costs make a swap cost less than a forward (structural costs have zero times, where a
    memory policy never swaps). Profiling takes 15-60 s on a loaded 2-core machine, and four modules
    used to take this same profile each. Shared, so it must stay as measured: a test that changes a
    bundle works on a copy (``shutil.copytree``), and the session fails at the end if any file of
    this one changed (file permissions would not stop a test run as root)."""
    from exec.profiler import profile_workload
    from traces.bundle import write_bundle

    bundle = profile_workload("gpt-tiny", micro_batch=1, warmup=1, repeats=3, with_ops=False, device="cpu")
    path = write_bundle(bundle, tmp_path_factory.mktemp("profile") / "gpt-tiny")
    written = folder_digest(path)
    yield path
    assert folder_digest(path) == written, (f"a test changed the shared profile {path}: copy it before "
                                            "changing it (see tests/conftest.py)")


@pytest.fixture
def saved_figures(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Every matplotlib figure saved during the test, by file stem, as it was when saved: what a reader
    sees (titles, legends, axes), which a test cannot read back from a PNG."""
    from matplotlib.figure import Figure

    seen: dict[str, Any] = {}
    save = Figure.savefig

    def savefig(fig: Figure, fname: object, *args: object, **kwargs: object) -> None:
        name = Path(str(fname)).name
        if name.startswith(".") and name.endswith(".tmp"):  # traces.atomic.atomic_path's ".NAME.EXT.XXXX.tmp"
            name = name[1:].rsplit(".", 2)[0]
        seen[Path(name).stem] = fig
        save(fig, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return seen


def said(fig: Any) -> str:
    """A figure's suptitle, axes titles and legend titles, one a line."""
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes)]
    texts = [fig.get_suptitle(), *(ax.get_title() for ax in fig.axes),
             *(legend.get_title().get_text() for legend in legends if legend is not None)]
    return "\n".join(text for text in texts if text)

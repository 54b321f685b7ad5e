"""Console tables shared by the CLI and the demo."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from traces.errors import ParatwinError


def _make_console(stderr: bool = False) -> Console:
    # A pipe or a file has no width to wrap at: keep table rows and error lines whole there.
    terminal = Console(stderr=stderr)
    return terminal if terminal.is_terminal else Console(stderr=stderr, width=250, soft_wrap=True)


console = _make_console()
error_console = _make_console(stderr=True)  # for a CLI whose stdout is its result (analysis.hap_experiment)
ERROR_CHARS = 4000  # the most of an error message the CLI prints


def plain(text: object) -> None:
    """Print text as it is: no markup (a gloo error holds ``[/__w/...]``), no highlighting."""
    console.print(str(text), markup=False, highlight=False)


def print_error(message: object, to: Console = console) -> None:
    """``error: <message>`` on one line, the message escaped and cut to ``ERROR_CHARS``."""
    text = str(message)
    if len(text) > ERROR_CHARS:
        text = text[:ERROR_CHARS] + f"... ({len(text) - ERROR_CHARS:,} more characters)"
    to.print(f"[red]error:[/red] {escape(text)}", highlight=False, soft_wrap=True)


def run_cli(command: Callable[[], object], to: Console = console) -> None:
    """Run a CLI's ``command``; an error paratwin reports (``ParatwinError``) is printed on ``to`` as one
    ``error:`` line, no traceback, and the process exits with status 2, unless the error carries its
    own ``exit_code`` (3: plan does not fit; 128 + the signal's number: a run stopped by SIGINT or SIGTERM).
    A file system that refuses a write (full, over quota, read-only) is such an error too, wherever the write
    was: ``storage_problem``."""
    try:
        command()
    except ParatwinError as exc:
        print_error(exc, to)
        # CPython marks a KeyboardInterrupt that left an exec() of a string (a dataclass's generated methods,
        # in a lazy import) as unhandled even once caught, and `python -m` then ends by SIGINT, not with the
        # status below; an exec() that completes clears the mark.
        exec("pass")
        sys.exit(getattr(exc, "exit_code", 2))
    except Exception as exc:
        problem = storage_problem(exc)
        if problem is None:
            raise
        print_error(problem, to)
        sys.exit(2)


# What to do where a file system refused a write (errno: the fix).
STORAGE_FIXES = {
    errno.ENOSPC: "free space or choose another folder",
    errno.EDQUOT: "free space (your quota is full) or choose another folder",
    errno.EROFS: "choose a folder on a file system you can write",
}


def storage_problem(exc: BaseException) -> str | None:
    """The one line for a write the file system refused (``exc`` or an error it was raised from): the
    command's output cannot be written, which is no bug (it was a traceback, exit 1). None for any other error.
    The file is the one an atomic writer was writing (``traces.atomic`` names it)."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in STORAGE_FIXES:
            where = f" while writing {cause.filename}" if cause.filename else ""
            return f"--out: {os.strerror(cause.errno).lower()}{where} (fix: {STORAGE_FIXES[cause.errno]})"
        cause = cause.__cause__ or cause.__context__
    return None


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3f} GiB"


def size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g}{unit[0]}"
    return f"{int(nbytes)}B"  # K, M, G are binary (KiB, MiB, GiB)


def flop_rate(per_s: float) -> str:
    """FLOP/s with a decimal prefix and three significant digits: a CPU's 2.1 GFLOP/s is not
    "0.00" TFLOP/s, and a rate that really is zero says so."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(per_s) >= scale:
            return f"{per_s / scale:.3g} {prefix}FLOP/s"
    return f"{per_s:.3g} FLOP/s" + (" (no FLOPs counted)" if per_s == 0 else "")


def unsteady_notes(layers) -> list[str]:  # noqa: ANN001 - a DataFrame
    """One line per layer the profiler flagged unsteady: name, spread and why (empty when none)."""
    if "unsteady" not in layers.columns:
        return []
    notes = []
    for row in layers[layers["unsteady"].astype(bool)].itertuples():
        why = str(getattr(row, "steadiness", "") or "")
        spreads = ", ".join(f"{k} {getattr(row, k + '_spread'):.2f}"
                            for k in ("fwd", "bwd", "recompute", "bwd_input", "bwd_weight"))
        notes.append(f"unsteady: layer {row.layer} {row.name}: {why or 'flagged'} (spread IQR/median: {spreads}); "
                     "re-profile on a quieter machine")
    return notes


def print_layers(layers) -> None:  # noqa: ANN001 - a DataFrame
    table = Table("#", "name", "F ms", "B ms", "W ms", "R ms", "param B", "saved B", "out B", "GFLOP",
                  title="per-layer medians: F fwd, B input grad, W weight grad, R recompute; bytes")
    for row in layers.itertuples():
        table.add_row(str(row.layer), escape(str(row.name)), f"{row.fwd_s * 1e3:.3f}", f"{row.bwd_input_s * 1e3:.3f}",
                      f"{row.bwd_weight_s * 1e3:.3f}", f"{row.recompute_s * 1e3:.3f}", size(row.param_bytes),
                      size(row.saved_bytes), size(row.output_bytes), f"{row.flops_fwd / 1e9:.3f}")
    console.print(table)
    for note in unsteady_notes(layers):  # plain text: layer names and reasons are not markup
        console.print(note, markup=False, highlight=False)


def print_sim(result) -> None:  # noqa: ANN001 - SimResult
    table = Table("figure", "value", title=f"simulation of {escape(str(result.plan_name))}")
    table.add_row("iteration time", f"{result.iteration_s * 1e3:.3f} ms")
    table.add_row("throughput", f"{result.samples_per_s:.2f} samples/s, {result.tokens_per_s:,.0f} tokens/s")
    table.add_row("model FLOP/s per device", flop_rate(result.model_flops_per_device))
    table.add_row("MFU", f"{result.mfu:.1%}")
    for stage, bubble in sorted(result.bubble_fraction.items()):
        table.add_row(f"bubble, pipeline rank {stage}", f"{bubble:.1%}")
    for rank, memory in sorted(result.memory.items()):
        flag = "  OUT OF MEMORY" if memory.oom else ""
        table.add_row(f"peak memory, rank {rank}", f"{gib(memory.peak_bytes)} of {gib(memory.capacity_bytes)}{flag}")
    table.add_row("simulator", f"{result.wall_s:.3f} s wall, {result.events} rows, "
                  f"{'symmetric' if result.symmetric else 'full'} mode")
    console.print(table)
    for note in result.notes:
        plain(f"note: {note}")

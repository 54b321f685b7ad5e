"""Predicted and measured timelines of one iteration, laid over each other rank by rank.

For every rank the figure has a pair of lanes, "predicted" above "measured", on one time axis.
Inside a lane, compute instructions are full-height boxes; communication and copies sit in a thin
strip per stream below them (they overlap compute on their own streams), so a lane reads like a
Perfetto track group. Boxes are coloured by instruction kind, with one legend for the figure.
Both tables are INSTRUCTION_TABLE rows of one iteration with times in seconds from its start;
child rows (per-layer events) are left out.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

# One colour per instruction kind; forward-ish work blue, backward-ish orange/red, communication
# greens and greys, memory traffic purple, the optimizer black.
KIND_COLOURS = {
    "FWD": "#4C72B0",
    "RECOMPUTE": "#8FB1E0",
    "BWD": "#DD8452",
    "BWD_I": "#C44E52",
    "BWD_W": "#F0B27A",
    "OPTIMIZER_STEP": "#222222",
    "SEND_ACT": "#55A868",
    "RECV_ACT": "#A6D8A8",
    "SEND_GRAD": "#2E7D32",
    "RECV_GRAD": "#7FBF7F",
    "ALLREDUCE": "#8C8C8C",
    "ALLTOALL": "#4D4D4D",
    "SWAP_OUT": "#8172B3",
    "SWAP_IN": "#B9AEDB",
}
# Strips under the compute boxes, top to bottom.
SIDE_STREAMS = ("p2p_send", "p2p_recv", "collective", "copy")
LANE_HEIGHT = 1.0
COMPUTE_SHARE = 0.55  # of a lane's height; the side-stream strips share the rest
PAIR_GAP = 0.5


def _top_level(table: pd.DataFrame) -> pd.DataFrame:
    return table[table["parent"] == -1]


def _draw_lane(ax: plt.Axes, rows: pd.DataFrame, y0: float, scale: float) -> None:
    """Draw one lane whose bottom is at ``y0``; times multiplied by ``scale`` (s -> ms)."""
    strip = LANE_HEIGHT * (1 - COMPUTE_SHARE) / len(SIDE_STREAMS)
    for row in rows.itertuples(index=False):
        start, width = row.start_s * scale, max((row.end_s - row.start_s) * scale, 0.0)
        colour = KIND_COLOURS.get(str(row.kind), "#CCCCCC")
        if row.stream == "compute":
            bottom, height = y0 + LANE_HEIGHT * (1 - COMPUTE_SHARE), LANE_HEIGHT * COMPUTE_SHARE * 0.95
        else:
            position = SIDE_STREAMS.index(row.stream) if row.stream in SIDE_STREAMS else len(SIDE_STREAMS) - 1
            bottom = y0 + LANE_HEIGHT * (1 - COMPUTE_SHARE) - (position + 1) * strip
            height = strip * 0.9
        ax.broken_barh([(start, width)], (bottom, height), facecolors=colour, edgecolors="white",
                       linewidth=0.3)


def plot_timelines(predicted: pd.DataFrame, measured: pd.DataFrame, path_stem: Path, title: str = "",
                   formats: tuple[str, ...] = ("png", "pdf")) -> list[Path]:
    """Write the overlay figure as ``path_stem.<format>`` for each format; returns the paths."""
    predicted, measured = _top_level(predicted), _top_level(measured)
    ranks = sorted(set(predicted["rank"]) | set(measured["rank"]))
    scale = 1e3  # seconds -> milliseconds on the axis
    pair_height = 2 * LANE_HEIGHT + PAIR_GAP
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.9 * pair_height * len(ranks)))
    ticks, labels = [], []
    for position, rank in enumerate(ranks):
        base = (len(ranks) - 1 - position) * pair_height  # rank 0 at the top
        _draw_lane(ax, measured[measured["rank"] == rank], base, scale)
        _draw_lane(ax, predicted[predicted["rank"] == rank], base + LANE_HEIGHT, scale)
        ticks += [base + LANE_HEIGHT / 2, base + 1.5 * LANE_HEIGHT]
        labels += [f"rank {rank} measured", f"rank {rank} predicted"]
        ax.axhline(base + LANE_HEIGHT, color="#DDDDDD", linewidth=0.6)
    ends = [t["end_s"].max() for t in (predicted, measured) if len(t)]
    starts = [t["start_s"].min() for t in (predicted, measured) if len(t)]
    ax.set_xlim(min([0.0, *starts]) * scale, max(ends, default=1.0) * scale * 1.02)
    ax.set_ylim(-0.2, len(ranks) * pair_height - PAIR_GAP + 0.2)
    ax.set_yticks(ticks, labels)
    ax.set_xlabel("time from the start of the iteration (ms); thin strips under the compute boxes: "
                  "send, receive, collective and copy streams")
    ax.set_title(title or "predicted vs measured timeline")
    kinds = sorted(set(predicted["kind"]) | set(measured["kind"]), key=lambda k: list(KIND_COLOURS).index(k)
                   if k in KIND_COLOURS else len(KIND_COLOURS))
    ax.legend(handles=[Patch(facecolor=KIND_COLOURS.get(k, "#CCCCCC"), label=k) for k in kinds],
              loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=min(len(kinds), 7), fontsize=8, frameon=False)
    fig.tight_layout()
    paths = []
    for fmt in formats:
        path = Path(f"{path_stem}.{fmt}")
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=150)
        paths.append(path)
    plt.close(fig)
    return paths

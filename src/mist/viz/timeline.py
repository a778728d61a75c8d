"""Draw one iteration of a simulated plan: per stage, lanes for compute, collectives, swap-in
and swap-out (the transfer lanes show each micro-batch's standalone transfer volume, placed at
the start of the forward or backward it overlaps)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from mist.simulate.plan_sim import Timeline

IMAGE_SUFFIXES = (".png", ".svg", ".pdf")  # what `--timeline` may write (matplotlib's formats)
LANES = ("compute", "collectives", "swap-in", "swap-out")
CHANNEL_OF = {"collectives": "G2G", "swap-in": "C2G", "swap-out": "G2C"}
# forward, backward (a zero-bubble plan's: B and its deferred W), first micro-batch's one-off (optimizer step), last one's (final reduction)
COLORS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:red", "X": "tab:green", "Y": "tab:purple"}


def draw_timeline(timeline: Timeline, path: str, title: str = "") -> None:
    events, channels = timeline.events, timeline.channels
    S = len(channels)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.1 * S))
    ytick, ylab = [], []
    for i in range(S):
        for j, lane in enumerate(LANES):
            y = (S - 1 - i) * (len(LANES) + 1) + (len(LANES) - 1 - j)
            ytick.append(y + 0.4)
            ylab.append(f"stage {i} {lane}")
            for st, kind, m, start, end in events:
                if st != i:
                    continue
                color = COLORS[kind]
                if lane == "compute":
                    ax.broken_barh([(start, end - start)], (y, 0.8), facecolors=color, edgecolor="white", linewidth=0.3)
                    if end - start > timeline.iteration_time_s / 60:
                        ax.text(
                            (start + end) / 2,
                            y + 0.4,
                            f"{kind}{m}",
                            ha="center",
                            va="center",
                            fontsize=6,
                            color="white",
                        )
                elif kind in ("F", "B"):
                    vol = channels[i][CHANNEL_OF[lane]] / 2
                    if vol > 0:
                        ax.broken_barh([(start, min(vol, end - start))], (y, 0.8), facecolors=color, alpha=0.5)
    ax.set_yticks(ytick)
    ax.set_yticklabels(ylab, fontsize=7)
    ax.set_xlabel("time (s)")
    ax.set_title(
        title
        or f"one iteration: {timeline.iteration_time_s * 1e3:.1f} ms (blue forward, orange backward (its input gradient under ZB-H1, red its weight gradients), green optimizer step, purple final reduction)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

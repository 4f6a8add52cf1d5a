"""The tuning plot: padding waste (worst dimension) and estimated warm-up versus the number of
model graphs, one series per scheme, the chosen buckets marked."""
from __future__ import annotations

from typing import Optional


def draw(report, seconds_per_graph: Optional[float], path: str) -> None:
    """Write the PNG at ``path``. Without a measured compile time the warm-up panel is left out."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window
    import matplotlib.pyplot as plt

    panels = 2 if seconds_per_graph else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
    _waste_panel(axes[0][0], report, lambda c: c.plan.model_graphs, "model graphs (prefill + decode)")
    if seconds_per_graph:
        _waste_panel(axes[0][1], report, lambda c: c.graphs * seconds_per_graph,
                     "estimated warm-up on this machine (s)")
    fig.suptitle(f"{len(report.trace)} requests replayed; worst-dimension padding waste")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _waste_panel(ax, report, x_of, xlabel: str) -> None:
    curve = report.curve
    ax.plot([x_of(c) for c in curve], [100 * c.worst_waste for c in curve], "-", color="tab:blue",
            label="optimal (DP) per budget")
    families = {}
    for candidate in report.candidates[:-1]:
        families.setdefault(candidate.name.split(":")[0], []).append(candidate)
    markers = dict(default="s", pow2="o", gap="^", pct="v")
    for family, members in families.items():
        ax.scatter([x_of(c) for c in members], [100 * c.worst_waste for c in members],
                   marker=markers.get(family, "x"), label=family, zorder=3)
        for c in members:
            ax.annotate(c.name, (x_of(c), 100 * c.worst_waste), fontsize=7, xytext=(3, 3), textcoords="offset points")
    chosen = report.chosen
    ax.scatter([x_of(chosen)], [100 * chosen.worst_waste], marker="*", s=220, color="red", zorder=4, label="chosen")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("padding waste, worst dimension (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)

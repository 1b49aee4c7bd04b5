"""Pictures of routing, for looking rather than reading: PNG, SVG, PDF or a self-contained HTML page.

matplotlib is an optional dependency (the ``plot`` extra); it is
imported only when a plot is asked for.
"""

from __future__ import annotations

import html
import io
import math
from pathlib import Path

import numpy as np

from moetrace.analysis.balance import gini
from moetrace.errors import MoetraceError, install_extra
from moetrace.output_files import check_new_output, check_not_an_input, replacing
from moetrace.trace.stats import LoadStats, load_stats

SUFFIXES = (".png", ".svg", ".pdf", ".html")
CELL_MARK_LIMIT = 6000  # mark dead experts with a dot while cells are big enough to see it


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise MoetraceError(f"--plot needs matplotlib: {install_extra('plot')}") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def check_plot_path(path: Path, *, overwrite: bool, inputs: list[Path]) -> None:
    """Before any work: a picture file name, and an output the command may write (the
    rule of every output: an existing file only with ``--overwrite``, never an input)."""
    if path.suffix.lower() not in SUFFIXES:
        raise MoetraceError(f"--plot {path}: the file name must end in {', '.join(SUFFIXES)}")
    if not path.parent.exists():
        raise MoetraceError(f"--plot {path}: no such directory {path.parent}")
    check_not_an_input(path, [(f"the trace {p}", p) for p in inputs])
    check_new_output(path, overwrite=overwrite)
    _pyplot()


def _ticks(n: int, most: int) -> np.ndarray:
    step = max(1, math.ceil(n / most))
    for nice in (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100):
        if nice >= step:
            step = nice
            break
    return np.arange(0, n, step)


def _layer_axis(ax, layers: list[int], axis: str, most: int = 24) -> None:
    pos = _ticks(len(layers), most)
    labels = [str(layers[i]) for i in pos]
    if axis == "y":
        ax.set_yticks(pos, labels)
    else:
        ax.set_xticks(pos, labels)


def plot_load(
    counts: np.ndarray,
    layers: list[int],
    path: Path,
    *,
    title: str,
    subtitle: str = "",
    ep: dict | None = None,
) -> None:
    """Layer x expert load heatmap (load / layer mean) over a per-layer imbalance chart.

    With ``ep`` (``EPBalance.result``), a third panel shows the busiest rank's
    load over the mean and the mean number of ranks a token is sent to.
    """
    plt = _pyplot()
    num_layers = counts.shape[0]
    stats = load_stats(counts)
    heat_h = min(max(0.17 * num_layers + 1.6, 3.2), 11.0)
    heights = [heat_h, 2.8] + ([2.6] if ep else [])
    fig = plt.figure(figsize=(12, sum(heights) + 1.2), layout="constrained")
    grid = fig.add_gridspec(len(heights), 2, height_ratios=heights, width_ratios=[60, 1])
    fig.suptitle(title + (f"\n{subtitle}" if subtitle else ""), fontsize=12)
    _load_heatmap(fig, grid, counts, stats, layers)
    _imbalance_panel(fig.add_subplot(grid[1, 0]), counts, stats, layers)
    if ep:
        _ep_panel(fig.add_subplot(grid[2, 0]), ep, layers)
    save(fig, path, title, subtitle)
    plt.close(fig)


def _load_heatmap(fig, grid, counts: np.ndarray, stats: LoadStats, layers: list[int]) -> None:
    """Each expert's load over its layer's mean, white on blue to red around 1; with
    cells big enough to see, a cross on each expert never selected."""
    from matplotlib.colors import TwoSlopeNorm

    num_layers, num_experts = counts.shape
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = counts / stats.mean[:, None]
    rel = np.where(np.isfinite(rel), rel, np.nan)
    ax = fig.add_subplot(grid[0, 0])
    vmax = max(2.0, float(np.nanmax(rel)) if np.isfinite(rel).any() else 2.0)
    im = ax.imshow(
        rel,
        aspect="auto",
        interpolation="nearest",
        cmap="RdBu_r",
        norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax),
    )
    if counts.size <= CELL_MARK_LIMIT:
        dead_l, dead_e = np.nonzero(counts == 0)
        size = float(np.clip(3000 / max(num_experts, 4 * num_layers), 8, 80))
        ax.scatter(
            dead_e, dead_l, s=size, c="white", marker="x", linewidths=1.2, label="never selected"
        )
        if len(dead_l):
            legend = ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
            for handle in legend.legend_handles:  # white on the map, black in the key
                handle.set_color("black")
    ax.set_title("expert load relative to the layer mean (1 = perfectly balanced)", fontsize=10)
    ax.set_xlabel("expert id")
    ax.set_ylabel("MoE layer (decoder index)")
    ax.set_xticks(_ticks(num_experts, 32))
    _layer_axis(ax, layers, "y")
    cax = fig.add_subplot(grid[0, 1])
    fig.colorbar(im, cax=cax, label="load / layer mean")


def _imbalance_panel(ax, counts: np.ndarray, stats: LoadStats, layers: list[int]) -> None:
    """MaxVio bars with the coefficient of variation and Gini per layer."""
    num_layers = counts.shape[0]
    x = np.arange(num_layers)
    ax.bar(
        x,
        np.nan_to_num(stats.max_violation),
        color="#c0504d",
        alpha=0.8,
        label="MaxVio (max - mean) / mean",
    )
    ax.plot(x, stats.cv, "o-", color="#1f4e79", ms=3, lw=1.2, label="coefficient of variation")
    ax.plot(x, gini(counts), "s--", color="#4f9a3a", ms=3, lw=1.0, label="Gini")
    ax.set_xlim(-0.6, num_layers - 0.4)
    ax.set_ylim(0, _headroom(np.nan_to_num(stats.max_violation), stats.cv))
    ax.set_title("imbalance per layer (0 = perfectly balanced)", fontsize=10)
    ax.set_xlabel("MoE layer (decoder index)")
    ax.set_ylabel("imbalance")
    _layer_axis(ax, layers, "x", most=32)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, ncol=3, framealpha=0.9)


def _ep_panel(ax, ep: dict, layers: list[int]) -> None:
    """Expert parallelism per layer: the busiest rank's load over the mean (bars) and the
    ranks a token is sent to (line, against the most it can reach)."""
    per = ep["layers"]
    num_layers = len(per)
    x = np.arange(num_layers)
    ratio = [p["max_over_mean"] or 0 for p in per]
    fan = [p["mean_ranks_per_token"] or 0 for p in per]
    ax.bar(x, ratio, color="#8064a2", alpha=0.8, label="busiest rank / mean rank load")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_ylabel("rank load max / mean")
    ax.set_xlabel("MoE layer (decoder index)")
    ax.set_xlim(-0.6, num_layers - 0.4)
    ax.set_ylim(0, _headroom(ratio))
    _layer_axis(ax, layers, "x", most=32)
    twin = ax.twinx()
    twin.plot(x, fan, "o-", color="#f79646", ms=3, lw=1.2, label="ranks per token (mean)")
    twin.set_ylabel("ranks per token")
    reach = min(ep["top_k"], ep["ep_size"]) if ep.get("top_k") else max(fan, default=1)
    twin.axhline(
        reach, color="#f79646", lw=0.8, ls="--", alpha=0.6, label="most ranks a token can reach"
    )
    twin.set_ylim(0, _headroom([reach]))
    ax.set_title(f"expert parallelism over {ep['ep_size']} ranks", fontsize=10)
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=8, ncol=3)


def _headroom(*series) -> float:
    """An axis top that leaves the upper third for the legend."""
    top = max((float(np.nanmax(x)) for x in series if len(x)), default=1.0)
    return 1.45 * top if top > 0 else 1.0


def plot_diff(result: dict, path: Path, *, title: str, subtitle: str = "") -> None:
    """Per-layer mismatch shares and how many layers differ per token."""
    plt = _pyplot()
    per = result["layers"]
    layers = [p["layer"] for p in per]
    fig, (ax, ax2) = plt.subplots(
        2, 1, figsize=(12, 6.4), layout="constrained", height_ratios=[3, 2.4]
    )
    fig.suptitle(title + (f"\n{subtitle}" if subtitle else ""), fontsize=12)
    x = np.arange(len(per))
    ax.bar(
        x, [100 * (p["set_mismatch"] or 0) for p in per], color="#c0504d", label="top-k set differs"
    )
    ax.plot(
        x,
        [100 * (p["top1_mismatch"] or 0) for p in per],
        "o-",
        color="#1f4e79",
        ms=3,
        label="top-1 differs",
    )
    ax.set_ylabel("% of compared tokens")
    ax.set_xlabel("MoE layer (decoder index)")
    ax.set_title("routing mismatch per layer", fontsize=10)
    ax.set_xlim(-0.6, len(per) - 0.4)
    ax.set_ylim(0, _headroom([100 * (p["set_mismatch"] or 0) for p in per]))
    _layer_axis(ax, layers, "x", most=32)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    hist = np.asarray(result["layers_differing_histogram"], dtype=float)
    total = hist.sum()
    ax2.bar(np.arange(len(hist)), 100 * hist / total if total else hist, color="#8064a2")
    ax2.set_xlabel("MoE layers whose top-k set differs, per token")
    ax2.set_ylabel("% of compared tokens")
    ax2.set_title(
        "how many layers differ per token (0 = the token routes identically)", fontsize=10
    )
    ax2.set_xticks(_ticks(len(hist), 32))
    ax2.grid(axis="y", alpha=0.3)
    save(fig, path, title, subtitle)
    plt.close(fig)


def save(fig, path: Path, title: str, subtitle: str = "") -> None:
    """By suffix; ``.html`` is a page with the SVG inline, needing nothing else to view.

    Written beside ``path`` and renamed over it once whole, as every output is.
    """
    kind = path.suffix.lower()[1:]
    try:
        with replacing(path) as temporary:
            if kind != "html":
                fig.savefig(temporary, dpi=110, format=kind)
                return
            buf = io.StringIO()
            fig.savefig(buf, format="svg")
            svg = buf.getvalue()
            svg = svg[svg.index("<svg") :]
            page = (
                '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
                f"<title>{html.escape(title)}</title>"
                "<style>body{font-family:system-ui,sans-serif;margin:1.5em}svg{max-width:100%;"
                "height:auto}</style></head>\n<body>"
                f'<h1 style="font-size:1.2em">{html.escape(title)}</h1>'
                f"<p>{html.escape(subtitle)}</p>\n{svg}\n</body></html>\n"
            )
            temporary.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise MoetraceError(f"cannot write plot {path}: {exc.strerror or exc}") from None

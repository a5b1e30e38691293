"""docs/benchmarks.png: mean latency against users, and the closed loop's throughput."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .configs import THINK_TIME_S, Load
from .results import ConfigResult


def write_plot(out: Path, results: list[ConfigResult], loads: Sequence[Load]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (latency_axes, throughput_axes) = plt.subplots(1, 2, figsize=(12, 4.8),
                                                           gridspec_kw={"width_ratios": [3, 2]})
    colours = {result.config: f"C{index}" for index, result in enumerate(results)}
    plot_latency(latency_axes, results, [load for load in loads if not load.closed_loop], colours)
    closed = next((load for load in loads if load.closed_loop), None)
    if closed:
        plot_throughput(throughput_axes, results, closed, colours)
    else:
        throughput_axes.set_axis_off()
    figure.tight_layout()
    path = out / "benchmarks.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_latency(axes: Any, results: list[ConfigResult], open_loads: list[Load], colours: dict[str, str]) -> None:
    from matplotlib.ticker import FuncFormatter

    for result in results:
        points = [(load.users, stats.mean_ms) for load in open_loads
                  if (stats := result.loads.get(load.label)) and stats.mean_ms]
        if points:
            axes.plot(*zip(*points, strict=True), marker="o", label=result.config, color=colours[result.config])
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    axes.set_xlabel(f"users ({THINK_TIME_S[0]:g}–{THINK_TIME_S[1]:g} s think time; log scale)")
    axes.set_ylabel("mean latency, ms (log scale)")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xticks([load.users for load in open_loads])
    axes.xaxis.set_major_formatter(plain)
    axes.xaxis.set_minor_formatter(FuncFormatter(lambda value, _: ""))
    axes.yaxis.set_major_formatter(plain)
    # Minor ticks of a log axis: label 2s and 5s only (20, 50, 200 ...), or they crowd.
    axes.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}" if f"{value:g}"[0] in "25" else ""))
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    axes.set_title("Mean latency against users")


def plot_throughput(axes: Any, results: list[ConfigResult], closed: Load, colours: dict[str, str]) -> None:
    served = [(result.config, stats.rps) for result in results
              if (stats := result.loads.get(closed.label)) and stats.rps]
    names = [name for name, _ in served]
    values = [rps for _, rps in served]
    bars = axes.barh(names, values, color=[colours[name] for name in names])
    axes.bar_label(bars, labels=[f"{value:,.0f}" for value in values], padding=3, fontsize="small")
    axes.margins(x=0.15)
    axes.invert_yaxis()
    axes.set_xlabel("requests/s")
    axes.set_title(f"Closed loop, {closed.users} users")
    axes.grid(True, axis="x", alpha=0.3)

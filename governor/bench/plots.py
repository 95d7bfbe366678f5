"""PNG plots with matplotlib (Agg, no display): TTFT and ITL ECDFs per arm at each level,
and throughput and TTFT p50/p99 against concurrency or request rate. A level whose
comparison was refused says so in its title: the curves are per-arm measurements, never a
claim."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib import ticker

from governor.bench.config import Level

DPI = 110


def _log_axis(axis: matplotlib.axis.Axis) -> None:
    """Log scale labelled in plain numbers at 1, 2, 5 × 10^k."""
    axis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(ticker.NullFormatter())


def _ecdf(ax: plt.Axes, values: Sequence[float], label: str) -> None:
    xs = sorted(v * 1000 for v in values)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def ecdf_plot(path: Path, title: str, xlabel: str, samples: Mapping[str, Sequence[float]]
              ) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for arm, values in samples.items():
        _ecdf(ax, values, arm)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples ≤ x")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if any(samples.values()):
        ax.set_xscale("log")
        _log_axis(ax.xaxis)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _x(levels: Sequence[Level]) -> tuple[list[float], str]:
    if all(lv.request_rate is None for lv in levels):
        return [float(lv.concurrency or 0) for lv in levels], "max concurrency"
    return [float(lv.request_rate or 0) for lv in levels], "request rate (req/s)"


def load_plots(out: Path, levels: Sequence[Level], arms: Sequence[str],
               throughput: dict[str, list[float]], ttft_p50: dict[str, list[float | None]],
               ttft_p99: dict[str, list[float | None]], title: str) -> list[Path]:
    """`throughput` in output tokens/s, TTFT in seconds, one value per level per arm."""
    xs, xlabel = _x(levels)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for arm in arms:
        ax.plot(xs, throughput[arm], marker="o", label=arm)
    ax.set_xlabel(xlabel)
    ax.set_xticks(xs)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{title}: output throughput", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tp = out / "throughput.png"
    fig.savefig(tp, dpi=DPI)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, arm in enumerate(arms):
        color = f"C{i}"
        p50 = [v * 1000 if v is not None else float("nan") for v in ttft_p50[arm]]
        p99 = [v * 1000 if v is not None else float("nan") for v in ttft_p99[arm]]
        ax.plot(xs, p50, marker="o", color=color, label=f"{arm} p50")
        ax.plot(xs, p99, marker="^", linestyle="--", color=color, label=f"{arm} p99")
    ax.set_xlabel(xlabel)
    ax.set_xticks(xs)
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    _log_axis(ax.yaxis)
    ax.set_title(f"{title}: TTFT p50 / p99", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tt = out / "ttft_vs_load.png"
    fig.savefig(tt, dpi=DPI)
    plt.close(fig)
    return [tp, tt]

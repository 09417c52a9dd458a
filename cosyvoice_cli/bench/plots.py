"""PNG plots of a results dict: latency and throughput vs concurrency, the per-request first-chunk
histogram of each level, open-loop latency and underrun-free share vs arrival rate, token2wav
batched vs one at a time (matplotlib, Agg backend; skipped when matplotlib is missing)."""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Mapping

import numpy as np

log = logging.getLogger(__name__)


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plots (pip install matplotlib)")
        print("[bench] matplotlib is not installed: skipping the plots (pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def write_plots(results: dict, out_dir: str | Path, prefix: str = "", targets: Mapping | None = None) -> list[Path]:
    """latency.png, throughput.png and first_chunk_hist.png (closed-loop levels), open_loop.png
    (open-loop levels and capacity trials), t2w.png (with a comparison). Needs matplotlib;
    without it, logs a message and returns []."""
    plt = _pyplot()
    if plt is None:
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = results.get("levels") or []
    written = []
    title = results.get("title", "async_cosyvoice")
    if levels:
        c = [lv["concurrency"] for lv in levels]

        def series(metric, stat):
            return [1e3 * lv[metric][stat] if lv[metric][stat] is not None else np.nan for lv in levels]

        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        ax.plot(c, series("first_chunk_s", "p50"), "o-", label="first chunk p50")
        ax.plot(c, series("first_chunk_s", "p99"), "o--", label="first chunk p99")
        ax.plot(c, series("second_chunk_s", "p50"), "s-", label="second chunk p50 (gap)")
        ax.plot(c, series("total_s", "p50"), "^-", label="total p50")
        for label, ms in (targets or {}).items():
            ax.axhline(ms, color="grey", lw=0.8, ls=":")
            ax.text(c[0], ms, f" {label}", va="bottom", fontsize=8, color="grey")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(c, [str(x) for x in c])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"{title}: latency vs concurrency")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / f"{prefix}latency.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p)

        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        aps = [lv["audio_s_per_s"] or np.nan for lv in levels]
        ax.plot(c, aps, "o-", color="C0", label="audio seconds / second")
        ax.plot(c, c, ":", color="grey", label="real time for every stream")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(c, [str(x) for x in c])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("audio seconds per wall second")
        ax2 = ax.twinx()
        ax2.bar(c, [lv["underruns"]["requests_with_underruns"] for lv in levels],
                width=[x * 0.3 for x in c], alpha=0.3, color="C3", label="requests with underruns")
        ax2.set_ylabel("requests with underruns", color="C3")
        ax2.yaxis.get_major_locator().set_params(integer=True)
        ax.set_zorder(ax2.get_zorder() + 1)  # the line over the bars
        ax.patch.set_visible(False)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
        ax.set_title(f"{title}: throughput vs concurrency")
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        p = out_dir / f"{prefix}throughput.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p)
        p = _first_chunk_histogram(plt, levels, title, out_dir / f"{prefix}first_chunk_hist.png")
        if p:
            written.append(p)
    open_levels = list(results.get("open_loop") or []) + list((results.get("capacity") or {}).get("trials") or [])
    if open_levels:
        written.append(_open_loop(plt, open_levels, results.get("capacity"), title, out_dir / f"{prefix}open_loop.png"))
    cmp = results.get("t2w_compare")
    if cmp:
        fig, ax = plt.subplots(figsize=(5, 4))
        vals = [cmp["sequential"]["audio_s_per_s"], cmp["batched"]["audio_s_per_s"]]
        ax.bar(["one at a time", "batched"], vals, color=["C7", "C2"])
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.1f}", ha="center", va="bottom")
        speed = f"{cmp['speedup']:.1f}x" if cmp.get("speedup") else "-"
        ax.set_title(f"token2wav, {cmp['concurrency']} streams: {speed}")
        ax.set_ylabel("audio seconds per wall second")
        fig.tight_layout()
        p = out_dir / f"{prefix}t2w.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p)
    return written


def _first_chunk_histogram(plt, levels: list[dict], title: str, path: Path) -> Path | None:
    """Per-request first chunk of every level (needs the levels' `detail`): waves show as modes."""
    data = [(lv["concurrency"], [1e3 * d["first_chunk_s"] for d in lv.get("detail") or [] if d["ok"]])
            for lv in levels]
    data = [(c, x) for c, x in data if x]
    if not data:
        return None
    fig, axes = plt.subplots(len(data), 1, figsize=(7.5, 1.6 * len(data) + 0.8), sharex=True, squeeze=False)
    hi = max(max(x) for _, x in data)
    bins = np.linspace(0, hi * 1.02, 60)
    for ax, (c, x) in zip(axes[:, 0], data):
        ax.hist(x, bins=bins, color="C0")
        ax.set_ylabel(f"{c} streams", fontsize=8)
        ax.yaxis.get_major_locator().set_params(integer=True)
    axes[-1, 0].set_xlabel("first chunk (ms), one count per request")
    axes[0, 0].set_title(f"{title}: first chunk per request")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _open_loop(plt, levels: list[dict], capacity: dict | None, title: str, path: Path) -> Path:
    levels = sorted(levels, key=lambda lv: lv["rate"])
    r = [lv["rate"] for lv in levels]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for stat, style in (("p50", "o-"), ("p99", "o--")):
        ax.plot(r, [1e3 * lv["first_chunk_s"][stat] if lv["first_chunk_s"][stat] is not None else np.nan
                    for lv in levels], style, label=f"first chunk {stat}")
    if capacity:
        ax.axhline(1e3 * capacity["criteria"]["p99_first_chunk_s"], color="grey", lw=0.8, ls=":")
        if capacity.get("capacity_rate"):
            ax.axvline(capacity["capacity_rate"], color="C2", lw=1.0, ls="--",
                       label=f"capacity {capacity['capacity_rate']:.3g}/s "
                             f"({capacity['streams_in_flight']['mean']:.1f} streams)")
    ax.set_xlabel("arrivals per second (Poisson)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax2 = ax.twinx()
    ax2.plot(r, [100 * (lv["underrun_free_fraction"] or 0.0) for lv in levels], "s:", color="C3",
             label="requests without underrun (%)")
    ax2.set_ylim(0, 105)
    ax2.set_ylabel("requests without underrun (%)", color="C3")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    ax.set_title(f"{title}: open loop")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

"""PNG plots of a results dict: latency and throughput vs concurrency, token2wav batched vs one at
a time (matplotlib, Agg backend; skipped when matplotlib is missing)."""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Mapping

import numpy as np

log = logging.getLogger(__name__)


def write_plots(results: dict, out_dir: str | Path, prefix: str = "", targets: Mapping | None = None) -> list[Path]:
    """latency.png and throughput.png (vs concurrency; t2w.png with a comparison). Needs
    matplotlib; without it, logs a message and returns []."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plots (pip install matplotlib)")
        print("[bench] matplotlib is not installed: skipping the plots (pip install matplotlib)", file=sys.stderr)
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

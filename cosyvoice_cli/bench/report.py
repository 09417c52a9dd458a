"""The results in writing: the table on stdout, the token2wav comparison, the environment of the
run, and the results JSON (written atomically)."""
from __future__ import annotations

import os
import platform
import time
from typing import Sequence


def environment(device: str | None = None) -> dict:
    """Versions and hardware for the results file."""
    info = {"python": platform.python_version(), "platform": platform.platform(), "host": platform.node(),
            "cpu_count": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if device and device.startswith("cuda") and torch.cuda.is_available():
            d = torch.device(device)
            props = torch.cuda.get_device_properties(d)
            info["gpu"] = props.name
            info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return info


def _ms(x: float | None) -> str:
    return f"{1e3 * x:8.1f}" if x is not None else f"{'-':>8}"


def format_table(levels: Sequence[dict]) -> str:
    head = (f"{'conc':>5} {'reqs':>5} {'first avg':>9} {'p50':>8} {'p90':>8} {'p99':>8} {'2nd p50':>8} "
            f"{'total p50':>9} {'RTF':>7} {'audio s/s':>9} {'late':>5} {'req late':>8} {'max stall':>9} {'err':>4}")
    lines = [head, "-" * len(head)]
    for lv in levels:
        f, s, t, u = lv["first_chunk_s"], lv["second_chunk_s"], lv["total_s"], lv["underruns"]
        rtf = f"{lv['rtf']:7.4f}" if lv["rtf"] is not None else f"{'-':>7}"
        aps = f"{lv['audio_s_per_s']:9.2f}" if lv["audio_s_per_s"] is not None else f"{'-':>9}"
        lines.append(f"{lv['concurrency']:5d} {lv['requests']:5d} {_ms(f['avg']):>9} {_ms(f['p50'])} {_ms(f['p90'])} "
                     f"{_ms(f['p99'])} {_ms(s['p50'])} {_ms(t['p50']):>9} {rtf} {aps} {u['late_chunks']:5d} "
                     f"{u['requests_with_underruns']:8d} {_ms(u['stall_s']['max']):>9} {lv['errors']:4d}")
    lines.append("latencies in ms; RTF = level wall / audio seconds; late = chunks that arrived after the audio "
                 "before them had played")
    return "\n".join(lines)


def format_t2w(cmp: dict) -> str:
    b, s = cmp["batched"], cmp["sequential"]
    speed = f"{cmp['speedup']:.2f}x" if cmp.get("speedup") else "-"
    return (f"token2wav alone, {cmp['concurrency']} streams x {cmp['tokens']} tokens "
            f"(prompt {cmp['prompt_tokens']} tokens, first hop {cmp['first_hop']}):\n"
            f"  batched    {b['audio_s_per_s']:9.2f} audio s/s  wall {b['wall_s']:7.2f} s  "
            f"first chunk p50 {_ms(b['first_chunk_s']['p50']).strip()} ms  "
            f"mean batch {b.get('batcher', {}).get('mean_batch', float('nan')):.1f}\n"
            f"  sequential {s['audio_s_per_s']:9.2f} audio s/s  wall {s['wall_s']:7.2f} s  "
            f"first chunk p50 {_ms(s['first_chunk_s']['p50']).strip()} ms\n"
            f"  speedup {speed} (target >= {cmp['target_speedup']:g}x: {'met' if cmp.get('met') else 'NOT met'})")


def format_stages(levels: list[dict], title: str = "stages") -> str:
    """Where each level's device time went, from the stages' own counters: busy fraction of the
    level's wall time, ms per call and items per call of the LLM steps and token2wav batches; and,
    from a server, the mean first chunk split into tokens / wait / t2w (ms)."""
    lines = [f"{title} (busy fraction of the level's wall time; ms per call (LLM: every step, the steps with a "
             "prefill); items per call; first chunk mean ms: until its tokens / waiting for a batch / the batch; of "
             "its tokens' time, until the first token):",
             f"{'conc':>5} {'LLM busy':>9} {'ms/step':>8} {'prefill':>8} {'t2w busy':>9} {'ms/batch':>9} {'jobs/batch':>10} "
             f"{'1st tokens':>10} {'1st wait':>9} {'1st t2w':>8} {'1st token':>9}"]

    def f(d, k, fmt):
        return fmt.format(d[k]) if d.get(k) is not None else "-"
    for lv in levels:
        st = lv.get("stages") or {}
        llm, prefill, t2w = st.get("llm_step", {}), st.get("llm_prefill_step", {}), st.get("token2wav_batch", {})
        parts = [st.get(f"first_chunk_{p}", {}) for p in ("tokens", "wait", "t2w", "first_token")]
        lines.append(f"{lv['concurrency']:5d} {f(llm, 'busy_fraction', '{:9.2f}'):>9} "
                     f"{f(llm, 'ms_per_call', '{:8.1f}'):>8} {f(prefill, 'ms_per_call', '{:8.1f}'):>8} "
                     f"{f(t2w, 'busy_fraction', '{:9.2f}'):>9} {f(t2w, 'ms_per_call', '{:9.1f}'):>9} "
                     f"{f(t2w, 'items_per_call', '{:10.1f}'):>10} "
                     + " ".join(f"{f(d, 'ms_per_call', '{:.1f}'):>{w}}" for d, w in zip(parts, (10, 9, 8, 9))))
    return "\n".join(lines)

"""The multi-GPU server THROUGH gRPC, one placement after another: capacity and first-chunk latency
of `one` GPU, `replicas` (a pipeline per GPU) and `disaggregated` (LLM on GPU 0, token2wav on the
others), measured by a client in another process (issue 16).

    PYTHONPATH=. python benchmarks/multi_gpu_server_bench.py                       # all three setups
    PYTHONPATH=. python benchmarks/multi_gpu_server_bench.py --setups replicas --out runs/mg/replicas
    PYTHONPATH=. python benchmarks/multi_gpu_server_bench.py --merge runs/mg/one,runs/mg/replicas,... --out runs/mg
    PYTHONPATH=. python benchmarks/multi_gpu_server_bench.py --quick               # CPU smoke test, tiny model

Setups (`--setups`, default all three, run one after another):
- `one`: --config (default configs/gpu.yaml) as it is, on cuda:0 (`model.device: cuda:0`, no devices);
- `replicas`: `model.devices: [cuda:0 .. cuda:N-1]`, `placement: replicas`;
- `disaggregated`: the same devices, `placement: disaggregated`;
N = --gpus (default: every visible GPU). --quick runs them on CPU devices ([cpu] and [cpu] * N, N = 2)
with the tiny model. In every setup `limits.max_concurrent_streams` is max(256, 2 x the largest level);
the warm-up's max batch follows the config's own rule (warmup.max_batch unset).

Each setup is what benchmarks/h200_server_bench.py does through the server (the same code):
the server in a child process (`python -m cosyvoice_cli serve`), time to SERVING, a speaker
registered from a generated 6 s prompt, the first request, an untimed warm-up round at the largest
level, closed-loop levels 1, 32, 64, 128 streams of 250 forced tokens (10 s of audio; max(4, 2 x
streams) requests per level, each level stopped sending after --max-level-seconds), then the
open-loop capacity search (Poisson arrivals from --start-rate, doubling then bisecting, --duration
seconds each): the largest arrival rate with p99 first chunk <= 300 ms and >= 99 % of requests free
of underruns, and the streams in flight there; then the server is stopped.

NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set in this process's environment (unless already set) and so in the
servers it starts.

Time: --budget-s (default 560 s per setup) is shared: each setup gets the time left divided by the
setups left, so one that ends early leaves its time to the next; inside a setup the phases that would
start too late are skipped (listed under "skipped"); a setup that fails is recorded and the next one
runs. For 10-minute machine calls, run one setup per call (`--setups one`, ...) and merge.

Output (--out, default $OUT or runs/multi-gpu): setup-<name>.json per setup (everything measured,
the server's log tail included), then, from every setup-*.json in --out (so several invocations into
one folder combine), multi_gpu_results.json (per setup: GPUs, start to SERVING, per level first chunk
p50/p99, late chunks, audio s/s; capacity, capacity per GPU, and the scaling of capacity and of
throughput at the largest level against `one`), multi_gpu_table.txt and multi_gpu_table.md (the same
tables in markdown). `--merge DIR1,DIR2,...` (or `--merge` alone: --out itself) only builds those
three files from the setup-*.json files found there; nothing runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import h200_server_bench as server_bench
from cosyvoice_cli import bench
from async_cosyvoice.warmup import compile_cache_dir, compile_in_use

SETUPS = ("one", "replicas", "disaggregated")
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SETUP_BUDGET_S = 560.0  # one 10-minute machine call per setup
_LEVELS = [1, 32, 64, 128]
FULL = {**server_bench.FULL, "levels": _LEVELS, "requests": {c: max(4, 2 * c) for c in _LEVELS},
        "llm_batches": [], "ready_timeout_s": 450.0, "restart_s": 0.0}
QUICK = {**server_bench.QUICK, "restart_s": 0.0}
QUICK_DEVICES = 2


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    server_bench.add_server_arguments(ap, "runs/multi-gpu", budget_s=None, levels=FULL["levels"])
    ap.add_argument("--setups", default=",".join(SETUPS), help="comma list of: " + ", ".join(SETUPS))
    ap.add_argument("--gpus", type=int, help="devices for replicas / disaggregated (default: all visible GPUs)")
    ap.add_argument("--skip", default="", help="comma list of phases to skip: warmup,sweep,capacity")
    ap.add_argument("--merge", nargs="?", const="", metavar="DIRS",
                    help="only build the combined table from the setup-*.json in these folders (default: --out)")
    args = ap.parse_args(argv)
    args.setups = [s for s in args.setups.split(",") if s]
    if unknown := set(args.setups) - set(SETUPS):
        ap.error(f"unknown setups {sorted(unknown)}; choose from {', '.join(SETUPS)}")
    if args.budget_s is None:
        args.budget_s = SETUP_BUDGET_S * len(args.setups)
    return args, server_bench.make_plan(args, FULL, QUICK)


def log(msg: str) -> None:
    print(f"[multi-gpu-bench] {msg}", file=sys.stderr, flush=True)


def device_list(args) -> list[str]:
    if args.quick:
        return ["cpu"] * (args.gpus or QUICK_DEVICES)
    n = torch.cuda.device_count() if args.gpus is None else args.gpus
    if n < 1:
        raise SystemExit("no CUDA device (--gpus); --quick runs on CPU devices")
    return [f"cuda:{i}" for i in range(n)]


def setup_model(name: str, devices: list[str]) -> dict:
    """The config's model section for a setup."""
    if name == "one":
        return {"device": devices[0], "devices": []}
    if len(devices) < 2:
        raise ValueError(f"setup {name} needs at least 2 devices, got {devices} (--gpus)")
    return {"device": devices[0], "devices": devices, "placement": name}


def compile_cache_warm(config) -> bool | None:
    """Whether torch.compile's cache folder (warmup.use_compile_cache's) already has something in it:
    a later setup starts faster when an earlier one filled it. None when nothing is compiled."""
    if not compile_in_use(config):
        return None
    folder = compile_cache_dir(config)
    return folder.is_dir() and any(folder.iterdir())


def run_setup(args, plan: dict, name: str, devices: list[str], model_dir: Path, deadline: float) -> dict:
    """One setup: its server started, measured (server_bench.measure_server) and stopped, by `deadline`."""
    phases: dict = {}
    results: dict = {"setup": name, "meta": {
        "script": "benchmarks/multi_gpu_server_bench.py", "argv": args.argv, "quick": args.quick,
        "placement": None if name == "one" else name, "devices": devices[:1] if name == "one" else devices,
        "gpus": 1 if name == "one" else len(devices), "plan": server_bench.plan_json(plan),
        "environment": bench.environment(devices[0] if devices else None),
        "multicast_env": {k: os.environ.get(k) for k in NVLS_OFF}, "phases": phases}}
    t = time.monotonic()
    skip = frozenset(s for s in args.skip.split(",") if s)
    try:
        with tempfile.TemporaryDirectory(prefix=f"multi-gpu-{name}-") as scratch:
            config = server_bench.server_config(
                args, model_dir, Path(scratch) / "spk", model=setup_model(name, devices),
                limits={"max_concurrent_streams": max(256, 2 * max(plan["levels"]))})
            results["meta"]["config"] = config.model_dump(mode="json")
            results["meta"]["compile_cache_warm"] = compile_cache_warm(config)
            time_left = deadline - time.monotonic()
            setup_plan = {**plan, "ready_timeout_s": max(1.0, min(plan["ready_timeout_s"], time_left))}
            reserve = {} if args.quick else server_bench.RESERVE
            results["meta"]["server_returncode"], results["server_log_tail"] = server_bench.run_server(
                config, Path(scratch), Path(scratch) / "server.log", lambda server: server_bench.measure_server(
                    setup_plan, server, results, phases, deadline, seed=args.seed, skip=skip, reserve=reserve),
                results)
    except Exception as e:  # e.g. a config that does not validate: the next setup still runs
        results.setdefault("phase_errors", {})["setup"] = server_bench.format_error(e)
        log(f"setup {name} failed: {type(e).__name__}: {e}")
    phases["total_s"] = time.monotonic() - t
    return results


# -- the combined table ----------------------------------------------------------------------

def load_setups(dirs: list[Path]) -> dict[str, dict]:
    """Every setup-*.json in `dirs`, by setup name (a later folder's wins)."""
    found: dict[str, dict] = {}
    for d in dirs:
        for path in sorted(Path(d).glob("setup-*.json")):
            res = json.loads(path.read_text())
            if res["setup"] in found:
                log(f"{path}: setup {res['setup']} seen before, this one is used")
            found[res["setup"]] = res
    return found


def level_summary(lv: dict) -> dict:
    u = lv["underruns"]
    return {"streams": lv["concurrency"], "requests": lv["requests"], "errors": lv["errors"],
            "first_chunk_p50_s": lv["first_chunk_s"]["p50"], "first_chunk_p99_s": lv["first_chunk_s"]["p99"],
            "late_chunks": u["late_chunks"], "requests_with_underruns": u["requests_with_underruns"],
            "audio_s_per_s": lv["audio_s_per_s"]}


def setup_summary(res: dict) -> dict:
    meta, cap = res["meta"], res.get("capacity") or {}
    flight = cap.get("streams_in_flight") or {}
    env = meta.get("environment", {})
    return {"setup": res["setup"], "gpus": meta["gpus"], "devices": meta["devices"], "gpu": env.get("gpu"),
            "host": env.get("host"), "time": env.get("time"),
            "start_s": meta["phases"].get("server_start_s"), "compile_cache_warm": meta.get("compile_cache_warm"),
            "levels": [level_summary(lv) for lv in res.get("levels", [])],
            "capacity_rate": cap.get("capacity_rate"), "capacity_streams": flight.get("mean"),
            "capacity_streams_max": flight.get("max"), "first_failing_rate": cap.get("first_failing_rate"),
            "capacity_stopped_early": cap.get("stopped_early"), "skipped": res.get("skipped", []),
            "failed": sorted(res.get("phase_errors") or {})}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _throughput(row: dict | None, streams: int | None) -> float | None:
    return next((lv["audio_s_per_s"] for lv in (row or {}).get("levels", []) if lv["streams"] == streams), None)


def combine(raw: dict[str, dict]) -> list[dict]:
    """Per setup (SETUPS order): setup_summary plus capacity per GPU and, against `one` where it is
    there, the capacity's scaling (arrival rates: the same 10-s requests, so the same ratio as the
    streams in flight, less noisy) and the throughput's at the largest level both measured."""
    rows = [setup_summary(raw[n]) for n in sorted(raw, key=lambda n: (SETUPS + (n,)).index(n))]
    one = next((r for r in rows if r["setup"] == "one"), None)
    one_levels = {lv["streams"] for lv in one["levels"]} if one else set()
    for r in rows:
        r["capacity_streams_per_gpu"] = _ratio(r["capacity_streams"], r["gpus"])
        r["capacity_rate_per_gpu"] = _ratio(r["capacity_rate"], r["gpus"])
        r["capacity_vs_one"] = _ratio(r["capacity_rate"], one and one["capacity_rate"])
        top = max(({lv["streams"] for lv in r["levels"]} & one_levels) or {lv["streams"] for lv in r["levels"]},
                  default=None)
        r["throughput_streams"], r["throughput"] = top, _throughput(r, top)
        r["throughput_vs_one"] = _ratio(r["throughput"], _throughput(one, top))
    return rows


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def summary_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    head = ["setup", "GPUs", "start to SERVING", "capacity req/s", "capacity streams", "streams per GPU",
            "capacity vs one", "audio s/s (streams)", "throughput vs one"]
    body = []
    for r in rows:
        cache = {True: " (warm compile cache)", False: " (cold)", None: ""}[r["compile_cache_warm"]]
        cap = _f(r["capacity_rate"], "{:.3g}")
        if r["capacity_rate"] is None and r["first_failing_rate"] is not None:
            cap = f"< {r['first_failing_rate']:.3g}"
        body.append([r["setup"], str(r["gpus"]), _f(r["start_s"], "{:.0f} s") + cache, cap,
                     _f(r["capacity_streams"], "{:.1f}"), _f(r["capacity_streams_per_gpu"], "{:.2f}"),
                     _f(r["capacity_vs_one"], "{:.2f}x"),
                     _f(r["throughput"], "{:.1f}") + (f" ({r['throughput_streams']})" if r["throughput"] else ""),
                     _f(r["throughput_vs_one"], "{:.2f}x")])
    return head, body


def levels_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    head = ["setup", "streams", "first chunk p50", "p99", "late chunks (requests)", "audio s/s", "errors"]
    body = [[r["setup"], str(lv["streams"]), _f(lv["first_chunk_p50_s"] and 1e3 * lv["first_chunk_p50_s"], "{:.0f} ms"),
             _f(lv["first_chunk_p99_s"] and 1e3 * lv["first_chunk_p99_s"], "{:.0f} ms"),
             f"{lv['late_chunks']} ({lv['requests_with_underruns']} of {lv['requests']})",
             _f(lv["audio_s_per_s"], "{:.1f}"), str(lv["errors"])]
            for r in rows for lv in r["levels"]]
    return head, body


def render(head: list[str], body: list[list[str]], markdown: bool) -> str:
    if markdown:
        return "\n".join("| " + " | ".join(cells) + " |" for cells in [head, ["---"] * len(head), *body])
    widths = [max(len(c) for c in col) for col in zip(head, *body)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in [head, *body]]
    return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:])


def notes(rows: list[dict], raw: dict[str, dict]) -> list[str]:
    out = []
    plan = next(iter(raw.values()))["meta"]["plan"] if raw else {}
    if plan:
        audio_s = plan["tokens"] * bench.SECONDS_PER_TOKEN
        out.append(f"workload: {plan['tokens']} forced tokens per request ({audio_s:g} s of audio), a registered "
                   f"speaker with a {plan['prompt_seconds']:g} s prompt, closed loop; capacity: "
                   "open loop, the largest arrival rate with p99 first chunk <= 300 ms and >= 99 % of requests "
                   f"underrun-free ({plan['duration_s']:g} s of arrivals per trial); capacity streams = mean in flight "
                   "there; 'vs one' = this setup / the one-GPU setup (capacity: arrival rates; throughput: audio s/s "
                   "at the largest level both ran)")
    workloads = {json.dumps({k: res["meta"]["plan"].get(k) for k in ("tokens", "prompt_seconds", "duration_s")})
                 for res in raw.values()}
    if len(workloads) > 1:
        out.append("setups ran with different workloads: " + "; ".join(
            f"{n}: {res['meta']['plan']['tokens']} tokens, {res['meta']['plan']['duration_s']:g} s trials"
            for n, res in raw.items()))
    hosts = {(r["host"], r["gpu"]) for r in rows}
    if len(hosts) > 1:
        out.append("setups ran on different machines: " + "; ".join(f"{r['setup']} on {r['host']} ({r['gpu']}) at "
                                                               f"{r['time']}" for r in rows))
    for r in rows:
        if r["skipped"] or r["failed"]:
            out.append(f"{r['setup']}: skipped {', '.join(r['skipped']) or 'nothing'}; failed "
                       f"{', '.join(r['failed']) or 'nothing'} (see setup-{r['setup']}.json)")
        if r["capacity_stopped_early"]:
            out.append(f"{r['setup']}: the capacity search ran out of time before it converged")
    return out


def write_report(raw: dict[str, dict], out: Path) -> list[dict]:
    """multi_gpu_results.json, multi_gpu_table.txt and multi_gpu_table.md from the setups' results."""
    rows = combine(raw)
    gpu = next((r["gpu"] for r in rows if r["gpu"]), None)
    title = f"async_cosyvoice through gRPC, several devices{f' ({gpu})' if gpu else ''}"
    bench.write_json({"title": title, "setups": rows, "notes": notes(rows, raw)}, out / "multi_gpu_results.json")
    tables, remarks = [summary_table(rows), levels_table(rows)], notes(rows, raw)
    text = [title, ""] + [part for t in tables for part in (render(*t, markdown=False), "")] + remarks
    md = [part for t in tables for part in (render(*t, markdown=True), "")] + [f"- {n}" for n in remarks]
    (out / "multi_gpu_table.txt").write_text("\n".join(text) + "\n", encoding="utf-8")
    (out / "multi_gpu_table.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    print("\n".join(text))
    return rows


def main(argv=None) -> int:
    for key, value in NVLS_OFF.items():
        os.environ.setdefault(key, value)
    args, plan = parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge is not None:
        rows = write_report(load_setups([Path(d) for d in args.merge.split(",") if d] or [args.out]), args.out)
        return 0 if rows else 1
    deadline = time.monotonic() + args.budget_s
    devices = device_list(args)
    model_dir = server_bench.bench_model_dir(args)
    log(f"model {model_dir}; devices {devices}; setups {args.setups}")
    failed = False
    for i, name in enumerate(args.setups):
        now = time.monotonic()
        res = run_setup(args, plan, name, devices, model_dir, now + (deadline - now) / (len(args.setups) - i))
        bench.write_json(res, args.out / f"setup-{name}.json")
        failed |= bool(res.get("phase_errors")) or any(lv["errors"] for lv in res.get("levels", []))
    write_report(load_setups([args.out]), args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

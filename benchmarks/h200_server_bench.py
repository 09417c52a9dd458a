"""The whole H200 measurement THROUGH THE gRPC SERVER, in one run: what a user of
`async-cosyvoice serve` gets, measured by a client in another process.

    python benchmarks/h200_server_bench.py                                   # the H200 run (cuda)
    python benchmarks/h200_server_bench.py --baseline-tree /tmp/before       # + LLM ms/step before/after
    python benchmarks/h200_server_bench.py --quick                           # CPU smoke test, tiny model
    python benchmarks/h200_server_bench.py --preset cosyvoice3-0.5b --skip llm,restart   # CosyVoice3

Needs our package importable (PYTHONPATH=. from the repo root) and its runtime dependencies;
matplotlib is optional (without it the plots are skipped).

Steps (each timed; the results say how long):
1. LLM decode, optional (`--llm-batches`, default 1,32,128 on cuda): `benchmarks/bench_llm_engine.py
   --full-size` in this tree and, with `--baseline-tree DIR`, in that one (e.g. the code before a
   change), same machine, same call: ms per decode step at each batch size, graphs only (and
   with torch.compile when `--llm-compile`);
   The LM timed is CosyVoice2-0.5B's (CosyVoice3's is the same Qwen2 backbone, a larger speech
   vocabulary); skip it (`--skip llm`) for a CosyVoice3 run;
2. `make_random_model(preset)` (full-size CosyVoice2-0.5B by default; `--preset cosyvoice3-0.5b`:
   CosyVoice3; `--quick` takes the preset's tiny twin, QUICK_PRESETS) into /tmp; the model kind
   is read from the directory (results meta.model_kind, the title);
3. the server: `python -m cosyvoice_cli serve --config C` in a child process, C being
   `--config` (default configs/gpu.yaml) with the model directory, a scratch speaker store and
   free local ports filled in, and (unless --keep-compile-cache) an empty torch.compile cache
   folder in the scratch directory, so the first start is a fresh machine's; start-up time =
   spawn until health turns SERVING, and the server's own phase table (GetServerInfo.startup:
   load weights, compile, capture, warm-up requests, save compile cache; the CUDA graphs
   captured; whether the persistent compile cache hit);
4. a speaker registered over gRPC from a generated 6 s prompt (150 prompt tokens); the first
   request after SERVING (cold) is timed on its own, with the server's split of its first chunk
   (until its tokens / waiting for a token2wav batch / the batch);
5. warm-up: one untimed round of short requests at each closed-loop level (the server's start
   captured its fixed graph set only, 1 stream by default: warmup.capture_plan; step 4 measured
   the cold path); for CosyVoice3 the requests are the workload's full length (plan
   warmup_tokens None), since its vocoder re-vocodes the whole mel so far: its HiFT graph
   buckets grow with the utterance;
   before each timed phase (every closed-loop level, every capacity trial) the bench waits until the
   server has captured the CUDA graphs its calls wanted (`cosyvoice_device_cuda_graphs_wanted` 0
   on its metrics endpoint; 1-2 s a capture, beside the batches), at most
   --settle-s (default 180 s), and logs one line: the wait, graphs captured, any still wanted
   (results "graph_settle");
6. the closed-loop sweep 1, 4, 16, 32, 64 streams of 250 forced tokens (10 s of audio),
   requests per level 4, 8, 32, 64, 128, each level stopped after --max-level-seconds;
7. the open-loop capacity search: Poisson arrivals of the same 10-s requests, doubling the rate
   from --start-rate, then bisecting, each trial at least --duration (20) seconds of arrivals and at
   least --min-requests (40; --quick 3) requests: max(duration, N / rate) seconds, on to the N-th
   arrival if fewer came (a p99 over ~10 requests is their maximum); capacity = the largest rate
   with p99 first chunk <= 300 ms and >= 99 % of requests free of underruns, reported with the
   requests of the deciding trials; each trial's seconds and requests are in the table and JSON;
8. the server is stopped (SIGINT, then SIGKILL after 30 s);
9. restart: the same server started again (same speaker store, same torch.compile cache): time to
   SERVING and its phase table (it captures the same graph set as the first start), its first
   request and three warm ones, each with the first-chunk split.
Steps 3-8 (`server_config`, `run_server`, `measure_server`) are also the per-setup code of
benchmarks/multi_gpu_server_bench.py.
Every level reports the server's own stage counters (LLM steps, token2wav batches: busy
seconds, calls, items) read from its Prometheus endpoint before and after.
A wall-clock budget (--budget-s, default 560 s) keeps the run inside one 10-minute device call:
phases that would start too late are skipped and listed under "skipped"; a failing phase is
recorded and the next one runs. Writes into --out (default $OUT or runs/h200-server):
server_results.json, server_table.txt, server-latency.png, server-throughput.png,
server-first_chunk_hist.png, server-open_loop.png, server_log_tail.txt, server_startup_lines.txt,
server_error_lines.txt where the log has errors (and the restart's restart_* files of the same).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import yaml

from cosyvoice_cli import bench
from grpc_async.client import CosyVoiceClient
from async_cosyvoice.config import Config
from async_cosyvoice.model_dir import model_kind
from async_cosyvoice.tools.make_random_model import make_random_model

REPO = Path(__file__).resolve().parents[1]
FULL = dict(levels=[1, 4, 16, 32, 64], requests={1: 4, 4: 8, 16: 32, 32: 64, 64: 128}, tokens=250,
            prompt_seconds=6.0, start_rate=1.0, duration_s=20.0, min_requests=bench.MIN_REQUESTS, max_rate=32.0,
            refine=2, max_level_seconds=25.0, llm_batches=[1, 32, 128], ready_timeout_s=300.0, restart_s=100.0)
QUICK = dict(levels=[1, 2], requests={1: 2, 2: 2}, tokens=20, prompt_seconds=1.0, start_rate=1.0, duration_s=2.0,
             min_requests=3, max_rate=2.0, refine=0, max_level_seconds=10.0, llm_batches=[], ready_timeout_s=300.0,
             restart_s=0.0)
QUICK_PRESETS = {"cosyvoice2-0.5b": "tiny", "cosyvoice3-0.5b": "cosyvoice3-tiny"}
SETTLE_S = 180.0  # the longest wait for the server's pending CUDA graph captures before a timed phase
# phases that must still fit after a phase starts (seconds), so the headline numbers come first
RESERVE = {"llm": 330.0, "server": 200.0, "sweep": 90.0, "capacity": 10.0}


def add_server_arguments(ap: argparse.ArgumentParser, out_default: str, budget_s: float | None,
                         levels: list[int]) -> None:
    """The options of a through-the-server run (shared with multi_gpu_server_bench.py)."""
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "gpu.yaml")
    ap.add_argument("--preset", default="cosyvoice2-0.5b", help="make_random_model preset")
    ap.add_argument("--model-dir", type=Path, help="use this model directory instead of generating one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", out_default)))
    ap.add_argument("--levels", help=f"closed-loop levels (default {','.join(map(str, levels))})")
    ap.add_argument("--tokens", type=int, help="forced tokens per request (default 250)")
    ap.add_argument("--start-rate", type=float)
    ap.add_argument("--duration", type=float, help="seconds of arrivals per capacity trial, at least (default 20)")
    ap.add_argument("--min-requests", type=bench.non_negative_int, metavar="N",
                    help="requests per capacity trial, at least: a trial lasts max(--duration, N / rate) s of "
                         f"arrivals, on to the N-th arrival if fewer came (default {bench.MIN_REQUESTS}; --quick "
                         f"{QUICK['min_requests']})")
    ap.add_argument("--max-level-seconds", type=float)
    ap.add_argument("--budget-s", type=float, default=budget_s)
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: tiny model, small workload")
    ap.add_argument("--settle-s", type=float, default=SETTLE_S,
                    help="before each timed phase, wait at most this long for the server's CUDA graph captures "
                         f"(no graph wanted on its metrics endpoint; default {SETTLE_S:g})")
    ap.add_argument("--keep-compile-cache", action="store_true",
                    help="the first start uses the config's torch.compile cache folder (default: an empty one "
                         "in the scratch directory, as on a fresh machine)")


def make_plan(args, full: dict, quick: dict) -> dict:
    """`full` or (--quick) `quick`, with the workload options given on the command line."""
    plan = dict(quick if args.quick else full)
    plan["settle_s"] = args.settle_s
    if args.quick:  # the full-size presets' tiny twins
        args.preset = QUICK_PRESETS.get(args.preset, args.preset)
    for key, value in (("tokens", args.tokens), ("start_rate", args.start_rate), ("duration_s", args.duration),
                       ("min_requests", args.min_requests), ("max_level_seconds", args.max_level_seconds)):
        if value is not None:
            plan[key] = value
    if args.levels:
        plan["levels"] = bench.parse_int_list(args.levels)
        plan["requests"] = {c: max(4, 2 * c) for c in plan["levels"]}
    return plan


def plan_json(plan: dict) -> dict:
    """The plan as JSON has it (the requests per level keyed by strings)."""
    return {k: (v if not isinstance(v, dict) else {str(a): b for a, b in v.items()}) for k, v in plan.items()}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_arguments(ap, "runs/h200-server", budget_s=560.0, levels=FULL["levels"])
    ap.add_argument("--baseline-tree", type=Path, help="another checkout: LLM ms/step there too (before/after)")
    ap.add_argument("--llm-batches", help="comma list of LLM decode batch sizes (default 1,32,128; quick: none)")
    ap.add_argument("--llm-compile", action="store_true", help="also time the LLM with torch.compile")
    ap.add_argument("--skip", default="", help="comma list of phases to skip: llm,sweep,capacity,restart")
    args = ap.parse_args(argv)
    plan = make_plan(args, FULL, QUICK)
    if args.llm_batches is not None:
        plan["llm_batches"] = bench.parse_int_list(args.llm_batches) if args.llm_batches else []
    return args, plan


def log(msg: str) -> None:
    print(f"[server-bench] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def format_error(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def server_config(args, model_dir: Path, speakers_dir: Path, **sections: dict) -> Config:
    """--config with the model, a scratch speaker store and free local ports; CPU settings for --quick;
    then `sections` (e.g. model={"devices": [...]}) update the config's sections of those names."""
    data = yaml.safe_load(args.config.read_text()) or {}
    data.setdefault("model", {})["dir"] = str(model_dir)
    data.setdefault("speakers", {})["dir"] = str(speakers_dir)
    data["server"] = {**data.get("server", {}), "host": "127.0.0.1", "port": free_port(), "metrics_port": free_port()}
    if not getattr(args, "keep_compile_cache", True):
        data.setdefault("warmup", {})["compile_cache_dir"] = str(speakers_dir.parent / "torch-compile")
    if args.quick:
        data["model"].update(device="cpu", llm_dtype="float32", flow_dtype="float32")
        data.setdefault("engine", {}).update(cuda_graphs=False, compile=False, max_num_seqs=8, max_model_len=512)
        data.setdefault("token2wav", {}).update(estimator="torch")
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return Config.model_validate(data)


def bench_model_dir(args) -> Path:
    """--model-dir, else the random model of --preset/--seed in a scratch folder (reused when it is there)."""
    if args.model_dir:
        return args.model_dir
    scratch = Path(tempfile.gettempdir()) / "async_cosyvoice_bench" / f"{args.preset}-seed{args.seed}"
    return make_random_model(args.preset, scratch, seed=args.seed)


# -- 1. LLM decode, this tree and the baseline ------------------------------------------------

_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")


def llm_steps(tree: Path, batches: list[int], compile: bool, timeout_s: float) -> dict:
    """bench_llm_engine.py --full-size in `tree` (its own code on PYTHONPATH): ms/step per batch."""
    cmd = [sys.executable, str(tree / "benchmarks" / "bench_llm_engine.py"), "--device", "cuda", "--dtype", "bfloat16",
           "--full-size", "--batch-sizes", *map(str, batches), "--max-model-len", "1024"] + (["--compile"] if compile else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    t = time.monotonic()
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    rows = {}
    for line in p.stdout.splitlines():
        m = _ROW.match(line)
        if m:
            b, prefill, step_ms, decode_tps, total_tps = m.groups()
            rows[int(b)] = {"prefill_s": float(prefill), "step_ms": float(step_ms), "decode_tok_s": float(decode_tps)}
    out = {"tree": str(tree), "compile": compile, "wall_s": time.monotonic() - t, "returncode": p.returncode,
           "by_batch": rows, "stdout": p.stdout[-3000:]}
    if p.returncode:
        out["stderr"] = p.stderr[-3000:]
    return out


def format_llm(llm: dict) -> str:
    """ms per step by batch for every run, and after / before where both ran."""
    names = list(llm)
    pairs = [(n, n.replace("after", "before")) for n in names if n.startswith("after") and
             n.replace("after", "before") in llm]
    head = f"{'batch':>6}" + "".join(f"{n:>18}" for n in names) + "".join(f"{a + ' / before':>24}" for a, _ in pairs)
    lines = ["LLM decode, ms per step (bench_llm_engine.py --full-size, bf16, CUDA graphs):", head]
    for b in sorted({b for run in llm.values() for b in run["by_batch"]}):
        ms = {n: llm[n]["by_batch"].get(b, {}).get("step_ms") for n in names}
        row = f"{b:>6}" + "".join(f"{ms[n]:18.2f}" if ms[n] else f"{'-':>18}" for n in names)
        row += "".join(f"{ms[a] / ms[o]:24.3f}" if ms[a] and ms[o] else f"{'-':>24}" for a, o in pairs)
        lines.append(row)
    return "\n".join(lines)


# -- 3-8. the server -----------------------------------------------------------------------

class ServerProcess:
    """`python -m cosyvoice_cli serve --config <file>` in a child process."""

    def __init__(self, config: Config, workdir: Path, log_path: Path):
        self.config = config
        self.config_path = workdir / "server.yaml"
        self.config_path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.config.server.port}"

    @property
    def metrics(self) -> str:
        return f"127.0.0.1:{self.config.server.metrics_port}"

    def start(self) -> None:
        self.started = time.monotonic()
        self._log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               "PYTHONUNBUFFERED": "1"}
        if self.config.warmup.compile_cache_dir is not None:  # the config's folder, not an inherited one
            for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
                env.pop(name, None)
        self.proc = subprocess.Popen([sys.executable, "-m", "cosyvoice_cli", "serve", "--config",
                                      str(self.config_path)], stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=REPO)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    async def wait_serving(self, client, timeout_s: float) -> None:
        """Until health turns SERVING; fails at once (with the log's tail) if the server exits first."""
        loop = asyncio.get_running_loop()
        exited: asyncio.Future = loop.create_future()

        def wait_exit() -> None:
            rc = self.proc.wait()
            with contextlib.suppress(RuntimeError):  # the loop may be closed by then
                loop.call_soon_threadsafe(lambda: exited.done() or exited.set_result(rc))

        threading.Thread(target=wait_exit, daemon=True).start()
        ready = asyncio.ensure_future(client.wait_ready(timeout=timeout_s))
        await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            raise RuntimeError(f"server exited with status {exited.result()} before SERVING:\n{self.log_tail(15)}")
        ready.result()

    def log_tail(self, n: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""


# the server log's start-up lines (what was captured, the phase table, the compile cache), kept beside the tail,
# and the long full garbage collections while serving (gc_pauses.py), with the heap the warm-up froze
STARTUP_LINE = re.compile(r"warm-up|start-up|compile cache|torch\.compile|CUDA graph|^  \S.*\d s$|SERVING|"
                          r"heap settled|full garbage collection")
# and its errors: a level's failed requests leave only a count in the results, the cause is here
ERROR_LINE = re.compile(r" (ERROR|CRITICAL) |Traceback|Error: ")


def error_lines(lines: list[str], limit: int = 300) -> list[str]:
    """The log's error lines, each with the line after it (a traceback's first frame, or the next
    message), numbered from 1; at most `limit`."""
    hit = [bool(ERROR_LINE.search(line)) for line in lines]
    return [f"{i + 1}: {line}" for i, line in enumerate(lines) if hit[i] or (i and hit[i - 1])][:limit]


def run_server(config: Config, workdir: Path, log_path: Path, measure, results: dict,
               error_key: str = "server") -> tuple[int | None, str]:
    """Start a server from `config`, run the coroutine `measure(server)` against it, stop it. A failure
    (e.g. the server never came up) is recorded in results["phase_errors"][error_key], so what was
    measured is kept. Returns the server's exit status and the last 200 lines of its log; its start-up
    lines are kept in <error_key>_startup_lines.txt beside it and its first 300 error lines (with the
    line after each) in <error_key>_error_lines.txt when it has any; the log file itself is removed (it
    can be large)."""
    server = ServerProcess(config, workdir, log_path)
    server.start()
    try:
        asyncio.run(measure(server))
    except Exception as e:
        results.setdefault("phase_errors", {})[error_key] = format_error(e)
        log(f"{error_key} failed: {type(e).__name__}: {e}")
    finally:
        returncode = server.stop()
        tail = server.log_tail(200)
        with contextlib.suppress(OSError):
            lines = log_path.read_text(errors="replace").splitlines()
            startup = [line for line in lines if STARTUP_LINE.search(line)]
            log_path.with_name(f"{error_key}_startup_lines.txt").write_text("\n".join(startup[:120]) + "\n")
            if errors := error_lines(lines):
                log_path.with_name(f"{error_key}_error_lines.txt").write_text("\n".join(errors) + "\n")
        with contextlib.suppress(OSError):
            log_path.unlink()
    return returncode, tail


async def measure_server(plan: dict, server: ServerProcess, results: dict, phases: dict, deadline: float, *,
                         seed: int = 0, skip: frozenset = frozenset(), reserve: dict = RESERVE) -> None:
    """One started server: wait for SERVING, register the speaker, the first request, then the phases
    warmup, sweep (plan["levels"]) and capacity, each skipped when in `skip` or when less than
    reserve[phase] seconds would be left before `deadline` (monotonic) once it starts (a level C of
    the sweep: reserve["sweep C"] if given, else reserve["sweep"])."""
    progress = bench.Progress()
    skipped = results.setdefault("skipped", [])
    errors = results.setdefault("phase_errors", {})

    def time_left(phase: str) -> float:  # "sweep 64" falls back to "sweep"'s reserve
        return deadline - time.monotonic() - reserve.get(phase, reserve.get(phase.split()[0], 0.0))

    async def run_phase(name: str, coro_fn) -> None:
        if name in skip:
            skipped.append(name)
            return
        if time_left(name) <= 0:
            skipped.append(name)
            log(f"out of time budget: skipping {name}")
            return
        t = time.monotonic()
        try:
            await coro_fn()
        except Exception as e:  # keep what the other phases measure
            errors[name] = format_error(e)
            log(f"{name} failed: {type(e).__name__}: {e}")
        phases[f"{name}_s"] = time.monotonic() - t

    stages = bench.PrometheusStages(server.metrics)
    async with CosyVoiceClient(server.target) as client:
        await server.wait_serving(client, plan["ready_timeout_s"])
        phases["server_start_s"] = time.monotonic() - server.started
        log(f"server SERVING {phases['server_start_s']:.1f} s after spawn")
        results["startup"] = startup_json(await client.get_server_info(), phases["server_start_s"])
        speaker = bench.SpeakerSpec(prompt_seconds=plan["prompt_seconds"], seed=seed)
        results["meta"]["prompt_seconds"] = await bench.register_grpc(client, speaker)
        target = bench.GrpcTarget(client)
        workload = bench.Workload(tokens=plan["tokens"], seed=seed, speaker_id=speaker.speaker_id)
        results["meta"]["workload"] = workload.to_json()

        cold = await bench.run_level(target, workload, 1, 1, detail=True, label="first request after SERVING",
                                     stages=stages)
        results["first_request"] = cold

        async def warm():
            phases["warmup_s"] = await bench.warm_up(target, workload, plan["levels"], progress,
                                                     max_tokens=plan.get("warmup_tokens", 60))

        async def settle(phase: str) -> None:
            """Until the server has captured the CUDA graphs its calls wanted (cosyvoice_cli/bench/graphs.py),
            at most plan["settle_s"] and the phase's time left."""
            try:
                settled = await bench.settle_graphs(stages, max(0.0, min(plan["settle_s"], time_left(phase))))
            except Exception as e:  # the phase still runs; the results say its graphs were not read
                settled = {"error": f"{type(e).__name__}: {e}"}
            results.setdefault("graph_settle", []).append({"before": phase, **settled})
            log(bench.format_settle(settled, phase))

        async def sweep():
            results["levels"] = []
            counts = bench.requests_per_level(plan["levels"], plan["requests"])
            for c in plan["levels"]:
                await settle(f"sweep {c}")
                budget = time_left(f"sweep {c}")
                if budget <= 1.0:
                    skipped.append(f"sweep level {c}")
                    continue
                results["levels"].append(await bench.run_level(
                    target, workload, c, counts[c], progress=progress, stages=stages,
                    max_seconds=min(plan["max_level_seconds"], budget)))

        async def capacity():
            async def before_trial(rate: float) -> None:
                await settle(f"capacity {rate:g}/s")
            results["capacity"] = await bench.capacity_search(
                target, workload, start_rate=plan["start_rate"], duration_s=plan["duration_s"],
                min_requests=plan["min_requests"], max_rate=plan["max_rate"], refine=plan["refine"],
                within=plan.get("within"), max_trials=plan.get("max_trials", 12), progress=progress, stages=stages,
                detail=True, drain_timeout_s=max(30.0, 4 * plan["tokens"] * bench.SECONDS_PER_TOKEN),
                stop_at=deadline - 5.0 - (0.0 if "restart" in skip else plan["restart_s"]), before_trial=before_trial)

        await run_phase("warmup", warm)
        await run_phase("sweep", sweep)
        await run_phase("capacity", capacity)


async def measure_restart(plan: dict, server: ServerProcess, results: dict, phases: dict, workload) -> None:
    """A second start of the same server (same speaker store, same torch.compile cache): time to
    SERVING, then its first request (the speaker is warmed at start-up) and three warm ones."""
    async with CosyVoiceClient(server.target) as client:
        await server.wait_serving(client, plan["ready_timeout_s"])
        phases["restart_start_s"] = time.monotonic() - server.started
        log(f"restarted server SERVING {phases['restart_start_s']:.1f} s after spawn")
        startup = startup_json(await client.get_server_info(), phases["restart_start_s"])
        target = bench.GrpcTarget(client)
        stages = bench.PrometheusStages(server.metrics)
        results["restart"] = {
            "start_s": phases["restart_start_s"],
            "startup": startup,
            "first_request": await bench.run_level(target, workload, 1, 1, detail=True, stages=stages,
                                                   label="first request after a restart"),
            "warm": await bench.run_level(target, workload, 1, 3, label="after a restart, warm", stages=stages)}


def startup_json(info, spawn_to_serving_s: float) -> dict:
    """A start as the server reports it (GetServerInfo.startup), with the client's spawn-to-SERVING time."""
    st = info.startup
    return {"spawn_to_serving_s": spawn_to_serving_s, "server_s": st.seconds, "compile_cache": st.compile_cache,
            "phases_s": {p.name: p.seconds for p in st.phases}, "cuda_graphs": dict(st.cuda_graphs)}


def format_startup(results: dict) -> str:
    """The phase table of the first start and the restart, side by side."""
    starts = [(name, s) for name, s in (("first start", results.get("startup")),
                                        ("second start", (results.get("restart") or {}).get("startup"))) if s]
    if not starts:
        return ""
    names = list(dict.fromkeys(n for _, s in starts for n in s["phases_s"]))
    rows = [("spawn to SERVING (client)", [f"{s['spawn_to_serving_s']:.1f}" for _, s in starts]),
            ("  before the server (imports)", [f"{s['spawn_to_serving_s'] - s['server_s']:.1f}" for _, s in starts]),
            ("  server start to SERVING", [f"{s['server_s']:.1f}" for _, s in starts])]
    rows += [(f"    {n}", [f"{s['phases_s'].get(n, 0.0):.1f}" for _, s in starts]) for n in names]
    rows += [("CUDA graphs captured", [str(sum(s["cuda_graphs"].values())) for _, s in starts]),
             ("persistent compile cache", [s["compile_cache"] for _, s in starts])]
    out = ["start-up (seconds):" + "".join(f"{name:>16}" for name, _ in starts)]
    out += [f"{label:<30}" + "".join(f"{v:>16}" for v in values) for label, values in rows]
    for name, s in starts:
        if s["cuda_graphs"]:
            out.append(f"{name} graphs: " + ", ".join(f"{k} {v}" for k, v in sorted(s["cuda_graphs"].items())))
    return "\n".join(out)


def format_first_requests(results: dict) -> str:
    """The first request after each start against warm ones: the first chunk and where it went
    (the server's first-chunk parts: until its tokens / waiting for a token2wav batch / the batch)."""
    by_c = {lv["concurrency"]: lv for lv in results.get("levels", [])}
    restart = results.get("restart") or {}
    runs = [("first request after SERVING", results.get("first_request")), ("warm, 1 stream", by_c.get(1)),
            ("first request after the restart", restart.get("first_request")),
            ("after the restart, warm", restart.get("warm"))]
    lines = []
    for label, lv in runs:
        if not lv or lv["first_chunk_s"]["p50"] is None:
            continue
        st = lv.get("stages") or {}
        parts = [(st.get(f"first_chunk_{p}") or {}).get("ms_per_call") for p in ("tokens", "wait", "t2w")]
        split = " / ".join("-" if v is None else f"{v:.1f}" for v in parts)
        lines.append(f"  {label:<34}{1e3 * lv['first_chunk_s']['p50']:8.1f} ms   ({split} ms)")
    if not lines:
        return ""
    return "\n".join(["first chunk p50 (tokens / wait / t2w, the server's means):"] + lines)


def summary_rows(results: dict) -> list[dict]:
    """The issue's table: what was measured for each target."""
    by_c = {lv["concurrency"]: lv for lv in results.get("levels", [])}
    cap = results.get("capacity") or {}
    c1, c32, c64 = by_c.get(1), by_c.get(32), by_c.get(64)
    cold = results.get("first_request")
    warm_p50 = c1 and c1["first_chunk_s"]["p50"]
    cold_first = cold and cold["first_chunk_s"]["max"]
    restart = results.get("restart") or {}
    r_cold = restart and restart["first_request"]["first_chunk_s"]["max"]
    r_warm = restart and restart["warm"]["first_chunk_s"]["p50"]
    return [
        {"metric": "first chunk p50, 1 stream (ms)", "value": c1 and 1e3 * c1["first_chunk_s"]["p50"], "target": 75},
        {"metric": "first chunk p99, 32 streams (ms)", "value": c32 and 1e3 * c32["first_chunk_s"]["p99"],
         "target": 250},
        {"metric": "late chunks at 32 streams", "value": c32 and c32["underruns"]["late_chunks"], "target": 0},
        {"metric": "late chunks at 64 streams", "value": c64 and c64["underruns"]["late_chunks"], "target": 0},
        {"metric": "capacity: arrivals/s (p99 <= 300 ms, >= 99% clean)", "value": cap.get("capacity_rate"),
         "target": None},
        {"metric": "capacity: concurrent streams (mean in flight)",
         "value": (cap.get("streams_in_flight") or {}).get("mean"), "target": 64},
        {"metric": "first request after SERVING / warm p50",
         "value": cold_first / warm_p50 if cold_first and warm_p50 else None, "target": 1.2},
        {"metric": "first start (empty compile cache) to SERVING (s)",
         "value": results["meta"]["phases"].get("server_start_s"), "target": 90},
        {"metric": "second start to SERVING (s)", "value": restart.get("start_s"), "target": 30},
        {"metric": "after the restart: first request / warm p50",
         "value": r_cold / r_warm if r_cold and r_warm else None, "target": 1.2},
    ]


def format_summary(rows: list[dict]) -> str:
    out = ["through the gRPC server:"]
    for r in rows:
        v = r["value"]
        shown = "not measured" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))
        goal = "" if r["target"] is None else f"   (target {r['target']})"
        out.append(f"  {r['metric']}: {shown}{goal}")
    return "\n".join(out)


def main(argv=None) -> int:
    args, plan = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t_all = time.monotonic()
    deadline = t_all + args.budget_s
    phases: dict = {}
    results: dict = {"title": "async_cosyvoice through gRPC", "meta": {
        "script": "benchmarks/h200_server_bench.py", "argv": sys.argv[1:] if argv is None else list(argv),
        "quick": args.quick, "plan": plan_json(plan),
        "environment": bench.environment("cpu" if args.quick else "cuda"), "phases": phases}}
    gpu = results["meta"]["environment"].get("gpu")
    if gpu:
        results["title"] = f"async_cosyvoice on {gpu}, through gRPC"
    skip = frozenset(s for s in args.skip.split(",") if s)

    if plan["llm_batches"] and "llm" not in skip:
        t = time.monotonic()
        llm: dict = {}
        trees = [("after", REPO)] + ([("before", args.baseline_tree)] if args.baseline_tree else [])
        for compiled in ([False, True] if args.llm_compile else [False]):
            for name, tree in trees:
                if deadline - time.monotonic() < RESERVE["llm"]:
                    results.setdefault("skipped", []).append(f"llm {name}{' compiled' if compiled else ''}")
                    continue
                key = f"{name}{' +compile' if compiled else ''}"
                try:
                    llm[key] = llm_steps(tree, plan["llm_batches"], compiled, timeout_s=150.0)
                    log(f"LLM {key}: " + ", ".join(f"b{b} {r['step_ms']:.2f} ms"
                                                   for b, r in llm[key]["by_batch"].items()))
                except Exception as e:  # a timeout or a missing tree: keep going
                    results.setdefault("phase_errors", {})[f"llm {key}"] = f"{type(e).__name__}: {e}"
        results["llm"] = llm
        phases["llm_s"] = time.monotonic() - t

    t = time.monotonic()
    model_dir = bench_model_dir(args)
    phases["model_s"] = time.monotonic() - t
    kind = model_kind(model_dir)
    results["meta"].update(model_kind=kind, preset=None if args.model_dir else args.preset)
    if kind == "cosyvoice3":  # its vocoder's lengths grow with the utterance: warm its graphs at full length
        plan["warmup_tokens"] = None
        results["meta"]["plan"] = plan_json(plan)
    results["title"] = results["title"].replace("async_cosyvoice", f"async_cosyvoice ({kind})", 1)
    log(f"model {model_dir} ({kind}) ready in {phases['model_s']:.1f} s")

    with tempfile.TemporaryDirectory(prefix="server-bench-") as scratch:
        config = server_config(args, model_dir, Path(scratch) / "spk")
        results["meta"]["config"] = config.model_dump(mode="json")
        log_path = args.out / "server.log"
        reserve = {} if args.quick else RESERVE
        results["meta"]["server_returncode"], tail = run_server(
            config, Path(scratch), log_path, lambda server: measure_server(
                plan, server, results, phases, deadline, seed=args.seed, skip=skip, reserve=reserve), results)
        (args.out / "server_log_tail.txt").write_text(tail + "\n", encoding="utf-8")
        if "restart" in skip or "workload" not in results["meta"]:
            results.setdefault("skipped", []).append("restart")
        elif deadline - time.monotonic() < plan["restart_s"]:
            results.setdefault("skipped", []).append("restart")
            log("out of time budget: skipping restart")
        else:
            workload = bench.Workload(**results["meta"]["workload"])
            _, tail = run_server(config, Path(scratch), log_path, lambda server: measure_restart(
                plan, server, results, phases, workload), results, "restart")
            (args.out / "restart_log_tail.txt").write_text("\n".join(tail.splitlines()[-60:]) + "\n",
                                                           encoding="utf-8")
    phases["total_s"] = time.monotonic() - t_all
    results["summary"] = summary_rows(results)
    path = bench.write_json(results, args.out / "server_results.json")
    log(f"wrote {path}")

    text = []
    if results.get("llm"):
        text += [format_llm(results["llm"]), ""]
    if results.get("first_request"):
        fr = results["first_request"]
        text += [f"first request after SERVING: first chunk {1e3 * (fr['first_chunk_s']['max'] or 0):.1f} ms, "
                 f"errors {fr['errors']}", ""]
    if results.get("levels"):
        text += [f"closed loop, {plan['tokens']} tokens per request ({plan['tokens'] * bench.SECONDS_PER_TOKEN:g} s "
                 f"of audio), prompt {results['meta'].get('prompt_seconds')} s:", bench.format_table(results["levels"]),
                 "", bench.format_stages(results["levels"], "server stages"), ""]
    if results.get("capacity"):
        text += [bench.format_open_loop(results["capacity"]["trials"]), bench.format_capacity(results["capacity"]), ""]
    if results.get("skipped"):
        text += ["skipped to stay within --budget-s: " + ", ".join(results["skipped"]), ""]
    for name, trace in (results.get("phase_errors") or {}).items():
        text += [f"phase {name} FAILED:", trace.rstrip(), ""]
    for block in (format_startup(results), format_first_requests(results)):
        if block:
            text += [block, ""]
    text += [format_summary(results["summary"]), "", "phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())]
    table = "\n".join(text)
    print(table)
    (args.out / "server_table.txt").write_text(table + "\n", encoding="utf-8")
    for p in bench.write_plots(results, args.out, prefix="server-", targets=None if args.quick else {"300 ms": 300.0}):
        log(f"wrote {p}")
    failed = sum(lv["errors"] for lv in results.get("levels", []))
    return 1 if failed or results.get("phase_errors") else 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the "load weights" seconds of a start go: the model directory, the LM, flow and HiFT
(build the modules, read the file, load the state dict, move to dtype and device) and the request
front (tokenizer, text normalizer, ONNX prompt encoder, speaker store).

    PYTHONPATH=. python benchmarks/load_time_bench.py [--model-dir DIR] [--runs 3] [--device cpu]
        [--llm-dtype bfloat16] [--flow-dtype float16] [--threads N] [--baseline-root DIR] [--json FILE]

Without --model-dir a full-size random CosyVoice2 (`cosyvoice2-0.5b`, 2.5 GB) is written once
under the bench cache ($TMPDIR/async_cosyvoice_bench) and reused. Two ways of building the models
are timed, each run in a fresh process, alternating, and the table shows the median of --runs:

  old   what build_models did before: the modules constructed on the CPU (every nn.Linear, Conv
        and Embedding randomly initialised), `load_state_dict` copying the file's tensors in, then
        `.to(device, dtype)`
  new   build_models now: the modules constructed on the meta device (`empty_init`), the file's
        tensors assigned (`load_strict`, checked by `finish_empty_init`), `.to(...)`, then what is
        still the file's pages (nothing converted it) copied (`own_memory`)

The weight files are read through torch.load(mmap=True): "read file" is opening them and the
keys, the pages come in during "load" (old: the copy) or "to dtype/device" (new). The files are in
the page cache after the first run (as on a restart on the same machine); "page cache read" is
reading each file's bytes once (the floor of any load). The dtypes default to configs/gpu.yaml's
(LM bfloat16, flow float16, HiFT float32). The request-front rows do not depend on the way.

A second table times the whole start-up phase as the server runs it, in a fresh process per run:
importing `cosyvoice_cli.serve` and `Synthesizer.create(warmup=False)`'s "load weights" phase
(startup.py: model directory, compile cache, LM, request front, engine, token2wav stage), with the
default config but the model directory, the device and the dtypes. `--baseline-root` runs the same
probe on another checkout of the repository too (e.g. a worktree of an older commit) for a
before/after on one machine; the probe uses only what both have.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from async_cosyvoice.config import Config
from async_cosyvoice.frontend.prompt import PromptEncoder
from async_cosyvoice.frontend.text import TextFrontend
from async_cosyvoice.model_dir import (
    FLOW_FILE,
    HIFT_FILE,
    LLM_FILE,
    LM_CLASSES,
    TOKEN2WAV_CLASSES,
    build_models,
    load_model_dir,
    load_strict,
    own_memory,
)
from async_cosyvoice.model_speakers import with_model_speakers
from async_cosyvoice.models.empty_init import empty_init, finish_empty_init
from async_cosyvoice.random_model import ensure_random_model
from async_cosyvoice.speaker_store import open_speaker_store
from async_cosyvoice.speakers import VoiceFit

WAYS = ("old", "new")
ROOT = Path(__file__).resolve().parents[1]

# the server's own imports and load phase; only APIs an older checkout has too
PHASE_PROBE = """
import asyncio, json, sys, tempfile, time
t = time.perf_counter()
import cosyvoice_cli.serve
from async_cosyvoice.config import Config
from async_cosyvoice.startup import Startup
from async_cosyvoice.tts import Synthesizer
imports = time.perf_counter() - t
model_dir, device, llm_dtype, flow_dtype = sys.argv[1:5]
config = Config.model_validate({"model": {"dir": model_dir, "device": device, "llm_dtype": llm_dtype,
                                          "flow_dtype": flow_dtype}, "speakers": {"dir": tempfile.mkdtemp()}})

async def load() -> float:
    startup = Startup()
    synth = await Synthesizer.create(config, warmup=False, startup=startup)
    seconds = startup.finish().phases["load weights"]
    await synth.close()
    return seconds

print(json.dumps({"imports (cosyvoice_cli.serve)": imports, "load weights phase": asyncio.run(load())}))
"""
STEPS = ("build modules", "read file", "load state dict", "to dtype/device")


class Timer:
    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t


def page_cache_read(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(1 << 24)
        while f.readinto(buf):
            pass


def load_part(timer: Timer, way: str, part: str, make, state_dict, file: str, device, dtype) -> torch.nn.Module:
    if way == "old":
        with timer(f"{part}: build modules"):
            module = make()
        with timer(f"{part}: read file"):
            sd = state_dict()
        with timer(f"{part}: load state dict"):
            module.load_state_dict(sd, strict=True)
    else:
        with timer(f"{part}: build modules"), empty_init():
            module = make()
        with timer(f"{part}: read file"):
            sd = state_dict()
        with timer(f"{part}: load state dict"):
            load_strict(module, sd, file)
            finish_empty_init(module)
    with timer(f"{part}: to dtype/device"):
        module = module.to(device=device, dtype=dtype)
        if way == "new":
            module = own_memory(module, sd)
    return module.eval()


def child(args: argparse.Namespace) -> dict[str, float]:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    timer = Timer(device)
    with timer("model dir (yaml, dims)"):
        md = load_model_dir(args.model_dir)
    for file in (LLM_FILE, FLOW_FILE, HIFT_FILE):
        with timer(f"page cache read ({file})"):
            page_cache_read(md.file(file))
    flow_cls, hift_cls = TOKEN2WAV_CLASSES[md.kind]
    llm_dtype, flow_dtype = getattr(torch, args.llm_dtype), getattr(torch, args.flow_dtype)
    models = [load_part(timer, args.child, "LLM", lambda: LM_CLASSES[md.kind](md.dims.lm), md.llm_state_dict,
                        LLM_FILE, device, llm_dtype),
              load_part(timer, args.child, "flow", lambda: flow_cls(md.dims.flow), md.flow_state_dict,
                        FLOW_FILE, device, flow_dtype),
              load_part(timer, args.child, "HiFT", lambda: hift_cls(md.dims.hift, md.dims.flow), md.hift_state_dict,
                        HIFT_FILE, device, torch.float32)]
    del models
    if args.child == "new":  # the same steps through the library's one call, as the server runs them
        with timer("build_models (LLM, flow, HiFT in one call)"):
            build_models(md, device=device, dtype=flow_dtype, llm_dtype=llm_dtype)
    with timer("tokenizer"):
        tokenizer = md.tokenizer()
    with timer("text frontend (wetext, inflect)"):
        TextFrontend(tokenizer).preload()
    with timer("prompt encoder (ONNX sessions)"):
        PromptEncoder.from_model_dir(md.path, mel=md.dims.feat, speech_tokenizer=md.speech_tokenizer_onnx.name)
    with tempfile.TemporaryDirectory() as speakers_dir:
        config = Config.model_validate({"speakers": {"dir": speakers_dir}})
        with timer("speaker store (+ spk2info.pt)"):
            with_model_speakers(open_speaker_store(config.speakers, fit=VoiceFit.of(md.dims)), md.path,
                                tokenizer.encode, model_kind=md.kind).infos()
    return timer.seconds


def run_child(args: argparse.Namespace, way: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", way, "--model-dir", str(args.model_dir), "--device", args.device,
           "--llm-dtype", args.llm_dtype, "--flow-dtype", args.flow_dtype, "--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_phase(args: argparse.Namespace, root: Path) -> dict[str, float]:
    cmd = [sys.executable, "-c", PHASE_PROBE, str(args.model_dir), args.device, args.llm_dtype, args.flow_dtype]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def totals(seconds: dict[str, float]) -> dict[str, float]:
    out = dict(seconds)
    for part in ("LLM", "flow", "HiFT"):
        out[f"{part} total"] = sum(v for k, v in seconds.items() if k.startswith(f"{part}: "))
    out["models total (LLM + flow + HiFT)"] = sum(out[f"{p} total"] for p in ("LLM", "flow", "HiFT"))
    return out


def table(medians: dict[str, dict[str, float]]) -> str:
    rows = []
    for part in ("LLM", "flow", "HiFT"):
        rows += [f"{part}: {step}" for step in STEPS] + [f"{part} total"]
    rows += ["models total (LLM + flow + HiFT)", "build_models (LLM, flow, HiFT in one call)", "model dir (yaml, dims)"]
    rows += [k for k in medians["new"] if k.startswith("page cache read")]
    rows += ["tokenizer", "text frontend (wetext, inflect)", "prompt encoder (ONNX sessions)",
             "speaker store (+ spk2info.pt)"]
    width = max(map(len, rows))
    lines = [f"{'part':<{width}}  {'old (s)':>8}  {'new (s)':>8}"]
    for row in rows:
        cells = [f"{medians[w][row]:8.2f}" if row in medians[w] else f"{'-':>8}" for w in WAYS]
        lines.append(f"{row:<{width}}  {cells[0]}  {cells[1]}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, help="default: a full-size random CosyVoice2 in the bench cache")
    p.add_argument("--runs", type=int, default=3, help="processes per way (median)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--llm-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--flow-dtype", default="float16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--baseline-root", type=Path, help="another checkout whose server phase is timed too")
    p.add_argument("--json", type=Path, help="write every run's seconds and the medians here")
    p.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.model_dir is None:
        args.model_dir = ensure_random_model("cosyvoice2-0.5b",
                                             Path(tempfile.gettempdir()) / "async_cosyvoice_bench" / "cosyvoice2-0.5b-seed0")
    runs: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
    for i in range(args.runs):
        for way in WAYS:
            runs[way].append(totals(run_child(args, way)))
            print(f"run {i + 1}/{args.runs} {way}: models {runs[way][-1]['models total (LLM + flow + HiFT)']:.2f} s",
                  file=sys.stderr)
    roots = {"this checkout": ROOT} | ({"baseline": args.baseline_root.resolve()} if args.baseline_root else {})
    phase_runs: dict[str, list[dict[str, float]]] = {name: [] for name in roots}
    for i in range(args.runs):
        for name, root in roots.items():
            phase_runs[name].append(run_phase(args, root))
            print(f"run {i + 1}/{args.runs} phase, {name}: {phase_runs[name][-1]}", file=sys.stderr)
    medians = {w: {k: statistics.median(r[k] for r in runs[w]) for k in runs[w][0]} for w in WAYS}
    phase = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in phase_runs.items()}
    print(f"load time, {args.model_dir.name}, {args.device}, LM {args.llm_dtype}, flow {args.flow_dtype}, "
          f"{torch.get_num_threads() if not args.threads else args.threads} threads, median of {args.runs} runs")
    print(table(medians))
    print()
    print(f"{'the server, fresh process':<40}" + "".join(f"  {name:>14}" for name in roots))
    for row in ("imports (cosyvoice_cli.serve)", "load weights phase"):
        print(f"{row:<40}" + "".join(f"  {phase[name][row]:14.2f}" for name in roots))
    if args.baseline_root:
        print(f"(baseline: {roots['baseline']})")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "medians": medians, "phase_runs": phase_runs,
                                         "phase": phase}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

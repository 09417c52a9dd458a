"""Offline batch synthesis of a data list: many requests at once through one Synthesizer.

    async-cosyvoice batch --data-list data.jsonl --out-dir out/ [--model-dir DIR --device cuda]
    async-cosyvoice batch --data-list data.jsonl --out-dir out/ --devices cuda:0,cuda:1,cuda:2,cuda:3

Data list: one JSON object per line (the seed-tts format),

    {"key": "utt1", "prompt_text": "transcript of the prompt", "text": "what to say",
     "prompt_wav": "prompts/utt1.wav", "wav": "utt1.wav"}

- `key` (unique), `text` and `prompt_wav` (the voice; a relative path is taken from the data
  list's folder) are required; `prompt_text` is the prompt's transcript (empty or missing: the
  cross-lingual mode, which needs none); `wav` is the output, relative to `--out-dir` or
  absolute (missing: `<key>.wav`). Blank lines are skipped. Every line is checked before any
  work starts, and an error names the file and line.

How it runs: `--concurrency` requests (default: the engine's `max_num_seqs`) are in flight at
once, non-streaming, so the LLM engine decodes them as one continuously refilled batch, and the
finished ones are rendered by the offline path (docs/offline.md): whole utterances in
length-sorted, padded flow and HiFT batches, each equal to its own render. `--no-offline` renders
them through the streaming token2wav batcher instead (one job per utterance, as before). Each entry's seed is `--seed` plus a hash
of its key, so the audio of an entry does not depend on the order, the sharding or on resuming.
`--tokens N` forces N speech tokens per text segment (benchmarks with random-weight models).

Resumable: an output is written to a temporary file in its folder and renamed into place once
complete (24 kHz 16-bit PCM WAV), so an existing, readable, non-empty wav is a finished entry and
is skipped; rerun the same command after an interruption. A failed entry is reported (key, line,
error) and the others go on; the exit status is 1 when any failed.

Multi-GPU on one host: `--devices cuda:0,cuda:1,...` starts one worker process per device
(`python -m cosyvoice_cli batch ... --device cuda:K --shard K/N`); worker K takes the
entries whose position in the list is K modulo N (the same split on every run, so resuming
works per shard), loads its own model copy, and reports progress to the parent as JSON lines
on stdout; the parent shows one combined progress bar and report. torchrun is not needed: the
workers do not talk to each other.

Report (stderr, and `--report FILE` as JSON): entries done / skipped / failed, audio seconds,
synthesis wall time (model loading excluded, reported apart), RTF = wall / audio and the
multiple of real time.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .files import atomic_writer, write_json
from .progress import ProgressLine

if TYPE_CHECKING:
    from .config import Config
    from .tts import Synthesizer

log = logging.getLogger(__name__)

REQUIRED = ("key", "text", "prompt_wav")
KNOWN = ("key", "text", "prompt_text", "prompt_wav", "wav")
_PROGRESS_EVERY_S = 0.5


class DataListError(ValueError):
    """A data list that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Entry:
    line: int                 # 1-based line in the data list
    key: str
    text: str
    prompt_text: str
    prompt_wav: Path
    wav: Path                 # absolute output path

    def seed(self, base: int) -> int:
        return base + zlib.crc32(self.key.encode("utf-8")) % 1_000_000


def load_data_list(path: str | Path, out_dir: str | Path, check_files: bool = True) -> list[Entry]:
    """Parse and check every line (see the module docstring); raises DataListError."""
    path = Path(path)
    out_dir = Path(out_dir).resolve()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataListError(f"cannot read data list {path}: {e}") from None
    base = path.resolve().parent
    entries: list[Entry] = []
    keys: dict[str, int] = {}
    outputs: dict[Path, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DataListError(f"{where}: not a JSON object ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise DataListError(f"{where}: expected a JSON object with {', '.join(KNOWN)}, got {type(obj).__name__}")
        for name in REQUIRED:
            if not isinstance(obj.get(name), str) or not obj[name].strip():
                raise DataListError(f"{where}: '{name}' is missing or empty (a non-empty string is required)")
        for name in ("prompt_text", "prompt_wav", "wav"):
            if obj.get(name) is not None and not isinstance(obj[name], str):
                raise DataListError(f"{where}: '{name}' must be a string, got {type(obj[name]).__name__}")
        key = obj["key"]
        if key in keys:
            raise DataListError(f"{where}: key {key!r} already used on line {keys[key]}")
        keys[key] = lineno
        prompt_wav = Path(obj["prompt_wav"]).expanduser()
        prompt_wav = prompt_wav if prompt_wav.is_absolute() else base / prompt_wav
        if check_files and not prompt_wav.is_file():
            raise DataListError(f"{where}: prompt_wav {obj['prompt_wav']!r} not found ({prompt_wav})")
        wav = Path(obj.get("wav") or f"{key}.wav").expanduser()
        wav = (wav if wav.is_absolute() else out_dir / wav).resolve()
        if wav in outputs:
            raise DataListError(f"{where}: output {wav} is also the output of line {outputs[wav]}")
        outputs[wav] = lineno
        entries.append(Entry(lineno, key, obj["text"], obj.get("prompt_text") or "", prompt_wav, wav))
    if not entries:
        raise DataListError(f"{path}: no entries")
    return entries


def is_complete(wav: Path) -> bool:
    """A finished output: a readable sound file with at least one frame."""
    import soundfile as sf

    try:
        return wav.is_file() and sf.info(str(wav)).frames > 0
    except (RuntimeError, sf.LibsndfileError, OSError):
        return False


def write_wav_atomic(path: Path, audio: np.ndarray, sample_rate: int) -> None:
    """16-bit PCM WAV via a temporary file in the same folder and a rename."""
    import soundfile as sf

    with atomic_writer(path) as tmp:
        sf.write(str(tmp), np.clip(audio, -1.0, 1.0), sample_rate, subtype="PCM_16", format="WAV")


def shard(entries: Sequence[Entry], index: int, count: int) -> list[Entry]:
    """Entries at positions index, index + count, ... of the list."""
    if not 0 <= index < count:
        raise ValueError(f"shard {index}/{count}: need 0 <= index < count")
    return [e for i, e in enumerate(entries) if i % count == index]


# ---------------------------------------------------------------------------------------------
# Progress and report


@dataclass
class BatchStats:
    total: int = 0
    skipped: int = 0
    done: int = 0
    failed: list[dict] = field(default_factory=list)
    audio_s: float = 0.0
    started: float = 0.0        # time.time() when synthesis started
    finished: float = 0.0
    load_s: float = 0.0
    offline: dict | None = None  # the offline renderer's counters (token2wav_offline.OfflineStats)

    @property
    def finished_entries(self) -> int:
        return self.skipped + self.done + len(self.failed)

    def report(self) -> dict:
        wall = max(0.0, (self.finished or time.time()) - self.started) if self.started else 0.0
        return {"entries": self.total, "skipped": self.skipped, "done": self.done, "failed": len(self.failed),
                "failures": self.failed, "audio_s": self.audio_s, "wall_s": wall, "load_s": self.load_s,
                "rtf": wall / self.audio_s if self.audio_s > 0 else None,
                "x_real_time": self.audio_s / wall if wall > 0 else None,
                "started": self.started, "finished": self.finished, "offline": self.offline}


class ProgressBar:
    """`[batch] ████░░ 40/100 (skipped 10, failed 0)  audio 123 s  x45.1 RT  eta 1m03s` on stderr."""

    def __init__(self, stream=None, enabled: bool = True, width: int = 24):
        self.progress = ProgressLine(stream, enabled, log_every_s=10.0)
        self.width = width

    def line(self, s: BatchStats) -> str:
        n, total = s.finished_entries, max(s.total, 1)
        filled = int(self.width * n / total)
        bar = "█" * filled + "░" * (self.width - filled)
        wall = time.time() - s.started if s.started else 0.0
        speed = f"  x{s.audio_s / wall:.1f} RT" if wall > 0 and s.audio_s > 0 else ""
        todo = s.total - n
        rate = s.done / wall if wall > 0 else 0.0
        eta = f"  eta {_duration(todo / rate)}" if rate > 0 and todo else ""
        return (f"[batch] {bar} {n}/{s.total} (skipped {s.skipped}, failed {len(s.failed)})  "
                f"audio {s.audio_s:.1f} s{speed}{eta}")

    def draw(self, s: BatchStats, force: bool = False) -> None:
        self.progress.show(self.line(s), force)

    def close(self, s: BatchStats) -> None:
        self.progress.end(self.line(s))


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def format_report(r: dict) -> str:
    lines = [f"entries {r['entries']}: {r['done']} synthesized, {r['skipped']} skipped (already done), "
             f"{r['failed']} failed"]
    if r["audio_s"] > 0:
        lines.append(f"audio {r['audio_s']:.1f} s in {r['wall_s']:.1f} s (model load {r['load_s']:.1f} s apart): "
                     f"RTF {r['rtf']:.4f}, {r['x_real_time']:.1f}x real time")
    for f in r["failures"][:20]:
        lines.append(f"  failed: line {f['line']} key {f['key']!r}: {f['error']}")
    if len(r["failures"]) > 20:
        lines.append(f"  ... and {len(r['failures']) - 20} more failures")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# One process


async def synthesize_entry(synth: "Synthesizer", entry: Entry, *, seed: int = 0, tokens: int | None = None,
                           text_frontend: bool = True) -> float:
    """Synthesize one entry (non-streaming) and write its wav; returns its audio seconds."""
    from .frontend.audio import load_audio
    from .request import Mode, SynthesisOptions, SynthesisRequest

    prompt = await asyncio.to_thread(load_audio, entry.prompt_wav)
    mode = Mode.ZERO_SHOT if entry.prompt_text.strip() else Mode.CROSS_LINGUAL
    request = SynthesisRequest(mode, text=entry.text, prompt_text=entry.prompt_text, prompt_audio=prompt,
                               options=SynthesisOptions(stream=False, seed=entry.seed(seed), max_tokens=tokens,
                                                        text_frontend=text_frontend),
                               request_id=f"batch-{entry.line}")
    pieces = []
    async with contextlib.aclosing(synth.synthesize(request)) as chunks:
        async for chunk in chunks:
            pieces.append(chunk.samples)
    audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    if audio.size == 0:
        raise RuntimeError("no audio was produced")
    await asyncio.to_thread(write_wav_atomic, entry.wav, audio, synth.sample_rate)
    return audio.size / synth.sample_rate


async def run_entries(synth: "Synthesizer", entries: Sequence[Entry], *, concurrency: int, seed: int = 0,
                      tokens: int | None = None, text_frontend: bool = True, stats: BatchStats | None = None,
                      on_update: Callable[[BatchStats], None] | None = None) -> BatchStats:
    """Skip the finished entries, synthesize the rest with `concurrency` in flight."""
    stats = stats or BatchStats()
    stats.total = len(entries)
    todo = []
    for e in entries:
        if is_complete(e.wav):
            stats.skipped += 1
        else:
            todo.append(e)
    stats.started = time.time()
    update = on_update or (lambda s: None)
    update(stats)
    queue = iter(todo)

    async def worker():
        for entry in queue:  # shared: each worker takes the next entry
            try:
                seconds = await synthesize_entry(synth, entry, seed=seed, tokens=tokens, text_frontend=text_frontend)
                stats.audio_s += seconds  # not `+= await`: that would read the total before awaiting
                stats.done += 1
            except asyncio.CancelledError:
                raise
            except Exception as e:  # reported per entry; the batch goes on
                log.debug("entry %s failed", entry.key, exc_info=True)
                stats.failed.append({"line": entry.line, "key": entry.key, "error": f"{type(e).__name__}: {e}"})
            update(stats)

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(todo) or 1)))))
    stats.finished = time.time()
    update(stats)
    return stats


async def run_batch(config: "Config", entries: Sequence[Entry], *, concurrency: int | None = None, seed: int = 0,
                    tokens: int | None = None, text_frontend: bool = True,
                    on_update: Callable[[BatchStats], None] | None = None) -> BatchStats:
    """Build a Synthesizer from `config` (only when something is left to do) and run the entries."""
    from .tts import Synthesizer

    stats = BatchStats(total=len(entries))
    if all(is_complete(e.wav) for e in entries):
        stats.skipped = len(entries)
        stats.started = stats.finished = time.time()
        if on_update:
            on_update(stats)
        return stats
    t = time.monotonic()
    synth = await Synthesizer.create(config, warmup=True)
    stats.load_s = time.monotonic() - t
    try:
        stats = await run_entries(synth, entries, concurrency=concurrency or config.engine.max_num_seqs, seed=seed,
                                  tokens=tokens, text_frontend=text_frontend, stats=stats, on_update=on_update)
        offline = getattr(synth.batcher, "offline", None)
        stats.offline = offline.stats.to_json() if offline is not None else None
        return stats
    finally:
        await synth.close()


# ---------------------------------------------------------------------------------------------
# Several devices: one worker process each


def worker_argv(args, device: str, index: int, count: int) -> list[str]:
    """The command line of the worker for `device` (shard index/count)."""
    # the worker is the command line (cosyvoice_cli, above this library) run again: started as a
    # process, never imported from here
    argv = [sys.executable, "-m", "cosyvoice_cli", "batch", "--data-list", str(args.data_list),
            "--out-dir", str(args.out_dir), "--device", device, "--shard", f"{index}/{count}", "--worker",
            "--seed", str(args.seed)]
    for flag, value in (("--config", args.config), ("--model-dir", args.model_dir),
                        ("--speakers-dir", args.speakers_dir), ("--engine", args.engine),
                        ("--concurrency", args.concurrency), ("--tokens", args.tokens),
                        ("--llm-dtype", args.llm_dtype), ("--flow-dtype", args.flow_dtype)):
        if value is not None:
            argv += [flag, str(value)]
    if args.no_text_frontend:
        argv.append("--no-text-frontend")
    if getattr(args, "no_offline", False):
        argv.append("--no-offline")
    return argv


async def run_workers(args, devices: Sequence[str], bar: ProgressBar, total: int | None = None) -> dict:
    """Start one worker per device, merge their progress lines into one bar, and their reports.
    `total`: the entries of all shards (known to the parent before any worker reports)."""
    per_worker: dict[int, dict] = {}
    reports: dict[int, dict] = {}
    started = time.time()

    def combined() -> BatchStats:
        s = BatchStats(started=min((w.get("started") or started for w in per_worker.values()), default=started))
        for w in per_worker.values():
            s.total += w.get("entries", 0)
            s.skipped += w.get("skipped", 0)
            s.done += w.get("done", 0)
            s.audio_s += w.get("audio_s", 0.0)
            s.failed.extend(w.get("failures", []))
        s.total = max(s.total, total or 0)
        return s

    async def one(index: int, device: str) -> int:
        proc = await asyncio.create_subprocess_exec(*worker_argv(args, device, index, len(devices)),
                                                    stdout=asyncio.subprocess.PIPE)
        try:
            async for raw in proc.stdout:
                try:
                    msg = json.loads(raw)
                except json.JSONDecodeError:
                    continue
                per_worker[index] = msg
                if msg.get("event") == "report":
                    reports[index] = msg
                bar.draw(combined())
            return await proc.wait()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            await proc.wait()
            raise

    codes = await asyncio.gather(*(one(i, d) for i, d in enumerate(devices)))
    total = combined()
    bar.close(total)
    starts = [r["started"] for r in reports.values() if r.get("started")]
    ends = [r["finished"] for r in reports.values() if r.get("finished")]
    total.started = min(starts) if starts else started
    total.finished = max(ends) if ends else time.time()
    total.load_s = max((r.get("load_s", 0.0) for r in reports.values()), default=0.0)
    report = total.report()
    report["devices"] = list(devices)
    report["workers"] = [{"device": d, "exit_code": c, **{k: reports.get(i, {}).get(k) for k in
                                                           ("entries", "done", "skipped", "failed", "audio_s",
                                                            "wall_s", "load_s")}}
                         for i, (d, c) in enumerate(zip(devices, codes))]
    missing = [d for i, d in enumerate(devices) if i not in reports]
    if missing:
        report["worker_errors"] = [f"worker on {d} exited without a report (exit code {codes[devices.index(d)]}); "
                                   "see its messages above" for d in missing]
    return report


# ---------------------------------------------------------------------------------------------
# CLI (`async-cosyvoice batch`)


def add_arguments(p) -> None:
    p.add_argument("--data-list", type=Path, required=True, help="jsonl: key, prompt_text, text, prompt_wav, wav")
    p.add_argument("--out-dir", type=Path, required=True, help="folder for the outputs named by `wav`")
    p.add_argument("--devices", help="one worker process per device, e.g. cuda:0,cuda:1 (default: --device)")
    p.add_argument("--concurrency", type=int, help="requests in flight (default: engine.max_num_seqs)")
    p.add_argument("--seed", type=int, default=0, help="base seed; each entry adds a hash of its key")
    p.add_argument("--tokens", type=int, help="force this many speech tokens per text segment (benchmarks)")
    p.add_argument("--no-text-frontend", action="store_true", help="texts are already normalized")
    p.add_argument("--no-offline", action="store_true",
                   help="render through the streaming token2wav batcher, not the offline batches")
    p.add_argument("--llm-dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--flow-dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--report", type=Path, help="also write the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--shard", help=argparse_suppress())
    p.add_argument("--worker", action="store_true", help=argparse_suppress())


def argparse_suppress():
    import argparse
    return argparse.SUPPRESS


def _batch_config(config: "Config", args) -> "Config":
    model = {k: v for k, v in (("llm_dtype", args.llm_dtype), ("flow_dtype", args.flow_dtype)) if v}
    if model:
        config = config.model_copy(update={"model": config.model.model_copy(update=model)})
    if getattr(args, "no_offline", False):
        config = config.model_copy(update={"token2wav": config.token2wav.model_copy(update={"offline": False})})
    return config


def main(args, config_factory: Callable[[object], "Config"]) -> int:
    """`async-cosyvoice batch`."""
    try:
        entries = load_data_list(args.data_list, args.out_dir)
        if args.shard:
            index, count = (int(x) for x in args.shard.split("/"))
            entries = shard(entries, index, count)
    except (DataListError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.concurrency is not None and args.concurrency < 1:
        print("error: --concurrency must be >= 1", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    devices = [d for d in (args.devices or "").split(",") if d.strip()]

    if len(devices) > 1 and not args.worker:
        bar = ProgressBar(enabled=not args.quiet)
        if not args.quiet:
            print(f"[batch] {len(entries)} entries: starting {len(devices)} workers ({', '.join(devices)}), "
                  "each loads the model first", file=sys.stderr)
        report = asyncio.run(run_workers(args, devices, bar, total=len(entries)))
        return _finish(report, args)

    if len(devices) == 1:
        args.device = devices[0]
    config = _batch_config(config_factory(args), args)
    if args.worker:  # progress and report as JSON lines on stdout, for the parent
        last = [0.0]

        def emit(s: BatchStats, event: str = "progress") -> None:
            now = time.monotonic()
            if event == "progress" and now - last[0] < _PROGRESS_EVERY_S and s.finished_entries < s.total:
                return
            last[0] = now
            print(json.dumps({"event": event, **s.report()}), flush=True)

        stats = asyncio.run(run_batch(config, entries, concurrency=args.concurrency, seed=args.seed,
                                      tokens=args.tokens, text_frontend=not args.no_text_frontend, on_update=emit))
        emit(stats, "report")
        return 1 if stats.failed else 0

    bar = ProgressBar(enabled=not args.quiet)
    stats = asyncio.run(run_batch(config, entries, concurrency=args.concurrency, seed=args.seed, tokens=args.tokens,
                                  text_frontend=not args.no_text_frontend, on_update=bar.draw))
    bar.close(stats)
    report = stats.report()
    report["devices"] = [config.model.device]
    return _finish(report, args)


def _finish(report: dict, args) -> int:
    print(format_report(report), file=sys.stderr)
    for message in report.get("worker_errors", []):
        print(f"error: {message}", file=sys.stderr)
    if args.report:
        write_json(report, args.report)
    return 1 if report["failed"] or report.get("worker_errors") else 0

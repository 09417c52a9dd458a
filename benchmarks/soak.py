"""Soak: N mixed requests against a real server; RSS over time, statuses, leaks.

    python benchmarks/soak.py --requests 3000              # starts its own server on 127.0.0.1
    python benchmarks/soak.py --target host:port --metrics http://host:mport/metrics --requests 3000

The plan (seeded, so two runs send the same requests) mixes every synthesis mode, streamed and
not, StreamSynthesize, client cancellations mid-stream, short deadlines, malformed requests and
speaker register / get / synthesize / delete / list. Each kind of request has the statuses it may
end with; anything else is "unexpected". Every --sample-every requests the server's resident
memory (from /proc when the server is ours, else its `process_resident_memory_bytes` metric),
active streams and LM engine requests are printed.

Against --target it registers (replacing) the speakers `soak_zs` and `soak_sft` and registers
and deletes `soak-<n>` ones; use a test instance.

Statuses are counted twice: as each client call ended, and as the server counted its RPCs
(`cosyvoice_requests_total`, the difference over the run); a status the server ended an RPC with
that is not in SERVER_EXPECTED is unexpected even if no client saw it.

Exit status: 0 when there was no crash, no unexpected status, no leaked stream or engine request
after the run, and resident memory after warm-up stayed within the bound (see `rss_verdict`);
1 otherwise. `--json PATH` writes everything measured.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np
import soundfile as sf
import yaml

from grpc_async import SERVICE_NAME, pb2
from grpc_async.client import CosyVoiceClient

MiB = 1 << 20
OK, CANCELLED, DEADLINE = "OK", "CANCELLED", "DEADLINE_EXCEEDED"
PROMPT_TEXT = "This is a synthetic prompt recorded for the soak, nothing more."
TEXTS = ("Hello there.", "How are you today? Fine, thanks.", "The quick brown fox jumps over the lazy dog.",
         "One, two, three.", "It is a lovely day for a walk along the river.")
LONG_TEXT = ("This sentence is long enough to keep the engine busy for a while, and then some more words "
             "follow so that the stream has many chunks before it ends. ") * 2
SYNTH_MODES = ("zero_shot", "cross_lingual", "instruct2", "sft", "zero_shot_by_spk_id",
               "instruct2_by_spk_id", "vc")
SPEAKER_ZS, SPEAKER_SFT = "soak_zs", "soak_sft"
# What the server may end an RPC with (its own view, from its metrics): a client's cancel or
# deadline is CANCELLED / DEADLINE_EXCEEDED there; anything else (INTERNAL, UNKNOWN, UNAVAILABLE)
# counts as unexpected even when the client never saw it (e.g. after it had gone away).
SERVER_EXPECTED = (OK, CANCELLED, DEADLINE, "INVALID_ARGUMENT", "NOT_FOUND")


# ---------------------------------------------------------------------------------------------
# the server under test


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_of(pid: int) -> int:
    """Resident bytes of one process (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class OwnServer:
    """`python -m grpc_async.server` on free 127.0.0.1 ports with a fresh speaker folder."""

    def __init__(self, model_dir: str | None, workdir: Path, limits: dict):
        self.port, self.metrics_port = free_port(), free_port()
        config = {"server": {"host": "127.0.0.1", "port": self.port, "metrics_port": self.metrics_port,
                             "grace_seconds": 5},
                  "speakers": {"dir": str(workdir / "speakers")},
                  "limits": limits}
        if model_dir:
            config["model"] = {"dir": model_dir}
        (workdir / "config.yaml").write_text(yaml.safe_dump(config))
        self.log_path = workdir / "server.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "grpc_async.server", "--config",
                                      str(workdir / "config.yaml")], stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _metrics_page(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def read_metrics(url: str) -> dict[str, float]:
    """The unlabelled samples of a Prometheus text page (name -> value)."""
    out = {}
    for line in _metrics_page(url).splitlines():
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*) (\S+)", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def server_statuses(url: str) -> Counter[tuple[str, str]]:
    """The server's own count of finished RPCs by (method, status): `cosyvoice_requests_total`."""
    out: Counter[tuple[str, str]] = Counter()
    for m in re.finditer(r'^cosyvoice_requests_total\{method="(\w+)",mode="[^"]*",status="(\w+)"\} (\S+)$',
                         _metrics_page(url), re.M):
        out[(m.group(1), m.group(2))] += int(float(m.group(3)))
    return out


# ---------------------------------------------------------------------------------------------
# the request plan


def tone_wav(seconds: float, rate: int, freq: float, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * freq * t) + 0.02 * rng.standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@dataclass(frozen=True)
class Step:
    kind: str                 # what the request exercises (the counts are kept per kind)
    expect: tuple[str, ...]   # statuses it may end with
    args: dict = field(default_factory=dict)


def plan(n: int, seed: int, max_tokens_cap: int | None = None) -> list[Step]:
    """n requests, deterministic for a seed. Weights: ~60% synthesis, the rest misuse and speakers.
    `max_tokens_cap`: every synthesis that would end on its own is forced to 5..cap tokens instead
    (a short, CPU-cheap plan for CI)."""
    rng = random.Random(seed)
    steps: list[Step] = []
    kinds = [("synth", 40), ("stream_synth", 8), ("cancel", 8), ("deadline", 6), ("malformed", 18),
             ("speaker", 6), ("list", 4), ("unknown_speaker", 4), ("vc", 6)]
    names, weights = zip(*kinds)
    for i in range(n):
        kind = rng.choices(names, weights)[0]
        text = rng.choice(TEXTS)
        stream = rng.random() < 0.5
        max_tokens = rng.choice((None, rng.randint(8, 40)))
        if max_tokens_cap is not None:
            max_tokens = rng.randint(5, max_tokens_cap)
        if kind == "synth":
            mode = rng.choice(SYNTH_MODES[:-1])
            steps.append(Step(f"synth:{mode}:{'stream' if stream else 'whole'}", (OK,),
                              dict(mode=mode, text=text, stream=stream, max_tokens=max_tokens, seed=i)))
        elif kind == "vc":
            steps.append(Step("synth:vc", (OK,), dict(mode="vc", text="", stream=stream, seed=i)))
        elif kind == "stream_synth":
            steps.append(Step("stream_synthesize", (OK,), dict(pieces=text.split(" "), seed=i,
                                                               max_tokens=max_tokens if max_tokens_cap else None)))
        elif kind == "cancel":
            steps.append(Step("cancel_mid_stream", (CANCELLED, OK), dict(after=rng.randint(1, 3), seed=i)))
        elif kind == "deadline":
            steps.append(Step("deadline", (DEADLINE, OK), dict(timeout=rng.uniform(0.05, 0.5), seed=i)))
        elif kind == "malformed":
            steps.append(Step("malformed", ("INVALID_ARGUMENT",), dict(which=rng.randrange(len(MALFORMED)))))
        elif kind == "speaker":
            steps.append(Step("speaker_lifecycle", (OK,), dict(speaker_id=f"soak-{i}", seed=i)))
        elif kind == "list":
            steps.append(Step("list_speakers", (OK,)))
        else:
            steps.append(Step("unknown_speaker", ("NOT_FOUND",), dict(speaker_id=f"nobody-{i}")))
    return steps


def _malformed(prompt: bytes) -> list[pb2.SynthesizeRequest | bytes]:
    zs = pb2.ZeroShotBySpeaker(speaker_id=SPEAKER_ZS)
    return [
        pb2.SynthesizeRequest(text="Hi.", zero_shot=pb2.ZeroShot(prompt_text="x", prompt_audio=pb2.AudioData(
            file=b"RIFF....garbage"))),
        pb2.SynthesizeRequest(text="Hi.", cross_lingual=pb2.CrossLingual(prompt_audio=pb2.AudioData(
            pcm=pb2.RawPcm(data=b"\0\0" * 100, encoding=pb2.PCM_ENCODING_S16LE)))),
        pb2.SynthesizeRequest(text="Hi.", cross_lingual=pb2.CrossLingual(prompt_audio=pb2.AudioData(
            pcm=pb2.RawPcm(data=b"\0\0\0", encoding=pb2.PCM_ENCODING_S16LE, sample_rate=16000)))),
        pb2.SynthesizeRequest(text="", zero_shot_by_spk_id=zs),
        pb2.SynthesizeRequest(text="Hello."),
        pb2.SynthesizeRequest(text="Hello.").SerializeToString() + bytes([0x7A, 0x02, 0x08, 0x01]),
        pb2.SynthesizeRequest(text="Hi.", zero_shot_by_spk_id=zs, options=pb2.SynthesisOptions(speed=0.0)),
        pb2.SynthesizeRequest(text="Hi.", zero_shot_by_spk_id=zs,
                              options=pb2.SynthesisOptions(speed=1.5, stream=True)),
        pb2.SynthesizeRequest(text="Hi.", zero_shot_by_spk_id=zs, options=pb2.SynthesisOptions(sample_rate=7)),
        pb2.SynthesizeRequest(text="Hi.", zero_shot_by_spk_id=zs, options=pb2.SynthesisOptions(encoding=99)),
        pb2.SynthesizeRequest(text="Hi.", zero_shot_by_spk_id=zs, request_id="bad id!"),
        pb2.SynthesizeRequest(text="Hi.", sft=pb2.Sft(speaker_id="../etc/passwd")),
        pb2.SynthesizeRequest(text="Hi.", vc=pb2.VoiceConversion(source_audio=pb2.AudioData(file=prompt),
                                                                 prompt_audio=pb2.AudioData(file=prompt))),
        pb2.SynthesizeRequest(text="Hi.", zero_shot=pb2.ZeroShot(prompt_audio=pb2.AudioData(file=prompt))),
        pb2.SynthesizeRequest(text="x" * 5000, zero_shot_by_spk_id=zs),
    ]


MALFORMED = _malformed(b"")  # sized here; rebuilt with the real prompt in Soak


# ---------------------------------------------------------------------------------------------
# running it


@dataclass
class Sample:
    requests: int
    seconds: float
    rss_mib: float
    active_streams: float
    engine_running: float
    engine_waiting: float


class Soak:
    def __init__(self, target: str, metrics_url: str, pid: int | None, concurrency: int, seed: int,
                 prompt_seconds: float = 2.0):
        self.target = target
        self.metrics_url = metrics_url
        self.pid = pid
        self.concurrency = concurrency
        self.seed = seed
        self.prompt = tone_wav(prompt_seconds, 16000, 180.0, seed)
        self.malformed = _malformed(self.prompt)
        self.statuses: Counter[tuple[str, str]] = Counter()
        self.unexpected: list[tuple[str, str, str]] = []
        self.samples: list[Sample] = []
        self.done = 0
        self.t0 = time.perf_counter()

    # -- one request of each kind; each returns the final status name --

    def _voice(self, mode: str, speaker_zs: str = SPEAKER_ZS) -> dict:
        return {
            "zero_shot": dict(prompt_audio=self.prompt, prompt_text=PROMPT_TEXT),
            "cross_lingual": dict(prompt_audio=self.prompt),
            "instruct2": dict(prompt_audio=self.prompt, instruct_text="Speak slowly."),
            "sft": dict(speaker_id=SPEAKER_SFT),
            "zero_shot_by_spk_id": dict(speaker_id=speaker_zs),
            "instruct2_by_spk_id": dict(speaker_id=speaker_zs, instruct_text="Speak slowly."),
            "vc": dict(source_audio=self.prompt, prompt_audio=self.prompt),
        }[mode]

    async def _drain(self, chunks) -> None:
        final = False
        async for chunk in chunks:
            final = chunk.is_final
        if not final:
            raise RuntimeError("the response ended without a final chunk")

    async def run_step(self, c: CosyVoiceClient, step: Step) -> str:
        a = step.args
        if step.kind.startswith("synth:"):
            await self._drain(c.synthesize(a["text"], mode=a["mode"], stream=a["stream"], seed=a["seed"],
                                           max_tokens=a.get("max_tokens"), **self._voice(a["mode"])))
        elif step.kind == "stream_synthesize":
            await self._drain(c.stream_synthesize([p + " " for p in a["pieces"]], speaker_id=SPEAKER_ZS,
                                                  stream=True, seed=a["seed"], max_tokens=a["max_tokens"]))
        elif step.kind == "cancel_mid_stream":
            n = 0
            async for chunk in c.synthesize(LONG_TEXT, speaker_id=SPEAKER_ZS, stream=True, seed=a["seed"]):
                n += 1
                if chunk.is_final:
                    return OK
                if n >= a["after"]:
                    return CANCELLED  # leaving the loop cancels the RPC
        elif step.kind == "deadline":
            await self._drain(c.synthesize(LONG_TEXT, speaker_id=SPEAKER_ZS, stream=True, seed=a["seed"],
                                           timeout=a["timeout"]))
        elif step.kind == "malformed":
            request = self.malformed[a["which"]]
            if isinstance(request, bytes):
                raw = c.channel.unary_stream(f"/{SERVICE_NAME}/Synthesize", request_serializer=lambda b: b,
                                             response_deserializer=pb2.AudioChunk.FromString)
                await self._drain(raw(request))
            else:
                await self._drain(c.synthesize(request=request))
        elif step.kind == "speaker_lifecycle":
            sid = a["speaker_id"]
            await c.register_speaker(sid, PROMPT_TEXT, self.prompt)
            await c.get_speaker(sid)
            await self._drain(c.synthesize("Hi.", speaker_id=sid, seed=a["seed"], max_tokens=10))
            await c.delete_speaker(sid)
        elif step.kind == "list_speakers":
            await c.all_speakers(page_size=2)
        elif step.kind == "unknown_speaker":
            await self._drain(c.synthesize("Hi.", mode="sft", speaker_id=a["speaker_id"]))
        else:
            raise ValueError(step.kind)
        return OK

    async def _one(self, c: CosyVoiceClient, step: Step) -> None:
        try:
            status = await self.run_step(c, step)
            detail = ""
        except grpc.aio.AioRpcError as e:
            status, detail = e.code().name, e.details() or ""
        except RuntimeError as e:  # a response without its final chunk, chunks out of order
            status, detail = "INCOMPLETE", str(e)
        self.statuses[(step.kind, status)] += 1
        if status not in step.expect:
            self.unexpected.append((step.kind, status, detail))
            print(f"UNEXPECTED {step.kind}: {status} {detail!r}", file=sys.stderr, flush=True)

    def sample(self) -> Sample:
        m = read_metrics(self.metrics_url)
        rss = rss_of(self.pid) if self.pid else m.get("process_resident_memory_bytes", float("nan"))
        s = Sample(self.done, time.perf_counter() - self.t0, rss / MiB, m.get("cosyvoice_active_streams", -1),
                   m.get("cosyvoice_engine_running_requests", -1), m.get("cosyvoice_engine_waiting_requests", -1))
        self.samples.append(s)
        return s

    async def setup(self) -> None:
        async with CosyVoiceClient(self.target) as c:
            for sid in (SPEAKER_ZS, SPEAKER_SFT):
                try:
                    await c.delete_speaker(sid)
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.NOT_FOUND:
                        raise
            await c.register_speaker(SPEAKER_ZS, PROMPT_TEXT, self.prompt)
            # sft mode reads only the embedding, which every registered speaker has
            await c.register_speaker(SPEAKER_SFT, PROMPT_TEXT, tone_wav(2.0, 16000, 240.0, self.seed + 1))

    async def run(self, steps: list[Step], sample_every: int) -> None:
        queue: asyncio.Queue[Step] = asyncio.Queue()
        for s in steps:
            queue.put_nowait(s)
        next_sample = [sample_every]

        async def worker():
            async with CosyVoiceClient(self.target) as c:
                while not queue.empty():
                    step = queue.get_nowait()
                    await self._one(c, step)
                    self.done += 1
                    if self.done >= next_sample[0]:
                        next_sample[0] += sample_every
                        s = await asyncio.to_thread(self.sample)
                        print(f"{s.requests:6d} req {s.seconds:7.1f} s  RSS {s.rss_mib:7.1f} MiB  "
                              f"active streams {s.active_streams:.0f}  engine running {s.engine_running:.0f} "
                              f"waiting {s.engine_waiting:.0f}", flush=True)

        await asyncio.gather(*(worker() for _ in range(self.concurrency)))

    def settle(self, timeout: float = 15.0) -> Sample:
        """After the last response: cancelled handlers unwind on the server within moments."""
        end = time.monotonic() + timeout
        while True:
            s = self.sample()
            if (s.active_streams, s.engine_running, s.engine_waiting) == (0, 0, 0) or time.monotonic() > end:
                return s
            time.sleep(0.2)


def rss_verdict(samples: list[Sample], warmup: int, bound_mib: float, slope_bound: float) -> dict:
    """Bounded, not merely plateaued-by-luck: after warm-up (the first `warmup` requests: allocator
    arenas, thread pools, ONNX/torch caches and the speaker cache fill up), the peak may exceed the
    RSS at the end of warm-up by at most `bound_mib`, and the least-squares slope over the
    post-warm-up samples must stay under `slope_bound` KiB per request. A leak of one streamed
    chunk per request (~50 KiB of float32 audio) shows as >= 50 KiB/request."""
    after = [s for s in samples if s.requests > warmup]
    base = [s for s in samples if s.requests <= warmup]
    if not base or len(after) < 3:
        return {"ok": True, "skipped": "too few samples after warm-up to judge"}
    base_rss = base[-1].rss_mib
    peak = max(s.rss_mib for s in after)
    x = np.array([s.requests for s in after], float)
    y = np.array([s.rss_mib for s in after], float)
    slope_kib = float(np.polyfit(x, y, 1)[0] * 1024)
    ok = peak - base_rss <= bound_mib and slope_kib <= slope_bound
    return {"ok": bool(ok), "warmup_rss_mib": base_rss, "peak_after_mib": peak,
            "growth_mib": peak - base_rss, "bound_mib": bound_mib, "slope_kib_per_request": slope_kib,
            "slope_bound_kib": slope_bound, "final_rss_mib": after[-1].rss_mib}


def deadline_views(client: Counter[tuple[str, str]], server: Counter[tuple[str, str]]) -> dict:
    """Synthesis RPCs that ended on a deadline as the client saw them and as the server counted
    them. They agree but for races a client deadline cannot settle: the server finished the
    response just as the client's deadline fired (client DEADLINE_EXCEEDED, server OK)."""
    return {"client": sum(n for (kind, st), n in client.items() if st == DEADLINE),
            "server": sum(n for (method, st), n in server.items()
                          if st == DEADLINE and method in ("Synthesize", "StreamSynthesize"))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-every", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=None, help="requests before RSS is judged (default N/5, "
                    "at most 600)")
    ap.add_argument("--rss-bound-mib", type=float, default=256.0)
    ap.add_argument("--slope-bound-kib", type=float, default=20.0)
    ap.add_argument("--target", help="host:port of a running server (default: start one)")
    ap.add_argument("--metrics", help="its /metrics URL (needed with --target)")
    ap.add_argument("--pid", type=int, help="with --target: read RSS from /proc/PID (else the metric)")
    ap.add_argument("--model-dir", default=os.environ.get("COSYVOICE_TINY_FIXTURE"),
                    help="model for the server we start (default $COSYVOICE_TINY_FIXTURE, else the demo model)")
    ap.add_argument("--max-tokens-cap", type=int, help="force every synthesis to 5..CAP speech tokens "
                    "(a cheap plan, for CI)")
    ap.add_argument("--prompt-seconds", type=float, default=2.0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--keep-log", action="store_true", help="print the server log path instead of deleting it")
    args = ap.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else min(600, args.requests // 5)

    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    server = None
    if args.target:
        if not args.metrics:
            ap.error("--target needs --metrics")
        target, metrics, pid = args.target, args.metrics, args.pid
    else:
        server = OwnServer(args.model_dir, workdir, {"max_concurrent_streams": 64, "max_text_chars": 1000,
                                                     "max_prompt_seconds": 10.0})
        target, metrics, pid = server.target, server.metrics_url, server.proc.pid
    result: dict = {}
    crashed = False
    try:
        t_start = time.perf_counter()
        asyncio.run(_wait_ready(target, server))
        print(f"server ready in {time.perf_counter() - t_start:.1f} s at {target}", flush=True)
        soak = Soak(target, metrics, pid, args.concurrency, args.seed, args.prompt_seconds)
        asyncio.run(soak.setup())
        first = soak.sample()
        server_before = server_statuses(metrics)
        print(f"start: RSS {first.rss_mib:.1f} MiB", flush=True)
        steps = plan(args.requests, args.seed, args.max_tokens_cap)
        asyncio.run(soak.run(steps, args.sample_every))
        last = soak.settle()
        server_side = server_statuses(metrics) - server_before
        server_unexpected = {f"{m} {st}": n for (m, st), n in sorted(server_side.items()) if st not in SERVER_EXPECTED}
        crashed = server is not None and server.proc.poll() is not None
        verdict = rss_verdict(soak.samples, warmup, args.rss_bound_mib, args.slope_bound_kib)
        leaked = {"active_streams": last.active_streams, "engine_running": last.engine_running,
                  "engine_waiting": last.engine_waiting}
        by_status = Counter()
        for (_, status), n in soak.statuses.items():
            by_status[status] += n
        result = {"requests": soak.done, "seconds": time.perf_counter() - soak.t0, "warmup": warmup,
                  "by_status": dict(by_status), "by_kind": {f"{k} {s}": n for (k, s), n in sorted(soak.statuses.items())},
                  "server_by_status": {f"{m} {st}": n for (m, st), n in sorted(server_side.items())},
                  "server_unexpected": server_unexpected, "deadlines": deadline_views(soak.statuses, server_side),
                  "unexpected": soak.unexpected, "leaked": leaked, "crashed": crashed, "rss": verdict,
                  "samples": [asdict(s) for s in soak.samples]}
    except (grpc.aio.AioRpcError, OSError, TimeoutError, ConnectionError) as e:
        crashed = True
        result = {"crashed": True, "error": repr(e)}
        print(f"soak aborted: {e!r}", file=sys.stderr)
    finally:
        if server is not None:
            code = server.stop()
            result["server_exit_code"] = code
            if args.keep_log or crashed:
                print(f"server log: {server.log_path}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if "rss" not in result:
        return 1
    print("\nstatuses:", ", ".join(f"{k} {v}" for k, v in sorted(result["by_status"].items())))
    for k, n in result["by_kind"].items():
        print(f"  {k:45s} {n}")
    print("server-side:", ", ".join(f"{k} {n}" for k, n in result["server_by_status"].items()))
    print(f"deadlines (client vs server): {result['deadlines']}")
    print(f"unexpected: {len(result['unexpected'])} (client), {result['server_unexpected'] or 0} (server); "
          f"crashed: {crashed}; after the run: {result['leaked']}")
    v = result["rss"]
    print("RSS:", json.dumps(v))
    failed = (crashed or result["unexpected"] or result["server_unexpected"] or any(result["leaked"].values()) or not v["ok"]
              or result.get("server_exit_code", 0) not in (0,))
    print("SOAK FAILED" if failed else "SOAK OK")
    return 1 if failed else 0


async def _wait_ready(target: str, server: OwnServer | None, timeout: float = 600.0) -> None:
    async with CosyVoiceClient(target) as c:
        ready = asyncio.ensure_future(c.wait_ready(timeout))
        while not ready.done():
            await asyncio.wait({ready}, timeout=1.0)
            if server is not None and server.proc.poll() is not None:
                ready.cancel()
                raise ConnectionError(f"the server exited with {server.proc.returncode} while loading; "
                                      f"see {server.log_path}")
        ready.result()


if __name__ == "__main__":
    raise SystemExit(main())

"""Peak resident memory of one request, each case in a fresh process (issue 26 items 1 and 2).

    # prompt audio at odd sample rates: the prompt encoder's resampling (16 kHz and 24 kHz)
    python benchmarks/request_memory.py resample --rates 16000 16004 16001 44100 48001 --seconds 10
    # one synthesis of N forced speech tokens on the tiny fixture (CPU), streamed and not
    python benchmarks/request_memory.py synth --model-dir ../shared/fixtures/cosyvoice2-tiny --tokens 500 1500 3000

Each case runs in its own `python -c` child (run this from the repository root: the child imports
the package from there); the numbers are the child's RSS after start-up (imports, model loaded)
and its peak RSS (`ru_maxrss`), so `peak - base` is what the request cost; `bound_mb` is the
request's admission bound (async_cosyvoice/cost.py). The child fixes glibc's mmap threshold at
1 MiB as the server does. `--json PATH` writes the rows.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

MB = 1 << 20

_RSS = textwrap.dedent("""
    import resource, time
    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    def peak_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
""")

_RESAMPLE = _RSS + textwrap.dedent("""
    import numpy as np, torch
    torch.set_num_threads(1)
    from async_cosyvoice.frontend import audio as A
    from async_cosyvoice.request import Audio
    rate, seconds = {rate}, {seconds}
    x = np.random.default_rng(0).uniform(-0.5, 0.5, int(rate * seconds)).astype(np.float32)
    A.resample(np.zeros(1000, np.float32), 44100, 16000)  # import-time work out of the measurement
    base, t0 = rss_mb(), time.perf_counter()
    status = "ok"
    try:
        for target in (16000, 24000):
            A.audio_at_rate(Audio(x, rate), target)
    except Exception as e:
        status = type(e).__name__ + ": " + str(e)[:120]
    print({{"case": "resample", "rate": rate, "seconds": seconds, "base_mb": round(base), "peak_mb": round(peak_mb()),
            "kept_mb": round(rss_mb() - base), "wall_s": round(time.perf_counter() - t0, 2), "status": status}})
""")

_SYNTH = _RSS + textwrap.dedent("""
    import asyncio, torch
    from async_cosyvoice.config import Config
    from async_cosyvoice.heap import fix_mmap_threshold
    fix_mmap_threshold(1 << 20)  # as the server's entry point does (server.heap_mmap_threshold_kib)
    from async_cosyvoice.request import Mode, SynthesisOptions, SynthesisRequest
    from async_cosyvoice.tts import SyncSynthesizer
    config = Config.model_validate({{"model": {{"dir": {model_dir!r}}}, "speakers": {{"dir": {spk_dir!r}}},
                                    "token2wav": {{"adaptive": False}}}})
    synth = SyncSynthesizer(config)
    synth.synth.speakers.import_spk2info({model_dir!r} + "/spk2info.pt", overwrite=True)
    base, t0 = rss_mb(), time.perf_counter()
    status, samples = "ok", 0
    try:
        request = SynthesisRequest(Mode.SFT, text="Hello there.", speaker_id="tiny_sft_spk",
                                   options=SynthesisOptions(stream={stream}, seed=1, max_tokens={tokens}))
        for chunk in synth.synthesize(request):
            samples += len(chunk.samples)
    except Exception as e:
        status = type(e).__name__ + ": " + str(e)[:160]
    try:  # the admission bound (sft: no prompt); absent before issue 26
        from async_cosyvoice.cost import utterance_bytes
        bound = utterance_bytes(synth.synth.dims, 0, {tokens}, torch.float32)
    except ImportError:
        bound = None
    print({{"case": "synth", "tokens": {tokens}, "stream": {stream}, "base_mb": round(base),
            "peak_mb": round(peak_mb()), "bound_mb": None if bound is None else round(bound / 2**20),
            "wall_s": round(time.perf_counter() - t0, 2),
            "audio_s": round(samples / 24000, 2), "status": status}})
    synth.close()
""")


def run_child(code: str, timeout: float) -> dict:
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {timeout:g} s"}
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return eval(line)  # our own child's dict repr
    return {"status": f"child failed (exit {out.returncode}): {out.stderr.strip()[-300:]}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("resample", help="prompt audio at odd rates")
    r.add_argument("--rates", type=int, nargs="+", default=[16000, 16004, 16001, 44100, 48001])
    r.add_argument("--seconds", type=float, default=10.0)
    s = sub.add_parser("synth", help="one request of N forced tokens")
    s.add_argument("--model-dir", required=True)
    s.add_argument("--tokens", type=int, nargs="+", default=[500, 1500, 3000])
    s.add_argument("--stream", choices=["true", "false", "both"], default="both")
    for q in (r, s):
        q.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
        q.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    rows = []
    if args.what == "resample":
        cases = [_RESAMPLE.format(rate=rate, seconds=args.seconds) for rate in args.rates]
    else:
        import tempfile
        spk_dir = tempfile.mkdtemp(prefix="request-memory-spk")
        streams = {"true": [True], "false": [False], "both": [True, False]}[args.stream]
        cases = [_SYNTH.format(model_dir=str(args.model_dir), spk_dir=spk_dir, stream=stream, tokens=n)
                 for n in args.tokens for stream in streams]
    for code in cases:
        row = run_child(code, args.timeout)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

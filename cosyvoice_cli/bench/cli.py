"""`async-cosyvoice bench`: the subcommand's arguments and its main (run, print the table, write
the JSON and the plots)."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .plots import write_plots
from .progress import Progress
from .open_loop import MIN_REQUESTS, CapacityCriteria, format_capacity, format_open_loop
from async_cosyvoice.files import write_json

from ..options import DEFAULT_WAIT_SECONDS
from .report import format_t2w, format_table
from .session import OpenLoopPlan, bench_grpc, bench_in_process
from .workload import DEFAULT_PROMPT_TEXT, DEFAULT_SPEAKER, DEFAULT_TEXT, SpeakerSpec, Workload, requests_per_level

if TYPE_CHECKING:
    from async_cosyvoice.config import Config


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def add_arguments(p) -> None:
    """The `bench` subcommand's own arguments (cli.py adds --config/--model-dir/--device/...)."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="host:port of a running server (gRPC)")
    where.add_argument("--in-process", action="store_true", help="run a Synthesizer in this process")
    p.add_argument("--metrics", metavar="HOST:PORT",
                   help="with --target: the server's Prometheus endpoint (server.metrics_port); each level "
                        "then reports the server's stage busy counters")
    p.add_argument("--token", default=os.environ.get("ASYNC_COSYVOICE_TOKEN"),
                   help="bearer token for --target (env ASYNC_COSYVOICE_TOKEN)")
    p.add_argument("--wait", type=float, default=DEFAULT_WAIT_SECONDS, metavar="SECONDS",
                   help=f"with --target: wait up to this long for the server to report SERVING (default "
                        f"{DEFAULT_WAIT_SECONDS:g})")
    p.add_argument("--concurrency", help="closed-loop levels, e.g. 1,2,4,8,16,32,64 (default 1,2,4,8; none with "
                                        "--open-loop / --capacity unless given)")
    p.add_argument("--requests", default="8",
                   help="requests per level: one number, or one per level (each level gets at least its "
                        "concurrency); default 8")
    p.add_argument("--tokens", type=int, help="force this many speech tokens per request (EOS ignored); "
                                              "in-process only")
    p.add_argument("--text", default=DEFAULT_TEXT, help="text every request speaks")
    p.add_argument("--seed", type=int, default=0, help="request i of a level uses seed + i (default 0)")
    p.add_argument("--first-hop", type=int, help="tokens in the first streamed chunk (in-process)")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests (offline throughput)")
    p.add_argument("--speaker", default=DEFAULT_SPEAKER, help=f"speaker id (default {DEFAULT_SPEAKER})")
    p.add_argument("--no-register", action="store_true",
                   help="use the speaker as already registered instead of registering it first")
    p.add_argument("--prompt-wav", type=Path, help="register the speaker from this file (default: a generated "
                                                    "speech-like prompt)")
    p.add_argument("--prompt-text", default=DEFAULT_PROMPT_TEXT, help="transcript of the prompt")
    p.add_argument("--prompt-seconds", type=float, default=6.0,
                   help="length of the generated prompt (default 6 s = 150 prompt tokens)")
    p.add_argument("--llm-dtype", choices=["float32", "bfloat16", "float16"], help="in-process LLM dtype")
    p.add_argument("--flow-dtype", choices=["float32", "bfloat16", "float16"], help="in-process flow dtype")
    p.add_argument("--t2w-compare", type=int, metavar="C",
                   help="also run token2wav alone at C streams, batched vs one at a time (in-process)")
    p.add_argument("--t2w-tokens", type=int, help="tokens per stream for --t2w-compare (default --tokens or 250)")
    p.add_argument("--open-loop", action="store_true", help="open-loop levels: Poisson arrivals at each --rate")
    p.add_argument("--capacity", action="store_true",
                   help="search the largest arrival rate meeting --p99-ms and --clean-pct (starts at --rate)")
    p.add_argument("--rate", default="0.5", help="arrivals per second: a comma list for --open-loop, the start "
                                                  "of --capacity (default 0.5)")
    p.add_argument("--duration", type=float, default=30.0,
                   help="seconds of arrivals per open-loop level or capacity trial, at least (default 30)")
    p.add_argument("--min-requests", type=non_negative_int, default=MIN_REQUESTS, metavar="N",
                   help="requests per open-loop level or capacity trial, at least: a level lasts max(--duration, "
                        f"N / rate) s of arrivals, on to the N-th arrival if fewer came (default {MIN_REQUESTS}; "
                        "a p99 over fewer is the maximum of a handful)")
    p.add_argument("--max-rate", type=float, help="--capacity: never try above this rate")
    p.add_argument("--p99-ms", type=float, default=300.0, help="--capacity: p99 first chunk limit (default 300)")
    p.add_argument("--clean-pct", type=float, default=99.0,
                   help="--capacity: percent of requests that must play without an underrun (default 99)")
    p.add_argument("--max-level-seconds", type=float, help="stop sending new requests of a level after this long")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up round")
    p.add_argument("--out", type=Path, help="results JSON (plots are written next to it)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-detail", action="store_true", help="leave per-request records out of the JSON")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _bench_config(config: "Config", args, scratch: Path) -> "Config":
    updates = {}
    model = {k: v for k, v in (("llm_dtype", args.llm_dtype), ("flow_dtype", args.flow_dtype)) if v}
    if model:
        updates["model"] = config.model.model_copy(update=model)
    if not args.speakers_dir and not args.no_register:  # keep the bench speaker out of the user's store
        updates["speakers"] = config.speakers.model_copy(update={"dir": scratch})
    return config.model_copy(update=updates)


def main(args, config_factory: Callable[[object], "Config"]) -> int:
    """`async-cosyvoice bench`: run, print the table, write JSON and plots."""
    try:
        open_loop = open_loop_plan(args)
        levels = parse_int_list(args.concurrency or "1,2,4,8") if args.concurrency or not open_loop else []
        requests = parse_int_list(args.requests)
        requests = requests[0] if len(requests) == 1 else requests
        requests_per_level(levels, requests)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.target and (args.t2w_compare or args.first_hop or args.llm_dtype or args.flow_dtype):
        print("error: --t2w-compare, --first-hop, --llm-dtype and --flow-dtype need --in-process", file=sys.stderr)
        return 2
    workload = Workload(text=args.text, speaker_id=args.speaker, tokens=args.tokens, stream=not args.no_stream,
                        seed=args.seed, first_hop=args.first_hop)
    speaker = SpeakerSpec(args.speaker, register=not args.no_register, prompt_wav=args.prompt_wav,
                          prompt_text=args.prompt_text, prompt_seconds=args.prompt_seconds, seed=args.seed)
    progress = Progress(enabled=not args.quiet)
    common = dict(speaker=speaker, warmup=not args.no_warmup, max_level_seconds=args.max_level_seconds,
                  progress=progress, detail=not args.no_detail, open_loop=open_loop)
    try:
        if args.in_process:
            with tempfile.TemporaryDirectory(prefix="async-cosyvoice-bench-spk-") as scratch:
                config = _bench_config(config_factory(args), args, Path(scratch))
                results = asyncio.run(bench_in_process(config, workload, levels, requests,
                                                       t2w_compare=args.t2w_compare, t2w_tokens=args.t2w_tokens,
                                                       **common))
        else:
            results = asyncio.run(bench_grpc(args.target, workload, levels, requests, token=args.token,
                                             metrics_url=args.metrics, wait_s=args.wait, **common))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if results["levels"]:
        print(format_table(results["levels"]))
    if results.get("open_loop"):
        print(format_open_loop(results["open_loop"]))
    if "capacity" in results:
        print(format_open_loop(results["capacity"]["trials"]))
        print(format_capacity(results["capacity"]))
    if "t2w_compare" in results:
        print(format_t2w(results["t2w_compare"]))
    if args.out:
        write_json(results, args.out)
        print(f"wrote {args.out}", file=sys.stderr)
        if not args.no_plots:
            for p in write_plots(results, args.out.parent, prefix=f"{args.out.stem}-"):
                print(f"wrote {p}", file=sys.stderr)
    return 1 if any(lv["errors"] for lv in results["levels"] + results.get("open_loop", [])) else 0


def parse_float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ValueError(f"expected positive numbers, got {text!r}")
    return values


def open_loop_plan(args) -> OpenLoopPlan | None:
    if not (args.open_loop or args.capacity):
        return None
    rates = parse_float_list(args.rate)
    if args.capacity and len(rates) > 1 and not args.open_loop:
        raise ValueError("--capacity takes one start --rate")
    if not 0 < args.clean_pct <= 100 or not args.p99_ms > 0:
        raise ValueError("--clean-pct must be in (0, 100] and --p99-ms > 0")
    return OpenLoopPlan(rates=tuple(rates) if args.open_loop else (), duration_s=args.duration,
                        min_requests=args.min_requests, capacity=args.capacity, start_rate=rates[0],
                        max_rate=args.max_rate if args.max_rate else float("inf"),
                        criteria=CapacityCriteria(args.p99_ms / 1e3, args.clean_pct / 100))

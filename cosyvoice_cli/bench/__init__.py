"""Benchmark client: a closed-loop concurrency sweep of streaming synthesis, in-process or over gRPC.

    async-cosyvoice bench --in-process --concurrency 1,2,4,8 --requests 8 --tokens 250 --out r.json
    async-cosyvoice bench --target 127.0.0.1:50051 --concurrency 1,4,16 --requests 32 --out r.json
    async-cosyvoice bench --in-process --t2w-compare 32 --tokens 250 --out r.json
    async-cosyvoice bench --target 127.0.0.1:50051 --open-loop --rate 0.5,1,2 --duration 60 --tokens 250
    async-cosyvoice bench --target 127.0.0.1:50051 --capacity --rate 1 --duration 60 --tokens 250

Workload. Every request speaks the same text with a registered speaker (by default "bench",
registered first from a generated 6 s prompt wav, or from `--prompt-wav`), streaming, with seed
`--seed + i` for the i-th request of a level (so every level runs the same requests) and, with
`--tokens N`, exactly N speech tokens (EOS ignored until then): random-weight models give
reproducible workloads, N x 40 ms of audio per request.

Closed loop. At concurrency C, C workers each send a request, wait for its last chunk and send
the next, until the level's requests (at least C) are done; `--max-level-seconds` stops sending
new ones after that long.

Open loop (`--open-loop --rate R[,R2...] --duration D`): requests arrive as a Poisson process at R
per second, however many are in flight (what users do), for max(D, N / R) seconds with N =
`--min-requests` (40), on to the N-th arrival if fewer came: a p99 over fewer requests is their
maximum. The level reports what the closed loop reports plus its seconds of arrivals, requests in
flight (mean, max) and the fraction of requests that played without an underrun. `--capacity`
searches for the largest rate (starting at the first `--rate`, doubling, then bisecting; every
trial such a level) at which p99 first chunk <= `--p99-ms` (300) and >= `--clean-pct` (99) % of the
requests play without an underrun, and reports it with the streams in flight there and the
requests of the deciding trials. The closed-loop sweep runs too when `--concurrency` is given
(always without --open-loop/--capacity).

Per request (times from sending the request):
- first chunk: until the first chunk with audio arrives;
- second chunk: between the first and the second chunk's arrival (the Triton client's metric);
- total: until the last chunk arrives;
- underruns: playback starts when the first chunk arrives and plays without pausing, so chunk
  k is due at first_arrival + (audio seconds in chunks 0..k-1); a chunk that arrives after
  its due time is an underrun. `stall_s` is the silence a listener hears, with a player that
  pauses while it has nothing to play: the largest lateness of any chunk;
- audio seconds and RTF (total / audio seconds).
Per level: avg/std/min/p50/p90/p95/p99/max of each latency and of the per-request RTF; the
aggregate RTF (level wall time / audio seconds of all requests), audio seconds per second, and
the underrun totals. Also where the device time went (`stages`): busy seconds, calls and items of
the LLM engine's steps and of the token2wav batches, from the counters those stages keep
themselves, read in-process or, with `--metrics HOST:PORT`, from the server's Prometheus endpoint.

`--t2w-compare C` (in-process only): the token2wav stage alone on fixed random token lists,
C streams at once on the streaming chunk schedule, no LLM: once through a batching
`Token2WavBatcher` and once one job at a time (`batching=False`), in the same run; reports both
throughputs (audio seconds per second) and their ratio.

Output: a JSON file (`--out`), PNG plots next to it (latency and throughput vs concurrency,
matplotlib with the Agg backend, skipped with a message when matplotlib is missing), a table on
stdout and a progress line on stderr.

Over gRPC, `--tokens` travels as `SynthesisOptions.max_tokens` (the server caps it with
`limits.max_forced_tokens`).
"""

from .cli import add_arguments, main, non_negative_int, parse_int_list
from .metrics import PERCENTILES, RequestResult, summarize, summarize_level, underruns
from .plots import write_plots
from .progress import Progress
from async_cosyvoice.files import write_json

from .report import environment, format_stages, format_t2w, format_table
from .open_loop import MIN_REQUESTS, Arrivals, CapacityCriteria, arrival_window, capacity_search, format_capacity
from .open_loop import format_open_loop, plan_arrivals, poisson_arrivals, run_arrivals, run_open_loop
from .graphs import GraphCounts, format_settle, parse_graph_counts, settle_graphs
from .runner import run_level, run_request, run_sweep, warm_up
from .session import OpenLoopPlan, bench_grpc, bench_in_process
from .stages import PrometheusStages, StageCounters, SynthesizerStages, parse_prometheus, stage_delta
from .t2w_compare import token2wav_compare
from .targets import GrpcTarget, InProcessTarget, Target, register_grpc, register_in_process
from .workload import DEFAULT_PROMPT_TEXT, DEFAULT_SPEAKER, DEFAULT_TEXT, SECONDS_PER_TOKEN, SpeakerSpec, Workload
from .workload import requests_per_level, synthetic_prompt

__all__ = [
    "CapacityCriteria", "OpenLoopPlan", "capacity_search", "format_capacity", "format_open_loop",
    "GraphCounts", "format_settle", "parse_graph_counts", "settle_graphs",
    "MIN_REQUESTS", "Arrivals", "arrival_window", "plan_arrivals", "poisson_arrivals", "run_arrivals",
    "run_open_loop", "non_negative_int",
    "DEFAULT_PROMPT_TEXT", "DEFAULT_SPEAKER", "DEFAULT_TEXT", "PERCENTILES", "SECONDS_PER_TOKEN",
    "GrpcTarget", "InProcessTarget", "Progress", "PrometheusStages", "RequestResult", "SpeakerSpec", "StageCounters",
    "SynthesizerStages", "Target", "Workload",
    "add_arguments", "bench_grpc", "bench_in_process", "environment", "format_t2w", "format_table", "main",
    "parse_int_list", "parse_prometheus", "register_grpc", "register_in_process", "requests_per_level", "run_level", "run_request",
    "run_sweep", "summarize", "stage_delta", "summarize_level", "synthetic_prompt", "token2wav_compare",
    "underruns", "warm_up", "write_json", "write_plots", "format_stages",
]

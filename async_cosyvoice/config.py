"""Service configuration: pydantic models loaded from YAML plus environment overrides.

Environment overrides use `ASYNC_COSYVOICE__<SECTION>__<FIELD>` (double underscores), e.g.
`ASYNC_COSYVOICE__SERVER__PORT=50052`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .files import data_root

ENV_PREFIX = "ASYNC_COSYVOICE__"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Section):
    dir: Path | None = None  # None: the generated tiny random-weight demo model
    device: str = "cpu"
    llm_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    flow_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # several devices in one server (async_cosyvoice.placement); empty: just `device`; "all": every
    # visible CUDA device. A device may repeat (two workers on one device; tests use [cpu, cpu]).
    devices: list[str] | Literal["all"] = []
    # workers: a process per device (LLM + token2wav each) behind the server's front process;
    # disaggregated: the LLM on the first device, token2wav on the others; replicas: a Synthesizer
    # per device in the server's process (one GIL: they do not add up)
    placement: Literal["workers", "disaggregated", "replicas"] = "workers"

    @model_validator(mode="after")
    def _disaggregated_needs_two(self) -> "ModelConfig":
        if self.placement == "disaggregated" and self.devices != "all" and len(self.devices) < 2:
            raise ValueError("model.placement disaggregated needs model.devices with at least two entries "
                             "(the LLM on the first, token2wav on the others)")
        return self


class WorkersConfig(_Section):
    """The device worker processes of `model.placement: workers` (async_cosyvoice/worker_pool.py)."""
    start_timeout_s: float = Field(900.0, gt=0)   # loading + warm-up of one worker
    restart_backoff_s: float = Field(1.0, gt=0)   # the first restart's delay; doubled after each failed start
    restart_backoff_max_s: float = Field(60.0, gt=0)
    # a worker that fails to start this many times in a row is given up (degraded for good; when every
    # worker is given up the server goes NOT_SERVING and exits with code 3)
    max_failed_starts: int = Field(5, ge=1)


class EngineConfig(_Section):
    """LLM engine. `vllm_*` fields map onto vLLM's AsyncEngineArgs (the peer's ENGINE_ARGS)."""
    kind: Literal["native", "vllm"] = "native"
    max_num_seqs: int = Field(64, ge=1)
    max_model_len: int = Field(4096, ge=64)
    max_num_batched_tokens: int = Field(4096, ge=64)
    cuda_graphs: bool = True
    compile: bool = False  # native engine: torch.compile the decode step (CUDA; slower start, faster steps)
    # native engine, CUDA: a new request's prompt (up to 512 positions), when its step prefills it alone, as a
    # CUDA graph per width bucket (64, 128, 256, 512) instead of a forward launched kernel by kernel from Python
    prefill_graphs: bool = False
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    enforce_eager: bool = True
    cpu_kvcache_space_gib: int = Field(1, ge=1)


class SamplingConfig(_Section):
    """Defaults for RAS; None means: take the model yaml's value."""
    top_p: float | None = None
    top_k: int | None = None
    win_size: int | None = None
    tau_r: float | None = None


class Token2WavConfig(_Section):
    first_hop: int = Field(15, ge=1)  # speech tokens in the first streamed chunk
    max_hop_multiple: int = Field(4, ge=1)
    adaptive: bool = True  # later hops follow the listener's buffer (token2wav.adaptive_hop); False: doubling
    estimator: Literal["torch", "compiled", "onnxruntime", "tensorrt"] = "torch"
    batching: bool = True
    max_batch: int = Field(32, ge=1)
    # at most this many flow positions (prompt + tokens, summed over a batch's jobs) per streaming batch,
    # so a long render is split into batches that new first chunks can run between; None: no bound
    max_batch_tokens: int | None = Field(None, ge=1)
    # while the capture thread captures a CUDA graph beside the batches, Python's thread switch interval is
    # at most this (Python's own: 5 ms), so the LLM step thread waits less for the GIL (switch_interval.py);
    # None: leave it
    capture_switch_interval_ms: float | None = Field(0.5, gt=0)
    # jobs of one batch run the flow together when their lengths are within this ratio (padding <= 1 - 1/ratio)
    length_bucket_ratio: float = Field(1.5, ge=1)
    estimator_cache_dir: Path | None = None  # ONNX exports / TensorRT plans; None: ~/.cache/async_cosyvoice
    estimator_max_frames: int = Field(3000, ge=4)  # TensorRT profile max (prompt + target mel frames)
    estimator_opt_frames: int = Field(500, ge=4)
    estimator_chunked_graph: bool = True  # onnxruntime / tensorrt: a chunked-attention graph for streaming chunks
    # estimator compiled: torch.compile its repeated blocks (transformer / resnet blocks), not the whole module:
    # Dynamo traces each block class once (H100: compile 35 s cold / 8 s warm against 154 / 63 s, graphs 10 %
    # faster; docs/performance.md). Unused by the other estimators, so a GPU config that sets it can still
    # switch its estimator (e.g. to torch on a CPU) without touching it
    compile_regions: bool = False
    # the recomputing flow estimator's attention (estimator torch or compiled; CosyVoice2's decoder):
    # sdpa, an additive T x T bias per call read by every head; flex, torch's flex_attention over a block mask
    # made once per call, skipping fully masked blocks (models/flow/attention.py; fused only when compiled:
    # estimator compiled). The flow cache's cached calls and the onnxruntime / tensorrt graphs keep sdpa
    flow_attention: Literal["sdpa", "flex"] = "sdpa"
    # the exact flow state cache (token2wav/flow_cache.py): streaming chunks compute only the frames after the
    # stream's cached prefix (or its registered speaker's prompt prefix), on the flow's PyTorch module
    flow_cache: bool = True
    flow_cache_speaker_bytes: int = Field(2 << 30, ge=0)  # device memory for speakers' prompt prefixes (LRU)
    flow_cache_max_tokens: int | None = Field(None, ge=0)  # per stream: no state cached past this many tokens
    # the cache's state in a pool of this many stream slots at fixed addresses (token2wav/state_pool.py), each
    # holding up to flow_cache_slot_tokens prompt + target tokens; speakers' prefixes take slots of
    # flow_cache_speaker_bytes. Cached calls are then one CUDA graph per (streams, new tokens, key tokens) bucket
    # on CUDA (flow_cache_graphs). A stream finding no free slot, or outgrowing its slot, recomputes (exact).
    # None: the state is kept per stream (any length, no graphs). "auto": as many slots as fit
    # flow_cache_memory_fraction of the device memory free at start (a count that does not fit fails start).
    flow_cache_slots: Annotated[int, Field(ge=1)] | Literal["auto"] | None = None
    flow_cache_slot_tokens: int = Field(400, ge=1)
    flow_cache_memory_fraction: float = Field(0.6, gt=0, le=1)
    # a cached call attends over its streams' filled tokens rounded up to this step (null: the slots' capacity)
    flow_cache_key_tokens: int | None = Field(64, ge=1)
    flow_cache_graphs: bool = True
    # with estimator: compiled, also torch.compile the cached calls, by regions: each repeated block class of the
    # flow one program, the glue eager (token2wav/slot_regions.py; false: eager, still graphed)
    flow_cache_compile: bool = True
    # the final chunk also from the cache, with chunked attention: NOT exact (upstream's final uses full attention)
    flow_cache_chunked_final: bool = False
    # non-streaming utterances: rendered together in length-sorted, padded batches (docs/offline.md)
    offline: bool = True
    offline_max_batch: int = Field(64, ge=1)  # utterances per flow / HiFT call
    offline_max_frames: int = Field(65536, ge=1)  # padded mel frames per call (items x longest prompt + target)
    offline_wait_ms: float = Field(10.0, ge=0)  # the oldest waits this long for others before a batch is taken
    offline_segments_ahead: int = Field(8, ge=1)  # a non-streaming request's text segments running at once
    # the recomputing flow calls (flow_cache off; final and non-streaming calls) as one CUDA graph per
    # (streams, tokens) bucket of at most flow_graph_max_tokens streams x tokens (token2wav/flow_graphs.py); CUDA
    # devices, estimator torch or compiled (inside the graph: the compiled module without its own graphs)
    flow_graphs: bool = False
    flow_graph_max_tokens: int = Field(8192, ge=1)
    # HiFT's calls (streaming chunks of many streams, padded; offline groups that fit) as one CUDA
    # graph per (streams, mel frames) bucket of at most hift_graph_max_frames streams x frames
    # (token2wav/hift_graphs.py); CUDA devices
    hift_graphs: bool = False
    hift_graph_max_frames: int = Field(8192, ge=1)
    # flow + HiFT in a child process per device (token2wav/process.py): out of the server's GIL
    process: bool = False

    @model_validator(mode="after")
    def _graphs_need_a_torch_estimator(self) -> "Token2WavConfig":
        if self.flow_graphs and self.estimator not in ("torch", "compiled"):
            raise ValueError(f"token2wav.flow_graphs needs estimator torch or compiled (a {self.estimator} session "
                             "cannot run inside a CUDA graph); set flow_graphs: false")
        return self


class SpeakerConfig(_Section):
    backend: Literal["directory", "redis"] = "directory"  # redis: shared by every replica
    # default: the data folder's speakers/ (files.data_root: $ASYNC_COSYVOICE_DATA, $XDG_DATA_HOME/async_cosyvoice
    # or ~/.local/share/async_cosyvoice), never the current directory; a relative path given here is taken as is
    dir: Path = Field(default_factory=lambda: data_root() / "speakers")
    cache_size: int = Field(256, ge=1)
    redis_url: str | None = None  # e.g. redis://127.0.0.1:6379/0 (backend redis)
    redis_prefix: str = Field("async_cosyvoice:speakers", min_length=1)
    redis_timeout_seconds: float = Field(5.0, gt=0)  # connect and reply; past it a call is UNAVAILABLE
    # Redis' persistence at start (CONFIG GET): warn = log how acknowledged registrations could be
    # lost; require = refuse to start unless appendonly yes + appendfsync always
    redis_durability: Literal["warn", "require"] = "warn"

    @field_validator("dir")
    @classmethod
    def _expand_home(cls, path: Path) -> Path:
        return path.expanduser()

    @model_validator(mode="after")
    def _redis_needs_url(self) -> "SpeakerConfig":
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("speakers.backend redis needs speakers.redis_url (e.g. redis://127.0.0.1:6379/0)")
        return self


class LimitsConfig(_Section):
    """What one request may ask for and how long a front door waits for it (docs/robustness.md)."""
    max_concurrent_streams: int = Field(64, ge=1)
    max_text_chars: int = Field(4000, ge=1)  # a text (Synthesize, HTTP input), a prompt text, one streamed piece
    max_stream_text_chars: int = Field(20000, ge=1)  # all the pieces of one text stream together
    max_prompt_seconds: float = Field(30.0, gt=0)
    max_forced_tokens: int = Field(3000, ge=1)  # SynthesisOptions.max_tokens (benchmarks)
    # the admission bound of a request (async_cosyvoice/cost.py): over max_request_bytes it is refused
    # (RESOURCE_EXHAUSTED / 413); the bounds of running requests share memory_budget_bytes (None: no
    # budget), a request that does not fit waits up to admission_wait_seconds, then is shed (429).
    # max_request_bytes None: the token2wav device's memory (CUDA), or the host's RAM
    max_request_bytes: int | None = Field(None, ge=1)
    memory_budget_bytes: int | None = Field(None, ge=1)
    admission_wait_seconds: float = Field(10.0, ge=0)
    max_message_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    max_source_seconds: float = Field(120.0, gt=0)  # vc source audio
    text_idle_seconds: float = Field(30.0, gt=0)  # a text stream that sends nothing for this long is ended
    # StreamSynthesize and the WebSocket must send their config, an HTTP connection its request's
    # head (request line and headers), within this; else DEADLINE_EXCEEDED / close 4408 / the socket closed
    first_message_seconds: float = Field(10.0, gt=0)
    body_read_seconds: float = Field(60.0, gt=0)  # an HTTP request body must arrive in full within this (408)
    idle_connection_seconds: float = Field(60.0, gt=0)  # a connection with no call in progress is closed after this


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int | None = Field(50051, ge=0, le=65535)  # gRPC; None = off (HTTP only)
    metrics_port: int | None = Field(None, ge=0, le=65535)
    auth_token: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # set: clients must present a certificate signed by it (mTLS)
    grace_seconds: float = 10.0
    # malloc_trim at the end of a stream when the last one is this old (async_cosyvoice.heap); 0 = never
    heap_trim_seconds: float = Field(10.0, ge=0)
    # allocations of this size or more get their own mmap, freed at once (async_cosyvoice.heap,
    # set by the server's entry point `run`); 0 = glibc's default (a threshold that rises)
    heap_mmap_threshold_kib: int = Field(1024, ge=0, le=32 * 1024)
    # HTTP front door (http_api: OpenAI /v1/audio/speech, WebSocket, web page); None = off
    http_port: int | None = Field(None, ge=0, le=65535)
    # GET /v1/models and GetServerInfo; None: the model directory's kind (cosyvoice2 / cosyvoice3).
    # OpenAI's tts-1 etc. are accepted too
    served_model_name: str | None = None
    voice_aliases: dict[str, str] = {}  # e.g. {"alloy": "my_speaker"}: OpenAI voice names -> speaker ids
    # the HTTP door's own certificate; unset: tls_cert / tls_key (with TLS configured both doors use it)
    http_tls_cert: Path | None = None
    http_tls_key: Path | None = None
    http_docs: bool = True  # /docs and /openapi.json (behind auth_token when one is set); false: 404


class WarmupConfig(_Section):
    """What runs before health turns SERVING (async_cosyvoice/warmup.py)."""
    # capture the fixed graph set (warmup.capture_plan) before SERVING; None: where shapes are captured (CUDA)
    coverage: bool | None = None
    # the set, from these alone (never from which speakers exist): at 1 stream every flow bucket of a prompt
    # of <= capture_prompt_tokens plus <= capture_speech_tokens (25 tokens a second: 10 s + 10 s) and HiFT's
    # chunks; at 2, 4, ... up to capture_streams streams the first chunks of such prompts and HiFT's chunks.
    # Other buckets run without a graph until the token2wav stage's capture thread has captured them, one at a
    # time beside the batches (0.2-2 s each: never on a request's path; graph_buckets.py)
    capture_streams: int = Field(1, ge=1)
    # and at 2, 4, ... up to cover_streams streams, buckets of the longest call (and half of it), first in line
    # for the capture thread after SERVING: until a call's own bucket is captured, it runs in the smallest such
    # graph that covers it at little extra work (graph_buckets.GraphBuckets.cover) rather than without a graph
    cover_streams: int = Field(8, ge=1)
    capture_prompt_tokens: int = Field(250, ge=1)
    capture_speech_tokens: int = Field(250, ge=1)
    # covering: before SERVING only the shortest and the longest of the set's first-chunk buckets (2 of the 16 flow
    # graphs at 1 stream, 2 of HiFT's 9): the longest runs, padded, every first chunk whose own graph is not captured
    # yet (graph_buckets.GraphBuckets.cover); first_chunks: every first-chunk bucket (9 flow graphs; CosyVoice3's
    # causal HiFT: a first chunk's); either way the rest by the capture thread after SERVING, beside the first
    # requests; all: the whole set, and what the warm-up's requests met, before SERVING
    capture_before_serving: Literal["covering", "first_chunks", "all"] = "covering"
    # (flow cache) the most recent speakers whose flow prompt prefixes are computed at start-up (as many as
    # flow_cache_speaker_bytes holds)
    max_speakers: int = Field(8, ge=0)
    compile_cache_dir: Path | None = None  # torch.compile's caches; None: <cache root>/torch-compile
    # torch.compile's portable cache artifacts (compile_cache.py): loaded before anything compiles, saved
    # after the warm-up, keyed by torch/CUDA/GPU/model/dtypes/graph config; a file for another key is ignored
    persistent_compile_cache: bool = True
    # also keep Dynamo's traced frames (torch's experimental caching_precompile): a hit skips Dynamo's tracing,
    # but in torch 2.13 the first new trace after such a load fails ("Name '__builtins_dict___2' already
    # exists in scope"; docs/performance.md): keep it off
    precompile: bool = False


class Config(_Section):
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    sampling: SamplingConfig = SamplingConfig()
    token2wav: Token2WavConfig = Token2WavConfig()
    speakers: SpeakerConfig = Field(default_factory=SpeakerConfig)  # per Config: its dir reads the environment then
    limits: LimitsConfig = LimitsConfig()
    server: ServerConfig = ServerConfig()
    warmup: WarmupConfig = WarmupConfig()
    workers: WorkersConfig = WorkersConfig()

    @classmethod
    def load(cls, path: str | Path | None = None, env: dict[str, str] | None = None) -> "Config":
        data: dict = {}
        if path is not None:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
            if not isinstance(data, dict):
                raise ValueError(f"{path}: expected a mapping of sections at top level")
        for key, value in (os.environ if env is None else env).items():
            if not key.startswith(ENV_PREFIX):
                continue
            parts = key[len(ENV_PREFIX):].lower().split("__")
            if len(parts) != 2:
                raise ValueError(f"{key}: expected {ENV_PREFIX}<SECTION>__<FIELD>")
            data.setdefault(parts[0], {})[parts[1]] = yaml.safe_load(value)
        return cls.model_validate(data)

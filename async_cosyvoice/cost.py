"""The admission bound: the most memory one request can take, known before it runs.

An utterance (one text segment) of P prompt tokens and at most N speech tokens holds on the
token2wav device (the host too, on CPU):

- its exact flow state, `state_nbytes(P + N)` (token2wav/flow_cache.py), while the flow cache keeps
  it per stream (capped by token2wav.flow_cache_max_tokens; in the slot pool, flow_cache_slots, the
  state lives in memory allocated at start);
- its final, full-attention flow call over F = 2 (P + N) mel frames: activations linear in F, the
  estimator's (2, 1, F, F) additive attention bias, bool mask and the attention's float scores
  (9 bytes per frame pair: the one quadratic term left; measured 3000 tokens on the tiny model on
  CPU: 1002 MiB for the whole request, this bound 1216 MiB), and the encoder's position scores,
  computed in query blocks of ATTENTION_BLOCK_ELEMENTS (models/flow/encoder.py);
  CosyVoice3's DiT flow (no conformer encoder) has the (2, heads, F, F) float scores of its
  attention instead (`flow_call_bytes`; not measured yet);
- its audio, N x samples per token of float32, twice (HiFT's output and the chunks).

Plus, on the host, the prompt audio decoded and resampled to 16 and 24 kHz. N is `max_tokens` when
forced, else upstream's length rule (max_token_text_ratio x the segment's text tokens), and never more
than the engine's max_model_len. A streamed request renders one utterance at a time: its bound is the
largest one; a non-streamed request renders up to offline_segments_ahead segments at once: the sum of
that many largest. The bound is checked against limits.max_request_bytes and reserved in
limits.memory_budget_bytes (limiter.MemoryBudget) while the request runs.
"""
from __future__ import annotations

import os

import torch

from .models.dims import DiTFlowDims, FlowDims, ModelDims
from .models.flow.encoder import ATTENTION_BLOCK_ELEMENTS
from .request import Audio
from .token2wav.flow_cache import state_nbytes

FLOAT = 4


def utterance_bytes(dims: ModelDims, prompt_tokens: int, speech_tokens: int, flow_dtype: torch.dtype,
                    flow_cache: bool = True, flow_cache_max_tokens: int | None = None) -> int:
    """The most one utterance holds on the token2wav device (see the module doc)."""
    flow = dims.flow
    tokens = prompt_tokens + speech_tokens
    frames = dims.token_mel_ratio * tokens
    cached = 0
    if flow_cache:
        cached = state_nbytes(flow, tokens if flow_cache_max_tokens is None else min(tokens, flow_cache_max_tokens),
                              flow_dtype)
    audio = 2 * FLOAT * speech_tokens * dims.samples_per_token
    return cached + flow_call_bytes(flow, frames) + audio


def flow_call_bytes(flow: FlowDims | DiTFlowDims, frames: int) -> int:
    """The final, full-attention flow call over `frames` mel frames (both CFG halves)."""
    est = flow.estimator
    if isinstance(flow, DiTFlowDims):
        # CosyVoice3's DiT: per frame the block's input, AdaLN-modulated copies, q/k/v/out and the
        # feed-forward, a few alive at once, plus the look-ahead conv; SDPA with a bool mask may
        # take its math path, whose float scores are (2, heads, F, F): the quadratic term
        per_frame = FLOAT * (2 * (est.dim * (6 + 2 * est.ff_mult) + 4 * est.heads * est.dim_head + 3 * est.mel_dim)
                             + flow.lookahead_channels)
        return per_frame * frames + 2 * frames * frames * (1 + FLOAT * est.heads)
    enc = flow.encoder
    # per frame, both CFG halves: the U-Net's widest tensors (inputs, skip, attention q/k/v/out,
    # feed-forward) and the encoder's layer activations, a few alive at once
    per_frame = FLOAT * (2 * (est.in_channels + 8 * est.channels[0] + 6 * est.num_heads * est.attention_head_dim)
                         + 8 * enc.output_size + 4 * enc.linear_units)
    quadratic = 2 * frames * frames * (FLOAT + 1 + FLOAT)
    encoder_blocks = 3 * FLOAT * ATTENTION_BLOCK_ELEMENTS
    return per_frame * frames + quadratic + encoder_blocks


def device_memory(device: str) -> int:
    """Total memory of a device: a CUDA device's, else the host's RAM (what no request may exceed)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def audio_bytes(audio: Audio | None) -> int:
    """A prompt or source audio on the host: decoded, and at 16 and 24 kHz."""
    if audio is None:
        return 0
    n = len(audio.samples)
    return FLOAT * (n + int(n * (16000 + 24000) / max(1, audio.sample_rate)) + 2)

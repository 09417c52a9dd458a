"""Repetition-aware sampling (RAS), CosyVoice2's speech-token sampler, in three shapes.

RAS (facts §2.6, upstream HEAD): p = softmax(scores); the nucleus is the stably sorted p walked
while cum < top_p and count < top_k (the item that crosses top_p is kept); one id is drawn from the
nucleus. If that id occurs >= win_size * tau_r times in the last win_size decoded tokens, its score
is set to -inf and the id is redrawn from the full softmax instead.

- `ras_sample`: one row, the same torch ops in the same order as upstream, so that after
  `torch.manual_seed(s)` it draws the same ids (torch.multinomial consumes the RNG per call).
- `ras_sample_batch`: [B, V] on-device, per-row parameters, inverse-CDF draws from two float64
  uniforms per row (which the caller may supply, e.g. from per-request generators).
- `ras_log_probs`: the exact distribution RAS draws from, as log-probabilities, so that a plain
  temperature-1 sampler over them is RAS.

top_k == 1 is greedy: the argmax (lowest id on ties), never the random repetition fallback.
top_k < 1 means no top-k limit. win_size * tau_r is evaluated in float64 (10 * 0.1 == 1.0 exactly;
in float32 it is 1.0000000149 and a single repeat would no longer count).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .models.dims import SPEECH_TOKEN_SIZE, RASParams

NEG_INF = float("-inf")


# ---------------------------------------------------------------- one row, upstream RNG order

def nucleus(scores: Tensor, top_p: float = 0.8, top_k: int = 25) -> tuple[Tensor, Tensor]:
    """Candidate ids and their (not renormalised) probabilities, in sorted order."""
    probs, ids = scores.softmax(dim=0).sort(descending=True, stable=True)
    limit = len(probs) if top_k < 1 else min(top_k, len(probs))
    cum, n = 0.0, 0
    while n < limit and cum < top_p:
        cum = cum + probs[n]  # a float32 running sum, like upstream's, decides the crossing item
        n += 1
    n = max(n, 1)
    return ids[:n], probs[:n]


def ras_sample(scores: Tensor, decoded: Sequence[int], params: RASParams = RASParams(),
               generator: torch.Generator | None = None) -> int:
    """Draw one id from scores [V] (log-probs or logits) given the tokens decoded so far."""
    if params.top_k == 1:
        return int(scores.argmax())
    ids, probs = nucleus(scores, params.top_p, params.top_k)
    top = int(ids[probs.multinomial(1, replacement=True, generator=generator)])
    window = list(decoded)[-params.win_size:]
    if window.count(top) >= params.win_size * params.tau_r:
        scores = scores.clone()
        scores[top] = NEG_INF
        top = int(scores.softmax(dim=0).multinomial(1, replacement=True, generator=generator))
    return top


# ---------------------------------------------------------------- batched, on device

def _param(value, batch: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.as_tensor(value, dtype=dtype, device=device).expand(batch)


def _stable_top(probs: Tensor, k: int) -> Tensor:
    """ids of the k largest probs [B, V] in stable descending order (ties: lower id first), via
    topk on a unique int64 key (the float bits order non-negative floats) instead of a full sort."""
    V = probs.shape[-1]
    shift = V.bit_length()
    key = (probs.view(torch.int32).long() << shift) | ((1 << shift) - 1 - torch.arange(V, device=probs.device))
    return key.topk(k, dim=-1, sorted=True).indices


def _sorted_nucleus(scores: Tensor, top_p, top_k, max_top_k: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Stably sorted probs [B, N] (float32), their ids and the nucleus mask over that order. N = V,
    or max_top_k when every row's top_k is known to be within it (much cheaper than a sort)."""
    B, V = scores.shape
    probs = scores.float().softmax(-1)
    if max_top_k is None or max_top_k >= V:
        probs, ids = probs.sort(dim=-1, descending=True, stable=True)
    else:
        ids = _stable_top(probs, max_top_k)
        probs = probs.gather(1, ids)
    top_p = _param(top_p, B, torch.float64, scores.device).to(torch.float32)
    top_k = _param(top_k, B, torch.long, scores.device)
    top_k = torch.where(top_k < 1, V, top_k)
    # exclusive running sum; float64 then rounded, compared in float32 like upstream's float32 sum
    cum = probs.double().cumsum(-1)
    cum_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1).float()
    rank = torch.arange(probs.shape[1], device=scores.device)
    keep = (cum_before < top_p[:, None]) & (rank < top_k[:, None])
    keep[:, 0] = True
    return probs, ids, keep


def _window_mask(history: Tensor, win_size: Tensor) -> Tensor:
    """[B, W] True on the last win_size[b] non-empty entries of history [B, W]."""
    W = history.shape[1]
    return (torch.arange(W, device=history.device) >= W - win_size[:, None]) & (history >= 0)


def _inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """Index drawn from non-negative float64 weights [B, N] with uniforms u [B]."""
    cdf = weights.cumsum(-1)
    target = u * cdf[:, -1]
    return (cdf <= target[:, None]).sum(-1).clamp(max=weights.shape[1] - 1)


def ras_sample_batch(scores: Tensor, history: Tensor, top_p=0.8, top_k=25, win_size=10, tau_r=0.1,
                     generator: torch.Generator | None = None, uniforms: Tensor | None = None,
                     max_top_k: int | None = None) -> Tensor:
    """One RAS draw per row of scores [B, V] -> ids [B] (long).

    history [B, W]: each row's most recent decoded tokens, oldest first, right-aligned, -1 = empty.
    top_p/top_k/win_size/tau_r: scalars or [B] tensors (pass tau_r as float64 or Python float).
    uniforms [B, 2] float64 in [0, 1): the nucleus draw and the fallback draw; drawn from
    `generator` when not given. max_top_k: a bound on every row's top_k (1 <= top_k <= max_top_k)
    that replaces the full sort by a top-k; same result. No host sync, static shapes.
    """
    B, V = scores.shape
    dev = scores.device
    if uniforms is None:
        uniforms = torch.rand(B, 2, dtype=torch.float64, device=dev, generator=generator)
    probs, ids, keep = _sorted_nucleus(scores, top_p, top_k, max_top_k)
    pick = ids.gather(1, _inverse_cdf(torch.where(keep, probs.double(), 0.0), uniforms[:, 0])[:, None])[:, 0]

    win = _param(win_size, B, torch.long, dev)
    threshold = win.double() * _param(tau_r, B, torch.float64, dev)
    masked = scores.float().scatter(1, pick[:, None], NEG_INF)
    repeated = ((history == pick[:, None]) & _window_mask(history, win)).sum(-1) >= threshold
    repeated &= (_param(top_k, B, torch.long, dev) != 1) & (masked > NEG_INF).any(-1)
    redraw = _inverse_cdf(masked.double().softmax(-1).nan_to_num(0.0), uniforms[:, 1])
    return torch.where(repeated, redraw, pick)


def ras_log_probs(scores: Tensor, history: Tensor, top_p=0.8, top_k=25, win_size=10, tau_r=0.1) -> Tensor:
    """log P(next = x) [B, V] float64 under RAS, with N the renormalised nucleus distribution,
    p = softmax(scores), R the set of ids that would count as repeated:

        P(x) = N(x)·[x ∉ R] + Σ_{y ∈ R} N(y)·p(x)·[x ≠ y] / (1 - p(y))

    A repeated y with no other finite score keeps its mass (upstream would fail there).
    """
    B, V = scores.shape
    dev = scores.device
    _, ids, keep = _sorted_nucleus(scores, top_p, top_k)
    logp = scores.double().log_softmax(-1)
    p = logp.exp()
    nuc = torch.zeros_like(p).scatter(1, ids, torch.where(keep, p.gather(1, ids), 0.0))
    nuc = nuc / nuc.sum(-1, keepdim=True)

    win = _param(win_size, B, torch.long, dev)
    threshold = win.double() * _param(tau_r, B, torch.float64, dev)
    counts = torch.zeros(B, V, dtype=torch.float64, device=dev).scatter_add(
        1, history.clamp(min=0), _window_mask(history, win).double())
    repeated = (counts >= threshold[:, None]) & (nuc > 0)
    repeated &= ((_param(top_k, B, torch.long, dev) != 1) & ((scores > NEG_INF).sum(-1) >= 2))[:, None]

    # mass left when y is removed: 1 - p(y), except for the argmax, whose p may round to 1
    rest = 1.0 - p
    top = ids[:, :1]
    rest = rest.scatter(1, top, p.scatter(1, top, 0.0).sum(-1, keepdim=True))
    share = torch.where(repeated, nuc / rest, 0.0)  # N(y) / (1 - p(y)) for y in R
    fallback = p * (share.sum(-1, keepdim=True) - share)
    prob = torch.where(repeated, 0.0, nuc) + fallback.clamp(min=0.0)
    return prob.log()


# ---------------------------------------------------------------- stop rules (both engines)

def suppress_batch(logits: Tensor, n_decoded: Tensor, min_tokens: Tensor, ignore_stop: Tensor,
                   speech_token_size: int = SPEECH_TOKEN_SIZE) -> Tensor:
    """On logits [B, V] (in place): id `speech_token_size` (6561 only, as upstream: CosyVoice2's EOS,
    CosyVoice3's sos) where n_decoded < min_tokens; every stop id (all ids >= speech_token_size)
    where ignore_stop (benchmarks: never end early)."""
    logits[:, speech_token_size].masked_fill_(n_decoded < min_tokens, NEG_INF)
    logits[:, speech_token_size:].masked_fill_(ignore_stop[:, None], NEG_INF)
    return logits

"""Repetition-aware sampling (RAS) as a vLLM V1 logits processor.

vLLM's sampler cannot express RAS (its fallback redraw depends on the first draw), so this
processor replaces each opted-in request's logits by the log of the exact RAS next-token
distribution (`sampling.ras_log_probs`); the stock temperature-1 sampler that follows then draws
from RAS. For that the request must leave everything after the processor neutral: temperature 1,
top_p 1, top_k 0 (or -1), min_p 0 and default penalties — `validate_params` enforces it.

Per-request parameters travel in `SamplingParams.extra_args[EXTRA_ARGS_KEY]` (build them with
`ras_extra_args`): top_p, top_k, win_size, tau_r, min_tokens and ignore_stop_tokens, and for
bistream chunks `history` (the request's earlier outputs, fills included: vLLM starts a chunk's
output list afresh) and `fill_at` (the chunk's output index where the fill token is forced).
The model's special ids (CosyVoice2 or CosyVoice3, `SpeechIds`) come from the exported config's
vocabulary size. Before `min_tokens` outputs only id 6561 is masked, as upstream does; vLLM's own `min_tokens` would
mask every stop id, so it must stay 0 on these requests. `ignore_stop_tokens` masks all stop ids.
The repetition window is read in `apply()` from the live `output_tok_ids` list vLLM hands over
when the request joins the batch, so it already holds the previous step's token.

top_k == 1 is greedy: the argmax, lowest id on ties, no repetition fallback.
Requests without the extra_args entry pass through untouched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates

from ..models.dims import RASParams, SpeechIds
from ..sampling import ras_log_probs, suppress_batch

EXTRA_ARGS_KEY = "cosyvoice_ras"
_EPS = 1e-6


def ras_extra_args(params: RASParams, min_tokens: int = 0, ignore_stop_tokens: bool = False,
                   history: tuple[int, ...] = (), fill_at: int = -1) -> dict[str, Any]:
    """The `SamplingParams.extra_args` entry that turns RAS on for one request."""
    return {EXTRA_ARGS_KEY: {
        "top_p": float(params.top_p), "top_k": int(params.top_k), "win_size": int(params.win_size),
        "tau_r": float(params.tau_r), "min_tokens": int(min_tokens),
        "ignore_stop_tokens": bool(ignore_stop_tokens),
        "history": [int(t) for t in history[-params.win_size:]], "fill_at": int(fill_at),
    }}


@dataclass(frozen=True)
class _RequestRAS:
    top_p: float
    top_k: int
    win_size: int
    tau_r: float
    min_tokens: int
    ignore_stop_tokens: bool
    history: tuple[int, ...] = ()
    fill_at: int = -1

    @classmethod
    def from_params(cls, sp: SamplingParams) -> "_RequestRAS | None":
        args = (sp.extra_args or {}).get(EXTRA_ARGS_KEY)
        if args is None:
            return None
        if not isinstance(args, dict):
            raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}] must be a dict, got {type(args).__name__}")
        unknown = set(args) - {"top_p", "top_k", "win_size", "tau_r", "min_tokens", "ignore_stop_tokens",
                               "history", "fill_at"}
        if unknown:
            raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}] has unknown keys {sorted(unknown)}")
        d = RASParams()
        return cls(
            top_p=float(args.get("top_p", d.top_p)), top_k=int(args.get("top_k", d.top_k)),
            win_size=int(args.get("win_size", d.win_size)), tau_r=float(args.get("tau_r", d.tau_r)),
            min_tokens=int(args.get("min_tokens", 0)),
            ignore_stop_tokens=bool(args.get("ignore_stop_tokens", False)),
            history=tuple(int(t) for t in args.get("history", ())), fill_at=int(args.get("fill_at", -1)),
        )

    def check(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"RAS top_p must be in (0, 1], got {self.top_p}")
        if self.win_size < 1:
            raise ValueError(f"RAS win_size must be >= 1, got {self.win_size}")
        if self.tau_r < 0.0:
            raise ValueError(f"RAS tau_r must be >= 0, got {self.tau_r}")
        if self.min_tokens < 0:
            raise ValueError(f"RAS min_tokens must be >= 0, got {self.min_tokens}")


@dataclass
class _Slot:
    ras: _RequestRAS
    output: list[int]  # vLLM's live list of this request's output tokens


class RASLogitsProcessor(LogitsProcessor):
    """Writes log P_RAS(next token) into the logits of every request that opted in."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams):
        ras = _RequestRAS.from_params(sampling_params)
        if ras is None:
            return
        ras.check()
        sp = sampling_params
        neutral = {
            "temperature": abs(sp.temperature - 1.0) < _EPS,
            "top_p": abs(sp.top_p - 1.0) < _EPS,
            "top_k": sp.top_k in (0, -1),
            "min_p": sp.min_p < _EPS,
            "repetition_penalty": abs(sp.repetition_penalty - 1.0) < _EPS,
            "presence_penalty": abs(sp.presence_penalty) < _EPS,
            "frequency_penalty": abs(sp.frequency_penalty) < _EPS,
            "min_tokens": sp.min_tokens == 0,
        }
        bad = [name for name, ok in neutral.items() if not ok]
        if bad:
            raise ValueError(
                f"RAS requests need neutral vLLM sampling (temperature 1, top_p 1, top_k 0, min_p 0, "
                f"default penalties, min_tokens 0; pass top_p/top_k/min_tokens in extra_args"
                f"[{EXTRA_ARGS_KEY!r}] instead); offending: {', '.join(bad)}")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        vocab = vllm_config.model_config.hf_config.get_text_config().vocab_size
        self.ids = next(i for i in (SpeechIds.of("cosyvoice2"), SpeechIds.of("cosyvoice3")) if i.vocab == vocab)
        self.slots: dict[int, _Slot] = {}
        self._batch: _BatchParams | None = None

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_slot(params: SamplingParams, _prompt, output: list[int]) -> _Slot | None:
            ras = _RequestRAS.from_params(params)
            return None if ras is None else _Slot(ras, output)

        if process_dict_updates(self.slots, batch_update, new_slot):
            self._batch = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.slots:
            return logits
        if self._batch is None:
            self._batch = _BatchParams.build(self.slots, logits.device)
        b = self._batch
        outputs = [self.slots[i].output for i in b.index_list]
        n_out = torch.tensor([len(o) for o in outputs], device=logits.device)
        history = torch.full((len(outputs), b.max_win), -1, dtype=torch.long)
        for row, (out, win, i) in enumerate(zip(outputs, b.win_list, b.index_list)):
            earlier = self.slots[i].ras.history
            recent = (list(earlier[-win:]) + out)[-win:] if earlier else out[-win:]
            if recent:
                history[row, b.max_win - len(recent):] = torch.tensor(recent, dtype=torch.long)

        rows = logits.index_select(0, b.index)
        suppress_batch(rows, n_out, b.min_tokens, b.ignore_stop, self.ids.size)
        logp = ras_log_probs(rows, history.to(logits.device), top_p=b.top_p, top_k=b.top_k,
                             win_size=b.win_size, tau_r=b.tau_r)
        forced = n_out == b.fill_at  # bistream: the fill token, not a sample
        if bool(forced.any()):
            logp[forced] = float("-inf")
            logp[forced, self.ids.fill] = 0.0
        logits.index_copy_(0, b.index, logp.to(logits.dtype))
        return logits


@dataclass(frozen=True)
class _BatchParams:
    """Per-row parameter tensors for the current batch makeup (rebuilt when it changes)."""
    index_list: list[int]
    win_list: list[int]
    max_win: int
    index: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    win_size: torch.Tensor
    tau_r: torch.Tensor
    min_tokens: torch.Tensor
    ignore_stop: torch.Tensor
    fill_at: torch.Tensor

    @classmethod
    def build(cls, slots: dict[int, _Slot], device: torch.device) -> "_BatchParams":
        index_list = sorted(slots)
        ras = [slots[i].ras for i in index_list]

        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        win_list = [r.win_size for r in ras]
        return cls(
            index_list=index_list, win_list=win_list, max_win=max(win_list),
            index=col(index_list, torch.long),
            top_p=col([r.top_p for r in ras], torch.float64),
            top_k=col([r.top_k for r in ras], torch.long),
            win_size=col(win_list, torch.long),
            tau_r=col([r.tau_r for r in ras], torch.float64),
            min_tokens=col([r.min_tokens for r in ras], torch.long),
            ignore_stop=col([r.ignore_stop_tokens for r in ras], torch.bool),
            fill_at=col([r.fill_at for r in ras], torch.long),
        )

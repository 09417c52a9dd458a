"""What both flows share: speech tokens + prompt mel + x-vector -> mel frames by conditional flow
matching (CausalConditionalCFM) from token features `mu` at the mel rate.

CosyVoice2 (flow.py) makes `mu` with a conformer encoder, CosyVoice3 (cosyvoice3/flow.py) with the
pre-lookahead layer alone; the rest (speaker projection, prompt cond, masks, the solver, the
streaming state cache, upstream's one-request `inference`) is this class.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cfm import CausalConditionalCFM, Estimator
from .masks import length_mask
from .prefix import Cursor, EntryShape, FlowState, Geometry, LayoutCursor, SlotCursor, SlotGeometry


class MaskedDiffFlow(nn.Module):
    """Subclasses build `input_embedding`, `spk_embed_affine_layer` and `decoder` (a
    CausalConditionalCFM), set `dims` (token_mel_ratio, pre_lookahead_len, chunk_tokens) and define
    `encode` and `encode_cached`."""

    input_embedding: nn.Embedding
    spk_embed_affine_layer: nn.Linear
    decoder: CausalConditionalCFM

    @property
    def chunk_tokens(self) -> int:
        """Tokens per chunk of the streaming attention masks, counted from the prompt's first token."""
        return self.dims.chunk_tokens

    def encode(self, x: Tensor, token_lens: Tensor, context_lens: Tensor, streaming: bool | Tensor,
               n_tokens: int | None, trace: dict | None) -> tuple[Tensor, Tensor]:
        """Token embeddings x (B, S, C), zero past token_lens + context_lens -> (mu (B, 80, ratio·T),
        ratio·token_lens), T = n_tokens or max(token_lens)."""
        raise NotImplementedError

    def encode_cached(self, x: Tensor, g, cursor, context_lens: Tensor | None) -> Tensor:
        """`encode` of item b's tokens [start, end) (+ context) of `g` (a Geometry or SlotGeometry)
        against the cursor's state (a Cursor, SlotCursor or LayoutCursor) -> mu (B, 80, ratio·N)."""
        raise NotImplementedError

    def forward(
        self,
        tokens: Tensor,
        token_lens: Tensor,
        context_lens: Tensor,
        prompt_feat: Tensor,
        prompt_feat_lens: Tensor,
        embedding: Tensor,
        streaming: bool | Tensor = False,
        estimator: Estimator | None = None,
        trace: dict | None = None,
        n_tokens: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Batched flow over whole sequences (prompt + target), right-padded.

        tokens (B, S): item b renders its first token_lens[b] tokens; the context_lens[b] after them
        are look-ahead only (0 = final call). prompt_feat (B, F, 80) with prompt_feat_lens[b] valid
        frames becomes the cond of the first frames. embedding (B, 192). streaming: bool or (B,) bool.
        n_tokens: render this many token positions (>= max(token_lens); the rest is padding, which
        changes no item's frames); None: max(token_lens). With it, the call never waits for the device.

        Returns mel (B, 80, T) float32 including the prompt frames, T = token_mel_ratio · n_tokens,
        and the per-item frame counts token_mel_ratio · token_lens.
        """
        dtype, device = self.input_embedding.weight.dtype, self.input_embedding.weight.device
        tokens, token_lens, context_lens = tokens.to(device), token_lens.to(device), context_lens.to(device)
        if isinstance(streaming, Tensor):
            streaming = streaming.to(device)

        spks = self.spk_embed_affine_layer(F.normalize(embedding.to(device).float(), dim=1).to(dtype))
        seen = length_mask(token_lens + context_lens, tokens.size(1)).unsqueeze(-1)
        x = self.input_embedding(tokens.clamp(min=0).long()) * seen.to(dtype)
        mu, mel_lens = self.encode(x, token_lens, context_lens, streaming, n_tokens, trace)

        B, C, T = mu.shape
        mask = length_mask(mel_lens, T).unsqueeze(1).to(dtype)
        prompt = prompt_feat.to(device=device, dtype=dtype)[:, :T]
        prompt = prompt * length_mask(prompt_feat_lens.to(device), prompt.size(1)).unsqueeze(-1).to(dtype)
        cond = F.pad(prompt.transpose(1, 2), (0, T - prompt.size(1)))
        if trace is not None:
            trace.update(mu=mu, spks=spks, cond=cond, mask=mask)

        mel = self.decoder(mu, mask, spks, cond, streaming, estimator=estimator, trace=trace)
        return mel, mel_lens

    @torch.inference_mode()
    def forward_cached(
        self,
        tokens: Tensor,
        g: Geometry,
        prompt_feat: Tensor,
        prompt_feat_lens: Tensor,
        embedding: Tensor,
        states: list[FlowState | None],
        context_lens: list[int] | None = None,
    ) -> tuple[Tensor, list[FlowState]]:
        """A streaming call on new frames only (the exact flow state cache, prefix.py).

        Item b renders tokens [g.start[b], g.end[b]) of its prompt + target sequence against its
        cached state (states[b].tokens == g.start[b]; None: nothing cached, start 0) and keeps the
        state of tokens [0, g.keep[b]). tokens (B, N + pre_lookahead_len): the ids of tokens
        [start, end + pre_lookahead_len) right-padded; keep[b] must be a multiple of the encoder
        chunk (or equal start), so only complete chunks are cached. prompt_feat (B, F, 80) with
        prompt_feat_lens[b] valid frames (absolute, from frame 0), embedding (B, 192). context_lens[b]:
        look-ahead tokens after end[b] in `tokens` (default pre_lookahead_len; 0: zeros, as a final
        call, then with chunked instead of upstream's full attention).

        Returns mel (B, 80, ratio·N) float32 of frames [ratio·start, ratio·end), zero past each
        item, and the items' new states. Equal to `forward(..., streaming=True)` on the whole
        sequence at those frames, up to float summation order.
        """
        chunk = self.chunk_tokens
        for b, s in enumerate(states):
            if (0 if s is None else s.tokens) != g.start[b]:
                raise ValueError(f"item {b}: the cached state covers {0 if s is None else s.tokens} tokens, "
                                 f"the call starts at {g.start[b]}")
            if g.keep[b] != g.start[b] and g.keep[b] % chunk:
                raise ValueError(f"item {b}: keep {g.keep[b]} is not a multiple of the {chunk}-token chunk")
        cursor = Cursor([None if s is None else s.encoder for s in states])
        steps: list[list[list]] = [[] for _ in states]

        def step_cursor(step: int) -> Cursor:
            return Cursor([None if s is None else s.steps[step - 1] for s in states])

        def step_done(step: int, c: Cursor) -> None:
            for b, entries in enumerate(c.out):
                steps[b].append(entries)

        context = None if context_lens is None else torch.tensor(context_lens, device=self.input_embedding.weight.device)
        mel = self._cached_call(tokens, g, prompt_feat, prompt_feat_lens, embedding, cursor, step_cursor, step_done,
                                context)
        g2 = g.scaled(self.dims.token_mel_ratio)
        new = []
        for b, old in enumerate(states):
            kept = g2.keep[b] - g2.start[b]
            if kept == 0:
                new.append(old)
                continue
            mel_segments = (() if old is None else old.mel) + (mel[b:b + 1, :, :kept].clone(),)
            new.append(FlowState(g.keep[b], tuple(cursor.out[b]), tuple(tuple(e) for e in steps[b]), mel_segments))
        return mel, new

    def forward_slots(self, tokens: Tensor, g: SlotGeometry, prompt_feat: Tensor, prompt_feat_lens: Tensor,
                      embedding: Tensor, entries: Sequence[Tensor], n_encoder_entries: int) -> Tensor:
        """`forward_cached` over state slots (prefix.SlotGeometry, token2wav/state_pool.py): the same
        frames, from tensors alone (a CUDA graph can hold it). entries: the slots' state tensors in
        cursor order, the encoder's first, then each CFM step's. Streaming calls only (look-ahead
        pre_lookahead_len tokens). Returns mel (B, 80, ratio·N) of frames [ratio·start, ratio·end)."""
        per_step = (len(entries) - n_encoder_entries) // self.decoder.params.n_timesteps
        encoder = SlotCursor(entries[:n_encoder_entries])

        def step_cursor(step: int) -> SlotCursor:
            first = n_encoder_entries + (step - 1) * per_step
            return SlotCursor(entries[first:first + per_step])

        return self._cached_call(tokens, g, prompt_feat, prompt_feat_lens, embedding, encoder, step_cursor,
                                 lambda step, c: None, None)

    def state_layout(self, n_tokens: int) -> tuple[list[EntryShape], int]:
        """The state entries a cached call walks (encoder's, then one CFM step's), and how many are
        the encoder's: recorded from a call of n_tokens tokens with nothing cached."""
        device, dtype = self.input_embedding.weight.device, self.input_embedding.weight.dtype
        g = Geometry([0], [n_tokens], [n_tokens], device)
        encoder, step1 = LayoutCursor(n_tokens), LayoutCursor(n_tokens)
        with torch.inference_mode():
            self._cached_call(torch.zeros(1, n_tokens + self.dims.pre_lookahead_len, dtype=torch.long, device=device),
                              g, torch.zeros(1, 1, self.dims.output_size, dtype=dtype, device=device),
                              torch.zeros(1, dtype=torch.long, device=device),
                              torch.zeros(1, self.dims.spk_embed_dim, device=device), encoder,
                              lambda step: step1 if step == 1 else LayoutCursor(n_tokens), lambda step, c: None, None)
        return encoder.entries + step1.entries, len(encoder.entries)

    def _cached_call(self, tokens: Tensor, g, prompt_feat: Tensor, prompt_feat_lens: Tensor, embedding: Tensor,
                     encoder_cursor, step_cursor: Callable, step_done: Callable, context: Tensor | None) -> Tensor:
        """The body of a cached call, whichever cursor holds the state: mel (B, 80, ratio·N)."""
        dtype, device = self.input_embedding.weight.dtype, self.input_embedding.weight.device
        spks = self.spk_embed_affine_layer(F.normalize(embedding.to(device).float(), dim=1).to(dtype))
        x = self.input_embedding(tokens.to(device).clamp(min=0).long())
        mu = self.encode_cached(x, g, encoder_cursor, context)

        g2 = g.scaled(self.dims.token_mel_ratio)
        valid = g2.valid()
        mask = valid.unsqueeze(1).to(dtype)
        pos = g2.positions()
        feat = prompt_feat.to(device=device, dtype=dtype)
        if feat.size(1) == 0:
            feat = feat.new_zeros(feat.size(0), 1, feat.size(2))
        in_prompt = valid & (pos < prompt_feat_lens.to(device).unsqueeze(1))
        cond = torch.gather(feat, 1, pos.clamp(max=feat.size(1) - 1).unsqueeze(-1).expand(-1, -1, feat.size(2)))
        cond = (cond * in_prompt.unsqueeze(-1).to(dtype)).transpose(1, 2)
        return self.decoder.forward_cached(mu, mask, spks, cond, g2, step_cursor, step_done)

    @torch.inference_mode()
    def inference(
        self,
        token: Tensor,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        streaming: bool,
        finalize: bool,
        trace: dict | None = None,
    ) -> Tensor:
        """One request, upstream semantics. token (1, N), prompt_token (1, P), prompt_feat (1, 2P, 80),
        embedding (1, 192) -> mel (1, 80, T_new) float32 for the target tokens only.

        A non-final call keeps the last pre_lookahead_len tokens as look-ahead context and renders
        the ones before them; a final call renders all tokens (zero look-ahead).
        """
        P = prompt_token.size(1)
        if prompt_feat.size(1) != self.dims.token_mel_ratio * P:
            raise ValueError(
                f"prompt_feat has {prompt_feat.size(1)} frames for {P} prompt tokens; the frontend must trim "
                f"both to {self.dims.token_mel_ratio} frames per token"
            )
        tokens = torch.cat([prompt_token.to(token.device), token], dim=1)
        n_context = 0 if finalize else self.dims.pre_lookahead_len
        mel, _ = self.forward(
            tokens,
            torch.tensor([tokens.size(1) - n_context]),
            torch.tensor([n_context]),
            prompt_feat,
            torch.tensor([prompt_feat.size(1)]),
            embedding,
            streaming,
            trace=trace,
        )
        mel = mel[:, :, prompt_feat.size(1):]
        if trace is not None:
            trace["mel"] = mel
        return mel

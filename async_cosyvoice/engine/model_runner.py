"""Runs the LM for the native engine: the slot KV cache, per-slot sampling state, prefill and decode
forwards with on-device RAS, and CUDA graphs for decode.

Why slots and not pages: a CosyVoice2 request's length is bounded and known up front (prompt +
at most 20x the target text, capped by max_model_len), every request samples its own stream
until it ends, and nothing is shared between requests (no prefix caching: the prompt speech
tokens differ per speaker). A paged cache earns its complexity from sharing and from packing
sequences of unknown length; here it would buy little beyond memory packing and would need a
paged-attention kernel, while a slot cache lets a plain `scaled_dot_product_attention` read each
row's cache with one gather, keeps every decode shape static (graph-capturable), and makes
admission and abort O(1): a slot is taken when a prompt starts and handed back when it ends.
The price is that each slot reserves max_model_len positions; size max_num_seqs x max_model_len
to the memory you have.

Per-slot state lives on the device (last token, position, output count, RAS parameters and the
repetition window), so a decode step needs only the slot ids, two uniforms and a forced-fill flag
(bistream) per row from the host: the token embedding, forward, EOS/stop masking, RAS and the
state update all happen on the device, inside one CUDA graph per (batch bucket, attention-length
bucket). The last slot is a scratch slot that padding rows of a graph bucket read and write.

Reproducible seeds: RAS draws use two float64 uniforms per row per step, taken from the request's
own torch.Generator when it has a seed, so its draws do not depend on the other rows.

Measured on one H200 (random full-size weights, bf16, prompt 200): a decode step takes 3.7 ms at
batch 1 and 5.3 ms at 64 from graphs alone, 2.2 ms and 3.0 ms with `compile` (launch-bound: a
step is ~1000 small kernels without it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.llm import CosyVoice2LM, Table, input_rows
from ..sampling import ras_sample_batch, suppress_batch
from ..startup import CAPTURES
from .recorder import StepRecord, StepRecorder
from .scheduler import PrefillChunk, StepPlan
from .sequence import Sequence


@dataclass(frozen=True)
class RunnerConfig:
    max_num_seqs: int = 64
    max_model_len: int = 4096
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    cuda_graphs: bool = True
    history_len: int = 32  # longest RAS window a request may ask for
    max_top_k: int = 100  # largest RAS top_k a request may ask for (a top-k instead of a full sort)
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    min_graph_kv_len: int = 256  # attention-length buckets: powers of two from here to max_model_len
    compile: bool = False  # CUDA only: torch.compile each decoder layer (fuses norms and RoPE)
    # a new request's whole prompt, alone in its step's prefill, as one CUDA graph per width bucket (its
    # forward and the first token's sampling); off CUDA the same padded call runs without a graph
    prefill_graphs: bool = False
    prefill_graph_widths: tuple[int, ...] = (64, 128, 256, 512)


class ModelRunner:
    def __init__(self, model: CosyVoice2LM, config: RunnerConfig, seed: int | None = None,
                 recorder: StepRecorder | None = None):
        self.cfg = config
        self.recorder = recorder
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model = model.to(device=self.device, dtype=config.dtype).eval()
        if config.compile and self.device.type == "cuda":
            # one dynamic-shape compile serves prefill and every graph bucket; the ~45 small kernels
            # of a layer (fp32 norms, RoPE, reshapes) become ~15, which is what decode time is made of
            for layer in self.model.backbone.layers:
                layer.compile(dynamic=True)
        self.scratch = config.max_num_seqs
        self._allocate()
        self.generator = torch.Generator()  # draws for requests without a seed
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}  # by width bucket
        self.bucketed_prefills = 0  # prompts prefilled in a width bucket (replays, on CUDA)
        self._stream: torch.cuda.Stream | None = None  # CUDA: created by the step thread
        self._graph_pool = None
        self._capture_stream: torch.cuda.Stream | None = None

    @torch.inference_mode()  # inference tensors, like every tensor a step makes: one kind for torch.compile
    def _allocate(self) -> None:
        cfg, n = self.cfg, self.cfg.max_num_seqs + 1  # + scratch
        # one spare position: a window equal to the cache length would be one more compile variant
        self.cache = self.model.new_cache(cfg.max_num_seqs, cfg.max_model_len + 1, cfg.dtype, self.device)

        def zeros(dtype, *shape):
            return torch.zeros(n, *shape, dtype=dtype, device=self.device)
        self.last_token = zeros(torch.long)
        self.position = zeros(torch.long)  # where last_token is fed next
        self.num_out = zeros(torch.long)
        self.min_tokens = zeros(torch.long)
        self.ignore_stop = zeros(torch.bool)
        self.top_p, self.tau_r = zeros(torch.float64), zeros(torch.float64)
        self.top_k, self.win_size = zeros(torch.long), zeros(torch.long)
        self.history = zeros(torch.long, cfg.history_len) - 1
        self._graph_slots = torch.full((max(self._batch_buckets()),), self.scratch, dtype=torch.long,
                                       device=self.device)
        self._graph_uniforms = torch.zeros(len(self._graph_slots), 2, dtype=torch.float64, device=self.device)
        self._graph_force = torch.zeros(len(self._graph_slots), dtype=torch.bool, device=self.device)
        # the prefill graphs' inputs: one prompt of up to the widest bucket (each graph reads its leading W)
        widths = self._prefill_widths()
        self._prefill_x = torch.zeros(1, max(widths, default=0), self.model.dims.qwen.hidden_size,
                                      dtype=cfg.dtype, device=self.device)
        self._prefill_positions = torch.full((1, max(widths, default=0)), -1, dtype=torch.long, device=self.device)
        self._prefill_slot = torch.full((1,), self.scratch, dtype=torch.long, device=self.device)
        self._prefill_last = torch.zeros(1, dtype=torch.long, device=self.device)  # the prompt's last row
        self._prefill_uniforms = torch.zeros(1, 2, dtype=torch.float64, device=self.device)
        self._prefill_force = torch.zeros(1, dtype=torch.bool, device=self.device)

    @property
    def use_graphs(self) -> bool:
        return self.cfg.cuda_graphs and self.device.type == "cuda" and self.recorder is None

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> list[tuple[Sequence, int]]:
        """Run one planned step; returns (sequence, sampled id) for every decode row and every
        prefill row that completed its prompt. Called from the engine's single step thread."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the step thread is not the thread that built us
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
        out: list[tuple[Sequence, int]] = []
        records: list[StepRecord] = []
        step = self.recorder.next_step() if self.recorder is not None else -1
        # our own stream: the step's host syncs wait for the LM's kernels only, not for the
        # token2wav work another thread queued on the same device
        with torch.cuda.stream(self._stream):
            if plan.decode:
                tokens, logp = self._decode(plan.decode, plan.decode_kv_len)
                out += zip(plan.decode, tokens)
                if self.recorder is not None:
                    records += [StepRecord(step, s.request_id, s.num_cached, ((Table.SPEECH, s.last_token),),
                                           logp[i].cpu(), tokens[i]) for i, s in enumerate(plan.decode)]
            if plan.prefill:
                done = [c.seq for c in plan.prefill if c.is_last]
                tokens, logp = self._prefill(plan.prefill)
                out += zip(done, tokens)
                if self.recorder is not None:
                    records += self._chunk_records(step, plan.prefill, tokens, logp)
        if self.recorder is not None:
            self.recorder.add(records)
        return out

    @staticmethod
    def _chunk_records(step: int, chunks: list[PrefillChunk], tokens: list[int],
                       logp: Tensor | None) -> list[StepRecord]:
        records, done = [], 0
        for c in chunks:
            rows = input_rows(c.seq.segment)[c.start - c.seq.segment_start:c.end - c.seq.segment_start]
            row_logp = row_token = None
            if c.is_last:
                row_logp, row_token = logp[done].cpu(), tokens[done]
                done += 1
            records.append(StepRecord(step, c.seq.request_id, c.start, tuple(rows), row_logp, row_token))
        return records

    def _uniforms(self, seqs: list[Sequence]) -> Tensor:
        u = torch.rand(len(seqs), 2, dtype=torch.float64, generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                u[i] = torch.rand(2, dtype=torch.float64, generator=seq.generator)
        return u.to(self.device, non_blocking=True)

    def _force(self, seqs: list[Sequence]) -> Tensor:
        return torch.tensor([s.forces_fill for s in seqs], dtype=torch.bool)

    def _decode(self, seqs: list[Sequence], kv_len: int) -> tuple[list[int], Tensor | None]:
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long)
        uniforms, force = self._uniforms(seqs), self._force(seqs)
        if self.use_graphs:
            key = self.decode_graph_key(len(seqs), kv_len)
            graph, tokens = self.graphs.get(key) or self._capture(*key)
            self._graph_slots.fill_(self.scratch)
            self._graph_slots[:len(seqs)].copy_(slots, non_blocking=True)
            self._graph_uniforms[:len(seqs)].copy_(uniforms)
            self._graph_force.fill_(False)
            self._graph_force[:len(seqs)].copy_(force, non_blocking=True)
            graph.replay()
            return tokens[:len(seqs)].tolist(), None
        tokens, logp = self._decode_rows(slots.to(self.device), uniforms, force.to(self.device), kv_len)
        return tokens.tolist(), logp

    def _decode_rows(self, slots: Tensor, uniforms: Tensor, force: Tensor,
                     kv_len: int) -> tuple[Tensor, Tensor | None]:
        """Static-shape decode: feed each slot's last token, sample the next. Graph-capturable."""
        pos = torch.where(slots == self.scratch, -1, self.position[slots])
        x = self.model.embed_speech(self.last_token[slots])[:, None]
        hidden = self.model.backbone(x, pos[:, None], self.cache, slots, kv_len)[:, 0]
        self.position[slots] += 1
        return self._sample(hidden, slots, uniforms, force)

    def _sample(self, hidden: Tensor, slots: Tensor, uniforms: Tensor,
                force: Tensor) -> tuple[Tensor, Tensor | None]:
        """Sampled ids [B] (a bistream row's forced fill where `force`), and, with a recorder, the
        log-probs before masking."""
        logp = self.model.logits(hidden).float().log_softmax(-1)  # upstream samples from log-probs
        recorded = logp.clone() if self.recorder is not None else None
        ids = self.model.ids
        suppress_batch(logp, self.num_out[slots], self.min_tokens[slots], self.ignore_stop[slots], ids.size)
        tokens = ras_sample_batch(logp, self.history[slots], self.top_p[slots], self.top_k[slots],
                                  self.win_size[slots], self.tau_r[slots], uniforms=uniforms,
                                  max_top_k=self.cfg.max_top_k)
        tokens = torch.where(force, ids.fill, tokens)
        self.history[slots] = torch.cat([self.history[slots][:, 1:], tokens[:, None]], dim=1)
        self.last_token[slots] = tokens
        self.num_out[slots] += 1
        return tokens, recorded

    def _prefill(self, chunks: list[PrefillChunk]) -> tuple[list[int], Tensor | None]:
        """Padded prefill of segment chunks (chunk i feeds positions [start, end) of its sequence);
        samples the next token of segments that complete."""
        self._init_slots([c.seq for c in chunks if c.start == 0])
        self._put([c.seq for c in chunks if c.start == c.seq.segment_start], self.min_tokens,
                  [c.seq.min_tokens for c in chunks if c.start == c.seq.segment_start], torch.long)
        if (width := self.prefill_graph_width(chunks)) is not None:
            return self._prefill_bucketed(chunks[0], width), None
        width = max(c.end - c.start for c in chunks)
        x = torch.zeros(len(chunks), width, self.model.dims.qwen.hidden_size, dtype=self.cfg.dtype,
                        device=self.device)
        positions = torch.full((len(chunks), width), -1, dtype=torch.long)
        for i, c in enumerate(chunks):
            offset = c.seq.segment_start
            x[i, :c.end - c.start] = self._segment_embeds(c.seq)[c.start - offset:c.end - offset]
            positions[i, :c.end - c.start] = torch.arange(c.start, c.end)
        slots = torch.tensor([c.seq.slot for c in chunks], dtype=torch.long, device=self.device)
        kv_len = max(c.end for c in chunks)
        hidden = self.model.backbone(x, positions.to(self.device), self.cache, slots, kv_len)
        self._put([c.seq for c in chunks], self.position, [c.end for c in chunks], torch.long)
        last = [i for i, c in enumerate(chunks) if c.is_last]
        if not last:
            return [], None
        rows = torch.tensor(last, device=self.device)
        ends = torch.tensor([chunks[i].end - chunks[i].start - 1 for i in last], device=self.device)
        done = [chunks[i].seq for i in last]
        tokens, logp = self._sample(hidden[rows, ends], slots[rows], self._uniforms(done),
                                    self._force(done).to(self.device))
        return tokens.tolist(), logp

    def prefill_graph_width(self, chunks: list[PrefillChunk]) -> int | None:
        """The width bucket whose prefill graph runs this step's prefill, or None (it runs as a padded
        batch, eagerly): a single chunk that is a whole prompt from position 0 and fits a bucket."""
        if not self.cfg.prefill_graphs or self.recorder is not None or len(chunks) != 1:
            return None
        c = chunks[0]
        if c.start != 0 or not c.is_last:
            return None
        return next((w for w in self._prefill_widths() if w >= c.end), None)

    def _prefill_bucketed(self, c: PrefillChunk, width: int) -> list[int]:
        """A whole prompt in its width bucket's graph (off CUDA: the same padded call without one)."""
        rows = c.end
        self._prefill_x[0, :rows] = self._segment_embeds(c.seq)[:rows]
        self._prefill_x[0, rows:].zero_()
        self._prefill_positions.fill_(-1)
        self._prefill_positions[0, :rows] = torch.arange(rows, device=self.device)
        self._prefill_slot.fill_(c.seq.slot)
        self._prefill_last.fill_(rows - 1)
        self._prefill_uniforms.copy_(self._uniforms([c.seq]))
        self._prefill_force.copy_(self._force([c.seq]), non_blocking=True)
        if self.use_graphs:
            graph, tokens = self.prefill_graphs.get(width) or self._capture_prefill(width)
            graph.replay()
        else:
            tokens, _ = self._prefill_rows(width)
        self._put([c.seq], self.position, [c.end], torch.long)
        self.bucketed_prefills += 1
        return tokens.tolist()

    def _prefill_rows(self, width: int) -> tuple[Tensor, Tensor | None]:
        """Static-shape prefill of the prompt in the prefill buffers' leading `width` rows (padding:
        position -1, written to the scratch slot), then its first token sampled. Graph-capturable."""
        x, positions = self._prefill_x[:, :width], self._prefill_positions[:, :width]
        hidden = self.model.backbone(x, positions, self.cache, self._prefill_slot, width)
        return self._sample(hidden[0].index_select(0, self._prefill_last), self._prefill_slot,
                            self._prefill_uniforms, self._prefill_force)

    def _segment_embeds(self, seq: Sequence) -> Tensor:
        if seq.segment_embeds is None:
            seq.segment_embeds = self.model.embed_parts(seq.segment)
        return seq.segment_embeds

    def _put(self, seqs: list[Sequence], state: Tensor, values: list, dtype: torch.dtype) -> None:
        if seqs:
            slots = torch.tensor([s.slot for s in seqs], device=self.device)
            state[slots] = torch.tensor(values, dtype=dtype).to(self.device)

    def _init_slots(self, seqs: list[Sequence]) -> None:
        """Per-slot sampling state of sequences that start (their first segment starts)."""
        if not seqs:
            return
        reqs = [s.request for s in seqs]
        self._put(seqs, self.num_out, [0] * len(seqs), torch.long)
        self._put(seqs, self.ignore_stop, [s.ignore_stop_tokens for s in seqs], torch.bool)
        self._put(seqs, self.top_p, [r.ras.top_p for r in reqs], torch.float64)
        self._put(seqs, self.top_k, [r.ras.top_k for r in reqs], torch.long)
        self._put(seqs, self.win_size, [r.ras.win_size for r in reqs], torch.long)
        self._put(seqs, self.tau_r, [r.ras.tau_r for r in reqs], torch.float64)
        self.history[torch.tensor([s.slot for s in seqs], device=self.device)] = -1

    # ------------------------------------------------------------------ CUDA graphs

    def _batch_buckets(self) -> list[int]:
        sizes = [b for b in self.cfg.graph_batch_sizes if b < self.cfg.max_num_seqs]
        return sizes + [self.cfg.max_num_seqs]

    def _kv_buckets(self) -> list[int]:
        sizes, n = [], self.cfg.min_graph_kv_len
        while n < self.cfg.max_model_len:
            sizes.append(n)
            n *= 2
        return sizes + [self.cfg.max_model_len]

    def decode_graph_key(self, batch: int, kv_len: int) -> tuple[int, int]:
        """The (batch, attention length) bucket whose CUDA graph runs a decode step of `batch` rows
        attending over `kv_len` positions."""
        return self._bucket(batch, self._batch_buckets()), self._bucket(kv_len, self._kv_buckets())

    def _prefill_widths(self) -> list[int]:
        if not self.cfg.prefill_graphs:
            return []
        return sorted(w for w in self.cfg.prefill_graph_widths if w <= self.cfg.max_model_len)

    @staticmethod
    def _bucket(n: int, buckets: list[int]) -> int:
        return next(b for b in buckets if b >= n)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Before serving: compile (if asked) every input-shape variant torch.compile specialises
        (batch and length 1 or more), then capture every (batch, attention length) decode graph,
        largest first so that the shared memory pool is sized once. Without it, both happen on
        first use, in the middle of serving."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.cfg.compile and self.device.type == "cuda":
            hidden = self.model.dims.qwen.hidden_size
            for batch, length in ((1, 1), (2, 1), (1, 2), (2, 2)):
                x = torch.zeros(batch, length, hidden, dtype=self.cfg.dtype, device=self.device)
                positions = torch.arange(length, device=self.device).expand(batch, length)
                slots = torch.full((batch,), self.scratch, device=self.device)
                self.model.backbone(x, positions, self.cache, slots, self._kv_buckets()[0])
        if not self.use_graphs:
            return
        for kv_len in reversed(self._kv_buckets()):
            for batch in reversed(self._batch_buckets()):
                self._capture(batch, kv_len)
        for width in reversed(self._prefill_widths()):
            self._capture_prefill(width)

    @torch.inference_mode()
    def _capture(self, batch: int, kv_len: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        slots, uniforms, force = self._graph_slots[:batch], self._graph_uniforms[:batch], self._graph_force[:batch]
        slots.fill_(self.scratch)
        with CAPTURES.capturing("LLM decode step"):
            self.graphs[(batch, kv_len)] = self._captured(lambda: self._decode_rows(slots, uniforms, force, kv_len))
        return self.graphs[(batch, kv_len)]

    @torch.inference_mode()
    def _capture_prefill(self, width: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """The prefill graph of `width` rows, captured on the scratch slot (its inputs are the
        prefill buffers, which a call fills before the replay)."""
        self._prefill_slot.fill_(self.scratch)
        self._prefill_positions.fill_(-1)
        self._prefill_last.zero_()
        with CAPTURES.capturing("LLM prefill"):
            self.prefill_graphs[width] = self._captured(lambda: self._prefill_rows(width))
        return self.prefill_graphs[width]

    def _captured(self, rows) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """rows() (a step's static-shape forward and sampling) run once, then captured as a CUDA
        graph in the runner's pool; returns the graph and its sampled-tokens output."""
        rows()  # warm-up: kernels chosen, lazy buffers made
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        # our own capture stream on our device: torch.cuda.graph's default is one stream per process,
        # made on the device of the first capture (another replica's GPU, with several devices)
        with torch.cuda.graph(graph, pool=self._graph_pool, stream=self._capture_stream,
                              capture_error_mode="thread_local"):
            tokens, _ = rows()
        torch.cuda.synchronize(self.device)
        return graph, tokens

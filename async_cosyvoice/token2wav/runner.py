"""Token2WavRunner: the device half of token2wav. It computes the jobs of many streams together:
flow mels over padded length groups (or through the exact cache), then HiFT over padded groups of
mel frames, then each stream's `finish` (cross-fade, carry, advance)."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from ..graph_buckets import GraphBuckets
from ..models.cosyvoice3.hift import CausalHiFT
from ..models.flow.base import MaskedDiffFlow
from ..models.flow.prefix import FlowState, Geometry
from ..models.hift import HiFT
from .flow_cache import SpeakerPrefixCache, chunk_floor, speaker_prefix_tokens
from .flow_graphs import FlowGraphs
from .hift_graphs import HiFTGraphs, HiFTOutput, render_group
from .slot_calls import SlotCalls
from .state_pool import SlotLease
from .stream import FlowLike, Token2WavJob, Token2WavStream

log = logging.getLogger(__name__)

__all__ = ["Token2WavRunner", "ChunkRecord", "length_groups", "RunnerStats"]


@dataclass
class ChunkRecord:
    """What one token2wav call saw and produced (the golden files' `call<i>/…` arrays)."""
    n_tokens: int
    token_offset: int
    finalize: bool
    flow_streaming: bool
    flow_mel: Tensor             # flow output before the token_offset slice
    hift_in_mel: Tensor          # after the slice, cached mel prepended
    hift_in_cache_source: Tensor  # (1, 1, 0) when there is no cache
    hift_speech: Tensor          # raw HiFT output
    hift_source: Tensor
    out: Tensor                  # (1, n) emitted samples


def length_groups(lengths: Sequence[int], ratio: float, max_size: int | None = None) -> list[list[int]]:
    """Indices of `lengths` grouped for padded batch calls: longest first, a group takes the next
    item while that item is at least (group's longest) / ratio and the group has fewer than
    max_size items. Each item is then padded by less than 1 - 1/ratio of the padded length, and no
    grouping under that rule has fewer groups."""
    if ratio < 1:
        raise ValueError(f"ratio must be >= 1, got {ratio}")
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and lengths[i] * ratio >= lengths[groups[-1][0]] and (max_size is None or len(groups[-1]) < max_size):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class RunnerStats:
    """What the runner has sent to the device (cumulative)."""
    flow_calls: int = 0
    flow_items: int = 0
    flow_frames: int = 0         # mel frames computed (prompt + target, every item)
    flow_padded_frames: int = 0  # mel frames of the padded batches (>= flow_frames)
    flow_cached_frames: int = 0  # mel frames a cached call read from the stream's or speaker's cache
    hift_calls: int = 0
    hift_items: int = 0


class Token2WavRunner:
    """Runs the jobs of distinct streams together: one padded flow call per length group (each CFM
    step one estimator call for all of its streams, conditional and unconditional halves), and
    one HiFT call per length group of mel frames.

    Streaming chunks (the exact flow state cache, token2wav/flow_cache.py; `flow_cache=True`): each job
    computes only the tokens after its stream's cached prefix (`stream.flow_state`, or its
    registered speaker's prompt prefix, `stream.prompt_key`) and keeps the state of its complete
    chunks for the next one. Jobs are grouped by the number of new tokens; in one call the items
    have different cached prefix lengths (prefix.Geometry). Cached calls run the flow's own
    PyTorch estimator; the `estimator` backend runs the final and non-streaming calls (full
    attention, no cache), and with `flow_cache=False` every call, each recomputing the whole
    prefix as upstream does. Every cached chunk equals the recompute within float summation order
    (tests/test_flow_cache.py: 1e-5 in fp32).

    Flow batching rule: the jobs' lengths (cached: new tokens; otherwise prompt + target tokens)
    are grouped by `length_groups(…, length_bucket_ratio, max_flow_batch)`: sorted longest first,
    a job joins the current group while its length is >= the group's longest / ratio, so padding
    is < 1 − 1/ratio of each item's frames (default ratio 1.5: < 33 %). Items are right-padded;
    `Flow.forward` masks padding (causal convolutions, masked attention, per-item look-ahead and
    chunk flags), so each item equals its own call up to float summation order: flow mel within
    1e-5 (measured 1.2e-6), audio within 2e-5 (measured 1.1e-5; HiFT's NSF phase amplifies mel
    differences about 10x), tests/test_batcher.py.

    HiFT: the jobs' mel lengths (8 cached frames + the chunk's) are grouped by the same rule, and
    each group is one call (hift_graphs.render_group): a plain batched call when the lengths are
    equal, else one right-padded call (`HiFT.inference_padded`, exact: every convolution masked,
    each item's own NSF phase, cache_source and STFT reflection at its end), with `hift_graphs`
    one CUDA graph replay per bucket. Plain zero-padding would not be exact: HiFT is not causal,
    and a chunk's right edge is used (its last 3840 samples are cross-faded into the next chunk,
    its source tail seeds the next source).

    `flow` may be any FlowLike (tests use stand-ins); only a real flow (a MaskedDiffFlow: CosyVoice2's or
    CosyVoice3's) is batched and cached,
    others run one job at a time through `flow.inference`. `estimator` (see
    async_cosyvoice.estimator) replaces the flow's own estimator module in `Flow.forward`.
    speaker_cache_bytes: device memory for registered speakers' prompt prefixes (LRU).
    max_cached_tokens: a stream caches no state past this many prompt + target tokens (later
    chunks recompute the frames after it); None: no cap.
    chunked_final: a streaming stream's final call also computes only its new frames against the
    cache, with chunked attention and zero look-ahead. Not exact: upstream's final call uses full
    attention (every earlier frame sees the last tokens), so the final chunk's audio differs
    (measured on the tiny fixture: NOTES-flowcache.md). Off by default.
    flow_graphs: runs the recomputing flow calls (token2wav/flow_graphs.py: the whole call as one CUDA graph
    per bucket, larger calls as before); None: `flow(…, estimator=estimator)`.
    hift_graphs: runs HiFT's padded group calls as CUDA graphs (token2wav/hift_graphs.py); None: eagerly.
    slot_calls: keeps the cache's state in its state pool and runs cached calls through it
    (token2wav/slot_calls.py: one CUDA graph per bucket); None: the state lives on each stream.
    """

    def __init__(self, flow: FlowLike, hift: HiFT | CausalHiFT, recorder: Callable[[ChunkRecord], None] | None = None, *,
                 estimator: Callable[..., Tensor] | None = None, length_bucket_ratio: float = 1.5,
                 max_flow_batch: int | None = None, flow_cache: bool = True, speaker_cache_bytes: int = 2 << 30,
                 max_cached_tokens: int | None = None, chunked_final: bool = False,
                 flow_graphs: FlowGraphs | None = None, hift_graphs: HiFTGraphs | None = None,
                 slot_calls: SlotCalls | None = None):
        if length_bucket_ratio < 1:
            raise ValueError(f"length_bucket_ratio must be >= 1, got {length_bucket_ratio}")
        if max_cached_tokens is not None and max_cached_tokens < 0:
            raise ValueError(f"max_cached_tokens must be >= 0 or None, got {max_cached_tokens}")
        self.flow = flow
        self.hift = hift
        self.recorder = recorder
        self.estimator = estimator
        self.length_bucket_ratio = length_bucket_ratio
        self.max_flow_batch = max_flow_batch
        self.stats = RunnerStats()
        # CUDA: token2wav's own stream, made here: the device thread and the capture thread both use it
        self._cuda_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._batched_flow = isinstance(flow, MaskedDiffFlow)
        self.flow_cache = flow_cache and self._batched_flow
        # the cache's state: in a pool of slots (slot_calls.pool; graph-capturable) or per stream
        self.slot_calls = slot_calls if self.flow_cache else None
        self.state_pool = None if self.slot_calls is None else self.slot_calls.pool
        self.speaker_prefixes = SpeakerPrefixCache(speaker_cache_bytes) if self.state_pool is None else self.state_pool
        self.max_cached_tokens = max_cached_tokens
        self.chunked_final = chunked_final
        # the recomputing flow calls: whole-call CUDA graphs where a bucket fits, else the flow with the estimator
        self._flow_call = (flow_graphs if flow_graphs is not None else
                           functools.partial(flow, estimator=estimator) if self._batched_flow else None)
        self.flow_graphs = flow_graphs
        self.hift_graphs = hift_graphs
        if self.flow_cache and estimator is not None and getattr(estimator, "name", "torch") != "torch":
            log.info("flow state cache on: streaming chunks run the flow's PyTorch estimator against their cached "
                     "prefix; the %s estimator runs final and non-streaming calls (token2wav.flow_cache: false "
                     "runs every call on it, recomputing the prefix)", estimator.name)

    @property
    def device(self) -> torch.device:
        return next(self.hift.parameters()).device

    @property
    def causal_vocoder(self) -> bool:
        """The vocoder is CosyVoice3's CausalHiFT: streams carry carry.CausalCarry."""
        return isinstance(self.hift, CausalHiFT)

    def cuda_stream(self):
        """Context for token2wav's device work (the device thread's, and the capture thread's
        example inputs): on CUDA, our own stream, so syncs wait for token2wav's kernels only, not the
        LM's."""
        return torch.cuda.stream(self._cuda_stream)

    @torch.inference_mode()
    def flow_mel(self, job: Token2WavJob) -> Tensor:
        """One job's flow mel (1, 80, T) for its target tokens (prompt excluded)."""
        return self.flow_mels([job])[0]

    @torch.inference_mode()
    def flow_mels(self, jobs: Sequence[Token2WavJob]) -> list[Tensor]:
        """The flow mels of jobs of distinct streams, batched by length group."""
        out: list[Tensor | None] = [None] * len(jobs)
        full, cached = [], []
        for i, job in enumerate(jobs):
            s = job.stream
            if job.finalize and job.hop == 0:  # nothing new: the mel after 2*offset would be empty
                out[i] = s.prompt_feat.new_zeros(1, s.prompt_feat.shape[2], 0).to(self.device)
            elif not self._batched_flow:
                dev = self.device
                out[i] = self.flow.inference(job.tokens.to(dev), s.prompt_token.to(dev), s.prompt_feat.to(dev),
                                             s.embedding.to(dev), streaming=job.streaming, finalize=job.finalize)
            elif self.flow_cache and (job.streaming or (self.chunked_final and job.finalize and s.stream)):
                cached.append(i)
            else:
                full.append(i)
            if job.finalize and i not in cached:
                s.flow_state = None  # full attention from here on: the cache is of no further use
        if self.state_pool is not None:
            plans = {i: self._slot_plan(jobs[i]) for i in cached}
            full += [i for i in cached if plans[i] is None]
            cached = [i for i in cached if plans[i] is not None]
            cached_run = lambda idx: self._flow_slots([jobs[i] for i in idx], [plans[i] for i in idx])  # noqa: E731
            cached_lengths = [plans[i][2] - plans[i][1] for i in cached]
        else:
            plans = {i: self._cached_plan(jobs[i]) for i in cached}
            cached_run = lambda idx: self._flow_cached([jobs[i] for i in idx], [plans[i] for i in idx])  # noqa: E731
            cached_lengths = [plans[i][1] for i in cached]
        for i, job in enumerate(jobs):
            if job.finalize and i not in cached:
                self._release(job.stream)  # its slot's state is of no further use
        for todo, lengths, run in (
                (full, [jobs[i].stream.prompt_token.shape[1] + jobs[i].n_tokens for i in full],
                 lambda idx: self._flow_batch([jobs[i] for i in idx])),
                (cached, cached_lengths, cached_run)):
            for group in length_groups(lengths, self.length_bucket_ratio, self.max_flow_batch):
                idx = [todo[g] for g in group]
                for i, mel in zip(idx, run(idx)):
                    out[i] = mel
        return out

    def _flow_batch(self, jobs: Sequence[Token2WavJob]) -> list[Tensor]:
        """One padded Flow.forward over jobs -> each job's (1, 80, T_b) target mel (views into the batch)."""
        flow = self.flow
        n_context = flow.dims.pre_lookahead_len
        lengths = [j.stream.prompt_token.shape[1] + j.n_tokens for j in jobs]
        tokens, prompt_feat, feat_lens, embedding = self._batch_inputs(jobs, [(0, n) for n in lengths])
        contexts = [0 if j.finalize else n_context for j in jobs]
        token_lens = torch.tensor([n - c for n, c in zip(lengths, contexts)])
        flags = [j.streaming for j in jobs]
        streaming = flags[0] if len(set(flags)) == 1 else torch.tensor(flags)
        mel, mel_lens = self._flow_call(tokens, token_lens, torch.tensor(contexts), prompt_feat, feat_lens, embedding,
                                        streaming)
        mel_lens = mel_lens.tolist()
        B = len(jobs)
        st = self.stats
        st.flow_calls += 1
        st.flow_items += B
        st.flow_frames += sum(mel_lens)
        st.flow_padded_frames += B * mel.shape[2]
        return [mel[b:b + 1, :, j.stream.prompt_feat.shape[1]:mel_lens[b]] for b, j in enumerate(jobs)]

    def _batch_inputs(self, jobs: Sequence[Token2WavJob], windows: Sequence[tuple[int, int]]
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Padded flow inputs on the device: tokens (B, S) int32 holding tokens [lo, hi) of each job's
        prompt + target sequence, prompt_feat (B, F, 80), prompt_feat lengths (B,), embedding (B, 192).
        The prompts stay on the device (copied there once per stream); the target tokens come from
        the host."""
        dev = self.device
        tokens = self._window_tokens(jobs, windows)
        feats = [j.stream.prompt_feat[0] for j in jobs]
        prompt_feat = torch.zeros(len(jobs), max(f.shape[0] for f in feats), feats[0].shape[1], dtype=feats[0].dtype,
                                  device=dev)
        for b, f in enumerate(feats):
            prompt_feat[b, :f.shape[0]] = f
        feat_lens = torch.tensor([f.shape[0] for f in feats], device=dev)
        embedding = torch.cat([j.stream.embedding.reshape(1, -1).to(dev) for j in jobs])
        return tokens, prompt_feat, feat_lens, embedding

    def _window_tokens(self, jobs: Sequence[Token2WavJob], windows: Sequence[tuple[int, int]]) -> Tensor:
        """(B, S) int32 on the device: tokens [lo, hi) of each job's prompt + target sequence, right-padded."""
        dev = self.device
        tokens = torch.zeros(len(jobs), max(hi - lo for lo, hi in windows), dtype=torch.int32, device=dev)
        for b, (j, (lo, hi)) in enumerate(zip(jobs, windows)):
            prompt = j.stream.prompt_token.reshape(-1)
            P = prompt.numel()
            if lo < P:
                tokens[b, :min(hi, P) - lo] = prompt[lo:min(hi, P)]
            if hi > P:
                first = max(lo, P)
                tokens[b, first - lo:hi - lo] = j.tokens.reshape(-1)[first - P:hi - P].to(dev, non_blocking=True)
        return tokens

    # -- the exact flow state cache (token2wav/flow_cache.py)

    def _cached_plan(self, job: Token2WavJob) -> tuple[FlowState | None, int, int]:
        """(state to start from, new tokens to compute, tokens to keep) for a streaming job."""
        s = job.stream
        P = s.prompt_token.shape[1]
        end = P + job.n_tokens - (0 if job.finalize else self.flow.dims.pre_lookahead_len)
        state = s.flow_state
        if state is None or state.tokens > P + job.token_offset:  # none yet, or a job re-run: restart
            state = self._speaker_prefix(s)
        start = 0 if state is None else state.tokens
        keep = chunk_floor(end, self.flow.chunk_tokens) if not job.finalize else 0
        if self.max_cached_tokens is not None:
            keep = min(keep, chunk_floor(self.max_cached_tokens, self.flow.chunk_tokens))
        return state, end - start, max(start, keep)

    # -- the cache's state in a pool of slots (token2wav/state_pool.py, slot_calls.py)

    def _release(self, s: Token2WavStream) -> None:
        if s.flow_lease is not None:
            s.flow_lease.release()
            s.flow_lease = None

    def _slot_plan(self, job: Token2WavJob) -> tuple[SlotLease, int, int, int] | None:
        """(lease, start, end, keep) of a streaming job through the state pool, or None: it
        recomputes (no slot free, or the stream has outgrown its slot)."""
        s, pool, dims = job.stream, self.state_pool, self.flow.dims
        chunk = dims.chunk_tokens
        P = s.prompt_token.shape[1]
        end = P + job.n_tokens - dims.pre_lookahead_len
        if job.finalize or end > pool.slot_tokens:  # a final call: full attention, recomputed
            if s.flow_lease is not None and not job.finalize:
                pool.stats.outgrown += 1
            self._release(s)
            return None
        lease = s.flow_lease
        if lease is None or lease.tokens > P + job.token_offset:  # none yet, or a job re-run: restart
            if lease is None and (lease := pool.lease()) is None:
                return None
            s.flow_lease = lease
            lease.tokens = self._start_slot(s, lease.slot)
        keep = chunk_floor(end, chunk)
        if self.max_cached_tokens is not None:
            keep = min(keep, chunk_floor(self.max_cached_tokens, chunk))
        return lease, lease.tokens, end, max(lease.tokens, keep)

    def _start_slot(self, s: Token2WavStream, slot: int) -> int:
        """Fill a stream's new slot: its speaker's cached prefix (one copy) or just its prompt.
        Returns the tokens of state the slot holds."""
        prefix = self._speaker_slot(s)
        if prefix is not None:
            self.state_pool.copy_slot(prefix[0], slot, prefix[1])
            return prefix[1]
        self.state_pool.load_prompt(slot, s.prompt_feat, s.embedding)
        return 0

    def _speaker_slot(self, s: Token2WavStream) -> tuple[int, int] | None:
        """(slot, tokens) of the stream's speaker prefix in the pool (computed on a miss), or None."""
        pool, dims = self.state_pool, self.flow.dims
        n = speaker_prefix_tokens(s.prompt_token.shape[1], dims.chunk_tokens, dims.pre_lookahead_len)
        if s.prompt_key is None or n == 0 or pool.n_speaker_slots == 0 or n > pool.slot_tokens:
            return None
        tokens = s.prompt_token.reshape(-1)[:n + dims.pre_lookahead_len].cpu()
        slot = pool.speaker(s.prompt_key, tokens)
        if slot is None:
            slot = pool.speaker_slot(s.prompt_key, tokens)
            pool.load_prompt(slot, s.prompt_feat, s.embedding)
            self.slot_calls(tokens[None], [slot], [0], [n], [n])
            self._count_flow_call(1, dims.token_mel_ratio * n, dims.token_mel_ratio * n, 0)
        return slot, n

    def _flow_slots(self, jobs: Sequence[Token2WavJob], plans: Sequence[tuple[SlotLease, int, int, int]]
                    ) -> list[Tensor]:
        """One cached call through the state pool: each job computes tokens [start, end) of its
        slot and leaves [0, keep) there. Returns each job's (1, 80, T_b) target mel."""
        ratio, n_context = self.flow.dims.token_mel_ratio, self.flow.dims.pre_lookahead_len
        starts = [start for _, start, _, _ in plans]
        ends = [end for _, _, end, _ in plans]
        tokens = self._window_tokens(jobs, [(s, e + n_context) for s, e in zip(starts, ends)])
        new = [e - s for s, e in zip(starts, ends)]
        self.slot_calls(tokens, [lease.slot for lease, *_ in plans], starts, ends, [k for *_, k in plans])
        self._count_flow_call(len(jobs), ratio * sum(new), len(jobs) * ratio * max(new), ratio * sum(starts))
        out = []
        for j, (lease, start, end, keep) in zip(jobs, plans):
            lease.tokens = keep
            P = j.stream.prompt_token.shape[1]
            out.append(self.state_pool.mel[lease.slot, ratio * P:ratio * end].T.unsqueeze(0).clone())
        return out

    def _count_flow_call(self, items: int, frames: int, padded_frames: int, cached_frames: int) -> None:
        st = self.stats
        st.flow_calls += 1
        st.flow_items += items
        st.flow_frames += frames
        st.flow_padded_frames += padded_frames
        st.flow_cached_frames += cached_frames

    def prepare_speaker(self, stream: "Token2WavStream") -> bool:
        """Compute and cache a registered speaker's prompt prefix now (the stream names it by
        prompt_key), so its first request does not pay for it; False if there is none to keep (the
        flow cache is off, the prompt is too short or past the cache budget)."""
        if not self.flow_cache or stream.prompt_key is None:
            return False
        with self.cuda_stream():  # the batches' stream: they see the prefix complete
            if self.state_pool is not None:
                self._speaker_slot(stream)
            else:
                self._speaker_prefix(stream)
        return stream.prompt_key in self.speaker_prefixes

    def _speaker_prefix(self, s: "Token2WavStream") -> FlowState | None:
        """The stream's speaker prompt prefix (computed on a miss), or None (ad-hoc prompt, or too short)."""
        key = s.prompt_key
        dims = self.flow.dims
        n = speaker_prefix_tokens(s.prompt_token.shape[1], self.flow.chunk_tokens, dims.pre_lookahead_len)
        if key is None or n == 0 or self.speaker_prefixes.budget_bytes == 0:
            return None
        tokens = s.prompt_token.reshape(-1)[:n + dims.pre_lookahead_len].cpu()
        state = self.speaker_prefixes.get(key, tokens)
        if state is None:
            dev = self.device
            _, (state,) = self.flow.forward_cached(tokens[None].to(dev), Geometry([0], [n], [n], dev),
                                                   s.prompt_feat.to(dev),
                                                   torch.tensor([s.prompt_feat.shape[1]], device=dev),
                                                   s.embedding.reshape(1, -1).to(dev), [None])
            self.stats.flow_calls += 1
            self.stats.flow_items += 1
            self.stats.flow_frames += dims.token_mel_ratio * n
            self.stats.flow_padded_frames += dims.token_mel_ratio * n
            self.speaker_prefixes.put(key, state, tokens)
        return state

    def _flow_cached(self, jobs: Sequence[Token2WavJob], plans: Sequence[tuple[FlowState | None, int, int]]
                     ) -> list[Tensor]:
        """One cached Flow call over streaming jobs (with their `_cached_plan`s): each computes the
        tokens after its cached prefix. Updates each stream's flow_state; returns each job's
        (1, 80, T_b) target mel."""
        flow, dev = self.flow, self.device
        n_context, ratio = flow.dims.pre_lookahead_len, flow.dims.token_mel_ratio
        starts = [0 if state is None else state.tokens for state, _, _ in plans]
        ends = [start + n for start, (_, n, _) in zip(starts, plans)]
        g = Geometry(starts, ends, [keep for _, _, keep in plans], dev)
        B = len(jobs)
        contexts = [0 if j.finalize else n_context for j in jobs]
        tokens, prompt_feat, feat_lens, embedding = self._batch_inputs(
            jobs, [(s, e + c) for s, e, c in zip(starts, ends, contexts)])
        mel, states = flow.forward_cached(tokens, g, prompt_feat, feat_lens, embedding,
                                          [state for state, _, _ in plans], contexts)
        self._count_flow_call(B, ratio * sum(g.new), B * mel.shape[2], ratio * sum(starts))
        out = []
        for b, (j, (old, _, _), state) in enumerate(zip(jobs, plans, states)):
            j.stream.flow_state = None if j.finalize else state
            # the target mel from frame 0: the cached frames' mel is what they had when they were new
            # (a complete chunk's frames are the same on every later call), then this call's frames
            new = mel[b:b + 1, :, :ratio * g.new[b]]
            mel_b = torch.cat([*old.mel, new], dim=2) if old is not None else new
            out.append(mel_b[:, :, ratio * j.stream.prompt_token.shape[1]:])
        return out

    def graph_holders(self) -> list[GraphBuckets]:
        """What captures CUDA graphs by bucket here: the flow's, HiFT's and the cached flow's graphs,
        and the estimator where it is a CompiledEstimator."""
        found = (self.flow_graphs, self.hift_graphs, self.slot_calls, self.estimator)
        return [g for g in found if isinstance(g, GraphBuckets) and g.cuda_graphs]

    @property
    def wants_capture(self) -> bool:
        """Some bucket ran without a graph and waits for its capture (`capture_wanted`)."""
        return any(g.wanted for g in self.graph_holders())

    def capture_wanted(self) -> bool:
        """Capture one wanted CUDA graph (GraphBuckets.capture_wanted of the first holder that wants
        one); returns whether a capture ran. The batcher calls it in its capture thread, beside the
        device thread's batches: a capture takes 1-2 s (compiled regions)."""
        with self.cuda_stream():
            return any(g.capture_wanted() for g in self.graph_holders())

    def capture_all_wanted(self) -> int:
        """`capture_wanted` until nothing is wanted (the warm-up's end, a benchmark between rounds);
        returns how many captures ran. One thread at a time."""
        n = 0
        while self.capture_wanted():
            n += 1
        return n

    def run(self, job: Token2WavJob) -> Tensor:
        """Compute one job and apply it to its stream; returns the emitted samples (1-D float32, CPU)."""
        return self.run_many([job])[0]

    @torch.no_grad()
    def run_many(self, jobs: Sequence[Token2WavJob]) -> list[Tensor]:
        """Compute jobs of distinct streams (flow by length group, HiFT by length group too), apply
        each to its stream, and return each job's samples (1-D float32, CPU)."""
        if len({id(j.stream) for j in jobs}) != len(jobs):
            raise ValueError("run_many takes at most one job per stream (a stream's chunks are sequential)")
        for job in jobs:
            job.stream._check(job)
        with self.cuda_stream():
            return self._run_many(jobs)

    def _run_many(self, jobs: Sequence[Token2WavJob]) -> list[Tensor]:
        flow_mels = self.flow_mels(jobs)
        inputs = [job.stream.hift_input(job, mel) for job, mel in zip(jobs, flow_mels)]

        hift_out: list[HiFTOutput | None] = [None] * len(jobs)
        for group in length_groups([mel.shape[2] for mel, _ in inputs], self.length_bucket_ratio):
            group_out = render_group(self.hift, self.hift_graphs, [inputs[i][0] for i in group],
                                     [inputs[i][1] for i in group], [jobs[i].stream.noise for i in group],
                                     [jobs[i].finalize for i in group])
            self.stats.hift_calls += 1
            self.stats.hift_items += len(group)
            for i, out in zip(group, group_out):
                hift_out[i] = out

        outs = []
        for job, flow_mel, (mel, cache), (speech, source) in zip(jobs, flow_mels, inputs, hift_out):
            out = job.stream.finish(job, mel, speech, source)
            if self.recorder is not None:
                self.recorder(ChunkRecord(
                    n_tokens=job.n_tokens, token_offset=job.token_offset, finalize=job.finalize,
                    flow_streaming=job.streaming, flow_mel=flow_mel, hift_in_mel=mel,
                    hift_in_cache_source=cache if cache is not None else mel.new_zeros(1, 1, 0),
                    hift_speech=speech, hift_source=source, out=out.reshape(1, -1)))
            outs.append(out.cpu())
        return outs

    def render(self, stream: Token2WavStream, tokens: Sequence[int] | Tensor) -> list[Tensor]:
        """Append the rest of a stream's tokens (LLM done) and compute every chunk, in order."""
        stream.append(tokens)
        chunks = []
        while (job := stream.next_job(llm_done=True)) is not None:
            chunks.append(self.run(job))
        return chunks

"""Speech tokens -> 24 kHz audio: the per-request chunk schedule and its execution.

Two halves, kept apart so a cross-stream batcher can run many streams' chunks together:

- plan: `Token2WavStream` is one segment's state (prompt on the device, the speech tokens so far
  in a growing buffer, hop schedule, token offset, vocoder carry). `append(tokens)` adds what the
  LM produced; `next_job(llm_done)` says what to compute next, or None (wait for tokens). Planning
  changes nothing; a job is applied to its stream exactly once, in order.
- run: `Token2WavRunner.run_many(jobs)` computes jobs of many streams with a Flow and a HiFT module:
      flow mel  = Flow.forward over padded length groups (batched across streams)
      mel, cache = stream.hift_input(job, flow mel)      (pure)
      speech, source = render_group(hift, …)             (one padded call per length group)
      samples = stream.finish(job, mel, speech, source)  (the carry, advance)

Schedule (facts sheet §5, upstream `CosyVoice2Model.tts` / `token2wav`), except that the hop
state belongs to one request (upstream mutates a hop shared by all requests):
- streaming: the first chunk covers `first_hop + pad` tokens, pad = ceil(P/align)*align - P
  (align = first_hop by default), so later chunks line up with the flow's chunk masks counted
  from the prompt start; later hops double up to `max_hop_multiple * first_hop`. A chunk runs
  once hop + 3 lookahead tokens past the offset exist; the flow sees every token up to
  offset + hop + 3 with chunked attention, and the mel after 2*offset is kept. When the LLM is
  done and no full chunk is left, one final call renders the rest with full attention.
- non-streaming: a single final call over all tokens; `speed` != 1 resamples its mel.
- the vocoder's state between chunks is a carry (carry.py): CosyVoice2's HiFT cross-fades 3840
  samples and carries 8 mel frames and the source tail; CosyVoice3's causal HiFT (causal_vocoder)
  re-vocodes every mel frame so far and emits the samples past the previous end.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch
from torch import Tensor

from ..models.flow.prefix import FlowState
from ..models.hift import NSFNoise
from ..request import ChunkTiming
from .carry import CausalCarry, CrossfadeCarry, VocoderCarry, crossfade
from .schedule import ChunkSchedule, adaptive_hop
from .state_pool import SlotLease

__all__ = ["Token2WavJob", "Token2WavStream", "FlowLike", "crossfade", "request_noise"]


class FlowLike(Protocol):
    def inference(self, token: Tensor, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor,
                  streaming: bool, finalize: bool) -> Tensor:
        """-> mel (1, 80, T_new) for the target tokens (prompt excluded)."""
        ...


@dataclass(frozen=True, eq=False)
class Token2WavJob:
    """One flow + HiFT call for one stream."""
    stream: "Token2WavStream" = field(repr=False)
    index: int                # chunk number within the stream
    tokens: Tensor            # (1, n_tokens) int32: every target token the flow sees
    token_offset: int         # tokens already rendered; the flow mel before 2*offset is dropped
    hop: int                  # tokens this job renders (for the final job: all that remain)
    finalize: bool
    streaming: bool           # chunked (True) or full (False) attention in the flow
    timing: ChunkTiming = field(default_factory=ChunkTiming, compare=False)  # filled by the utterance and the batcher

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[1])


class Token2WavStream:
    """One segment's token2wav state. Not shared; dropped with its Utterance.

    Thread use: `append`, `next_job` and `after_chunk` run on the event loop; `hift_input` and
    `finish` run in the token2wav device thread while the stream's one job is in flight, and
    nothing else touches the stream then (a stream has at most one job in flight).
    """

    def __init__(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor, *, stream: bool = True,
                 schedule: ChunkSchedule = ChunkSchedule(), speed: float = 1.0, noise: NSFNoise | None = None,
                 device: torch.device | str | None = None, prompt_key: str | None = None,
                 causal_vocoder: bool = False):
        """prompt_token (1, P) speech ids, prompt_feat (1, token_mel_ratio*P, 80) prompt mel,
        embedding (1, 192) x-vector, moved to `device` once (the runner's device; None: left where
        they are). noise: the NSF policy of every HiFT call (None: torch's default RNG, like
        upstream). prompt_key: names a registered speaker's prompt (shared prompt state may be
        cached under it); None for a prompt of this request only. causal_vocoder: the vocoder is
        CosyVoice3's CausalHiFT (its carry is carry.CausalCarry). Inputs are trusted: the
        request rules (async_cosyvoice.rules) have checked speed and hops."""
        prompt_token = torch.as_tensor(prompt_token).reshape(1, -1).to(torch.int32)
        n_prompt = prompt_token.shape[1]
        if prompt_feat.dim() != 3 or prompt_feat.shape[0] != 1 or prompt_feat.shape[1] != schedule.token_mel_ratio * n_prompt:
            raise ValueError(f"prompt_feat must be (1, {schedule.token_mel_ratio * n_prompt}, 80) for {n_prompt} prompt "
                             f"tokens, got {tuple(prompt_feat.shape)}")
        self.prompt_token = prompt_token.to(device) if device is not None else prompt_token
        self.prompt_feat = prompt_feat.to(device) if device is not None else prompt_feat
        embedding = embedding.reshape(1, -1)
        self.embedding = embedding.to(device) if device is not None else embedding
        self.prompt_key = prompt_key
        self.stream = stream
        self.schedule = schedule
        self.speed = speed
        self.noise = noise
        self.pad = schedule.first_hop_pad(n_prompt) if stream else 0
        self.hop = schedule.first_hop   # next non-first hop; doubles (or adapts) after each chunk
        self.token_offset = 0
        self.chunks_done = 0
        self.samples_emitted = 0
        self.finished = False
        self._tokens = torch.empty(64, dtype=torch.int32)  # CPU; grows by doubling, never re-packed
        self._n = 0
        self.carry: VocoderCarry = CausalCarry() if causal_vocoder else CrossfadeCarry(schedule)
        self.flow_state: FlowState | None = None  # the runner's: the exact flow state cache (token2wav/flow_cache.py)
        self.flow_lease: SlotLease | None = None  # the runner's: the stream's slot in its state pool (state_pool.py)

    # -- the tokens

    @property
    def n_tokens(self) -> int:
        return self._n

    @property
    def tokens(self) -> Tensor:
        """(n_tokens,) int32: every target token so far (a view; later appends do not change it)."""
        return self._tokens[:self._n]

    def append(self, tokens: Sequence[int] | Tensor) -> None:
        """Add speech tokens the LM produced."""
        new = torch.as_tensor(tokens, dtype=torch.int32).reshape(-1)
        n = self._n + new.numel()
        if n > self._tokens.numel():
            grown = torch.empty(max(n, 2 * self._tokens.numel()), dtype=torch.int32)
            grown[:self._n] = self._tokens[:self._n]
            self._tokens = grown
        self._tokens[self._n:n] = new
        self._n = n

    # -- plan

    def next_job(self, llm_done: bool) -> Token2WavJob | None:
        """The next job given the tokens so far, or None if it must wait for more.
        Pure: calling it again before the job is finished returns an equal job."""
        if self.finished:
            return None
        n = self._n
        if self.stream:
            hop = self.hop + (self.pad if self.chunks_done == 0 else 0)
            end = self.token_offset + hop + self.schedule.pre_lookahead
            if n >= end:
                return self.job_until(end, hop, finalize=False, streaming=True)
        if not llm_done:
            return None
        return self.job_until(n, n - self.token_offset, finalize=True, streaming=False)

    def job_until(self, end: int, hop: int, finalize: bool, streaming: bool) -> Token2WavJob:
        """The next job (chunk `chunks_done`, from `token_offset`) over the first `end` tokens."""
        return Token2WavJob(self, self.chunks_done, self._tokens[:end].reshape(1, -1), self.token_offset, hop,
                            finalize, streaming)

    def after_chunk(self, lead_s: float, chunk_s: float, token_s: float) -> None:
        """Adapt the next hop to the listener (the service's adaptive schedule, `adaptive_hop`):
        lead_s is audio sent but not yet played, chunk_s the last chunk's time in token2wav,
        token_s the recent time per LM token."""
        if not self.finished and self.stream:
            self.hop = adaptive_hop(self.schedule, self.hop, self._n - self.token_offset, lead_s, chunk_s, token_s)

    # -- run (the model calls are the runner's)

    def _check(self, job: Token2WavJob):
        if job.stream is not self:
            raise ValueError("job belongs to another stream")
        if self.finished or job.index != self.chunks_done:
            raise RuntimeError(f"stale job {job.index}: stream has finished {self.chunks_done} chunks"
                               + (" and is done" if self.finished else ""))

    def hift_input(self, job: Token2WavJob, flow_mel: Tensor) -> tuple[Tensor, Tensor | None]:
        """Flow output (1, 80, 2*(n_tokens[-3])) -> (mel for HiFT, cache_source or None)."""
        self._check(job)
        return self.carry.hift_input(flow_mel[:, :, job.token_offset * self.schedule.token_mel_ratio:], job.finalize,
                                     self.speed)

    def finish(self, job: Token2WavJob, hift_mel: Tensor, speech: Tensor, source: Tensor | None) -> Tensor:
        """Apply a job's HiFT output: the carry (cross-fade and caches, or the causal offset), the
        schedule. hift_mel (1, 80, T) from hift_input, speech (1, S) and source (1, 1, S') the
        vocoder's. Returns the samples to emit, a 1-D float32 tensor on speech's device."""
        self._check(job)
        out = self.carry.finish(hift_mel, speech, source, job.finalize).reshape(-1).to(torch.float32)
        self.advance(job, out.numel())
        return out

    def advance(self, job: Token2WavJob, n_samples: int) -> None:
        """The plan's half of applying a job (offset, next hop, chunk count, done): `finish` does it;
        a stream whose jobs render in another process (token2wav/process.py) does it on its own."""
        self._check(job)
        sched = self.schedule
        if job.finalize:
            self.finished = True
            self.token_offset = job.n_tokens
        else:
            self.token_offset += job.hop
            self.hop = min(sched.max_hop, self.hop * sched.hop_scale)
        self.chunks_done += 1
        self.samples_emitted += n_samples


def request_noise(seed: int | None, segment: int, device: torch.device | str = "cpu") -> NSFNoise:
    """A segment's NSF noise, drawn by a generator on the token2wav device: on a GPU, drawing a
    chunk's (length x 9) normals on the CPU made HiFT 15x slower (benchmarks/hift_batch.py: 5463 vs
    366 ms for 64 x 10 s on an H200). A seed gives the same audio on the same kind of device; CPU
    and CUDA generators draw different numbers. None: a random seed."""
    if seed is None:
        return NSFNoise.random(torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**62, ()).item())))
    return NSFNoise.random(torch.Generator(device=device).manual_seed(seed * 1000 + segment))

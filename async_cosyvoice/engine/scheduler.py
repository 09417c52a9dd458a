"""Which sequences run in the next engine step, under a token budget.

Every step decodes one token for every decoding sequence (1 budget token each), and fills what
is left of `max_num_batched_tokens` with input-segment chunks (a prompt, or a bistream segment):
first the running sequences part-way through or at the start of a segment, then waiting ones in
arrival order while a KV slot is free. A running bistream sequence that waits for text has
neither and is left out of the step. The prefill batch is padded to its longest chunk, so its cost is counted as
rows x longest chunk; a prompt that does not fit is split across steps (chunked prefill). Decodes
are never postponed for prompts, so a long prompt cannot stall the streams already running.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .sequence import Sequence, SeqStatus


@dataclass(frozen=True)
class PrefillChunk:
    seq: Sequence
    start: int  # positions [start, end) of the sequence's current segment are fed this step
    end: int

    @property
    def is_last(self) -> bool:
        return self.end == self.seq.segment_end


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode_kv_len: int = 0  # cache positions the decode batch must attend over

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)

    @property
    def sequences(self) -> list[Sequence]:
        return self.decode + [c.seq for c in self.prefill]


class Scheduler:
    def __init__(self, num_slots: int, max_num_batched_tokens: int):
        if max_num_batched_tokens < num_slots:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({num_slots}): every running sequence decodes one token per step")
        self.num_slots = num_slots
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.free_slots: deque[int] = deque(range(num_slots))

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def release(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and free its slot at once."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
        seq.status = SeqStatus.FINISHED

    def schedule(self) -> StepPlan:
        plan = StepPlan(decode=[s for s in self.running if s.decoding])
        plan.decode_kv_len = max((s.context_len for s in plan.decode), default=0)
        budget = self.max_num_batched_tokens - len(plan.decode)
        width = 0  # longest chunk so far; the padded prefill costs rows * width

        def take(seq: Sequence) -> bool:
            nonlocal width
            cap = budget // (len(plan.prefill) + 1)  # widest chunk that keeps the padded batch in budget
            if cap < 1 or cap < width:
                return False
            end = seq.num_cached + min(seq.segment_end - seq.num_cached, cap)
            plan.prefill.append(PrefillChunk(seq, seq.num_cached, end))
            width = max(width, end - seq.num_cached)
            return True

        for seq in self.running:
            if seq.needs_prefill and not take(seq):
                return plan
        while self.waiting and self.free_slots:
            seq = self.waiting[0]
            if seq.needs_prefill and not take(seq):
                break  # a bistream sequence still waiting for text takes its slot now
            self.waiting.popleft()
            seq.slot = self.free_slots.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        return plan

    def usage(self) -> float:
        return len(self.running) / self.num_slots

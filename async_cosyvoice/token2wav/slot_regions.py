"""The cached flow call over state slots (slot_calls.py) compiled by regions: every repeated block
of the flow (`repeated_blocks`: CosyVoice2's estimator transformer and resnet blocks and its
encoder's conformer layers; CosyVoice3's DiT blocks) runs through one torch.compile'd program of
its class, shared by all its instances, CFM steps and buckets; the glue between the blocks (the
masks, the time embedding, the causal convs outside the blocks, the solver) runs eagerly, and the
CUDA graph of the bucket (slot_calls.py) captures both.

Why not the whole call as one program (the first compiled step, CompiledSlotCall, now gone):
Dynamo traced every block instance with its cache reads and writes (CosyVoice2: 56 transformer
blocks, 14 resnets, 10 conformer layers, per CFM step) for each bucket shape family; on an H200
that set-up did not finish within ~6 minutes, on the CPU it took ~7x the regional one
(docs/flow-cache.md). By regions a block class is traced once per shape family.

A block's program is `_run_block`, a function of tensors and ints only: it gets the block's own
state entries (a slice of the call's, as a fresh SlotCursor) and rebuilds the geometry from the
call's tensors and (N, K), so Dynamo guards on neither the block's place in the walk (an int that
differs per layer) nor the call's buckets (dynamic ints). How many entries a block walks is
recorded from its first call, which runs eagerly: the layout walk at construction
(MaskedDiffFlow.state_layout). The slot entries it is given are written in place (inductor keeps
index_put_ / index_copy_ on graph inputs; tests/test_slot_regions.py checks the pool's storage).

Each class's programs are a recompile region of their own (`isolate_recompiles`), so the
recompute estimator's programs of the same block classes (compile_estimator) do not count
against them, with room for every shape family the warm-up meets (`RECOMPILE_LIMIT`). A torch
whose torch.compile has no recompile regions (the GPU image had 2.11; these tests run 2.13) gets
a copy of `_run_block`'s code per class instead, each with programs of its own, and Dynamo's
process-wide recompile limit raised to RECOMPILE_LIMIT (`block_program`). A compiler failure
falls back to eager, for every block, with one warning.
"""
from __future__ import annotations

import logging
import types
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ..estimator.regions import regional, repeated_blocks
from ..models.flow.base import MaskedDiffFlow
from ..models.flow.prefix import SlotCursor, SlotGeometry

log = logging.getLogger(__name__)

__all__ = ["RECOMPILE_LIMIT", "SlotRegions"]

# programs per block class: weight shapes (CosyVoice2's resnets: 3) x input layouts x a batch of one
# (specialised) or more x keys short of a slot's capacity or all of it, with room to spare
RECOMPILE_LIMIT = 64


def _run_block(block: nn.Module, inputs: tuple[Tensor, ...], slots: Tensor, start: Tensor, end: Tensor,
               keep: Tensor, entries: list[Tensor], N: int, K: int) -> Tensor:
    """block(*inputs, cache) over its own state entries: what a block class's program compiles."""
    return block(*inputs, (SlotCursor(entries), SlotGeometry(slots, start, end, keep, N, K)))


def block_program(cls: type[nn.Module], options: dict | None) -> tuple[Callable, Callable[[], int]]:
    """The compiled `_run_block` of one block class, and how many programs it holds so far."""
    try:
        program = torch.compile(_run_block, dynamic=True, options=options, isolate_recompiles=True,
                                recompile_limit=RECOMPILE_LIMIT)
    except TypeError:  # a torch.compile without recompile regions
        code = _run_block.__code__.replace(co_name=f"_run_{cls.__name__}")
        own = types.FunctionType(code, _run_block.__globals__, code.co_name)
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, limit, max(getattr(config, limit), RECOMPILE_LIMIT))
        return (torch.compile(own, dynamic=True, options=options),
                lambda: len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code)))
    region = program._isolate_recompiles_id
    return program, lambda: len(torch._dynamo.eval_frame._get_cache_entries_for_region(_run_block.__code__, region))


class SlotRegions:
    """`flow` for cached slot calls with its repeated blocks compiled (`self.flow`: a copy sharing
    its weights; call its forward_slots). `compiled`: False once a compile failed (all eager)."""

    def __init__(self, flow: MaskedDiffFlow, options: dict | None = None):
        """options: inductor's, for every program (torch.compile's `options`)."""
        compiled = {cls: block_program(cls, options) for cls in repeated_blocks(flow)}
        self.programs = {cls: program for cls, (program, _) in compiled.items()}
        self._counts = {cls: count for cls, (_, count) in compiled.items()}
        self.compiled = True
        self.flow: MaskedDiffFlow = regional(flow, lambda block: CachedBlock(block, self))
        self.flow.state_layout(flow.dims.chunk_tokens)  # each block's entry count, from an eager walk
        blocks = [m for m in self.flow.modules() if isinstance(m, CachedBlock)]
        log.info("cached flow call: torch.compile of its %d repeated blocks (%s), the rest eager", len(blocks),
                 ", ".join(cls.__name__ for cls in self.programs))

    def run(self, block: nn.Module, inputs: Sequence[Tensor], entries: Sequence[Tensor], g: SlotGeometry) -> Tensor:
        call = (block, tuple(inputs), g.slots, g.start, g.end, g.keep, list(entries), g.N, g.K)
        if self.compiled:
            try:
                return self.programs[type(block)](*call)
            except Exception as e:  # noqa: BLE001 — a compiler failure must not take the service down
                log.warning("torch.compile of the cached flow call's %s failed (%s: %s); running its blocks eagerly",
                            type(block).__name__, type(e).__name__, e)
                self.compiled = False
        return _run_block(*call)

    def programs_of(self, cls: type[nn.Module]) -> int:
        """Dynamo programs compiled for `cls` (its recompile region's, or its own code's, cache entries)."""
        return self._counts[cls]()


class CachedBlock(nn.Module):
    """A repeated block in the regional copy: called as the block (its cache last), it runs the
    block's class program over the block's own slot entries and moves the cursor past them."""

    def __init__(self, block: nn.Module, regions: SlotRegions):
        super().__init__()
        self.block = block
        self.regions = regions
        self.walks: int | None = None  # state entries the block walks, from its first (eager) call

    def forward(self, *args):
        *inputs, cache = args
        if cache is None:
            return self.block(*args)
        cursor, g = cache
        if self.walks is None or not isinstance(cursor, SlotCursor):
            first = cursor.pos
            out = self.block(*args)
            self.walks = cursor.pos - first
            return out
        out = self.regions.run(self.block, inputs, cursor.entries[cursor.pos:cursor.pos + self.walks], g)
        cursor.pos += self.walks
        return out

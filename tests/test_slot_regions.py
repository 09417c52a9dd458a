"""The cached slot call compiled by regions (token2wav/slot_regions.py): the flow's repeated blocks
(CosyVoice2: the estimator's transformer and resnet blocks, the encoder's conformer layers;
CosyVoice3: the DiT blocks) each run through one program of their class over their own slot
entries, the glue eager. Equal to the eager call (1e-5 fp32) over rounds of different stream
counts and positions, the pool written in place, a handful of programs per block class for all
its instances, CFM steps and stream counts, nothing new after compile_shapes, and a compiler
failure falls back to eager with one warning. (The pool's own compiled-step test, with the
recompute as reference, is in tests/test_state_pool.py.)"""
from __future__ import annotations

import logging

import pytest
import torch
from cv3_fixture import cv3_dir, flow_dims
from test_flow_cache import ATOL, flow  # noqa: F401  (fixture)
from torch._dynamo.utils import counters

from async_cosyvoice.model_dir import load_strict
from async_cosyvoice.models.cosyvoice3.dit import DiTBlock
from async_cosyvoice.models.cosyvoice3.flow import DiTFlow
from async_cosyvoice.models.flow.encoder import ConformerLayer
from async_cosyvoice.models.flow.estimator import CausalResnetBlock1D, TransformerBlock
from async_cosyvoice.token2wav.slot_calls import SlotCalls
from async_cosyvoice.token2wav.slot_regions import RECOMPILE_LIMIT, CachedBlock, SlotRegions
from async_cosyvoice.token2wav.state_pool import StatePool

torch.set_num_threads(1)

# (slots, start, end, keep) per call: 2, 1, 3 and 2 streams, fresh and continuing, at different
# positions; slot 3 starts later than the others, slots 2 and 1 swap places in the last call
ROUNDS = [([1, 2], [0, 0], [50, 75], [50, 75]),
          ([3], [0], [40], [25]),
          ([1, 2, 3], [50, 75, 25], [90, 110, 70], [75, 100, 50]),
          ([2, 1], [100, 75], [130, 100], [125, 100])]


@pytest.fixture(scope="module")
def dit_flow():
    d = cv3_dir()
    f = DiTFlow(flow_dims(d))
    load_strict(f, torch.load(d / "flow.pt", map_location="cpu", weights_only=True), "flow.pt")
    return f.eval()


def pool_calls(flow, **kw) -> SlotCalls:  # noqa: F811
    """SlotCalls over 3 stream slots of 200 tokens, each slot holding its own prompt (40 tokens of
    mel) and speaker embedding, keys in buckets of 32 tokens."""
    pool = StatePool(flow, slots=3, slot_tokens=200)
    g = torch.Generator().manual_seed(0)
    dims = flow.dims
    for slot in (1, 2, 3):
        pool.load_prompt(slot, torch.randn(1, dims.token_mel_ratio * 40, dims.output_size, generator=g) - 5,
                         torch.randn(1, dims.spk_embed_dim, generator=g))
    return SlotCalls(flow, pool, cuda_graphs=False, key_token_step=32, **kw)


def run(calls: SlotCalls, rounds=ROUNDS) -> list[list[torch.Tensor]]:
    """The rounds through `calls`: each slot renders its own random token sequence. Returns each
    round's mels (80, ratio·(end − start)) per item."""
    look, ratio = calls.flow.dims.pre_lookahead_len, calls.flow.dims.token_mel_ratio
    g = torch.Generator().manual_seed(1)
    sequences = {slot: torch.randint(0, 6561, (200,), generator=g, dtype=torch.int32) for slot in (1, 2, 3)}
    mels = []
    for slots, start, end, keep in rounds:
        tokens = torch.zeros(len(slots), max(e - s for s, e in zip(start, end)) + look, dtype=torch.int32)
        for b, (slot, s, e) in enumerate(zip(slots, start, end)):
            tokens[b, :e + look - s] = sequences[slot][s:e + look]
        calls(tokens, slots, start, end, keep)
        mels.append([calls.pool.mel[slot, ratio * s:ratio * e].T.clone() for slot, s, e in zip(slots, start, end)])
    return mels


def assert_same_calls(regional: SlotCalls, eager: SlotCalls, got, expected) -> None:
    for r, (a, b) in enumerate(zip(got, expected)):
        for x, y in zip(a, b):
            assert (x - y).abs().max().item() <= ATOL, r
    written, want = regional.pool.buffer, eager.pool.buffer
    assert torch.equal(written != 0, want != 0)  # the same positions written, in the pool's own storage
    assert (written - want).abs().max().item() <= ATOL * want.abs().max().item()


def test_the_regional_copy_wraps_each_repeated_block_and_leaves_the_flow_as_it_is(flow):  # noqa: F811
    """Nothing compiles here: the copy's blocks are wrappers of the flow's own blocks, each knowing
    how many state entries it walks (2: keys and values, or a resnet's two causal convs), read from
    the eager layout walk; the copy's entries add up to the pool's layout."""
    regions = SlotRegions(flow)
    wrapped = [m for m in regions.flow.modules() if isinstance(m, CachedBlock)]
    blocks = [m for m in flow.modules() if isinstance(m, (TransformerBlock, CausalResnetBlock1D, ConformerLayer))]
    assert [w.block for w in wrapped] == blocks and len(blocks) == 13  # 5 conformer layers, 4 resnets, 4 transformers
    assert set(regions.programs) == {ConformerLayer, TransformerBlock, CausalResnetBlock1D}
    assert all(w.walks == 2 for w in wrapped)
    assert regions.flow.decoder.estimator.final_proj.weight is flow.decoder.estimator.final_proj.weight
    assert not any(isinstance(m, CachedBlock) for m in flow.modules())
    _, n_encoder = flow.state_layout(flow.dims.chunk_tokens)
    encoder_walks = sum(w.walks for w in wrapped if isinstance(w.block, ConformerLayer))
    assert encoder_walks == n_encoder - 2  # the pre-lookahead and upsampling convs are the glue's
    assert regions.compiled


@pytest.mark.slow  # inductor's C++ builds: ~1 min on a cold cache
def test_regional_calls_equal_eager_with_a_few_programs_per_block_class(flow):  # noqa: F811
    torch._dynamo.reset()
    counters.clear()
    eager = pool_calls(flow)
    expected = run(eager)
    regional = pool_calls(flow, compile=True, stream_buckets=(1, 2, 4))
    # as the warm-up before serving: every stream bucket x 32 and 64 new tokens x the shortest and
    # longest key bucket; then the rounds (1 to 3 streams) compile nothing new
    assert regional.compile_shapes([32, 64]) == 9  # 64 new tokens do not go with 32 keys
    made = counters["stats"]["unique_graphs"]
    programs = {cls: regional.regions.programs_of(cls) for cls in regional.regions.programs}
    got = run(regional)
    assert counters["stats"]["unique_graphs"] == made, "a call after compile_shapes compiled a new program"
    assert regional.compiled  # no fallback to eager
    assert_same_calls(regional, eager, got, expected)
    # each class's programs serve all its instances (4 transformer blocks x 10 CFM steps, 5 conformer
    # layers) and every stream count: per class at most (weight shapes x input layouts) x (a batch of
    # one, a larger batch) x (keys short of a slot's capacity, all of it), never one per instance or bucket
    assert programs[TransformerBlock] <= 4 and programs[ConformerLayer] <= 2 * 4
    assert programs[CausalResnetBlock1D] <= 4 * 2  # 3 weight shapes, the first mid block's input layout
    assert sum(programs.values()) == made


@pytest.mark.slow  # inductor's C++ builds of the DiT block
def test_cosyvoice3_regional_calls_equal_eager(dit_flow):
    """CosyVoice3's DiT flow: its blocks compiled regionally (no encoder: the pre-lookahead layer is glue)."""
    torch._dynamo.reset()
    counters.clear()
    eager = pool_calls(dit_flow)
    expected = run(eager)
    regional = pool_calls(dit_flow, compile=True)
    assert set(regional.regions.programs) == {DiTBlock}
    got = run(regional)
    assert regional.compiled
    assert_same_calls(regional, eager, got, expected)
    assert regional.regions.programs_of(DiTBlock) == counters["stats"]["unique_graphs"] <= 4


def test_a_compiler_failure_falls_back_to_eager_with_one_warning(flow, caplog):  # noqa: F811
    """inductor given a C++ compiler that does not exist: the first block's compile fails, every block
    then runs eagerly, the calls stay exact and the failure is logged once."""
    torch._dynamo.reset()
    eager = pool_calls(flow)
    expected = run(eager, ROUNDS[:2])
    broken = pool_calls(flow, compile=True, compile_options={"cpp.cxx": ("/nonexistent/c++",)})
    with caplog.at_level(logging.WARNING, logger="async_cosyvoice.token2wav.slot_regions"):
        got = run(broken, ROUNDS[:2])
    assert not broken.compiled and broken.compile_shapes([32]) == 0
    warnings = [r for r in caplog.records if r.name == "async_cosyvoice.token2wav.slot_regions"]
    assert len(warnings) == 1 and "running its blocks eagerly" in warnings[0].getMessage()
    assert_same_calls(broken, eager, got, expected)


@pytest.mark.slow  # inductor's C++ builds
def test_a_torch_without_recompile_regions_gets_a_program_per_class_all_the_same(flow, monkeypatch):  # noqa: F811
    """torch.compile as an older torch has it (no isolate_recompiles / recompile_limit: the GPU
    image had 2.11): each block class compiles its own copy of the block function, the calls stay
    equal to eager, and the classes' programs are counted apart."""
    real = torch.compile

    def older_compile(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                      disable=False):
        return real(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode, options=options,
                    disable=disable)

    monkeypatch.setattr(torch, "compile", older_compile)
    torch._dynamo.reset()
    eager = pool_calls(flow)
    expected = run(eager, ROUNDS[:1])
    limit = torch._dynamo.config.recompile_limit  # raised by the fallback (monkeypatch's undo deletes the key)
    try:
        regional = pool_calls(flow, compile=True)
        got = run(regional, ROUNDS[:1])
        raised = torch._dynamo.config.recompile_limit
    finally:
        torch._dynamo.config.recompile_limit = limit
    assert_same_calls(regional, eager, got, expected)
    regions = regional.regions
    assert regions.compiled
    names = {program._torchdynamo_orig_callable.__code__.co_name for program in regions.programs.values()}
    assert names == {"_run_ConformerLayer", "_run_TransformerBlock", "_run_CausalResnetBlock1D"}
    assert all(regions.programs_of(cls) >= 1 for cls in regions.programs)
    assert raised == max(limit, RECOMPILE_LIMIT)

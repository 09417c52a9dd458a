"""The estimator's flex attention (token2wav.flow_attention: flex; models/flow/attention.py) against
its SDPA attention: the BlockMask says exactly what the dense mask says, is made without reading a
value on the host, and the estimator and a whole flow call give the SDPA outputs (1e-5 fp32), eager
and with the blocks torch.compile'd by regions (CPU, inductor's C++ flex template; on a GPU, Triton's
kernel inside the buckets' CUDA graphs, fp32 and fp16)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import next_job_upto
from estimator_inputs import estimator_inputs
from pydantic import ValidationError
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.nn.attention.flex_attention import create_mask

from async_cosyvoice.config import Token2WavConfig
from async_cosyvoice.estimator import CompiledEstimator, TorchEstimator, estimator_from_config, make_estimator
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.models.cosyvoice3.dit import DiT
from async_cosyvoice.models.dims import DiTDims
from async_cosyvoice.models.flow.attention import FLEX_BLOCK, flex_block_mask
from async_cosyvoice.models.flow.estimator import TransformerBlock
from async_cosyvoice.models.flow.masks import attention_mask, length_mask
from async_cosyvoice.token2wav import ChunkSchedule, Token2WavRunner, Token2WavStream

torch.set_num_threads(1)

ATOL = 1e-5  # fp32: the same sums in another order
CHUNK = 50
# 3 items of different lengths (one of them empty: a padded batch row) over T frames, T not a multiple of
# the block; each streaming flag form the estimator meets
LENGTHS = [300, 217, 0]
FLAGS = [True, False, torch.tensor([True, False, True])]


@pytest.fixture(scope="module")
def models(tiny_dir):
    return build_models(load_model_dir(tiny_dir))


def _valid(lengths: list[int], T: int, device: str = "cpu") -> torch.Tensor:
    return length_mask(torch.tensor(lengths, device=device), T)


def _brute_block_counts(allowed: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From a dense (B, T, T) mask: per (item, query block) the key blocks any of its queries may
    attend to, and those every query may attend to whole (a block reaching past T is never whole)."""
    B, T, _ = allowed.shape
    n = -(-T // block)
    padded = torch.zeros(B, n * block, n * block, dtype=torch.bool)
    padded[:, :T, :T] = allowed
    tiles = padded.view(B, n, block, n, block).transpose(2, 3)  # (B, q block, kv block, q, kv)
    real = (torch.arange(n * block) < T).view(n, block)  # the queries that exist
    anyone = (tiles & real[None, :, None, :, None]).flatten(-2).any(-1)
    whole = (tiles | ~real[None, :, None, :, None]).flatten(-2).all(-1)
    return anyone.sum(-1), whole.sum(-1)


@pytest.mark.parametrize("T", [300, 256, 100])
@pytest.mark.parametrize("flag", FLAGS, ids=["streaming", "full", "mixed"])
def test_block_mask_says_what_the_dense_mask_says(T, flag):
    lengths = [min(n, T) for n in LENGTHS[:2]] + [0]
    valid = _valid(lengths, T)
    allowed = attention_mask(valid, CHUNK, flag)
    bm = flex_block_mask(valid, CHUNK, flag)
    assert bm.BLOCK_SIZE == (FLEX_BLOCK, FLEX_BLOCK) and bm.seq_lengths == (T, T)
    # the exact rule, frame by frame
    assert torch.equal(create_mask(bm.mask_mod, len(lengths), 1, T, T)[:, 0], allowed)
    # the block counts: full blocks skip mask_mod, partial ones apply it, the rest are skipped
    anyone, whole = _brute_block_counts(allowed, FLEX_BLOCK)
    full, partial = bm.full_kv_num_blocks[:, 0], bm.kv_num_blocks[:, 0]
    assert torch.equal(full, whole.to(full.dtype)) and torch.equal(full + partial, anyone.to(full.dtype))
    # the blocks listed are the first ones, full then partial: [0, full) then [full, full + partial)
    n = bm.kv_indices.shape[-1]
    for b in range(len(lengths)):
        for qb in range(n):
            f, p = int(full[b, qb]), int(partial[b, qb])
            assert bm.full_kv_indices[b, 0, qb, :f].tolist() == list(range(f))
            assert bm.kv_indices[b, 0, qb, :p].tolist() == list(range(f, f + p))
    if isinstance(flag, bool) and not flag:  # full attention, a whole row: every block but a last short one full
        assert full[0].eq(T // FLEX_BLOCK).all() and partial[0].eq(int(T % FLEX_BLOCK > 0)).all()
    assert full[2].eq(0).all() and partial[2].eq(0).all()  # an empty row: no block at all


def test_block_mask_is_made_without_reading_a_value():
    """The whole flow call is captured as one CUDA graph: the mask must be made from tensors alone. On
    the meta device every read of a value (.item(), .tolist(), a shape that depends on data) raises."""
    for flag in (True, False, torch.tensor([True, False, True], device="meta")):
        bm = flex_block_mask(_valid(LENGTHS, 300, "meta"), CHUNK, flag)
        assert bm.kv_num_blocks.device.type == "meta"
        assert bm.kv_num_blocks.shape == bm.full_kv_num_blocks.shape == (3, 1, 3)
        assert bm.kv_indices.shape == bm.full_kv_indices.shape == (3, 1, 3, 3)


def _inputs(module, T: int = 300):
    """Seeded estimator inputs of 3 rows: lengths T, T - 1/3 T - 1 (estimator_inputs) and 141."""
    x, mask, mu, t, spks, cond = estimator_inputs(module, 3, T, seed=0)
    mask[2, :, 141:] = 0
    return x, mask, mu, t, spks, cond


@pytest.mark.parametrize("flag", FLAGS, ids=["streaming", "full", "mixed"])
def test_flex_estimator_matches_sdpa(models, flag):
    module = models.flow.decoder.estimator
    args = _inputs(module)
    with torch.inference_mode():
        want = module(*args, flag)
        got = TorchEstimator(module, "flex")(*args, flag)
    err = (got - want).abs().max().item()
    print(f"flex vs sdpa estimator, streaming={flag}: max |diff| {err:.2e}")
    assert err <= ATOL and want.abs().max() > 0.1
    assert got[args[1].expand_as(got) == 0].abs().max() == 0  # masked frames stay zero


def test_an_empty_row_gives_zeros_not_nan(models):
    """A batch bucket's extra rows have an all-zero mask: no key at all, which flex answers with zeros."""
    module = models.flow.decoder.estimator
    args = _inputs(module)
    args[1][2] = 0
    with torch.inference_mode():
        got = module(*args, True, attention="flex")
        want = module(*args, True)
    assert torch.isfinite(got).all() and got[2].abs().max() == 0
    assert (got[:2] - want[:2]).abs().max() <= ATOL


def _golden_job(golden_dir, run: str):
    z = np.load(golden_dir / f"e2e_{run}.npz")
    g = {k: torch.from_numpy(z[k]) for k in z.files}
    stream = Token2WavStream(g["prompt_token"], g["prompt_feat"], g["embedding"], stream=run != "nonstream",
                             schedule=ChunkSchedule(first_hop=int(g["token_hop_len"][0])))
    return next_job_upto(stream, g["token"][0], llm_done=True)


def test_a_flow_call_through_the_runner_matches_sdpa(models, golden_dir):
    """One recomputing flow call (encoder + 10 CFM steps) of two streams of different lengths, a
    streaming first chunk and a final, in one batch: mixed streaming rows."""
    outs, flags = {}, []
    for attention in ("sdpa", "flex"):
        estimator = make_estimator("torch", models.flow, attention=attention)

        def seen(x, mask, mu, t, spks, cond, streaming=False, estimator=estimator):
            flags.append(streaming)  # what each CFM step's call asked for, then the call itself
            return estimator(x, mask, mu, t, spks, cond, streaming)

        runner = Token2WavRunner(models.flow, models.hift, estimator=seen, flow_cache=False,
                                 length_bucket_ratio=100)  # the two lengths in one call
        jobs = [_golden_job(golden_dir, "stream_hop15"), _golden_job(golden_dir, "nonstream")]
        assert [j.finalize for j in jobs] == [False, True]
        outs[attention] = runner.flow_mels(jobs)
    # one batch per CFM step, [conditional; unconditional] rows of both jobs (in the runner's order):
    # a streaming row and a full-attention row in each half
    assert len(flags) == 2 * models.flow.decoder.params.n_timesteps
    assert all(sorted(f.tolist()[:2]) == [False, True] and f.tolist()[2:] == f.tolist()[:2] for f in flags), flags[0]
    for want, got in zip(outs["sdpa"], outs["flex"]):
        err = (got - want).abs().max().item()
        print(f"flex vs sdpa flow mel {tuple(got.shape)}: max |diff| {err:.2e}")
        assert got.shape == want.shape and err <= ATOL


def test_the_setting_picks_the_attention_and_refuses_what_cannot_run(models):
    assert Token2WavConfig().flow_attention == "sdpa"  # unchanged until a GPU says otherwise
    with pytest.raises(ValidationError, match="flow_attention"):
        Token2WavConfig(flow_attention="flash")
    module = models.flow.decoder.estimator
    args = _inputs(module, 200)
    flex = estimator_from_config(Token2WavConfig(flow_attention="flex"), models.flow)
    sdpa = estimator_from_config(Token2WavConfig(), models.flow)
    with torch.inference_mode():
        assert (flex(*args, True) - sdpa(*args, True)).abs().max() <= ATOL
    with pytest.raises(ValueError, match="unknown flow attention 'flash'; choose one of sdpa, flex"):
        make_estimator("torch", models.flow, attention="flash")
    with pytest.raises(ValueError, match="estimator attention='flash'"):
        module(*args, True, attention="flash")
    # CosyVoice3's DiT has no flex path: said at build time, not at the first call
    dit = DiT(DiTDims(dim=64, depth=2, heads=2, dim_head=32))
    with pytest.raises(ValueError, match="flow attention 'flex': the DiT estimator supports sdpa"):
        TorchEstimator(dit, "flex")
    with pytest.raises(ValueError, match="the DiT estimator supports sdpa"):
        CompiledEstimator(dit, compile=False, cuda_graphs=False, attention="flex")


def _programs(cls) -> int:
    return len(_debug_get_cache_entry_list(cls.forward.__code__))


@pytest.mark.slow  # inductor's C++ flex template and the blocks: ~15 s on a warm cache, more cold
def test_regional_compiled_flex_estimator_matches_sdpa(models):
    """The recompute estimator as the GPU config builds it (compile_regions: each TransformerBlock a
    torch.compile'd region that gets the BlockMask as an input), padded to its buckets, on the CPU."""
    module = models.flow.decoder.estimator
    torch._dynamo.reset()
    est = CompiledEstimator(module, compile_regions=True, cuda_graphs=False, pad_to_buckets=True,
                            batch_buckets=(2, 4), attention="flex")
    # buckets (2, 192), (4, 256), (4, 320): 2 rows x 2 blocks ties the block count to the batch (duck
    # sizing), then untied; a new closure (mask_mod) every call recompiles nothing
    for batch, frames in [(2, 150), (3, 230), (3, 300)]:
        args = estimator_inputs(module, batch, frames, seed=frames)
        for flag in (False, torch.tensor([True, False, True][:batch])):
            with torch.inference_mode():
                err = (est(*args, flag) - module(*args, flag)).abs().max().item()
            print(f"compiled flex vs eager sdpa B={batch} T={frames} streaming={flag}: max |diff| {err:.2e}")
            assert err <= ATOL
    assert est.compiled  # no compile failure fell back to eager
    assert _programs(TransformerBlock) == 2, _programs(TransformerBlock)


@pytest.mark.slow  # two regional compiles on the GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's Triton kernel and CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-3), (torch.float16, 5e-2)], ids=["fp32", "fp16"])
def test_compiled_flex_graphs_match_sdpa_on_cuda(models, dtype, atol):
    """configs/gpu.yaml's estimator with flex: blocks compiled by regions (Triton's flex kernel, 128-frame
    blocks against the fp16 tile), the block mask made inside each bucket's CUDA graph and replayed for
    other lengths and flags, against the padded eager SDPA call. fp32: TF32 convolutions (1e-3, as
    test_estimator_backends); fp16: half precision over the blocks."""
    module = copy.deepcopy(models.flow.decoder.estimator).to("cuda", dtype)
    flex = CompiledEstimator(module, compile_regions=True, cuda_graphs=True, batch_buckets=(2, 4, 8), attention="flex")
    sdpa = CompiledEstimator(module, compile=False, cuda_graphs=False, pad_to_buckets=True, batch_buckets=(2, 4, 8))
    calls = [(6, 100), (2, 64), (6, 300), (3, 130)]
    for graphed in (False, True):  # first calls run padded without a graph; then their graphs replay
        for seed, (batch, frames) in enumerate(calls):
            args = [a.to("cuda", dtype) for a in estimator_inputs(module, batch, frames, seed=seed + graphed)]
            flag = torch.tensor([True, False] * (batch // 2) + [True] * (batch % 2), device="cuda")
            with torch.inference_mode():
                out, want = flex(*args, flag), sdpa(*args, flag)
            err = (out.float() - want.float()).abs().max().item()
            print(f"{dtype} B={batch} T={frames} graphed={graphed}: max |flex - sdpa| {err:.2e}")
            assert out.shape == want.shape and err <= atol
        if not graphed:
            while flex.capture_wanted():
                pass
    assert flex.compiled and flex.replays == len(calls) and flex.fallbacks == 0

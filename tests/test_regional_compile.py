"""Regional compilation of the flow estimator (token2wav.compile_regions; torch_backend.compile_estimator):
the repeated blocks compiled on their own, exact against eager (1e-5 fp32), one Dynamo program per
block class and weight shape however many instances the estimator has; CosyVoice2's decoder and
CosyVoice3's DiT (all on CPU, inductor C++: 15-40 s each on a cold cache)."""
from __future__ import annotations

import pytest
import torch
from estimator_inputs import estimator_inputs
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from async_cosyvoice.config import Token2WavConfig
from async_cosyvoice.estimator import compile_estimator, make_estimator
from async_cosyvoice.estimator.torch_backend import CompiledEstimator, TorchEstimator
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.models.cosyvoice3.dit import DiT, DiTBlock
from async_cosyvoice.models.dims import DiTDims
from async_cosyvoice.models.flow.estimator import CausalResnetBlock1D, TransformerBlock

torch.set_num_threads(1)

PAD_ATOL = 1e-5  # summation order only, as the whole-module compiled estimator (test_estimator_backends.py)


@pytest.fixture(scope="module")
def models(tiny_dir):
    return build_models(load_model_dir(tiny_dir))


def _programs(cls) -> int:
    """Dynamo's compiled programs (cache entries) of a block class's forward."""
    return len(_debug_get_cache_entry_list(cls.forward.__code__))


@pytest.mark.slow  # inductor's C++ build: ~40 s on a cold cache (10 s warm)
def test_regional_estimator_matches_eager_and_traces_each_block_class_once(models):
    module = models.flow.decoder.estimator
    transformers = [m for m in module.modules() if isinstance(m, TransformerBlock)]
    resnets = [m for m in module.modules() if isinstance(m, CausalResnetBlock1D)]
    resnet_shapes = {m.block1.block[0].weight.shape for m in resnets}
    assert len(transformers) >= 4 and len(resnet_shapes) < len(resnets)  # the fixture has repeats to share
    torch._dynamo.reset()
    counters.clear()
    est = CompiledEstimator(module, compile_regions=True, cuda_graphs=False, pad_to_buckets=True,
                            batch_buckets=(2, 4))
    # two buckets, (2, 192) and (4, 256) frames; no frame count equal to a channel count (duck sizing would
    # tie the two and specialise the first program to it)
    for seed, (batch, frames) in enumerate([(2, 150), (3, 230)]):
        args = estimator_inputs(module, batch, frames, seed)
        for flag in (False, torch.tensor([True, False, True][:batch])):
            with torch.inference_mode():
                err = (est(*args, flag) - module(*args, flag)).abs().max().item()
            assert err <= PAD_ATOL, (batch, frames, flag, err)
    assert est._compiled  # no compile failure fell back to eager
    assert _programs(TransformerBlock) == 1  # traced once, not once per instance or per bucket
    # once per weight shape, plus one input layout: the first mid block's input comes from a conv, the
    # next ones' from a transposed attention output (full size: 4 programs for 14 resnets)
    resnet_programs = _programs(CausalResnetBlock1D)
    assert len(resnet_shapes) <= resnet_programs <= len(resnet_shapes) + 1
    assert counters["stats"]["unique_graphs"] == 1 + resnet_programs  # nothing else compiled: the glue is eager
    # the module itself is untouched: its other callers (the eager estimator, the flow cache) stay eager
    assert not any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in module.modules())


def test_regional_compile_replaces_only_the_repeated_blocks(models, caplog):
    """The regional module is a shallow copy: its blocks are compiled wrappers of the same blocks,
    everything else shares the module's weights (nothing compiles until the first call)."""
    module = models.flow.decoder.estimator
    with caplog.at_level("INFO", logger="async_cosyvoice.estimator.torch_backend"):
        regional = compile_estimator(module, regions=True)
    assert "torch.compile of its 8 repeated blocks (TransformerBlock, CausalResnetBlock1D)" in caplog.text
    wrapped = [m for m in regional.modules() if isinstance(m, torch._dynamo.eval_frame.OptimizedModule)]
    blocks = [m for m in module.modules() if isinstance(m, module.repeated_blocks)]
    assert [w._orig_mod for w in wrapped] == blocks
    assert regional.final_proj.weight is module.final_proj.weight and regional.dims is module.dims
    assert not any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in module.modules())
    with pytest.raises(ValueError, match="repeated_blocks"):
        compile_estimator(torch.nn.Linear(2, 2), regions=True)


def test_compile_regions_config(models):
    """token2wav.compile_regions reaches the compiled estimator; the other estimators leave it unused, so
    a GPU config (which sets it) may switch its estimator without touching it."""
    whole = make_estimator("compiled", models.flow)._module_fn
    regional = make_estimator("compiled", models.flow, compile_regions=True)._module_fn
    assert isinstance(whole, torch._dynamo.eval_frame.OptimizedModule)
    assert not isinstance(regional, torch._dynamo.eval_frame.OptimizedModule)
    assert isinstance(regional.down_blocks[0][1][0], torch._dynamo.eval_frame.OptimizedModule)
    assert type(make_estimator("torch", models.flow, compile_regions=True)) is TorchEstimator
    assert Token2WavConfig(estimator="torch", compile_regions=True).estimator == "torch"
    assert Token2WavConfig(estimator="compiled", compile_regions=True).compile_regions
    assert not Token2WavConfig().compile_regions


def test_cosyvoice3_dit_regional_matches_eager():
    """CosyVoice3's DiT: its blocks compiled regionally, one program for all of them, exact."""
    module = DiT(DiTDims(dim=32, depth=3, heads=2, dim_head=16, ff_mult=2)).eval()
    torch._dynamo.reset()
    counters.clear()
    est = CompiledEstimator(module, compile_regions=True, cuda_graphs=False, pad_to_buckets=True, batch_buckets=(2,))
    args = estimator_inputs(module, 2, 150, seed=5)
    with torch.inference_mode():
        err = (est(*args, False) - module(*args, False)).abs().max().item()
    assert err <= PAD_ATOL and est._compiled
    assert _programs(DiTBlock) == 1 and counters["stats"]["unique_graphs"] == 1

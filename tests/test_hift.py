"""HiFT vocoder parity against the upstream goldens (golden/hift.npz, README section d)."""
import numpy as np
import pytest
import torch

from async_cosyvoice.models.dims import HiFTDims
from async_cosyvoice.models.hift import HiFT, NSFNoise

torch.set_num_threads(1)

SPEECH_ATOL = 1e-4
BATCH_ATOL = 2e-5  # batched vs single calls: only the kernels' summation order differs
SOURCE_ATOL = 1e-3
# f0 rtol 1e-5, plus the 1e-4 Hz that upstream itself moves when only the summation order
# changes (golden README: 2 threads vs 1); near-zero f0 (unvoiced frames) needs the atol.
F0_RTOL, F0_ATOL = 1e-5, 1e-4




@pytest.fixture(scope="module")
def gold(golden_dir):
    z = np.load(golden_dir / "hift.npz")
    return {k: torch.from_numpy(z[k]) for k in z.files}


def maxdiff(a, b):
    return (a - b).abs().max().item()


def test_parameter_names_are_folded_hift_pt_keys(model_dir, hift):
    raw = torch.load(model_dir.path / "hift.pt", map_location="cpu", weights_only=True)
    expected = set()
    for k in raw:
        k = k.removeprefix("generator.")
        for suffix in (".parametrizations.weight.original0", ".parametrizations.weight.original1"):
            if k.endswith(suffix):
                k = k[: -len(suffix)] + ".weight"
        expected.add(k)
    assert set(hift.state_dict()) == expected
    assert "stft_window" not in hift.state_dict()


def test_default_dims_build_official_shapes():
    m = HiFT(HiFTDims())
    sd = m.state_dict()
    assert sd["ups.0.weight"].shape == (512, 256, 16)
    assert sd["ups.2.weight"].shape == (128, 64, 7)
    assert sd["source_downs.0.weight"].shape == (256, 18, 30)
    assert sd["source_downs.1.weight"].shape == (128, 18, 6)
    assert sd["source_downs.2.weight"].shape == (64, 18, 1)
    assert sd["conv_post.weight"].shape == (18, 64, 7)
    assert sd["m_source.l_linear.weight"].shape == (1, 9)
    assert sd["f0_predictor.condnet.8.weight"].shape == (512, 512, 3)
    assert len([k for k in sd if k.startswith("resblocks.") and k.endswith("convs1.0.weight")]) == 9


def test_zero_noise_first_call(hift, gold):
    trace = {}
    speech, source = hift.inference(gold["mel1"], None, NSFNoise.zero(), trace=trace)
    assert speech.shape == gold["zero/speech1"].shape and source.shape == gold["zero/source1"].shape
    torch.testing.assert_close(trace["f0"], gold["zero/f0_1"], rtol=F0_RTOL, atol=F0_ATOL)
    assert maxdiff(source, gold["zero/source1"]) <= SOURCE_ATOL
    assert maxdiff(speech, gold["zero/speech1"]) <= SPEECH_ATOL


def test_zero_noise_with_cache_source(hift, gold):
    cache = gold["zero/cache_source_for_2"]
    trace = {}
    speech, source = hift.inference(gold["mel2"], cache, NSFNoise.zero(), trace=trace)
    torch.testing.assert_close(trace["f0"], gold["zero/f0_2"], rtol=F0_RTOL, atol=F0_ATOL)
    assert torch.equal(source[:, :, :cache.shape[-1]], cache)
    assert maxdiff(source, gold["zero/source2"]) <= SOURCE_ATOL
    assert maxdiff(speech, gold["zero/speech2"]) <= SPEECH_ATOL


def test_seeded_injected_draws(hift, gold):
    rand_ini = gold["seeded/draw_rand_ini"].clone()
    noise = NSFNoise.given(rand_ini, gold["seeded/draw_sine_noise"])
    speech, source = hift.inference(gold["mel1"], None, noise)
    assert torch.equal(rand_ini, gold["seeded/draw_rand_ini"])  # the caller's tensor is not modified
    assert maxdiff(source, gold["seeded/source1"]) <= SOURCE_ATOL
    assert maxdiff(speech, gold["seeded/speech1"]) <= SPEECH_ATOL


def test_seeded_generator_reproduces_upstream_draws(hift, gold):
    seed = int(gold["seeded/torch_seed"][0])
    g = torch.Generator().manual_seed(seed)
    rand_ini, sine_noise = NSFNoise.random(g).draw(1, gold["mel1"].shape[2] * 480, 9, torch.device("cpu"))
    expected_ini = gold["seeded/draw_rand_ini"].clone()
    expected_ini[:, 0] = 0
    assert torch.equal(rand_ini, expected_ini)
    assert torch.equal(sine_noise, gold["seeded/draw_sine_noise"])

    g.manual_seed(seed)
    speech, source = hift.inference(gold["mel1"], None, NSFNoise.random(g))
    assert maxdiff(source, gold["seeded/source1"]) <= SOURCE_ATOL
    assert maxdiff(speech, gold["seeded/speech1"]) <= SPEECH_ATOL
    # upstream's unused third draw (randn (1, L, 1)) is consumed too, so the generator continues
    # like upstream's RNG into the next call
    L = gold["mel1"].shape[2] * 480
    g.manual_seed(seed)
    NSFNoise.random(g).draw(1, L, 9, torch.device("cpu"))
    ref = torch.Generator().manual_seed(seed)
    torch.rand(1, 9, generator=ref)
    torch.empty(1, 9, L).transpose(1, 2).normal_(generator=ref)
    assert torch.equal(torch.randn(1, L, 1, generator=ref), gold["seeded/draw_source_noise_unused"])
    assert torch.equal(g.get_state(), ref.get_state())


def test_default_noise_uses_global_rng(hift, gold):
    torch.manual_seed(int(gold["seeded/torch_seed"][0]))
    speech, _ = hift.inference(gold["mel1"])
    assert maxdiff(speech, gold["seeded/speech1"]) <= SPEECH_ATOL


def test_batch_matches_single_calls(hift, gold):
    mel = torch.cat([gold["mel1"], gold["mel2"]])
    cache = gold["zero/cache_source_for_2"]
    s1, src1 = hift.inference(gold["mel1"], None, NSFNoise.zero())
    s2, src2 = hift.inference(gold["mel2"], cache, NSFNoise.zero())

    # per-row caches (a first chunk next to a later chunk)
    speech, source = hift.inference(mel, [None, cache], NSFNoise.zero())
    assert speech.shape == (2, 19200) and source.shape == (2, 1, 19200)
    assert maxdiff(speech[0], s1[0]) <= BATCH_ATOL and maxdiff(speech[1], s2[0]) <= BATCH_ATOL
    assert maxdiff(source[1], src2[0]) <= BATCH_ATOL

    # one (B, 1, S) cache for every row
    speech, _ = hift.inference(mel, torch.cat([cache, cache]), NSFNoise.zero())
    s1c, _ = hift.inference(gold["mel1"], cache, NSFNoise.zero())
    assert maxdiff(speech[0], s1c[0]) <= BATCH_ATOL and maxdiff(speech[1], s2[0]) <= BATCH_ATOL


def test_batch_with_per_row_generators(hift, gold):
    mel = torch.cat([gold["mel1"], gold["mel2"]])
    single = [hift.inference(m, None, NSFNoise.random(torch.Generator().manual_seed(s)))[0]
              for m, s in ((gold["mel1"], 11), (gold["mel2"], 22))]
    rows = [NSFNoise.random(torch.Generator().manual_seed(11)), NSFNoise.random(torch.Generator().manual_seed(22))]
    speech, _ = hift.inference(mel, None, rows)
    assert maxdiff(speech[0], single[0][0]) <= BATCH_ATOL and maxdiff(speech[1], single[1][0]) <= BATCH_ATOL
    # zero and random rows mix
    speech, _ = hift.inference(mel, None, [NSFNoise.zero(), NSFNoise.random(torch.Generator().manual_seed(22))])
    z1, _ = hift.inference(gold["mel1"], None, NSFNoise.zero())
    assert maxdiff(speech[0], z1[0]) <= BATCH_ATOL and maxdiff(speech[1], single[1][0]) <= BATCH_ATOL


def test_noise_validation(hift, gold):
    with pytest.raises(ValueError):
        NSFNoise(kind="given")
    with pytest.raises(ValueError):
        NSFNoise(kind="loud")
    with pytest.raises(ValueError, match="injected NSF draws"):
        hift.inference(gold["mel1"], None, NSFNoise.given(torch.zeros(1, 9), torch.zeros(1, 100, 9)))
    with pytest.raises(ValueError, match="NSFNoise entries"):
        hift.inference(gold["mel1"], None, [NSFNoise.zero(), NSFNoise.zero()])

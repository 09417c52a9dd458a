"""make_random_model's CosyVoice3 flow.pt / hift.pt layouts (random_model/weights.py): the official key
order and shapes of the fixture (upstream's own files), loadable strictly into DiTFlow / CausalHiFT,
and at full size the parameter counts of Fun-CosyVoice3-0.5B (~332M flow, ~20.8M vocoder)."""
import torch

from async_cosyvoice.model_dir import load_strict, normalize_hift_state_dict
from async_cosyvoice.models.cosyvoice3.flow import DiTFlow
from async_cosyvoice.models.cosyvoice3.hift import F0_PREDICTOR_PREFIX, CausalHiFT
from async_cosyvoice.models.dims import DiTFlowDims, HiFTDims
from async_cosyvoice.random_model.weights import dit_flow_specs, hift_specs, random_state_dict

from cv3_fixture import cv3_dir, flow_dims, hift_dims

FULL_FLOW = DiTFlowDims()
FULL_HIFT = HiFTDims(causal=True, conv_pre_look_right=4)


def _layout(sd) -> list[tuple[str, tuple[int, ...]]]:
    return [(k, tuple(v.shape)) for k, v in sd.items()]


def test_specs_are_the_official_layout():
    d = cv3_dir()
    for file, specs in (("flow.pt", dit_flow_specs(flow_dims(d))), ("hift.pt", hift_specs(hift_dims(d)))):
        official = torch.load(d / file, map_location="cpu", weights_only=True)
        assert [(k, s) for k, s, _ in specs] == _layout(official), file


def test_random_tiny_weights_load_strictly_and_run():
    d = cv3_dir()
    gen = torch.Generator().manual_seed(0)
    flow = DiTFlow(flow_dims(d))
    sd = random_state_dict(dit_flow_specs(flow_dims(d), mel_mean=-5.0), gen)
    load_strict(flow, sd, "flow.pt")
    assert torch.equal(sd["decoder.estimator.rotary_embed.inv_freq"], DiTFlow(flow_dims(d)).state_dict()[
        "decoder.estimator.rotary_embed.inv_freq"])
    hift = CausalHiFT(hift_dims(d))
    load_strict(hift, normalize_hift_state_dict(random_state_dict(hift_specs(hift_dims(d)), gen), "hift.pt",
                                                float64_under=(F0_PREDICTOR_PREFIX,)), "hift.pt")
    mel = flow.eval().inference(torch.randint(0, 6561, (1, 20), generator=gen), torch.zeros(1, 0, dtype=torch.long),
                                torch.zeros(1, 0, 80), torch.randn(1, 192, generator=gen), streaming=False,
                                finalize=True)
    speech, _ = hift.eval().inference(mel)
    assert speech.shape == (1, 40 * 480) and torch.isfinite(speech).all() and speech.abs().max() > 0


def test_full_size_layout_and_parameter_counts():
    with torch.device("meta"):
        flow, hift = DiTFlow(FULL_FLOW), CausalHiFT(FULL_HIFT)
    flow_specs = dit_flow_specs(FULL_FLOW)
    assert [(k, s) for k, s, _ in flow_specs] == _layout(flow.state_dict())
    folded = {k.replace(".parametrizations.weight.original1", ".weight"): s for k, s, _ in hift_specs(FULL_HIFT)
              if not k.endswith(".original0")}
    assert folded == dict(_layout(hift.state_dict()))
    n_flow = sum(p.numel() for p in flow.parameters())
    n_hift = sum(p.numel() for p in hift.parameters())
    assert 325e6 < n_flow < 340e6, n_flow
    assert 20e6 < n_hift < 21.5e6, n_hift

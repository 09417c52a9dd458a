"""The CosyVoice3 tiny fixture for the flow and vocoder tests: its directory and the flow / vocoder
dims read from its `cosyvoice3.yaml` (a stand-in until the model dir loader reads CosyVoice3)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from async_cosyvoice.models.dims import CFMParams, DiTDims, DiTFlowDims, HiFTDims
from async_cosyvoice.recipe import Tagged, load_recipe

FIXTURE_ENV = "COSYVOICE3_TINY_FIXTURE"
DEFAULT_FIXTURE = Path(__file__).resolve().parents[1] / ".." / "shared" / "fixtures" / "cosyvoice3-tiny"


def cv3_dir() -> Path:
    d = Path(os.environ.get(FIXTURE_ENV, DEFAULT_FIXTURE)).resolve()
    if not (d / "cosyvoice3.yaml").is_file():
        pytest.fail(f"CosyVoice3 tiny fixture not found at {d}. Set {FIXTURE_ENV} to the directory holding "
                    "cosyvoice3.yaml, flow.pt, hift.pt and golden/.")
    return d


def _args(node):
    return node.args if isinstance(node, Tagged) else node


def recipe(d: Path) -> dict:
    return load_recipe((d / "cosyvoice3.yaml").read_text(encoding="utf-8"))


def flow_dims(d: Path) -> DiTFlowDims:
    flow = _args(recipe(d)["flow"])
    est = _args(_args(flow["decoder"])["estimator"])
    cfm = _args(_args(flow["decoder"])["cfm_params"])
    cfm = cfm.get("content", cfm)
    return DiTFlowDims(
        **{k: flow[k] for k in ("input_size", "output_size", "spk_embed_dim", "vocab_size", "token_mel_ratio",
                                "pre_lookahead_len", "input_frame_rate")},
        lookahead_channels=_args(flow["pre_lookahead_layer"])["channels"],
        estimator=DiTDims(**{k: est[k] for k in ("dim", "depth", "heads", "dim_head", "ff_mult", "mel_dim", "mu_dim",
                                                 "spk_dim", "out_channels", "static_chunk_size",
                                                 "num_decoding_left_chunks")}),
        cfm=CFMParams(sigma_min=float(cfm["sigma_min"]), t_scheduler=cfm["t_scheduler"],
                      inference_cfg_rate=float(cfm["inference_cfg_rate"])))


def hift_dims(d: Path) -> HiFTDims:
    h = _args(recipe(d)["hift"])
    f0 = _args(h["f0_predictor"])
    return HiFTDims(
        **{k: h[k] for k in ("in_channels", "base_channels", "nb_harmonics", "sampling_rate", "nsf_alpha",
                             "nsf_sigma", "nsf_voiced_threshold", "lrelu_slope", "audio_limit",
                             "conv_pre_look_right")},
        upsample_rates=tuple(h["upsample_rates"]), upsample_kernel_sizes=tuple(h["upsample_kernel_sizes"]),
        istft_n_fft=h["istft_params"]["n_fft"], istft_hop_len=h["istft_params"]["hop_len"],
        resblock_kernel_sizes=tuple(h["resblock_kernel_sizes"]),
        resblock_dilation_sizes=tuple(map(tuple, h["resblock_dilation_sizes"])),
        source_resblock_kernel_sizes=tuple(h["source_resblock_kernel_sizes"]),
        source_resblock_dilation_sizes=tuple(map(tuple, h["source_resblock_dilation_sizes"])),
        f0_num_class=f0["num_class"], f0_in_channels=f0["in_channels"], f0_cond_channels=f0["cond_channels"],
        causal=True)

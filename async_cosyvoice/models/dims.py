"""Model dimensions: the hyperparameters every module is built from.

model_dir.py fills these from an official `cosyvoice2.yaml` / `cosyvoice3.yaml` + `CosyVoice-BlankEN/config.json`
and random_model/ writes directories from them, both through the tables of dims_map.py. Defaults are the
official CosyVoice2-0.5B values (facts sheet §1.2, §2.1); `cosyvoice3_dims()` gives Fun-CosyVoice3-0.5B's.
`ModelDims.kind` says which model a directory holds; it is read from the directory (the yaml's name).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ModelKind = Literal["cosyvoice2", "cosyvoice3"]
MODEL_KINDS: tuple[str, ...] = ("cosyvoice2", "cosyvoice3")

SPEECH_TOKEN_SIZE = 6561
# CosyVoice2's special speech ids (SpeechIds.of says them for every kind)
EOS_TOKEN = 6561  # speech_token_size
EOS2_TOKEN = 6562
FILL_TOKEN = 6563  # speech_token_size + 2, bistream only
STOP_TOKENS = (EOS_TOKEN, EOS2_TOKEN, FILL_TOKEN)
SPEECH_VOCAB = SPEECH_TOKEN_SIZE + 3  # rows of speech_embedding / llm_decoder
SOS_ROW = 0  # rows of llm_embedding
TASK_ROW = 1
# CosyVoice3: the FSQ silent and breath tokens (upstream CosyVoice3Model.silent_tokens); after
# MAX_SILENT_RUN of them in a row, further ones are dropped before the flow (the LM still sees them)
COSYVOICE3_SILENT_TOKENS = frozenset((1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323))
MAX_SILENT_RUN = 5


@dataclass(frozen=True)
class SpeechIds:
    """The speech vocabulary of an LM: ids 0..size-1 are speech tokens, every id >= size ends a
    generation (upstream's stop_token_ids), `vocab` rows in speech_embedding / llm_decoder.

    CosyVoice2: vocab size+3, eos size, fill size+2; sos and task are rows 0 and 1 of a separate
    `llm_embedding` (sos/task None here). CosyVoice3: vocab size+200, sos size, eos size+1,
    task size+2, fill size+3, all rows of speech_embedding. In both, `min_len` masks id `size`
    only (upstream's ignore_eos): CosyVoice2's eos, but CosyVoice3's sos, so that its real eos and
    the other stop ids stay sampleable before min_len."""
    size: int
    vocab: int
    eos: int
    fill: int
    sos: int | None = None
    task: int | None = None

    @classmethod
    def of(cls, kind: str, speech_token_size: int = SPEECH_TOKEN_SIZE) -> "SpeechIds":
        n = speech_token_size
        if kind == "cosyvoice3":
            return cls(n, n + 200, eos=n + 1, fill=n + 3, sos=n, task=n + 2)
        return cls(n, n + 3, eos=n, fill=n + 2)

    @property
    def min_len_masked(self) -> int:
        """The one id masked while fewer than min_len tokens are out (upstream: speech_token_size)."""
        return self.size

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(range(self.size, self.vocab))

    def is_stop(self, token: int) -> bool:
        return token >= self.size

    def ends_bistream(self, token: int) -> bool:
        """Whether `token`, sampled after a bistream request's text ended, ends it. CosyVoice2: its EOS
        only (upstream raises on 6562/6563). CosyVoice3: any stop id, as its unistream decode stops on
        all 200 (upstream's bistream loop, written for CosyVoice2's three ids, would raise on all but
        6562: with random weights nearly every request, with the released model practically never)."""
        return token == self.eos or (self.sos is not None and self.is_stop(token))


@dataclass(frozen=True)
class Qwen2Dims:
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_layers: int = 24
    num_heads: int = 14
    num_kv_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    vocab_size: int = 151936
    max_position_embeddings: int = 32768

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class RASParams:
    """Repetition-aware sampling (yaml `llm.sampling`)."""
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


@dataclass(frozen=True)
class LMDims:
    qwen: Qwen2Dims = field(default_factory=Qwen2Dims)
    llm_input_size: int = 896
    llm_output_size: int = 896
    speech_token_size: int = SPEECH_TOKEN_SIZE
    mix_ratio: tuple[int, int] = (5, 15)
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    kind: str = "cosyvoice2"  # ModelKind: the LM's input tables and speech vocabulary

    @property
    def ids(self) -> SpeechIds:
        return SpeechIds.of(self.kind, self.speech_token_size)

    @property
    def silent_tokens(self) -> frozenset[int]:
        """Speech ids whose long runs are cut before the flow (empty: none, CosyVoice2)."""
        return COSYVOICE3_SILENT_TOKENS if self.kind == "cosyvoice3" else frozenset()


@dataclass(frozen=True)
class EncoderDims:
    """UpsampleConformerEncoder (flow.encoder)."""
    input_size: int = 512
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4  # hard-coded upstream
    static_chunk_size: int = 25  # tokens; the up-layers use static_chunk_size * upsample_stride
    pre_lookahead_len: int = 3
    upsample_stride: int = 2


@dataclass(frozen=True)
class EstimatorDims:
    """CausalConditionalDecoder (flow.decoder.estimator)."""
    in_channels: int = 320
    out_channels: int = 80
    channels: tuple[int, ...] = (256,)
    attention_head_dim: int = 64
    n_blocks: int = 4
    num_mid_blocks: int = 12
    num_heads: int = 8
    act_fn: str = "gelu"
    static_chunk_size: int = 50  # mel frames


@dataclass(frozen=True)
class CFMParams:
    sigma_min: float = 1e-6
    t_scheduler: str = "cosine"
    inference_cfg_rate: float = 0.7
    n_timesteps: int = 10
    noise_frames: int = 15000  # rand_noise = (seed 0) randn(1, 80, noise_frames)


@dataclass(frozen=True)
class FlowDims:
    input_size: int = 512
    output_size: int = 80
    spk_embed_dim: int = 192
    vocab_size: int = SPEECH_TOKEN_SIZE
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    input_frame_rate: int = 25
    encoder: EncoderDims = field(default_factory=EncoderDims)
    estimator: EstimatorDims = field(default_factory=EstimatorDims)
    cfm: CFMParams = field(default_factory=CFMParams)

    @property
    def chunk_tokens(self) -> int:
        """Tokens per streaming attention chunk (the encoder's static_chunk_size)."""
        return self.encoder.static_chunk_size


@dataclass(frozen=True)
class DiTDims:
    """CosyVoice3's flow estimator (`cosyvoice.flow.DiT.dit.DiT`, flow.decoder.estimator)."""
    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64
    ff_mult: int = 2
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80
    out_channels: int = 80
    static_chunk_size: int = 50  # mel frames (chunk_size * token_mel_ratio)
    num_decoding_left_chunks: int = -1
    long_skip_connection: bool = False


@dataclass(frozen=True)
class DiTFlowDims:
    """CosyVoice3's flow (`CausalMaskedDiffWithDiT`): token embedding -> PreLookaheadLayer -> DiT CFM;
    no conformer encoder (mu is the look-ahead output repeated token_mel_ratio times)."""
    input_size: int = 80
    output_size: int = 80
    spk_embed_dim: int = 192
    vocab_size: int = SPEECH_TOKEN_SIZE
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    input_frame_rate: int = 25
    lookahead_channels: int = 1024  # pre_lookahead_layer.channels
    estimator: DiTDims = field(default_factory=DiTDims)
    cfm: CFMParams = field(default_factory=CFMParams)

    @property
    def chunk_tokens(self) -> int:
        """Tokens per streaming attention chunk (the DiT's static_chunk_size is in mel frames)."""
        return self.estimator.static_chunk_size // self.token_mel_ratio


@dataclass(frozen=True)
class HiFTDims:
    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_num_class: int = 1
    f0_in_channels: int = 80
    f0_cond_channels: int = 512
    causal: bool = False  # CosyVoice3's CausalHiFTGenerator + CausalConvRNNF0Predictor
    conv_pre_look_right: int = 0  # CausalHiFTGenerator: mel frames conv_pre reads ahead

    @property
    def samples_per_frame(self) -> int:
        n = self.istft_hop_len
        for r in self.upsample_rates:
            n *= r
        return n


@dataclass(frozen=True)
class MelDims:
    """yaml `feat_extractor` (matcha mel_spectrogram) for the 24 kHz prompt mel."""
    n_fft: int = 1920
    num_mels: int = 80
    sampling_rate: int = 24000
    hop_size: int = 480
    win_size: int = 1920
    fmin: float = 0.0
    fmax: float | None = 8000.0
    center: bool = False


@dataclass(frozen=True)
class ModelDims:
    kind: str = "cosyvoice2"  # ModelKind, from the directory (never configured)
    sample_rate: int = 24000
    token_frame_rate: int = 25
    token_mel_ratio: int = 2
    chunk_size: int = 25
    lm: LMDims = field(default_factory=LMDims)
    sampling: RASParams = field(default_factory=RASParams)
    flow: FlowDims | DiTFlowDims = field(default_factory=FlowDims)
    hift: HiFTDims = field(default_factory=HiFTDims)
    feat: MelDims = field(default_factory=MelDims)

    @property
    def samples_per_token(self) -> int:
        return self.hift.samples_per_frame * self.token_mel_ratio


def cosyvoice3_dims() -> ModelDims:
    """Fun-CosyVoice3-0.5B (upstream examples/libritts/cosyvoice3/conf/cosyvoice3.yaml)."""
    return ModelDims(kind="cosyvoice3", lm=LMDims(kind="cosyvoice3"), flow=DiTFlowDims(),
                     hift=HiFTDims(causal=True, conv_pre_look_right=4), feat=MelDims(fmax=None))

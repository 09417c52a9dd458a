"""`cosyvoice2.yaml` writer: the official recipe structure and tags, holding a preset's dims."""
from __future__ import annotations

from async_cosyvoice.models.dims import EncoderDims, LMDims, ModelDims


def _num(x) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "True" if x else "False"
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(x)


def _list(xs) -> str:
    return "[" + ", ".join(_list(x) if isinstance(x, (list, tuple)) else _num(x) for x in xs) + "]"


def recipe_yaml(d: ModelDims) -> str:
    """A `cosyvoice2.yaml` with the official structure and tags, holding the dims `d`."""
    f, e, est, cfm, h, m = d.flow, d.flow.encoder, d.flow.estimator, d.flow.cfm, d.hift, d.feat

    def ref_or(value, name, expected):
        return f"!ref <{name}>" if value == expected else _num(value)

    def extra(indent: int, values: dict) -> str:
        """Keys upstream hard-codes: written only when they differ from what the parser assumes."""
        return "".join(f"{' ' * indent}{k}: {_num(v)}\n" for k, (v, default) in values.items() if v != default)

    est_chunk = ("!ref <chunk_size> * <token_mel_ratio>"
                 if est.static_chunk_size == d.chunk_size * d.token_mel_ratio else _num(est.static_chunk_size))
    enc0, lm0, cfm0 = EncoderDims(), LMDims(), type(cfm)()
    extra_enc = extra(8, {"num_up_blocks": (e.num_up_blocks, enc0.num_up_blocks),
                          "pre_lookahead_len": (e.pre_lookahead_len, f.pre_lookahead_len),
                          "upsample_stride": (e.upsample_stride, enc0.upsample_stride)})
    lm_extra = extra(4, {"min_token_text_ratio": (d.lm.min_token_text_ratio, lm0.min_token_text_ratio),
                         "max_token_text_ratio": (d.lm.max_token_text_ratio, lm0.max_token_text_ratio)})
    cfm_extra = extra(16, {"n_timesteps": (cfm.n_timesteps, cfm0.n_timesteps),
                           "noise_frames": (cfm.noise_frames, cfm0.noise_frames)})
    return f"""# set random seed, so that you may reproduce your result.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

# fixed params
sample_rate: {d.sample_rate}
llm_input_size: {d.lm.llm_input_size}
llm_output_size: {d.lm.llm_output_size}
spk_embed_dim: {f.spk_embed_dim}
qwen_pretrain_path: ''
token_frame_rate: {d.token_frame_rate}
token_mel_ratio: {d.token_mel_ratio}

# stream related params
chunk_size: {d.chunk_size} # streaming inference chunk size, in token
num_decoding_left_chunks: -1 # streaming inference flow decoder left chunk size, <0 means use all left chunks

# model params
llm: !new:cosyvoice.llm.llm.Qwen2LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: {d.lm.speech_token_size}
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: {_list(d.lm.mix_ratio)}
{lm_extra}    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: {_num(d.sampling.top_p)}
        top_k: {d.sampling.top_k}
        win_size: {d.sampling.win_size}
        tau_r: {_num(d.sampling.tau_r)}

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: {f.input_size}
    output_size: {f.output_size}
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: {f.vocab_size}
    input_frame_rate: {ref_or(f.input_frame_rate, "token_frame_rate", d.token_frame_rate)}
    only_mask_loss: True
    token_mel_ratio: {ref_or(f.token_mel_ratio, "token_mel_ratio", d.token_mel_ratio)}
    pre_lookahead_len: {f.pre_lookahead_len}
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: {e.output_size}
        attention_heads: {e.attention_heads}
        linear_units: {e.linear_units}
        num_blocks: {e.num_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: {e.input_size}
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: {ref_or(e.static_chunk_size, "chunk_size", d.chunk_size)}
{extra_enc}    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: {f.output_size}
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: {_num(cfm.sigma_min)}
                solver: 'euler'
                t_scheduler: '{cfm.t_scheduler}'
                training_cfg_rate: 0.2
                inference_cfg_rate: {_num(cfm.inference_cfg_rate)}
                reg_loss_type: 'l1'
{cfm_extra}        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: {est.in_channels}
            out_channels: {est.out_channels}
            channels: {_list(est.channels)}
            dropout: 0.0
            attention_head_dim: {est.attention_head_dim}
            n_blocks: {est.n_blocks}
            num_mid_blocks: {est.num_mid_blocks}
            num_heads: {est.num_heads}
            act_fn: '{est.act_fn}'
            static_chunk_size: {est_chunk}
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
    in_channels: {h.in_channels}
    base_channels: {h.base_channels}
    nb_harmonics: {h.nb_harmonics}
    sampling_rate: {ref_or(h.sampling_rate, "sample_rate", d.sample_rate)}
    nsf_alpha: {_num(h.nsf_alpha)}
    nsf_sigma: {_num(h.nsf_sigma)}
    nsf_voiced_threshold: {_num(h.nsf_voiced_threshold)}
    upsample_rates: {_list(h.upsample_rates)}
    upsample_kernel_sizes: {_list(h.upsample_kernel_sizes)}
    istft_params:
        n_fft: {h.istft_n_fft}
        hop_len: {h.istft_hop_len}
    resblock_kernel_sizes: {_list(h.resblock_kernel_sizes)}
    resblock_dilation_sizes: {_list(h.resblock_dilation_sizes)}
    source_resblock_kernel_sizes: {_list(h.source_resblock_kernel_sizes)}
    source_resblock_dilation_sizes: {_list(h.source_resblock_dilation_sizes)}
    lrelu_slope: {_num(h.lrelu_slope)}
    audio_limit: {_num(h.audio_limit)}
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: {h.f0_num_class}
        in_channels: {h.f0_in_channels}
        cond_channels: {h.f0_cond_channels}

# gan related module
mel_spec_transform1: !name:matcha.utils.audio.mel_spectrogram
    n_fft: {m.n_fft}
    num_mels: {m.num_mels}
    sampling_rate: !ref <sample_rate>
    hop_size: {m.hop_size}
    win_size: {m.win_size}
    fmin: {_num(m.fmin)}
    fmax: null
    center: False
hifigan: !new:cosyvoice.hifigan.hifigan.HiFiGan
    generator: !ref <hift>
    discriminator: !new:cosyvoice.hifigan.discriminator.MultipleDiscriminator
        mpd: !new:matcha.hifigan.models.MultiPeriodDiscriminator
        mrd: !new:cosyvoice.hifigan.discriminator.MultiResSpecDiscriminator
    mel_spec_transform: [
        !ref <mel_spec_transform1>
    ]

# processor functions
parquet_opener: !name:cosyvoice.dataset.processor.parquet_opener
get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
allowed_special: 'all'
tokenize: !name:cosyvoice.dataset.processor.tokenize
    get_tokenizer: !ref <get_tokenizer>
    allowed_special: !ref <allowed_special>
filter: !name:cosyvoice.dataset.processor.filter
    max_length: 6000
    min_length: 100
    token_max_length: 200
    token_min_length: 1
resample: !name:cosyvoice.dataset.processor.resample
    resample_rate: !ref <sample_rate>
truncate: !name:cosyvoice.dataset.processor.truncate
    truncate_length: 24480 # must be a multiplier of hop_size
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: {m.n_fft}
    num_mels: {m.num_mels}
    sampling_rate: {ref_or(m.sampling_rate, "sample_rate", d.sample_rate)}
    hop_size: {m.hop_size}
    win_size: {m.win_size}
    fmin: {_num(m.fmin)}
    fmax: {_num(m.fmax)}
    center: {_num(m.center)}
compute_fbank: !name:cosyvoice.dataset.processor.compute_fbank
    feat_extractor: !ref <feat_extractor>
    num_frames: 960
compute_whisper_fbank: !name:cosyvoice.dataset.processor.compute_whisper_fbank
    num_frames: 960
compute_f0: !name:cosyvoice.dataset.processor.compute_f0
    sample_rate: !ref <sample_rate>
    hop_size: {m.hop_size}
parse_embedding: !name:cosyvoice.dataset.processor.parse_embedding
    normalize: True
shuffle: !name:cosyvoice.dataset.processor.shuffle
    shuffle_size: 1000
sort: !name:cosyvoice.dataset.processor.sort
    sort_size: 500  # sort_size should be less than shuffle_size
batch: !name:cosyvoice.dataset.processor.batch
    batch_type: 'dynamic'
    max_frames_in_batch: 2000
padding: !name:cosyvoice.dataset.processor.padding
    use_spk_embedding: False # change to True during sft

# dataset processor pipeline
data_pipeline: [
    !ref <parquet_opener>,
    !ref <tokenize>,
    !ref <filter>,
    !ref <resample>,
    !ref <compute_fbank>,
    !ref <parse_embedding>,
    !ref <compute_whisper_fbank>,
    !ref <shuffle>,
    !ref <sort>,
    !ref <batch>,
    !ref <padding>,
]
data_pipeline_gan: [
    !ref <parquet_opener>,
    !ref <tokenize>,
    !ref <filter>,
    !ref <resample>,
    !ref <truncate>,
    !ref <compute_fbank>,
    !ref <compute_f0>,
    !ref <parse_embedding>,
    !ref <shuffle>,
    !ref <sort>,
    !ref <batch>,
    !ref <padding>,
]

# llm flow train conf
train_conf:
    optim: adam
    optim_conf:
        lr: 1e-5 # change to 1e-5 during sft
    scheduler: constantlr # change to constantlr during sft
    scheduler_conf:
        warmup_steps: 2500
    max_epoch: 200
    grad_clip: 5
    accum_grad: 2
    log_interval: 100
    save_per_step: -1

# gan train conf
train_conf_gan:
    optim: adam
    optim_conf:
        lr: 0.0002 # use small lr for gan training
    scheduler: constantlr
    optim_d: adam
    optim_conf_d:
        lr: 0.0002 # use small lr for gan training
    scheduler_d: constantlr
    max_epoch: 200
    grad_clip: 5
    accum_grad: 1 # in gan training, accum_grad must be 1
    log_interval: 100
    save_per_step: -1
"""

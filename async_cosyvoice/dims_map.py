"""One table between the typed dims and a model directory's config files, used in both directions.

`RECIPE_FIELDS_BY_KIND` maps `ModelDims` fields to keys of `cosyvoice2.yaml` / `cosyvoice3.yaml` (the fields
both share, then each kind's flow and HiFT extras), `QWEN_FIELDS` maps `Qwen2Dims` fields
to keys of `CosyVoice-BlankEN/config.json`. `model_dir.py` reads dims through them (`read_dims`) and the
random-model writer fills the official recipe through the same rows (`write_recipe`, `qwen_config`), so
what is written is what is read.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from async_cosyvoice.errors import ModelDirError
from async_cosyvoice.models.dims import ModelDims, Qwen2Dims, cosyvoice3_dims
from async_cosyvoice.recipe import YAML_FILE, RecipeLoader, Tagged, load_recipe


# ---------------------------------------------------------------------------------------------------
# Converters: a raw yaml/json value -> the dims value, or ValueError("must be ...")
# ---------------------------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def to_int(v) -> int:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise ValueError("must be an integer")
    return v


def to_float(v) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ValueError("must be a number")
    return float(v)


def to_opt_float(v) -> float | None:
    return None if v is None else to_float(v)


def to_str(v) -> str:
    if not isinstance(v, str):
        raise ValueError("must be a string")
    return v


def to_bool(v) -> bool:
    if not isinstance(v, bool):
        raise ValueError("must be true/false")
    return v


def to_ints(v) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not all(_is_int(x) for x in v):
        raise ValueError("must be a list of integers")
    return tuple(v)


def to_int_lists(v) -> tuple[tuple[int, ...], ...]:
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, (list, tuple)) and all(_is_int(y) for y in x)
                                                    for x in v):
        raise ValueError("must be a list of integer lists")
    return tuple(tuple(x) for x in v)


# ---------------------------------------------------------------------------------------------------
# The tables
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Field:
    """`dims` (dotted field path) <-> `keys` (dotted config paths: the first present one is read, the first
    one is written). An `optional` key is hard-coded upstream: when absent the dims default applies, or
    the value of the earlier field `default_from`; it is written only when it differs from that."""
    dims: str
    keys: tuple[str, ...]
    convert: Callable[[Any], Any]
    optional: bool = False
    default_from: str | None = None


def _f(dims: str, key: str | tuple[str, ...], convert, **kw) -> Field:
    return Field(dims, (key,) if isinstance(key, str) else key, convert, **kw)


def _under(dims_prefix: str, key_prefix: str, *fields: Field) -> list[Field]:
    return [dataclasses.replace(f, dims=f"{dims_prefix}.{f.dims}", keys=tuple(f"{key_prefix}.{k}" for k in f.keys))
            for f in fields]


def _same(convert, *names: str) -> list[Field]:
    return [_f(n, n, convert) for n in names]


_CFM = "flow.decoder.cfm_params"

# the fields both kinds share, under the same keys
_COMMON_FIELDS: tuple[Field, ...] = (
    *_same(to_int, "sample_rate", "token_frame_rate", "token_mel_ratio", "chunk_size"),
    *_under("lm", "llm",
            *_same(to_int, "llm_input_size", "llm_output_size", "speech_token_size"),
            _f("mix_ratio", "mix_ratio", to_ints, optional=True),
            _f("min_token_text_ratio", "min_token_text_ratio", to_float, optional=True),
            _f("max_token_text_ratio", "max_token_text_ratio", to_float, optional=True)),
    *_under("sampling", "llm.sampling",
            _f("top_p", "top_p", to_float), _f("top_k", "top_k", to_int),
            _f("win_size", "win_size", to_int), _f("tau_r", "tau_r", to_float)),
    *_under("flow", "flow",
            *_same(to_int, "input_size", "output_size", "spk_embed_dim", "vocab_size", "token_mel_ratio",
                   "pre_lookahead_len", "input_frame_rate")),
    # cfm_params is `!new:omegaconf.DictConfig {content: {...}}` upstream; a plain mapping is read too
    *[_f(f"flow.cfm.{name}", (f"{_CFM}.content.{name}", f"{_CFM}.{name}"), convert, **kw)
      for name, convert, kw in (("sigma_min", to_float, {}), ("t_scheduler", to_str, {}),
                                ("inference_cfg_rate", to_float, {}), ("n_timesteps", to_int, {"optional": True}),
                                ("noise_frames", to_int, {"optional": True}))],
    *_under("hift", "hift",
            *_same(to_int, "in_channels", "base_channels", "nb_harmonics", "sampling_rate"),
            *_same(to_float, "nsf_alpha", "nsf_sigma", "nsf_voiced_threshold"),
            *_same(to_ints, "upsample_rates", "upsample_kernel_sizes"),
            _f("istft_n_fft", "istft_params.n_fft", to_int), _f("istft_hop_len", "istft_params.hop_len", to_int),
            _f("resblock_kernel_sizes", "resblock_kernel_sizes", to_ints),
            _f("resblock_dilation_sizes", "resblock_dilation_sizes", to_int_lists),
            _f("source_resblock_kernel_sizes", "source_resblock_kernel_sizes", to_ints),
            _f("source_resblock_dilation_sizes", "source_resblock_dilation_sizes", to_int_lists),
            *_same(to_float, "lrelu_slope", "audio_limit"),
            _f("f0_num_class", "f0_predictor.num_class", to_int),
            _f("f0_in_channels", "f0_predictor.in_channels", to_int),
            _f("f0_cond_channels", "f0_predictor.cond_channels", to_int)),
    *_under("feat", "feat_extractor",
            *_same(to_int, "n_fft", "num_mels", "sampling_rate", "hop_size", "win_size"),
            _f("fmin", "fmin", to_float), _f("fmax", "fmax", to_opt_float), _f("center", "center", to_bool)),
)

COSYVOICE2_FIELDS: tuple[Field, ...] = (
    *_COMMON_FIELDS,
    *_under("flow.encoder", "flow.encoder",
            *_same(to_int, "input_size", "output_size", "attention_heads", "linear_units", "num_blocks"),
            _f("num_up_blocks", "num_up_blocks", to_int, optional=True),
            _f("static_chunk_size", "static_chunk_size", to_int),
            _f("pre_lookahead_len", "pre_lookahead_len", to_int, optional=True, default_from="flow.pre_lookahead_len"),
            _f("upsample_stride", "upsample_stride", to_int, optional=True)),
    *_under("flow.estimator", "flow.decoder.estimator",
            *_same(to_int, "in_channels", "out_channels"),
            _f("channels", "channels", to_ints),
            *_same(to_int, "attention_head_dim", "n_blocks", "num_mid_blocks", "num_heads"),
            _f("act_fn", "act_fn", to_str),
            _f("static_chunk_size", "static_chunk_size", to_int)),
)

COSYVOICE3_FIELDS: tuple[Field, ...] = (
    *_COMMON_FIELDS,
    _f("flow.lookahead_channels", "flow.pre_lookahead_layer.channels", to_int),
    *_under("flow.estimator", "flow.decoder.estimator",
            *_same(to_int, "dim", "depth", "heads", "dim_head", "ff_mult", "mel_dim"),
            _f("mu_dim", "mu_dim", to_int, optional=True, default_from="flow.estimator.mel_dim"),
            *_same(to_int, "spk_dim", "out_channels", "static_chunk_size"),
            _f("num_decoding_left_chunks", "num_decoding_left_chunks", to_int, optional=True),
            _f("long_skip_connection", "long_skip_connection", to_bool, optional=True)),
    _f("hift.conv_pre_look_right", "hift.conv_pre_look_right", to_int, optional=True),
)

RECIPE_FIELDS_BY_KIND: dict[str, tuple[Field, ...]] = {"cosyvoice2": COSYVOICE2_FIELDS,
                                                       "cosyvoice3": COSYVOICE3_FIELDS}
RECIPE_FIELDS = COSYVOICE2_FIELDS  # the CosyVoice2 table (the random-model writer's)

# the classes each kind's recipe builds (checked before any field is read)
RECIPE_CLASSES_BY_KIND: dict[str, dict[str, str]] = {
    "cosyvoice2": {
        "llm": "Qwen2LM", "flow": "CausalMaskedDiffWithXvec", "flow.encoder": "UpsampleConformerEncoder",
        "flow.decoder": "CausalConditionalCFM", "flow.decoder.estimator": "CausalConditionalDecoder",
        "hift": "HiFTGenerator", "hift.f0_predictor": "ConvRNNF0Predictor",
    },
    "cosyvoice3": {
        "llm": "CosyVoice3LM", "flow": "CausalMaskedDiffWithDiT", "flow.pre_lookahead_layer": "PreLookaheadLayer",
        "flow.decoder": "CausalConditionalCFM", "flow.decoder.estimator": "DiT",
        "hift": "CausalHiFTGenerator", "hift.f0_predictor": "CausalConvRNNF0Predictor",
    },
}
RECIPE_CLASSES = RECIPE_CLASSES_BY_KIND["cosyvoice2"]
_PRETTY = {"cosyvoice2": "CosyVoice2", "cosyvoice3": "CosyVoice3"}


def base_dims(kind: str) -> ModelDims:
    """The defaults a kind's recipe is read over (fields a recipe leaves out keep these)."""
    return cosyvoice3_dims() if kind == "cosyvoice3" else ModelDims()

QWEN_FIELDS: tuple[Field, ...] = (
    _f("hidden_size", "hidden_size", to_int),
    _f("intermediate_size", "intermediate_size", to_int),
    _f("num_layers", "num_hidden_layers", to_int),
    _f("num_heads", "num_attention_heads", to_int),
    _f("num_kv_heads", "num_key_value_heads", to_int, optional=True, default_from="num_heads"),
    _f("rms_norm_eps", "rms_norm_eps", to_float),
    _f("rope_theta", ("rope_theta", "rope_parameters.rope_theta"), to_float),
    _f("vocab_size", "vocab_size", to_int),
    _f("max_position_embeddings", "max_position_embeddings", to_int),
)


# ---------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------

_MISSING = object()


def _lookup(data, key: str):
    """The value at dotted `key` of resolved data (a `Tagged` node steps into its arguments), or _MISSING."""
    node = data
    for part in key.split("."):
        args = node.args if isinstance(node, Tagged) else node
        if not isinstance(args, Mapping) or part not in args:
            return _MISSING
        node = args[part]
    return node


def _missing_prefix(data, key: str) -> str:
    parts = key.split(".")
    for i in range(1, len(parts) + 1):
        if _lookup(data, ".".join(parts[:i])) is _MISSING:
            return ".".join(parts[:i])
    return key


def _dims_value(dims, path: str):
    for part in path.split("."):
        dims = getattr(dims, part)
    return dims


def _build(defaults, flat: Mapping[str, Any], prefix: str = ""):
    """`defaults` (a dims instance) with the fields named in `flat` (dotted paths under `prefix`) replaced."""
    kwargs = {}
    for f in dataclasses.fields(defaults):
        path = prefix + f.name
        if path in flat:
            kwargs[f.name] = flat[path]
        elif dataclasses.is_dataclass(sub := getattr(defaults, f.name)):
            kwargs[f.name] = _build(sub, flat, path + ".")
    return dataclasses.replace(defaults, **kwargs)


def _read_flat(data, fields: tuple[Field, ...], defaults, file: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for f in fields:
        raw = next((v for k in f.keys if (v := _lookup(data, k)) is not _MISSING), _MISSING)
        if raw is _MISSING:
            if not f.optional:
                raise ModelDirError(file, f"missing key {_missing_prefix(data, f.keys[0])}")
            flat[f.dims] = flat[f.default_from] if f.default_from else _dims_value(defaults, f.dims)
            continue
        try:
            flat[f.dims] = f.convert(raw)
        except ValueError as e:
            key = next(k for k in f.keys if _lookup(data, k) is not _MISSING)
            raise ModelDirError(file, f"{key} {e}, got {raw!r}") from None
    return flat


def check_classes(recipe: Mapping[str, Any], file: str = YAML_FILE, kind: str = "cosyvoice2") -> None:
    for key, name in RECIPE_CLASSES_BY_KIND[kind].items():
        node = _lookup(recipe, key)
        if node is _MISSING:
            raise ModelDirError(file, f"missing key {_missing_prefix(recipe, key)}")
        if not isinstance(node, Tagged) or node.class_name != name:
            got = node.target if isinstance(node, Tagged) else repr(node)
            raise ModelDirError(file, f"{key} is {got}, expected {name} ({_PRETTY[kind]})")


def read_dims(recipe: Mapping[str, Any], qwen: Qwen2Dims, file: str = YAML_FILE,
              kind: str = "cosyvoice2") -> ModelDims:
    """`ModelDims` of a `kind` from its resolved recipe (`cosyvoice2.yaml` / `cosyvoice3.yaml`) and the
    backbone shape (no consistency checks)."""
    check_classes(recipe, file, kind)
    defaults = base_dims(kind)
    return _build(defaults, {**_read_flat(recipe, RECIPE_FIELDS_BY_KIND[kind], defaults, file), "lm.qwen": qwen})


def read_qwen_dims(config: Mapping[str, Any], file: str) -> Qwen2Dims:
    """`Qwen2Dims` from a Qwen2 `config.json` object (no consistency checks)."""
    return _build(Qwen2Dims(), _read_flat(config, QWEN_FIELDS, Qwen2Dims(), file))


# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------

def qwen_config(qwen: Qwen2Dims) -> dict[str, Any]:
    """The `config.json` keys `QWEN_FIELDS` read, holding `qwen`."""
    return {f.keys[0]: _dims_value(qwen, f.dims) for f in QWEN_FIELDS}


def yaml_literal(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    if isinstance(v, str):
        return "'" + v.replace("'", "''") + "'"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(yaml_literal(x) for x in v) + "]"
    return repr(v)


def _node(root: yaml.Node, key: str) -> tuple[yaml.MappingNode, yaml.Node | None]:
    """(parent mapping, value node or None) of dotted `key` in a composed (unresolved) yaml tree."""
    parent, node = None, root
    for part in key.split("."):
        if not isinstance(node, yaml.MappingNode):
            raise ValueError(f"template: no mapping holds {key}")
        parent, node = node, next((v for k, v in node.value if k.value == part), None)
    return parent, node


def _edit(root: yaml.Node, f: Field, value, field_keys: set[str]) -> tuple[tuple[int, int, str], bool]:
    """One text edit ((start, end, replacement), is_ref) that makes field `f` read `value`."""
    key = f.keys[0]
    parent, node = _node(root, key)
    literal = yaml_literal(value)
    if node is None:  # an optional key the template leaves out: insert it before the first sibling
        first = parent.value[0][0].start_mark
        name = key.rsplit(".", 1)[-1]
        return (first.index, first.index, f"{name}: {literal}\n{' ' * first.column}"), False
    span = (node.start_mark.index, node.end_mark.index)
    if node.tag == "!ref":
        target = node.value.strip()
        if target.startswith("<") and target.endswith(">") and target.count("<") == 1 \
                and target[1:-1] not in field_keys:  # a plain alias nobody else reads: write through it
            _, tnode = _node(root, target[1:-1])
            if tnode is not None and tnode.tag != "!ref":
                return (tnode.start_mark.index, tnode.end_mark.index, literal), False
        return (*span, literal), True
    return (*span, literal), False


def write_recipe(dims: ModelDims, template: str) -> str:
    """`template` (a `cosyvoice2.yaml` or `cosyvoice3.yaml`, as `dims.kind`) edited so that it reads back as
    `dims`; untouched text (comments, tags, `!ref`s that still resolve to the right value) is kept byte for byte."""
    fields = RECIPE_FIELDS_BY_KIND[dims.kind]
    field_keys = {k for f in fields for k in f.keys}
    want = {f.dims: _dims_value(dims, f.dims) for f in fields}
    text = template
    for _ in range(len(fields)):
        have = _read_flat(load_recipe(text), fields, base_dims(dims.kind), "template")
        wrong = [f for f in fields if have[f.dims] != want[f.dims]]
        if not wrong:
            return text
        root = yaml.compose(text, Loader=RecipeLoader)
        edits = [_edit(root, f, want[f.dims], field_keys) for f in wrong]
        # plain values first: a !ref that reads a changed value may be right afterwards
        chosen = {e for e, is_ref in edits if not is_ref} or {e for e, _ in edits}
        limit = len(text)
        for start, end, new in sorted(chosen, reverse=True):
            if end > limit:
                raise ValueError("template: two fields edit the same text (conflicting !ref aliases)")
            text, limit = text[:start] + new + text[end:], start
    raise ValueError("template: the dims cannot be written (conflicting !ref aliases)")

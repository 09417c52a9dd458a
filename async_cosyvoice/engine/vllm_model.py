"""CosyVoice2's and CosyVoice3's speech LM as a vLLM out-of-tree model.

The backbone is vLLM's own Qwen2 body. Speech ids are the model's output vocabulary (CosyVoice2:
6564 entries, 0..6560 speech tokens, 6561..6563 stop ids; CosyVoice3: 6761, 6561..6760 special),
so `model.embed_tokens` holds `speech_embedding` and `lm_head` (with bias for CosyVoice2 only,
config `cosyvoice_lm_head_bias`) holds `llm_decoder`. Unistream prompts come as
`prompt_embeds` built by the engine; bistream chunks come as input ids past the output
vocabulary for the sos/task rows and text tokens (vllm_export.py), embedded from `input_rows`.
The checkpoint directory vLLM loads is written by `vllm_export.export_for_vllm`.

Only vLLM processes import this module (the plugin registers it by "module:Class" path).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor as LogitsHead
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen2 import Qwen2Model
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix

class CosyVoice2ForCausalLM(nn.Module):
    """Qwen2 body + the speech head (`llm_decoder`: 6564-way with bias, or CosyVoice3's 6761-way)."""

    hf_to_vllm_mapper = Qwen2Model.hf_to_vllm_mapper
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config.get_text_config()
        quant_config = vllm_config.quant_config
        self.config = config
        self.model = Qwen2Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.head_bias = bool(getattr(config, "cosyvoice_lm_head_bias", True))
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            bias=self.head_bias,
            quant_config=quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        # vLLM's head layer; unrelated to the sampling-time logits processors (ras_processor.py).
        self.logits_processor = LogitsHead(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        # llm_embedding rows + the Qwen text embedding (input ids vocab_size...)
        self.input_rows = nn.Embedding(config.cosyvoice_input_rows, config.hidden_size)
        self.speech_vocab = config.vocab_size

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        speech = input_ids < self.speech_vocab
        embeds = self.model.embed_input_ids(torch.where(speech, input_ids, 0))
        rows = self.input_rows((input_ids - self.speech_vocab).clamp(min=0))
        return torch.where(speech[..., None], embeds, rows.to(embeds.dtype))

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if inputs_embeds is None and input_ids is not None:  # ids past the speech vocabulary need our table
            inputs_embeds, input_ids = self.embed_input_ids(input_ids), None
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        # The bias must be passed explicitly: the head layer adds it only when given, and a
        # missing bias fails silently (every logit off by llm_decoder.bias).
        return self.logits_processor(self.lm_head, hidden_states, self.lm_head.bias if self.head_bias else None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights)

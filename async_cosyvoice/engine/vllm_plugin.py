"""vLLM general plugin: registers `CosyVoice2ForCausalLM` with vLLM's model registry.

vLLM calls `register()` through the `vllm.general_plugins` entry point (pyproject.toml) in every
process it starts: the frontend, the spawned EngineCore, its Worker and the registry-inspection
subprocess. Registering from the parent process alone is not enough, because the model class is
resolved in the Worker. The function therefore runs once per process and must be idempotent.

This module must stay import-light: it is imported by vLLM itself, before any model code.
"""
from __future__ import annotations

ARCHITECTURE = "CosyVoice2ForCausalLM"
MODEL_CLASS_PATH = "async_cosyvoice.engine.vllm_model:CosyVoice2ForCausalLM"


def register() -> None:
    """Register the CosyVoice2 LM architecture with vLLM (no-op when already registered)."""
    from vllm import ModelRegistry

    if ARCHITECTURE in ModelRegistry.get_supported_archs():
        return
    # The "module:Class" form keeps this cheap (the class is imported lazily) and works in the
    # registry-inspection subprocess because async_cosyvoice is an installed package.
    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS_PATH)

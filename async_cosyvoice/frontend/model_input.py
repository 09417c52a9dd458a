"""What the LM and the flow receive for one text segment, built from the mode as data.

`MODE_SPECS` says, per mode, which parts of the voice each model uses (facts sheet §2.4);
`build_model_input` is the only constructor, and `ModelInput.to_upstream_dict` gives the dict that
upstream's `CosyVoiceFrontEnd.frontend_*` methods return (same keys, shapes and dtypes).

CosyVoice3's LM needs `<|endofprompt|>` in its text (upstream asserts it and leaves adding it to the
caller): `SystemPrompt` adds `You are a helpful assistant.<|endofprompt|>` where a request's LM
text lacks it, in front of the prompt transcript or, in modes without one, of the target text (as
upstream's cross-lingual texts carry it, so that it counts toward the length limits);
`instruction_text` wraps an instruction as upstream's examples do. Text that already holds the
marker is used as it is, so upstream-style inputs give upstream's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

from ..errors import InvalidRequest
from ..request import Mode, Voice
from .tokenizer import ENDOFPROMPT

PromptTextSource = Literal["transcript", "instruction"]
SYSTEM_PROMPT = "You are a helpful assistant."


@dataclass(frozen=True)
class ModeSpec:
    """How one mode uses the voice.

    runs_lm: the LM generates the speech tokens (False: VC, the source audio's tokens are used).
    lm_prompt_text: the LM's prompt text: the transcript of the prompt audio (from the request, or
        stored with the speaker), the request's instruction, or nothing.
    lm_prompt_speech: the LM continues from the prompt speech tokens.
    flow_prompt: the flow is conditioned on the prompt tokens and mel (always on the embedding).
    voice: where tokens/mel/embedding come from: the request's prompt audio or a stored speaker.
    """
    runs_lm: bool
    lm_prompt_text: PromptTextSource | None
    lm_prompt_speech: bool
    flow_prompt: bool
    voice: Literal["audio", "speaker"]


MODE_SPECS: dict[Mode, ModeSpec] = {
    Mode.ZERO_SHOT:           ModeSpec(True,  "transcript",  True,  True,  "audio"),
    Mode.CROSS_LINGUAL:       ModeSpec(True,  None,          False, True,  "audio"),
    Mode.INSTRUCT2:           ModeSpec(True,  "instruction", False, True,  "audio"),
    Mode.SFT:                 ModeSpec(True,  None,          False, False, "speaker"),
    Mode.ZERO_SHOT_BY_SPK_ID: ModeSpec(True,  "transcript",  True,  True,  "speaker"),
    # Upstream has no separate method for this: frontend_instruct2 with a zero_shot_spk_id starts from
    # the stored dict, so its LM prompt text would be the stored transcript rather than the
    # instruction. Here the instruction is used, which is what the mode asks for.
    Mode.INSTRUCT2_BY_SPK_ID: ModeSpec(True,  "instruction", False, True,  "speaker"),
    Mode.VC:                  ModeSpec(False, None,          False, True,  "audio"),
}

_NO_IDS = np.zeros(0, np.int32)
_NO_IDS.flags.writeable = False


def instruction_text(instruction: str, kind: str) -> str:
    """An instruct2 request's LM prompt text. CosyVoice2: the instruction ending in `<|endofprompt|>`
    (appended when missing); CosyVoice3: `You are a helpful assistant. <instruction><|endofprompt|>`
    unless the instruction already holds the marker."""
    if ENDOFPROMPT in instruction:
        return instruction
    if kind == "cosyvoice3":
        return f"{SYSTEM_PROMPT} {instruction}{ENDOFPROMPT}"
    return instruction + ENDOFPROMPT


@dataclass(frozen=True)
class SystemPrompt:
    """CosyVoice3: the tokens of `You are a helpful assistant.<|endofprompt|>` and the marker's id."""
    tokens: tuple[int, ...]
    endofprompt: int

    @classmethod
    def for_tokenizer(cls, encode, kind: str) -> "SystemPrompt | None":
        """None for CosyVoice2 (its LM text carries no system prompt)."""
        if kind != "cosyvoice3":
            return None
        tokens = tuple(encode(SYSTEM_PROMPT + ENDOFPROMPT))
        return cls(tokens, tokens[-1])

    def lm_texts(self, spec: "ModeSpec", prompt_text: np.ndarray, text: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(prompt_text, text) with the system prompt where the LM text lacks the marker."""
        if self.endofprompt in prompt_text or self.endofprompt in text:
            return prompt_text, text
        prefix = np.asarray(self.tokens, np.int32)
        if spec.lm_prompt_text is not None:
            return np.concatenate([prefix, prompt_text]), text
        return prompt_text, np.concatenate([prefix, text])


@dataclass(frozen=True, eq=False)
class ModelInput:
    """Per-segment inputs. Token arrays are int32 [N] (empty when the mode does not use them),
    `prompt_speech_feat` is float32 [2P, 80] (VC: unaligned), embeddings float32 [192]."""
    mode: Mode
    text: np.ndarray                        # target text tokens (Qwen ids)
    prompt_text: np.ndarray                 # LM prompt text tokens (transcript or instruction)
    llm_prompt_speech_token: np.ndarray     # LM prompt speech tokens
    flow_prompt_speech_token: np.ndarray    # flow prompt speech tokens
    prompt_speech_feat: np.ndarray          # flow prompt mel
    llm_embedding: np.ndarray               # carried for parity; the CosyVoice2 LM ignores it
    flow_embedding: np.ndarray
    source_speech_token: np.ndarray = field(default_factory=lambda: _NO_IDS)  # VC: the tokens the flow renders

    @property
    def spec(self) -> ModeSpec:
        return MODE_SPECS[self.mode]

    @property
    def lm_text_tokens(self) -> tuple[int, ...]:
        """The LM's text span: prompt text followed by the target text."""
        return tuple(int(t) for t in np.concatenate([self.prompt_text, self.text]))

    def to_upstream_dict(self) -> dict[str, np.ndarray]:
        """The upstream frontend dict: ids (1, N) int32 with `*_len` (1,) int32, feat (1, T, 80)
        float32, embeddings (1, 192) float32; only the keys upstream produces for this mode."""
        spec = self.spec
        out: dict[str, np.ndarray] = {}

        def ids(name: str, a: np.ndarray) -> None:
            out[name] = np.asarray(a, np.int32).reshape(1, -1)
            out[name + "_len"] = np.array([a.shape[0]], np.int32)

        if spec.runs_lm:
            ids("text", self.text)
        else:
            ids("source_speech_token", self.source_speech_token)
        if spec.lm_prompt_text is not None:
            ids("prompt_text", self.prompt_text)
        if spec.lm_prompt_speech:
            ids("llm_prompt_speech_token", self.llm_prompt_speech_token)
        if spec.flow_prompt:
            ids("flow_prompt_speech_token", self.flow_prompt_speech_token)
            out["prompt_speech_feat"] = self.prompt_speech_feat[None].astype(np.float32)
            out["prompt_speech_feat_len"] = np.array([self.prompt_speech_feat.shape[0]], np.int32)
        if spec.runs_lm:
            out["llm_embedding"] = self.llm_embedding.reshape(1, -1).astype(np.float32)
        out["flow_embedding"] = self.flow_embedding.reshape(1, -1).astype(np.float32)
        return out


def build_model_input(mode: Mode | str, voice: Voice, *, text_tokens: Sequence[int] = (),
                      instruction_tokens: Sequence[int] = (),
                      source_speech_tokens: Sequence[int] | None = None,
                      system_prompt: SystemPrompt | None = None) -> ModelInput:
    """Assemble the inputs of one segment.

    voice: a prepared voice (`PromptEncoder.encode` of prompt audio, with the transcript where the
        mode has one, or a stored speaker's). Its transcript tokens are the LM prompt text of the
        modes whose `lm_prompt_text` is "transcript".
    text_tokens: the target text (ignored by VC).
    instruction_tokens: the LM prompt text of the modes whose `lm_prompt_text` is "instruction".
    source_speech_tokens: VC only, the source audio's speech tokens.
    system_prompt: CosyVoice3's (SystemPrompt.lm_texts); None for CosyVoice2.
    """
    mode = Mode(mode)
    spec = MODE_SPECS[mode]
    if spec.flow_prompt and voice.n_tokens == 0:
        raise InvalidRequest(f"mode {mode.value} needs a voice with prompt speech tokens and mel; "
                             "this voice has only an embedding (an sft speaker?)")
    if spec.runs_lm:
        voice = voice.aligned()  # a no-op for encoder output and stored speakers
    elif source_speech_tokens is None or len(source_speech_tokens) == 0:
        raise InvalidRequest(f"mode {mode.value} needs source speech tokens")
    prompt_text = {"transcript": voice.prompt_text_tokens, "instruction": _ids(instruction_tokens),
                   None: _NO_IDS}[spec.lm_prompt_text]
    text = _ids(text_tokens) if spec.runs_lm else _NO_IDS
    if system_prompt is not None and spec.runs_lm:
        prompt_text, text = system_prompt.lm_texts(spec, prompt_text, text)
    flow_tokens = voice.speech_tokens if spec.flow_prompt else _NO_IDS
    feat = voice.speech_feat if spec.flow_prompt else np.zeros((0, voice.speech_feat.shape[1]), np.float32)
    return ModelInput(
        mode=mode,
        text=text,
        prompt_text=prompt_text,
        llm_prompt_speech_token=voice.speech_tokens if spec.lm_prompt_speech else _NO_IDS,
        flow_prompt_speech_token=flow_tokens,
        prompt_speech_feat=feat,
        llm_embedding=voice.embedding,
        flow_embedding=voice.embedding,
        source_speech_token=_NO_IDS if spec.runs_lm else _ids(source_speech_tokens),
    )


def _ids(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32).reshape(-1)

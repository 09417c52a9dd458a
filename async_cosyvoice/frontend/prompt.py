"""Prompt audio -> the features the LM and the flow are conditioned on (facts sheet §6.3).

`PromptEncoder` wraps the two ONNX models of an official model directory:

- `speech_tokenizer_v2.onnx`: whisper log-mel of 16 kHz audio -> 25 Hz speech tokens;
- `campplus.onnx`: mean-normalised Kaldi fbank of 16 kHz audio -> 192-d speaker embedding;

plus the 24 kHz prompt mel. Like upstream, the prompt is resampled from its own rate separately to
16 kHz and to 24 kHz, and for TTS the tokens and mel are aligned to exactly 2 mel frames per token.

onnxruntime sessions are safe to `run` from several threads at once and the feature code is pure,
so one encoder can serve many executor threads.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from ..models.dims import MelDims
from ..tts import Audio
from . import audio as A

TOKENIZER_SAMPLE_RATE = 16000
SPEECH_TOKENIZER_MAX_SECONDS = 30.0  # the tokenizer's whisper encoder window
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
CAMPPLUS_FILE = "campplus.onnx"
EMBEDDING_DIM = 192


@dataclass(frozen=True, eq=False)
class PromptFeatures:
    """What a prompt voice contributes: speech tokens (int32 [P]), the 24 kHz mel (float32 [T, 80],
    T == 2P once aligned) and the CAM++ speaker embedding (float32 [192])."""
    speech_tokens: np.ndarray
    speech_feat: np.ndarray
    embedding: np.ndarray

    def __post_init__(self):
        object.__setattr__(self, "speech_tokens", np.asarray(self.speech_tokens, dtype=np.int32).reshape(-1))
        feat = np.asarray(self.speech_feat, dtype=np.float32)
        if feat.ndim != 2:
            raise ValueError(f"speech_feat must be [frames, mels], got shape {feat.shape}")
        object.__setattr__(self, "speech_feat", feat)
        object.__setattr__(self, "embedding", np.asarray(self.embedding, dtype=np.float32).reshape(-1))

    @classmethod
    def embedding_only(cls, embedding, n_mels: int = 80) -> "PromptFeatures":
        """A voice known only by its embedding (sft speakers): no prompt tokens or mel."""
        return cls(np.zeros(0, np.int32), np.zeros((0, n_mels), np.float32), embedding)

    @property
    def n_tokens(self) -> int:
        return int(self.speech_tokens.shape[0])

    def aligned(self, token_mel_ratio: int = 2) -> "PromptFeatures":
        """Truncate to token_len = min(frames // ratio, P) tokens and ratio * token_len frames
        (upstream `frontend_zero_shot`; the flow needs exactly `ratio` frames per prompt token)."""
        n = min(self.speech_feat.shape[0] // token_mel_ratio, self.n_tokens)
        if n == self.n_tokens and self.speech_feat.shape[0] == token_mel_ratio * n:
            return self
        return PromptFeatures(self.speech_tokens[:n], self.speech_feat[: token_mel_ratio * n], self.embedding)


def _session(path: str | Path) -> ort.InferenceSession:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ONNX model not found: {path}")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


class PromptEncoder:
    """Speech tokens, speaker embedding and prompt mel from prompt audio."""

    def __init__(self, speech_tokenizer_onnx: str | Path, campplus_onnx: str | Path, mel: MelDims = MelDims(),
                 max_token_seconds: float = SPEECH_TOKENIZER_MAX_SECONDS):
        self.mel = mel
        self.max_token_seconds = max_token_seconds
        self._tokenizer = _session(speech_tokenizer_onnx)
        self._campplus = _session(campplus_onnx)
        self._tokenizer_inputs = [i.name for i in self._tokenizer.get_inputs()]
        self._campplus_inputs = [i.name for i in self._campplus.get_inputs()]
        if len(self._tokenizer_inputs) != 2:
            raise ValueError(f"{speech_tokenizer_onnx}: expected 2 inputs (feats, feats_length), "
                             f"got {self._tokenizer_inputs}")
        if len(self._campplus_inputs) != 1:
            raise ValueError(f"{campplus_onnx}: expected 1 input (fbank), got {self._campplus_inputs}")

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, mel: MelDims = MelDims()) -> "PromptEncoder":
        model_dir = Path(model_dir)
        return cls(model_dir / SPEECH_TOKENIZER_FILE, model_dir / CAMPPLUS_FILE, mel)

    # -- single stages ------------------------------------------------------------------------

    def speech_tokens(self, x16k) -> np.ndarray:
        """int32 [P] speech tokens (25 Hz) of 16 kHz audio; at most 30 s per call."""
        n = int(np.shape(x16k)[-1])
        if n / TOKENIZER_SAMPLE_RATE > self.max_token_seconds:
            raise A.AudioError(f"prompt audio is {n / TOKENIZER_SAMPLE_RATE:.2f} s long; the speech tokenizer "
                               f"takes at most {self.max_token_seconds:g} s")
        return self.tokens_from_log_mel(A.whisper_log_mel(x16k))

    def tokens_from_log_mel(self, log_mel: np.ndarray) -> np.ndarray:
        """Run the speech tokenizer on a (128, T) whisper log-mel."""
        feats = np.ascontiguousarray(log_mel, dtype=np.float32)
        if feats.ndim == 2:
            feats = feats[None]
        length = np.array([feats.shape[2]], dtype=np.int32)
        out = self._tokenizer.run(None, {self._tokenizer_inputs[0]: feats, self._tokenizer_inputs[1]: length})[0]
        return np.asarray(out).reshape(-1).astype(np.int32)

    def speaker_embedding(self, x16k) -> np.ndarray:
        """float32 [192] CAM++ embedding of 16 kHz audio."""
        return self.embedding_from_fbank(A.kaldi_fbank(x16k))

    @staticmethod
    def campplus_input(fbank: np.ndarray) -> np.ndarray:
        """(1, T, 80) campplus feed: the fbank minus its per-bin mean over time."""
        f = torch.from_numpy(np.ascontiguousarray(fbank, dtype=np.float32))
        return (f - f.mean(dim=0, keepdim=True)).unsqueeze(0).numpy()

    def embedding_from_fbank(self, fbank: np.ndarray) -> np.ndarray:
        out = self._campplus.run(None, {self._campplus_inputs[0]: self.campplus_input(fbank)})[0]
        return np.asarray(out, dtype=np.float32).reshape(-1)

    def speech_feat(self, x24k) -> np.ndarray:
        """float32 [T, 80] prompt mel of 24 kHz audio (T = len // 480)."""
        return A.prompt_mel_24k(x24k, self.mel)

    # -- whole prompts ------------------------------------------------------------------------

    def encode(self, audio: Audio) -> PromptFeatures:
        """Prompt features for TTS modes: tokens and mel aligned to 2 frames per token."""
        return self.encode_unaligned(audio).aligned()

    def encode_unaligned(self, audio: Audio) -> PromptFeatures:
        """Prompt features without alignment (the VC prompt, like upstream `frontend_vc`)."""
        x16k = A.audio_at_rate(audio, TOKENIZER_SAMPLE_RATE)
        x24k = A.audio_at_rate(audio, self.mel.sampling_rate)
        features = PromptFeatures(self.speech_tokens(x16k), self.speech_feat(x24k), self.speaker_embedding(x16k))
        if features.n_tokens == 0 or features.speech_feat.shape[0] < 2:
            raise A.AudioError(f"prompt audio is too short ({audio.seconds:.3f} s) to yield speech tokens")
        return features

    encode_vc_prompt = encode_unaligned

    def source_tokens(self, audio: Audio) -> np.ndarray:
        """Speech tokens of VC source audio (16 kHz, at most 30 s)."""
        return self.speech_tokens(A.audio_at_rate(audio, TOKENIZER_SAMPLE_RATE))

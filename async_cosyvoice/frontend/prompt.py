"""Prompt audio -> the features the LM and the flow are conditioned on (facts sheet §6.3).

`PromptEncoder` wraps the two ONNX models of an official model directory:

- `speech_tokenizer_v2.onnx` (CosyVoice3: `speech_tokenizer_v3.onnx`, same I/O): whisper log-mel of
  16 kHz audio -> 25 Hz speech tokens;
- `campplus.onnx`: mean-normalised Kaldi fbank of 16 kHz audio -> 192-d speaker embedding;

plus the 24 kHz prompt mel. Like upstream, the prompt is resampled from its own rate separately to
16 kHz and to 24 kHz, and for TTS the tokens and mel are aligned to exactly 2 mel frames per token.

onnxruntime sessions are safe to `run` from several threads at once and the feature code is pure,
so one encoder can serve many executor threads.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from ..models.dims import MelDims
from ..request import Audio, Voice
from . import audio as A

TOKENIZER_SAMPLE_RATE = 16000
SPEECH_TOKENIZER_MAX_SECONDS = 30.0  # the tokenizer's whisper encoder window
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
CAMPPLUS_FILE = "campplus.onnx"
EMBEDDING_DIM = 192


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
        self.prompts_encoded = 0  # whole prompts encoded (tokenizer + CAM++ + mel): what caching saves
        self._count_lock = threading.Lock()
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
    def from_model_dir(cls, model_dir: str | Path, mel: MelDims = MelDims(),
                       speech_tokenizer: str = SPEECH_TOKENIZER_FILE) -> "PromptEncoder":
        """speech_tokenizer: the ONNX file name (CosyVoice3: `speech_tokenizer_v3.onnx`, the
        same interface)."""
        model_dir = Path(model_dir)
        return cls(model_dir / speech_tokenizer, model_dir / CAMPPLUS_FILE, mel)

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

    def encode(self, audio: Audio) -> Voice:
        """The voice of prompt audio for TTS modes: tokens and mel aligned to 2 frames per token (no transcript yet)."""
        return self.encode_unaligned(audio).aligned()

    def encode_unaligned(self, audio: Audio) -> Voice:
        """Prompt features without alignment (the VC prompt, like upstream `frontend_vc`)."""
        x16k = A.audio_at_rate(audio, TOKENIZER_SAMPLE_RATE)
        x24k = A.audio_at_rate(audio, self.mel.sampling_rate)
        with self._count_lock:
            self.prompts_encoded += 1
        tokens, feat = self.speech_tokens(x16k), self.speech_feat(x24k)
        if tokens.size == 0 or feat.shape[0] < 2:
            raise A.AudioError(f"prompt audio is too short ({audio.seconds:.3f} s) to yield speech tokens")
        return Voice(tokens, feat, self.speaker_embedding(x16k))

    encode_vc_prompt = encode_unaligned

    def source_tokens(self, audio: Audio) -> np.ndarray:
        """Speech tokens of VC source audio (16 kHz, at most 30 s)."""
        return self.speech_tokens(A.audio_at_rate(audio, TOKENIZER_SAMPLE_RATE))

"""RequestFront: a request's CPU work before any device: rules, voice, text -> model inputs.

    request = front.rules.check(request)
    voice = await front.prepare_voice(request)        prompt audio encoded, or a stored speaker
    inputs = await front.model_inputs(request, voice) normalised, split, tokenized text segments
    async with front.admit(request, inputs): ...      its memory bound reserved (cost.py, limiter.py)
    tokens = front.stream_tokens(text, ...)           a text stream's token ids as they become known
    record = await front.new_speaker(...)             a zero-shot speaker computed and stored

A Synthesizer has one (the same process runs its devices); a server on several devices
(worker_pool.py) keeps the one front in the server process and sends the model inputs to the
device worker processes. The text frontend and ONNX prompt work run in a CPU thread pool.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterable, AsyncIterator, Literal, Sequence

import torch

from .config import Config
from .cost import audio_bytes, utterance_bytes
from .errors import InvalidRequest, TextTimeout, Unsupported
from .frontend.model_input import MODE_SPECS, ModelInput, SystemPrompt, build_model_input, instruction_text
from .frontend.prompt import PromptEncoder
from .frontend.sentences import complete_sentences
from .frontend.stream_text import StreamTextNormalizer
from .frontend.text import TextFrontend
from .frontend.tokenizer import TextTokenizer
from .limiter import MemoryBudget
from .model_dir import ModelDir
from .models.dims import ModelDims
from .model_speakers import with_model_speakers
from .request import FLUSH, Audio, SynthesisRequest, Voice
from .rules import RequestRules
from .speaker_store import open_speaker_store
from .speakers import SpeakerRecord, SpeakerStoreBase, VoiceFit, validate_speaker_id

log = logging.getLogger(__name__)

TextMode = Literal["sentence", "bistream"]
TextNormalization = Literal["safe", "raw"]
MAX_STREAM_SENTENCE_CHARS = 200  # a streamed text without sentence ends is cut at about this length


def default_text_mode(supports_bistream: bool) -> TextMode:
    """What a text stream gets when it does not say: bistream where the engine can, else sentences."""
    return "bistream" if supports_bistream else "sentence"


async def checked_pieces(text: AsyncIterable[str | object], idle_seconds: float,
                         rules: RequestRules) -> AsyncIterator[str | object]:
    """A text stream's pieces, checked (strings or FLUSH, within the rules' text limits), ended by
    TextTimeout when none arrives for `idle_seconds`."""
    pieces = aiter(text)
    received = 0
    while True:
        try:
            piece = await asyncio.wait_for(anext(pieces), idle_seconds)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise TextTimeout(f"no text arrived for {idle_seconds:g} s (limits.text_idle_seconds); "
                              "send the end of the text when it is complete") from None
        if piece is not FLUSH and not isinstance(piece, str):
            raise InvalidRequest(f"text pieces must be strings or FLUSH, got {type(piece).__name__}")
        if piece is not FLUSH:
            received = rules.check_piece(piece, received)
        yield piece


class RequestFront:
    def __init__(self, *, config: Config, dims: ModelDims, tokenizer: TextTokenizer, text_frontend: TextFrontend,
                 prompt_encoder: PromptEncoder, speakers: SpeakerStoreBase, model_kind: str = "cosyvoice2"):
        self.config = config
        self.dims = dims
        self.rules = RequestRules.from_config(config)
        lim = config.limits
        # max_request None here: the device's memory, set by the owner once known (`limit_to_device`)
        self.budget = MemoryBudget(lim.max_request_bytes, lim.memory_budget_bytes, lim.admission_wait_seconds)
        self.model_kind = model_kind  # the model directory's: its speakers, prompts and instruction text
        # CosyVoice3: `You are a helpful assistant.<|endofprompt|>` where a request's LM text lacks it
        self.system_prompt = SystemPrompt.for_tokenizer(tokenizer.encode, model_kind)
        self.tokenizer = tokenizer
        self.text_frontend = text_frontend
        self.prompt_encoder = prompt_encoder
        self.speakers = speakers
        self._cpu = ThreadPoolExecutor(max_workers=4, thread_name_prefix="frontend")

    @classmethod
    def load(cls, config: Config, model_dir: ModelDir) -> "RequestFront":
        """The tokenizer, text normalizer, prompt encoder (ONNX, CPU) and speaker store (blocking):
        the configured store, its records checked against this model (VoiceFit), with the model
        directory's own spk2info.pt speakers beside it (read-only, model_speakers.py)."""
        tokenizer = model_dir.tokenizer()
        try:
            text_frontend = TextFrontend(tokenizer)
        except ImportError as e:
            log.warning("wetext is not importable (%s): text normalization runs without it "
                        "(upstream's behaviour when no normalizer is installed)", e)
            text_frontend = TextFrontend(tokenizer, use_wetext=False)
        text_frontend.preload()
        prompt_encoder = PromptEncoder.from_model_dir(model_dir.path, mel=model_dir.dims.feat,
                                                      speech_tokenizer=model_dir.speech_tokenizer_onnx.name)
        speakers = with_model_speakers(open_speaker_store(config.speakers, fit=VoiceFit.of(model_dir.dims)),
                                       model_dir.path, tokenizer.encode, model_kind=model_dir.kind)
        return cls(config=config, dims=model_dir.dims, tokenizer=tokenizer, text_frontend=text_frontend,
                   prompt_encoder=prompt_encoder, speakers=speakers, model_kind=model_dir.kind)

    def close(self) -> None:
        self._cpu.shutdown(wait=False, cancel_futures=True)

    async def in_cpu(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._cpu, functools.partial(fn, *args, **kwargs))

    # -- admission --------------------------------------------------------------------------------

    def limit_to_device(self, total_bytes: int) -> None:
        """Without limits.max_request_bytes, no request may need more than the device's memory
        (`total_bytes`: the smallest device's, cost.device_memory, where several serve)."""
        if self.config.limits.max_request_bytes is None:
            self.budget.max_request = total_bytes

    def admit(self, request: SynthesisRequest, inputs: Sequence[ModelInput], *,
              streamed_text: bool = False) -> contextlib.AbstractAsyncContextManager[None]:
        """The request's admission bound (`request_bytes`) reserved in the memory budget while it
        runs: TooLarge at once, or a wait and then Overloaded (limiter.MemoryBudget). Every request
        passes here once, in the process of the front doors, before it reaches a device."""
        return self.budget.reserve(self.request_bytes(request, inputs, streamed_text=streamed_text))

    def admit_stream(self, request: SynthesisRequest, voice: Voice,
                     instruction: list[int]) -> contextlib.AbstractAsyncContextManager[None]:
        """`admit` for a text stream: its text is not known yet, so its speech is bounded only by
        max_tokens or the engine's max_model_len."""
        first = build_model_input(request.mode, voice, instruction_tokens=instruction)
        return self.admit(request, [first], streamed_text=True)

    def request_bytes(self, request: SynthesisRequest, inputs: Sequence[ModelInput], *,
                      streamed_text: bool = False) -> int:
        """The admission bound of a checked request (cost.py). streamed_text: a text stream, whose
        speech tokens are bounded only by max_tokens or the engine's max_model_len."""
        opts, t2w = request.options, self.config.token2wav
        max_len = self.config.engine.max_model_len

        def speech_tokens(model_input: ModelInput) -> int:
            if not model_input.spec.runs_lm:
                return len(model_input.source_speech_token)
            if opts.max_tokens is not None:
                return opts.max_tokens
            if streamed_text:
                return max_len
            return min(max_len, int(len(model_input.text) * self.dims.lm.max_token_text_ratio))

        dtype = getattr(torch, self.config.model.flow_dtype)
        each = sorted((utterance_bytes(self.dims, len(m.flow_prompt_speech_token), speech_tokens(m), dtype,
                                       t2w.flow_cache and t2w.flow_cache_slots is None, t2w.flow_cache_max_tokens)
                       for m in inputs), reverse=True)
        at_once = t2w.offline_segments_ahead if not opts.stream and t2w.offline else 1
        return sum(each[:at_once]) + audio_bytes(request.prompt_audio) + audio_bytes(request.source_audio)

    # -- voices -----------------------------------------------------------------------------------

    async def prepare_voice(self, request: SynthesisRequest) -> Voice:
        """The request's voice, resolved once: its prompt audio encoded (with the normalised
        transcript where the mode uses one) or a stored speaker. Every mode takes a prepared voice."""
        spec = MODE_SPECS[request.mode]
        if spec.voice == "speaker":
            record = await self.in_cpu(self.speakers.get, request.speaker_id)
            if record.model_kind != self.model_kind:
                raise Unsupported(
                    f"speaker {request.speaker_id!r} was registered with a {record.model_kind} model and this "
                    f"server runs {self.model_kind}: its speech tokens and prompt mel belong to the other model; "
                    "register the speaker again on this server (under another id, or with overwrite)")
            voice = record.voice
            if spec.flow_prompt and voice.kind == "sft":
                raise Unsupported(f"speaker {request.speaker_id!r} is an embedding-only (sft) speaker; "
                                  f"mode {request.mode.value} needs a zero-shot speaker: use mode sft for it")
            return voice if spec.flow_prompt else Voice.embedding_only(voice.embedding)
        # VC too gets the aligned prompt (upstream's frontend_vc skips the alignment, which makes
        # the flow's output length depend on the prompt's mel/token mismatch)
        if spec.lm_prompt_text == "transcript":
            return await self.in_cpu(self.encode_voice, request.prompt_audio, request.prompt_text,
                                     request.options.text_frontend)
        return await self.in_cpu(self.prompt_encoder.encode, request.prompt_audio)

    def encode_voice(self, audio: Audio, transcript: str, text_frontend: bool = True) -> Voice:
        """CPU pool: prompt audio + its transcript -> a zero-shot voice."""
        text = self.text_frontend.normalize(transcript, split=False, enabled=text_frontend)
        return self.prompt_encoder.encode(audio).with_transcript(text, self.tokenizer.encode(text))

    async def new_speaker(self, speaker_id: str, prompt_text: str, audio: Audio,
                          overwrite: bool = False) -> SpeakerRecord:
        """A zero-shot speaker checked, computed (tokens, 24 kHz mel, embedding, transcript tokens)
        and stored; preparing the devices for it is the caller's part."""
        validate_speaker_id(speaker_id)
        self.rules.check_text(prompt_text, "prompt_text")
        self.rules.check_prompt(audio, "prompt_audio")
        await self.in_cpu(self.speakers.check_put, speaker_id, overwrite)
        record = SpeakerRecord(speaker_id, await self.in_cpu(self.encode_voice, audio, prompt_text),
                               model_kind=self.model_kind)
        await self.in_cpu(self.speakers.put, record, overwrite)
        return record

    # -- text -------------------------------------------------------------------------------------

    async def model_inputs(self, request: SynthesisRequest, voice: Voice) -> list[ModelInput]:
        """What the LM and the flow receive for each text segment of a checked request."""
        if not MODE_SPECS[request.mode].runs_lm:
            source = await self.in_cpu(self.prompt_encoder.source_tokens, request.source_audio)
            return [self.model_input(request.mode, voice, source_speech_tokens=source)]
        segments = await self.in_cpu(self.text_segments, request.text, request.options.text_frontend)
        if not segments:
            raise InvalidRequest("text has nothing to speak after normalization (only punctuation?)")
        instruction = await self.in_cpu(self.instruction_tokens, request)
        return [self.model_input(request.mode, voice, text_tokens=t, instruction_tokens=instruction)
                for t in segments]

    def model_input(self, mode, voice: Voice, **parts) -> ModelInput:
        """`build_model_input` with this model's system prompt (CosyVoice3's; none for CosyVoice2)."""
        return build_model_input(mode, voice, system_prompt=self.system_prompt, **parts)

    def text_segments(self, text: str, text_frontend: bool) -> list[list[int]]:
        """CPU pool: normalise + split + tokenize."""
        segments = self.text_frontend.normalize(text, split=True, enabled=text_frontend)
        return [self.tokenizer.encode(s) for s in segments if s.strip()]

    def instruction_tokens(self, request: SynthesisRequest) -> list[int]:
        if MODE_SPECS[request.mode].lm_prompt_text != "instruction":
            return []
        # upstream HEAD requires the caller to add <|endofprompt|> (CosyVoice3: and the system prompt)
        return self.tokenizer.encode(instruction_text(request.instruct_text, self.model_kind))

    # -- text streams ---------------------------------------------------------------------------------

    def stream_modes(self, text_mode: str | None, text_normalization: str | None,
                     supports_bistream: bool) -> tuple[TextMode, TextNormalization]:
        """A text stream's modes, checked against each other and the engine (None: the defaults)."""
        mode = text_mode or default_text_mode(supports_bistream)
        if mode not in ("sentence", "bistream"):
            raise InvalidRequest(f"text_mode must be 'sentence' or 'bistream', got {text_mode!r}")
        if mode == "bistream" and not supports_bistream:
            raise Unsupported(f"the {self.config.engine.kind} engine cannot extend a running LM request "
                              "with text; use text_mode 'sentence'")
        normalization = text_normalization or "safe"
        if normalization not in ("safe", "raw"):
            raise InvalidRequest(f"text_normalization must be 'safe' or 'raw', got {text_normalization!r}")
        if normalization == "raw" and mode == "sentence":
            raise InvalidRequest("text_normalization 'raw' feeds bistream pieces as upstream does; sentence mode "
                                 "normalizes whole sentences (options.text_frontend=false skips that)")
        return mode, normalization

    async def stream_tokens(self, text: AsyncIterable[str | object], request: SynthesisRequest, mode: TextMode,
                            normalization: TextNormalization) -> AsyncIterator[list[int]]:
        """A text stream's token ids as they become known. bistream, raw: each piece's own (FLUSH
        means nothing to an LM that reads as text comes); bistream, safe: the normalized text up to
        the last safe boundary (frontend/stream_text.py; FLUSH releases what is held); sentence:
        each complete sentence normalized and split, one list per text segment. A pause of more
        than `limits.text_idle_seconds` between pieces raises TextTimeout."""
        pieces = checked_pieces(text, self.config.limits.text_idle_seconds, self.rules)
        if mode == "sentence":
            async for sentence in complete_sentences(pieces, min(MAX_STREAM_SENTENCE_CHARS, self.rules.max_text_chars)):
                for tokens in await self.in_cpu(self.text_segments, sentence, request.options.text_frontend):
                    yield tokens
            return
        normalizer = (StreamTextNormalizer(self.text_frontend, enabled=request.options.text_frontend)
                      if normalization == "safe" else None)
        async for piece in pieces:
            if normalizer is not None:
                tokens = await self.in_cpu(self._released_tokens, normalizer, piece)
            elif piece is FLUSH or not piece:
                continue
            else:
                tokens = await self.in_cpu(self.tokenizer.encode, piece)
            if tokens:
                yield tokens
        if normalizer is not None and (tokens := await self.in_cpu(self._released_tokens, normalizer, None)):
            yield tokens

    def _released_tokens(self, normalizer: StreamTextNormalizer, piece: str | object | None) -> list[int]:
        """CPU pool: a piece (FLUSH, or None for the end) into the normalizer -> the released tokens."""
        released = (normalizer.end() if piece is None else normalizer.flush() if piece is FLUSH
                    else normalizer.feed(piece))
        return self.tokenizer.encode(released) if released else []

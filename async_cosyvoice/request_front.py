"""RequestFront: a request's CPU work before any device: rules, voice, text -> model inputs.

    request = front.rules.check(request)
    voice = await front.prepare_voice(request)        prompt audio encoded, or a stored speaker
    inputs = await front.model_inputs(request, voice) normalised, split, tokenized text segments
    record = await front.new_speaker(...)             a zero-shot speaker computed and stored

A Synthesizer has one (the same process runs its devices); a server on several devices
(worker_pool.py) keeps the one front in the server process and sends the model inputs to the
device worker processes. The text frontend and ONNX prompt work run in a CPU thread pool.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor

from .config import Config
from .errors import InvalidRequest, SpeakerExists, Unsupported
from .frontend.model_input import MODE_SPECS, ModelInput, build_model_input
from .frontend.prompt import PromptEncoder
from .frontend.text import TextFrontend
from .frontend.tokenizer import TextTokenizer
from .model_dir import ModelDir
from .request import Audio, SynthesisRequest, Voice
from .rules import ENDOFPROMPT, RequestRules
from .speaker_store import open_speaker_store
from .speakers import SpeakerRecord, SpeakerStoreBase, validate_speaker_id

log = logging.getLogger(__name__)


class RequestFront:
    def __init__(self, *, config: Config, tokenizer: TextTokenizer, text_frontend: TextFrontend,
                 prompt_encoder: PromptEncoder, speakers: SpeakerStoreBase):
        self.config = config
        self.rules = RequestRules.from_config(config)
        self.tokenizer = tokenizer
        self.text_frontend = text_frontend
        self.prompt_encoder = prompt_encoder
        self.speakers = speakers
        self._cpu = ThreadPoolExecutor(max_workers=4, thread_name_prefix="frontend")

    @classmethod
    def load(cls, config: Config, model_dir: ModelDir) -> "RequestFront":
        """The tokenizer, text normalizer, prompt encoder (ONNX, CPU) and speaker store (blocking)."""
        tokenizer = model_dir.tokenizer()
        try:
            text_frontend = TextFrontend(tokenizer)
        except ImportError as e:
            log.warning("wetext is not importable (%s): text normalization runs without it "
                        "(upstream's behaviour when no normalizer is installed)", e)
            text_frontend = TextFrontend(tokenizer, use_wetext=False)
        text_frontend.preload()
        prompt_encoder = PromptEncoder.from_model_dir(model_dir.path, mel=model_dir.dims.feat)
        return cls(config=config, tokenizer=tokenizer, text_frontend=text_frontend, prompt_encoder=prompt_encoder,
                   speakers=open_speaker_store(config.speakers))

    def close(self) -> None:
        self._cpu.shutdown(wait=False, cancel_futures=True)

    async def in_cpu(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._cpu, functools.partial(fn, *args, **kwargs))

    # -- voices -----------------------------------------------------------------------------------

    async def prepare_voice(self, request: SynthesisRequest) -> Voice:
        """The request's voice, resolved once: its prompt audio encoded (with the normalised
        transcript where the mode uses one) or a stored speaker. Every mode takes a prepared voice."""
        spec = MODE_SPECS[request.mode]
        if spec.voice == "speaker":
            voice = (await self.in_cpu(self.speakers.get, request.speaker_id)).voice
            if spec.flow_prompt and voice.kind == "sft":
                raise Unsupported(f"speaker {request.speaker_id!r} is an embedding-only (sft) speaker; "
                                  f"mode {request.mode.value} needs a zero-shot speaker")
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
        if not overwrite and await self.in_cpu(self.speakers.exists, speaker_id):
            raise SpeakerExists(f"speaker {speaker_id!r} exists; pass overwrite to replace it")
        record = SpeakerRecord(speaker_id, await self.in_cpu(self.encode_voice, audio, prompt_text))
        await self.in_cpu(self.speakers.put, record, overwrite)
        return record

    # -- text -------------------------------------------------------------------------------------

    async def model_inputs(self, request: SynthesisRequest, voice: Voice) -> list[ModelInput]:
        """What the LM and the flow receive for each text segment of a checked request."""
        if not MODE_SPECS[request.mode].runs_lm:
            source = await self.in_cpu(self.prompt_encoder.source_tokens, request.source_audio)
            return [build_model_input(request.mode, voice, source_speech_tokens=source)]
        segments = await self.in_cpu(self.text_segments, request.text, request.options.text_frontend)
        if not segments:
            raise InvalidRequest("text has nothing to speak after normalization (only punctuation?)")
        instruction = await self.in_cpu(self.instruction_tokens, request)
        return [build_model_input(request.mode, voice, text_tokens=t, instruction_tokens=instruction)
                for t in segments]

    def text_segments(self, text: str, text_frontend: bool) -> list[list[int]]:
        """CPU pool: normalise + split + tokenize."""
        segments = self.text_frontend.normalize(text, split=True, enabled=text_frontend)
        return [self.tokenizer.encode(s) for s in segments if s.strip()]

    def instruction_tokens(self, request: SynthesisRequest) -> list[int]:
        if MODE_SPECS[request.mode].lm_prompt_text != "instruction":
            return []
        instruction = request.instruct_text
        if ENDOFPROMPT not in instruction:  # upstream HEAD requires the caller to add it
            instruction += ENDOFPROMPT
        return self.tokenizer.encode(instruction)

"""OpenAI's `voice` (+ `instructions`) -> our speaker id and synthesis mode."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from async_cosyvoice.config import Config
from async_cosyvoice.errors import InvalidRequest, SpeakerNotFound
from async_cosyvoice.request import Mode
from async_cosyvoice.speakers import validate_speaker_id


@dataclass(frozen=True)
class VoiceChoice:
    speaker_id: str
    mode: Mode
    instruct_text: str = ""


def speaker_id_for(config: Config, voice: str, what: str = "voice") -> str:
    """A configured alias (server.voice_aliases, e.g. alloy -> a speaker id) or the id itself."""
    if not isinstance(voice, str) or not voice:
        raise InvalidRequest(f"{what} is required: a registered speaker id (GET /v1/audio/voices)")
    return validate_speaker_id(config.server.voice_aliases.get(voice, voice), what)


async def choose_voice(synth, config: Config, voice: str, instructions: str | None,
                       what: str = "voice") -> VoiceChoice:
    """Zero-shot speakers speak as recorded (or follow `instructions` with instruct2); embedding-only
    (sft) speakers take no instructions. Raises SpeakerNotFound for an unknown id."""
    speaker_id = speaker_id_for(config, voice, what)
    try:
        record = await asyncio.to_thread(synth.speakers.get, speaker_id)
    except SpeakerNotFound:
        alias = f" (alias of {voice!r}, server.voice_aliases)" if speaker_id != voice else ""
        raise SpeakerNotFound(f"{what} {speaker_id!r}{alias} is not a registered speaker; see GET "
                              "/v1/audio/voices, or register one with POST /v1/audio/voices") from None
    instructions = (instructions or "").strip()
    if record.kind == "sft":
        if instructions:
            raise InvalidRequest(f"voice {speaker_id!r} is an embedding-only (sft) speaker and cannot follow "
                                 "instructions; register a zero-shot voice (POST /v1/audio/voices)")
        return VoiceChoice(speaker_id, Mode.SFT)
    if instructions:
        return VoiceChoice(speaker_id, Mode.INSTRUCT2_BY_SPK_ID, instructions)
    return VoiceChoice(speaker_id, Mode.ZERO_SHOT_BY_SPK_ID)

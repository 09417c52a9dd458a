"""Voices (our registered speakers), models, audio formats, and health probes."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse

from async_cosyvoice.audio_encoding import FORMATS
from async_cosyvoice.demo import served_model_name
from async_cosyvoice.errors import InvalidRequest, NotReady, StoreUnavailable
from async_cosyvoice.frontend.audio import load_audio
from async_cosyvoice.speakers import validate_speaker_id

from .audio import OPENAI_FORMATS, STREAM_FORMATS
from .backend import backend_of
from .call import HttpCall
from .errors import error_response, request_id_of
from .speech import peer

router = APIRouter()
health = APIRouter()

TOKENS_PER_SECOND = 25  # speech tokens per second of audio (CosyVoice2 and CosyVoice3)


def _voice(info, aliases: dict[str, str]) -> dict:
    return {"id": info.speaker_id, "object": "voice", "kind": info.kind, "transcript": info.prompt_text,
            "prompt_seconds": info.n_speech_tokens / TOKENS_PER_SECOND, "created_at": int(info.created_at),
            "model_kind": info.model_kind,
            "aliases": sorted(a for a, target in aliases.items() if target == info.speaker_id)}


async def _unary(request: Request, method: str, body, voice: str = ""):
    """Run one non-streaming request with its log line and metrics; errors in OpenAI's shape."""
    backend = backend_of(request)
    call = HttpCall(method, peer(request), request_id_of(request))
    call.voice = voice[:80]
    try:
        return await body(backend)
    except Exception as e:
        call.failed(e)
        return error_response(e, call.request_id)
    finally:
        call.finish(backend.metrics)


@router.get("/v1/audio/voices")
async def list_voices(request: Request):
    async def body(backend):
        synth = backend.synthesizer()
        infos = await asyncio.to_thread(synth.speakers.infos)
        aliases = backend.config.server.voice_aliases
        return {"object": "list", "data": [_voice(i, aliases) for i in infos]}
    return await _unary(request, "GET /v1/audio/voices", body)


@router.post("/v1/audio/voices", status_code=201)
async def register_voice(request: Request, id: str = Form(...), transcript: str = Form(...),
                         audio: UploadFile = File(...), overwrite: bool = Form(False)):
    async def body(backend):
        synth = backend.synthesizer()
        speaker_id = validate_speaker_id(id, "id")
        data = await audio.read()
        if not data:
            raise InvalidRequest("audio is an empty file; upload a wav/flac/ogg recording of the transcript")
        try:
            prompt = await asyncio.to_thread(load_audio, data)
        except InvalidRequest as e:
            raise InvalidRequest(f"audio: {e}") from None
        record = await synth.register_speaker(speaker_id, transcript, prompt, overwrite=overwrite)
        return JSONResponse(_voice(record.info, backend.config.server.voice_aliases), status_code=201)
    return await _unary(request, "POST /v1/audio/voices", body, id)


@router.delete("/v1/audio/voices/{voice_id}")
async def delete_voice(voice_id: str, request: Request):
    async def body(backend):
        synth = backend.synthesizer()
        speaker_id = validate_speaker_id(voice_id, "voice id")
        await synth.delete_speaker(speaker_id)
        return {"id": speaker_id, "object": "voice", "deleted": True}
    return await _unary(request, "DELETE /v1/audio/voices", body, voice_id)


@router.get("/v1/models")
async def list_models(request: Request):
    backend = backend_of(request)
    name = served_model_name(backend.config)
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "async_cosyvoice"}]}


@router.get("/v1/audio/formats")
async def list_formats():
    """Extension: the formats `POST /v1/audio/speech` (`speech`) and the WebSocket (`websocket`) write."""
    data = [{"id": name, "object": "audio_format", "content_type": FORMATS[name].content_type,
             "speech": name in OPENAI_FORMATS, "websocket": name in STREAM_FORMATS,
             "streamed": not FORMATS[name].whole_file,
             "sample_rates": list(FORMATS[name].sample_rates or ())}
            for name in dict.fromkeys(OPENAI_FORMATS + STREAM_FORMATS)]
    return {"object": "list", "data": data}


@health.get("/healthz")
async def healthz():
    """Liveness: the process serves HTTP (the model may still be loading)."""
    return {"status": "ok"}


@health.get("/readyz")
async def readyz(request: Request):
    """Readiness: the model is loaded, the speaker store answers and the server is not shutting down."""
    try:
        synth = backend_of(request).synthesizer()
        if not synth.speakers.reachable:
            raise StoreUnavailable(f"the speaker store ({synth.speakers}) is unreachable; reconnecting")
    except NotReady as e:
        return error_response(e, request_id_of(request))
    return {"status": "ready"}

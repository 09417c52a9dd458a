"""`synthesize` and `speakers` in this process: the model (torch) and the speaker store of the
config. cli.py imports this module only for a command without `--target`."""
from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

from async_cosyvoice.audio_encoding import AudioStreamEncoder
from async_cosyvoice.demo import resolve_model_dir
from async_cosyvoice.frontend.audio import load_audio, resample
from async_cosyvoice.model_dir import model_kind
from async_cosyvoice.model_speakers import with_model_speakers
from async_cosyvoice.request import Mode, SynthesisOptions, SynthesisRequest
from async_cosyvoice.speaker_store import open_speaker_store
from async_cosyvoice.speakers import SpeakerInfo
from async_cosyvoice.tts import Synthesizer

from . import speakers as speakers_cli
from . import synthesize as synthesize_cli
from .options import check_where, config_from_args
from .synthesize import RAW, Piece, Result

LIBRARY_FORMAT = {"pcm16": "pcm", "float32": "f32"}  # the library's names where they differ


# -- synthesize ----------------------------------------------------------------------------------

def synthesize(args) -> int:
    return synthesize_cli.run(args, _pieces)


def _request(args, mode: str) -> SynthesisRequest:
    options = SynthesisOptions(stream=args.stream, speed=1.0 if args.speed is None else args.speed,
                               text_frontend=not args.no_text_frontend, seed=args.seed, top_k=args.top_k,
                               max_tokens=args.max_tokens,
                               **({"first_hop": args.first_hop} if args.first_hop else {}))
    return SynthesisRequest(Mode(mode), text=args.text or "", prompt_text=args.prompt_text or "",
                            prompt_audio=load_audio(args.prompt_wav) if args.prompt_wav else None,
                            instruct_text=args.instruct or "", speaker_id=args.speaker or "",
                            source_audio=load_audio(args.source_wav) if args.source_wav else None,
                            options=options)


async def _pieces(args, result: Result) -> AsyncIterator[Piece]:
    if not args.mode:
        synthesize_cli.choose_mode(args)  # a missing transcript is said before the model loads
    synth = await Synthesizer.create(config_from_args(args), warmup=False)
    try:
        kind = None
        if args.speaker and not args.mode:
            kind = (await asyncio.to_thread(synth.speakers.get, args.speaker)).kind
        request = _request(args, synthesize_cli.choose_mode(args, kind))
        native = result.samples_rate = synth.sample_rate
        result.sample_rate = args.sample_rate or native
        result.resample = resample
        encoder = None
        if args.encoding not in RAW:
            encoder = AudioStreamEncoder(LIBRARY_FORMAT.get(args.encoding, args.encoding), result.sample_rate,
                                         native)
        loop = asyncio.get_running_loop()
        last = (0, 0.0)
        result.started = time.monotonic()
        async for chunk in synth.synthesize(request):
            result.speech_tokens.extend(chunk.segment_tokens)
            end_s = (chunk.sample_offset + len(chunk.samples)) / chunk.sample_rate
            if encoder is not None:  # codecs are CPU work: off the loop the synthesizer runs on
                data = await loop.run_in_executor(None, encoder.encode, chunk.samples)
                yield Piece(chunk.index, end_s, None, data)
            else:
                yield Piece(chunk.index, end_s, chunk.samples)
            last = chunk.index, end_s
        if encoder is not None:
            yield Piece(*last, None, await loop.run_in_executor(None, encoder.finish))
        result.n_speech_tokens = len(result.speech_tokens)
    finally:
        await synth.close()


# -- speakers ------------------------------------------------------------------------------------

def speakers(args) -> int:
    check_where(args)
    config = config_from_args(args)
    if args.action == "add":
        print(speakers_cli.line(*_info_fields(asyncio.run(_register(config, args)).info)))
        return 0
    store = open_speaker_store(config.speakers)
    # a spk2info.pt does not say which model made it: the configured model directory's kind
    kind = model_kind(resolve_model_dir(config.model.dir).resolve())
    if args.action == "import":
        ids = store.import_spk2info(args.file, overwrite=args.overwrite, model_kind=kind)
        print(f"imported {len(ids)} {kind} speakers: {', '.join(ids)}")
        return 0
    if args.action == "export":
        ids = store.export_spk2info(args.file, args.ids or None)
        print(f"exported {len(ids)} speakers to {args.file}")
        return 0
    # list, show and rm see the model directory's own speakers too, when one is named (the demo has none)
    speakers = with_model_speakers(store, config.model.dir, model_kind=kind)
    if args.action == "list":
        for info in speakers.infos():
            print(speakers_cli.line(*_info_fields(info)))
    elif args.action == "show":
        r = speakers.get(args.id)
        shown = speakers_cli.shown(*_info_fields(r.info))
        shown.update(prompt_text_tokens=int(r.voice.prompt_text_tokens.size),
                     speech_feat=list(r.voice.speech_feat.shape), embedding=list(r.voice.embedding.shape),
                     model_kind=r.model_kind)
        print(json.dumps(shown, indent=2))
    elif args.action == "rm":
        speakers.delete(args.id)
        print(f"deleted {args.id}")
    return 0


def _info_fields(info: SpeakerInfo) -> tuple:
    return info.speaker_id, info.kind, info.n_speech_tokens, info.created_at, info.prompt_text


async def _register(config, args):
    audio = load_audio(args.prompt_wav)
    synth = await Synthesizer.create(config, warmup=False)
    try:
        return await synth.register_speaker(args.id, args.prompt_text, audio, args.overwrite)
    finally:
        await synth.close()

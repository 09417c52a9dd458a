"""`async-cosyvoice speakers add|list|show|rm|import|export`: the local speaker store, or a
server's with `--target` (add/list/show/rm). Both ways print the same lines:

    list, add:  ID <tab> KIND <tab> PROMPT SECONDS <tab> CREATED (UTC) <tab> PROMPT TEXT
    show:       a JSON object with the speaker's model kind (in-process it adds the shapes of the
                stored arrays)
`import` stores the entries of an upstream spk2info.pt as speakers of the configured model's kind.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
from pathlib import Path

from async_cosyvoice.demo import resolve_model_dir
from async_cosyvoice.frontend.audio import load_audio
from async_cosyvoice.model_dir import model_kind
from async_cosyvoice.speaker_store import open_speaker_store
from async_cosyvoice.speakers import SpeakerInfo
from async_cosyvoice.tts import Synthesizer
from grpc_async import pb2

from .options import add_local, add_remote, check_where, client_from_args, config_from_args

TOKENS_PER_SECOND = 25
LOCAL_ACTIONS = ("import", "export")


def add_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", required=True)

    def action(name: str, remote: bool = True, **kw) -> argparse.ArgumentParser:
        q = actions.add_parser(name, **kw)
        add_local(q, engine=name == "add")  # the options may follow the action
        if remote:
            add_remote(q)
        return q

    q = action("add", help="register a speaker from prompt audio + its transcript")
    q.add_argument("id")
    q.add_argument("--prompt-wav", type=Path, required=True)
    q.add_argument("--prompt-text", required=True)
    q.add_argument("--overwrite", action="store_true")
    action("list")
    action("show").add_argument("id")
    action("rm").add_argument("id")
    q = action("import", remote=False, help="import an upstream spk2info.pt into the local store")
    q.add_argument("file", type=Path)
    q.add_argument("--overwrite", action="store_true")
    q = action("export", remote=False, help="export the local store to an upstream spk2info.pt")
    q.add_argument("file", type=Path)
    q.add_argument("ids", nargs="*")
    p.set_defaults(func=run)


def line(speaker_id: str, kind: str, speech_tokens: int, created_at: float | None, prompt_text: str) -> str:
    return (f"{speaker_id}\t{kind}\t{speech_tokens / TOKENS_PER_SECOND:.2f}s\t{_utc(created_at)}\t"
            f"{prompt_text}")


def _utc(unix_s: float | None) -> str:
    if not unix_s:
        return "-"
    return datetime.datetime.fromtimestamp(unix_s, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _shown(speaker_id: str, kind: str, speech_tokens: int, created_at: float | None, prompt_text: str) -> dict:
    return {"speaker_id": speaker_id, "kind": kind, "prompt_text": prompt_text, "speech_tokens": speech_tokens,
            "prompt_seconds": speech_tokens / TOKENS_PER_SECOND, "created_at": _utc(created_at)}


def run(args) -> int:
    check_where(args)
    if getattr(args, "target", None):  # import/export have no --target
        return asyncio.run(_remote(args))
    return _local(args)


# -- in-process --------------------------------------------------------------------------------

def _local(args) -> int:
    config = config_from_args(args)
    if args.action == "add":
        print(line(*_info_fields(asyncio.run(_register(config, args)).info)))
        return 0
    store = open_speaker_store(config.speakers)
    if args.action == "list":
        for info in store.infos():
            print(line(*_info_fields(info)))
    elif args.action == "show":
        r = store.get(args.id)
        shown = _shown(*_info_fields(r.info))
        shown.update(prompt_text_tokens=int(r.voice.prompt_text_tokens.size),
                     speech_feat=list(r.voice.speech_feat.shape), embedding=list(r.voice.embedding.shape),
                     model_kind=r.model_kind)
        print(json.dumps(shown, indent=2))
    elif args.action == "rm":
        store.delete(args.id)
        print(f"deleted {args.id}")
    elif args.action == "import":
        # spk2info.pt does not say which model made it: the configured model directory's kind
        kind = model_kind(resolve_model_dir(config.model.dir).resolve())
        ids = store.import_spk2info(args.file, overwrite=args.overwrite, model_kind=kind)
        print(f"imported {len(ids)} {kind} speakers: {', '.join(ids)}")
    elif args.action == "export":
        ids = store.export_spk2info(args.file, args.ids or None)
        print(f"exported {len(ids)} speakers to {args.file}")
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


# -- by a server -------------------------------------------------------------------------------

def _fields(s: pb2.Speaker) -> tuple:
    kind = pb2.SpeakerKind.Name(s.kind).removeprefix("SPEAKER_KIND_").lower()
    created = s.created_at.ToDatetime(datetime.timezone.utc).timestamp() if s.HasField("created_at") else None
    return s.speaker_id, kind, s.prompt_speech_tokens, created, s.prompt_text


async def _remote(args) -> int:
    async with client_from_args(args) as client:
        if args.action == "add":
            s = await client.register_speaker(args.id, args.prompt_text, args.prompt_wav, overwrite=args.overwrite,
                                              timeout=args.timeout)
            print(line(*_fields(s)))
        elif args.action == "list":
            for s in await client.all_speakers(timeout=args.timeout):
                print(line(*_fields(s)))
        elif args.action == "show":
            s = await client.get_speaker(args.id, timeout=args.timeout)
            print(json.dumps({**_shown(*_fields(s)), "model_kind": s.model_kind}, indent=2))
        elif args.action == "rm":
            await client.delete_speaker(args.id, timeout=args.timeout)
            print(f"deleted {args.id}")
    return 0

"""`async-cosyvoice serve | synthesize | speakers | client | bench | batch`."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .errors import CosyVoiceError, ModelDirError


def _config(args):
    from .config import Config

    config = Config.load(getattr(args, "config", None))
    updates = {}
    if getattr(args, "model_dir", None):
        updates["model"] = config.model.model_copy(update={"dir": Path(args.model_dir)})
    if getattr(args, "device", None):
        updates.setdefault("model", config.model)
        updates["model"] = updates["model"].model_copy(update={"device": args.device})
    if getattr(args, "engine", None):
        updates["engine"] = config.engine.model_copy(update={"kind": args.engine})
    if getattr(args, "speakers_dir", None):
        updates["speakers"] = config.speakers.model_copy(update={"dir": Path(args.speakers_dir)})
    return config.model_copy(update=updates)


def _common(p: argparse.ArgumentParser, engine: bool = True) -> None:
    p.add_argument("--config", type=Path, help="YAML config (default: built-in defaults)")
    p.add_argument("--model-dir", type=Path, help="CosyVoice2 model directory (default: tiny random demo model)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--speakers-dir", type=Path, help="speaker store folder (default: spk2info)")
    if engine:
        p.add_argument("--engine", choices=["native", "vllm"], help="LLM engine (default: native)")


# -- synthesize --------------------------------------------------------------------------------

def _request_from_args(args):
    from .frontend.audio import load_audio
    from .request import Mode, SynthesisOptions, SynthesisRequest

    prompt = load_audio(args.prompt_wav) if args.prompt_wav else None
    source = load_audio(args.source_wav) if args.source_wav else None
    if args.mode:
        mode = Mode(args.mode)
    elif source is not None:
        mode = Mode.VC
    elif args.speaker:
        mode = Mode.INSTRUCT2_BY_SPK_ID if args.instruct else Mode.ZERO_SHOT_BY_SPK_ID
    elif args.instruct:
        mode = Mode.INSTRUCT2
    elif prompt is not None:
        mode = Mode.ZERO_SHOT if args.prompt_text else Mode.CROSS_LINGUAL
    else:
        raise SystemExit("error: give a voice: --prompt-wav [--prompt-text], --speaker ID, or --source-wav with --prompt-wav")
    options = SynthesisOptions(stream=args.stream, speed=args.speed, text_frontend=not args.no_text_frontend,
                               seed=args.seed, top_k=args.top_k, max_tokens=args.max_tokens,
                               **({"first_hop": args.first_hop} if args.first_hop else {}))
    return SynthesisRequest(mode, text=args.text or "", prompt_text=args.prompt_text or "", prompt_audio=prompt,
                            instruct_text=args.instruct or "", speaker_id=args.speaker or "", source_audio=source,
                            options=options)


def cmd_synthesize(args) -> int:
    import numpy as np
    import soundfile as sf

    from .frontend.audio import resample
    from .tts import SyncSynthesizer

    if args.text_file:
        args.text = Path(args.text_file).read_text(encoding="utf-8")
    request = _request_from_args(args)
    pieces, tokens = [], []
    with SyncSynthesizer(_config(args)) as synth:
        for chunk in synth.synthesize(request):
            pieces.append(chunk.samples)
            tokens.extend(chunk.segment_tokens)
            audio_s = (chunk.sample_offset + len(chunk.samples)) / chunk.sample_rate
            print(f"\rchunk {chunk.index:3d}  segment {chunk.segment_index + 1}  audio {audio_s:6.2f} s  "
                  f"elapsed {chunk.elapsed_s:6.2f} s", end="", file=sys.stderr, flush=True)
        rate = synth.synth.sample_rate
    print(file=sys.stderr)
    audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    if args.sample_rate and args.sample_rate != rate:
        audio = resample(audio, rate, args.sample_rate)
        rate = args.sample_rate
    sf.write(args.out, audio, rate, subtype="PCM_16")
    print(f"wrote {args.out}: {len(audio) / rate:.2f} s at {rate} Hz, {len(tokens)} speech tokens", file=sys.stderr)
    if args.save_tokens:
        Path(args.save_tokens).write_text(json.dumps(tokens) + "\n", encoding="utf-8")
    return 0


# -- speakers ----------------------------------------------------------------------------------

def cmd_speakers(args) -> int:
    from .speaker_store import open_speaker_store

    config = _config(args)
    if args.action == "add":
        from .frontend.audio import load_audio
        from .tts import SyncSynthesizer

        with SyncSynthesizer(config) as synth:
            record = synth.register_speaker(args.id, args.prompt_text, load_audio(args.prompt_wav), args.overwrite)
        print(f"registered {record.speaker_id}: {record.voice.n_tokens} prompt tokens")
        return 0
    store = open_speaker_store(config.speakers)
    if args.action == "list":
        for info in store.infos():
            print(f"{info.speaker_id}\t{info.kind}\t{info.n_speech_tokens} tokens\t{info.prompt_text}")
    elif args.action == "show":
        r = store.get(args.id)
        print(json.dumps({"speaker_id": r.speaker_id, "kind": r.kind, "prompt_text": r.prompt_text,
                          "prompt_text_tokens": int(r.voice.prompt_text_tokens.size),
                          "speech_tokens": r.voice.n_tokens, "speech_feat": list(r.voice.speech_feat.shape),
                          "embedding": list(r.voice.embedding.shape), "created_at": r.created_at}, indent=2))
    elif args.action == "rm":
        store.delete(args.id)
        print(f"deleted {args.id}")
    elif args.action == "import":
        ids = store.import_spk2info(args.file, overwrite=args.overwrite)
        print(f"imported {len(ids)} speakers: {', '.join(ids)}")
    elif args.action == "export":
        ids = store.export_spk2info(args.file, args.ids or None)
        print(f"exported {len(ids)} speakers to {args.file}")
    return 0


# -- serve / client / bench / batch --------------------------------------------------------------

def serve_config(args):
    """The config `serve` runs: the file/env config with --port (-1: no gRPC) and --http-port."""
    config = _config(args)
    server = {}
    if args.port is not None:
        server["port"] = None if args.port < 0 else args.port
    if args.http_port is not None:
        server["http_port"] = args.http_port
    if server:
        config = config.model_copy(update={"server": config.server.model_copy(update=server)})
    return config


def cmd_serve(args) -> int:
    from grpc_async.server import run

    return run(serve_config(args))  # non-zero when the LM engine died


def cmd_client(argv: list[str]) -> int:
    from grpc_async.client import client_main

    return client_main(argv)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="async-cosyvoice", description="Streaming CosyVoice2 TTS")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the server: gRPC, and HTTP with --http-port")
    _common(p)
    p.add_argument("--port", type=int, help="gRPC port (0: any free port; -1: no gRPC)")
    p.add_argument("--http-port", type=int, help="HTTP port: OpenAI /v1/audio/speech, WebSocket, web page at /")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("synthesize", help="synthesize to a wav file in-process")
    _common(p)
    p.add_argument("--text")
    p.add_argument("--text-file", type=Path, help="read the text from a file")
    p.add_argument("--prompt-wav", type=Path)
    p.add_argument("--prompt-text")
    p.add_argument("--speaker", help="registered speaker id")
    p.add_argument("--instruct", help="instruction (instruct2 modes)")
    p.add_argument("--source-wav", type=Path, help="voice conversion source")
    p.add_argument("--mode", help="force a mode (zero_shot, cross_lingual, instruct2, sft, ...)")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--first-hop", type=int)
    p.add_argument("--no-text-frontend", action="store_true")
    p.add_argument("--top-k", type=int, help="RAS top-k (1 = greedy)")
    p.add_argument("--seed", type=int)
    p.add_argument("--max-tokens", type=int, help="force this many speech tokens per segment (ignore EOS)")
    p.add_argument("--save-tokens", type=Path, help="write the generated speech tokens as a JSON list")
    p.add_argument("--sample-rate", type=int, help="output rate (default 24000)")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=cmd_synthesize)

    p = sub.add_parser("speakers", help="manage the local speaker store")
    ssub = p.add_subparsers(dest="action", required=True)

    def action(name: str, **kw) -> argparse.ArgumentParser:
        q = ssub.add_parser(name, **kw)
        _common(q, engine=name == "add")  # the options may follow the action
        return q

    q = action("add", help="register a speaker from prompt audio + its transcript")
    q.add_argument("id")
    q.add_argument("--prompt-wav", type=Path, required=True)
    q.add_argument("--prompt-text", required=True)
    q.add_argument("--overwrite", action="store_true")
    action("list")
    action("show").add_argument("id")
    action("rm").add_argument("id")
    q = action("import", help="import an upstream spk2info.pt")
    q.add_argument("file", type=Path)
    q.add_argument("--overwrite", action="store_true")
    q = action("export", help="export to an upstream spk2info.pt")
    q.add_argument("file", type=Path)
    q.add_argument("ids", nargs="*")
    p.set_defaults(func=cmd_speakers)

    sub.add_parser("client", help="gRPC client (see `async-cosyvoice client -h`)", add_help=False)

    from . import batch as _batch
    from . import bench as _bench

    p = sub.add_parser("bench", help="benchmark: concurrency sweep in-process or against a server")
    _common(p)
    _bench.add_arguments(p)
    p.set_defaults(func=lambda a: _bench.main(a, _config))

    p = sub.add_parser("batch", help="offline batch synthesis of a jsonl data list (resumable, multi-GPU)")
    _common(p)
    _batch.add_arguments(p)
    p.set_defaults(func=lambda a: _batch.main(a, _config))
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "client":
        logging.basicConfig(level=logging.WARNING)
        return cmd_client(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose or args.command == "serve" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (CosyVoiceError, ModelDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

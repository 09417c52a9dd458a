"""`async-cosyvoice serve | synthesize | speakers | bench | batch`.

The parser and what a call to a server needs (cosyvoice_cli.remote) import no torch: a command with
`--target` skips the seconds of importing torch, and the client-only install (clients/python) has no
torch at all. What runs the model here (cosyvoice_cli.local, cosyvoice_cli.serve) is named in
COMMANDS and imported when that command runs, as a console script names its function.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

import grpc
import pydantic

from async_cosyvoice import batch
from async_cosyvoice.errors import CosyVoiceError, ModelDirError

from . import bench, speakers, synthesize
from .options import add_local, config_from_args, serve_config, verb_first

__all__ = ["main", "build_parser", "serve_config"]

# (command, where it runs) -> "module:function"; "remote" is with --target
COMMANDS = {
    ("serve", "local"): "cosyvoice_cli.serve:serve",
    ("synthesize", "local"): "cosyvoice_cli.local:synthesize",
    ("synthesize", "remote"): "cosyvoice_cli.remote:synthesize",
    ("speakers", "local"): "cosyvoice_cli.local:speakers",
    ("speakers", "remote"): "cosyvoice_cli.remote:speakers",
}
VERBS = {"serve", "synthesize", "speakers", "bench", "batch"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="async-cosyvoice", description="Streaming CosyVoice2 TTS",
        epilog="--target, --token, --tls, --ca-cert, --timeout, --wait, --config, --model-dir, --device, "
               "--speakers-dir and --engine may also come before the command.")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the server: gRPC, and HTTP with --http-port")
    add_local(p)
    p.add_argument("--port", type=int, help="gRPC port (0: any free port; -1: no gRPC)")
    p.add_argument("--http-port", type=int, help="HTTP port: OpenAI /v1/audio/speech, WebSocket, web page at /")

    synthesize.add_arguments(sub.add_parser(
        "synthesize", help="synthesize to an audio file, in-process or by a server (--target HOST:PORT)"))
    speakers.add_arguments(sub.add_parser(
        "speakers", help="manage the local speaker store, or a server's (--target HOST:PORT)"))

    p = sub.add_parser("bench", help="benchmark: concurrency sweep in-process or against a server")
    add_local(p)
    bench.add_arguments(p)
    p.set_defaults(func=lambda a: bench.main(a, config_from_args))

    p = sub.add_parser("batch", help="offline batch synthesis of a jsonl data list (resumable, multi-GPU)")
    add_local(p)
    batch.add_arguments(p)
    p.set_defaults(func=lambda a: batch.main(a, config_from_args))
    return ap


def command(args):
    """The function that runs the parsed command."""
    if getattr(args, "func", None) is not None:
        return args.func
    where = "remote" if getattr(args, "target", None) else "local"
    module, _, name = COMMANDS[args.command, where].partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:  # the client-only install (clients/python) has no model code
        raise ModuleNotFoundError(
            f"`{args.command}` runs the model in this process and needs the full async_cosyvoice package "
            f"(missing: {e.name}); this install is the client: synthesize, speakers and bench with "
            "--target HOST:PORT") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(verb_first(argv, VERBS))
    logging.basicConfig(level=logging.INFO if args.verbose or args.command == "serve" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return command(args)(args)
    except grpc.aio.AioRpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
    except pydantic.ValidationError as e:  # pydantic's own text is a paragraph per field
        fields = "; ".join(f"{'.'.join(map(str, d['loc']))}: {d['msg']}" for d in e.errors())
        print(f"error: the config (--config, ASYNC_COSYVOICE__* variables) is not valid: {fields}", file=sys.stderr)
    except (CosyVoiceError, ModelDirError, OSError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""`async-cosyvoice serve | synthesize | speakers | bench | batch`."""
from __future__ import annotations

import argparse
import logging
import sys

import grpc

from async_cosyvoice import batch
from async_cosyvoice.errors import CosyVoiceError, ModelDirError
from grpc_async.server import run as run_server

from . import bench, speakers, synthesize
from .options import add_local, config_from_args


def serve_config(args):
    """The config `serve` runs: the file/env config with --port (-1: no gRPC) and --http-port."""
    config = config_from_args(args)
    server = {}
    if args.port is not None:
        server["port"] = None if args.port < 0 else args.port
    if args.http_port is not None:
        server["http_port"] = args.http_port
    if server:
        config = config.model_copy(update={"server": config.server.model_copy(update=server)})
    return config


def cmd_serve(args) -> int:
    return run_server(serve_config(args)) or 0  # non-zero when the LM engine died


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="async-cosyvoice", description="Streaming CosyVoice2 TTS")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the server: gRPC, and HTTP with --http-port")
    add_local(p)
    p.add_argument("--port", type=int, help="gRPC port (0: any free port; -1: no gRPC)")
    p.add_argument("--http-port", type=int, help="HTTP port: OpenAI /v1/audio/speech, WebSocket, web page at /")
    p.set_defaults(func=cmd_serve)

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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO if args.verbose or args.command == "serve" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except grpc.aio.AioRpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
    except (CosyVoiceError, ModelDirError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

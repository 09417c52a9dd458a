"""`async-cosyvoice serve`: the server in this process (grpc_async.server)."""
from __future__ import annotations

from grpc_async.server import run as run_server

from .options import serve_config


def serve(args) -> int:
    return run_server(serve_config(args)) or 0  # non-zero when the LM engine died

"""The options every command shares: where the model and speakers are (in-process) or which server
to call (`--target`), and the Config built from them. Imports no torch (see cli.py)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from async_cosyvoice.config import Config
from grpc_async.client import TOKEN_ENV

TARGET_ENV = "ASYNC_COSYVOICE_TARGET"
DEFAULT_WAIT_SECONDS = 60.0
LOCAL_OPTIONS = ("config", "model_dir", "device", "speakers_dir", "engine")
REMOTE_OPTIONS = ("token", "tls", "ca_cert", "timeout")
# options that may also come before the verb (`async-cosyvoice --target H:P synthesize ...`):
# those taking a value, and flags
GLOBAL_VALUE_OPTIONS = ("--target", "--token", "--ca-cert", "--timeout", "--wait", "--config", "--model-dir",
                        "--device", "--speakers-dir", "--engine")
GLOBAL_FLAGS = ("--tls",)


def add_local(p: argparse.ArgumentParser, engine: bool = True) -> None:
    p.add_argument("--config", type=Path, help="YAML config (default: built-in defaults)")
    p.add_argument("--model-dir", type=Path, help="CosyVoice2 model directory (default: tiny random demo model)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--speakers-dir", type=Path,
                   help="speaker store folder (default: speakers.dir, else the data folder's speakers/)")
    if engine:
        p.add_argument("--engine", choices=["native", "vllm"], help="LLM engine (default: native)")


def add_remote(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=os.environ.get(TARGET_ENV) or None,
                   help=f"HOST:PORT of a server to call instead of running in-process (env {TARGET_ENV})")
    p.add_argument("--token", default=None, help=f"bearer token for --target (env {TOKEN_ENV})")
    p.add_argument("--tls", action="store_true", help="TLS to --target (system roots unless --ca-cert)")
    p.add_argument("--ca-cert", type=Path, help="PEM root certificate for TLS")
    p.add_argument("--timeout", type=float, help="deadline in seconds for each call to --target")
    p.add_argument("--wait", type=float, metavar="SECONDS",
                   help=f"wait up to this long for --target to be up and SERVING (a server loads its model "
                        f"after opening its port; default {DEFAULT_WAIT_SECONDS:g}; 0: do not wait)")


def verb_first(argv: list[str], verbs: set[str]) -> list[str]:
    """argv with the shared options given before the verb moved to the end, where the verb's own
    parser (or its action's, for `speakers`) reads them: `--target H:P synthesize ...` is
    `synthesize ... --target H:P`."""
    before, moved, i = [], [], 0
    while i < len(argv) and argv[i] not in verbs:
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in GLOBAL_VALUE_OPTIONS:
            take = 1 if "=" in arg else 2
            moved += argv[i:i + take]
            i += take
        elif arg in GLOBAL_FLAGS:
            moved.append(arg)
            i += 1
        else:
            before.append(arg)
            i += 1
    return before + argv[i:] + moved


def check_where(args, local_only: tuple[str, ...] = (), remote_only: tuple[str, ...] = ()) -> None:
    """Refuse options that mean nothing where the command runs (in-process or --target)."""
    if getattr(args, "target", None):
        given = [o for o in LOCAL_OPTIONS + local_only if getattr(args, o, None) not in (None, False)]
        if given:
            raise ValueError(f"{', '.join(_flag(o) for o in given)}: in-process only; the server at "
                             f"{args.target} uses its own config")
    else:
        given = [o for o in REMOTE_OPTIONS + ("wait",) + remote_only
                 if getattr(args, o, None) not in (None, False)]
        if given:
            raise ValueError(f"{', '.join(_flag(o) for o in given)}: only with --target HOST:PORT")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def config_from_args(args) -> Config:
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


def serve_config(args) -> Config:
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

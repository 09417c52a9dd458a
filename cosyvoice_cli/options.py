"""The options every command shares: where the model and speakers are (in-process) or which server
to call (`--target`), and the Config built from them."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from async_cosyvoice.config import Config
from grpc_async.client import TOKEN_ENV, CosyVoiceClient

TARGET_ENV = "ASYNC_COSYVOICE_TARGET"
LOCAL_OPTIONS = ("config", "model_dir", "device", "speakers_dir", "engine")
REMOTE_OPTIONS = ("token", "tls", "ca_cert", "timeout")


def add_local(p: argparse.ArgumentParser, engine: bool = True) -> None:
    p.add_argument("--config", type=Path, help="YAML config (default: built-in defaults)")
    p.add_argument("--model-dir", type=Path, help="CosyVoice2 model directory (default: tiny random demo model)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--speakers-dir", type=Path, help="speaker store folder (default: spk2info)")
    if engine:
        p.add_argument("--engine", choices=["native", "vllm"], help="LLM engine (default: native)")


def add_remote(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=os.environ.get(TARGET_ENV) or None,
                   help=f"HOST:PORT of a server to call instead of running in-process (env {TARGET_ENV})")
    p.add_argument("--token", default=None, help=f"bearer token for --target (env {TOKEN_ENV})")
    p.add_argument("--tls", action="store_true", help="TLS to --target (system roots unless --ca-cert)")
    p.add_argument("--ca-cert", type=Path, help="PEM root certificate for TLS")
    p.add_argument("--timeout", type=float, help="deadline in seconds for each call to --target")


def check_where(args, local_only: tuple[str, ...] = (), remote_only: tuple[str, ...] = ()) -> None:
    """Refuse options that mean nothing where the command runs (in-process or --target)."""
    if getattr(args, "target", None):
        given = [o for o in LOCAL_OPTIONS + local_only if getattr(args, o, None) not in (None, False)]
        if given:
            raise ValueError(f"{', '.join(_flag(o) for o in given)}: in-process only; the server at "
                             f"{args.target} uses its own config")
    else:
        given = [o for o in REMOTE_OPTIONS + remote_only if getattr(args, o, None) not in (None, False)]
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


def client_from_args(args) -> CosyVoiceClient:
    tls = (args.ca_cert or True) if (args.tls or args.ca_cert) else False
    return CosyVoiceClient(args.target, token=args.token or os.environ.get(TOKEN_ENV), tls=tls)

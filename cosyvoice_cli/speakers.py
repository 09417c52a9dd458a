"""`async-cosyvoice speakers add|list|show|rm|import|export`: the local speaker store
(cosyvoice_cli.local), or a server's with `--target` (add/list/show/rm; cosyvoice_cli.remote). Both
ways print the same lines:

    list, add:  ID <tab> KIND <tab> PROMPT SECONDS <tab> CREATED (UTC) <tab> PROMPT TEXT
    show:       a JSON object with the speaker's model kind (in-process it adds the shapes of the
                stored arrays)

`import` stores the entries of an upstream spk2info.pt as speakers of the configured model's kind.

This module imports no torch (see cli.py).
"""
from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from .options import add_local, add_remote

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


def line(speaker_id: str, kind: str, speech_tokens: int, created_at: float | None, prompt_text: str) -> str:
    return (f"{speaker_id}\t{kind}\t{speech_tokens / TOKENS_PER_SECOND:.2f}s\t{_utc(created_at)}\t"
            f"{prompt_text}")


def _utc(unix_s: float | None) -> str:
    if not unix_s:
        return "-"
    return datetime.datetime.fromtimestamp(unix_s, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def shown(speaker_id: str, kind: str, speech_tokens: int, created_at: float | None, prompt_text: str) -> dict:
    return {"speaker_id": speaker_id, "kind": kind, "prompt_text": prompt_text, "speech_tokens": speech_tokens,
            "prompt_seconds": speech_tokens / TOKENS_PER_SECOND, "created_at": _utc(created_at)}

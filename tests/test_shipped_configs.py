"""What the shipped configs expose: every one binds loopback; the container image opens 0.0.0.0
explicitly; a server bound to another address without a token says so in its log."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from async_cosyvoice.config import Config
from grpc_async.server import ServerThread, is_loopback

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
EXPOSED = "accepts connections from other machines"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_binds_loopback(path):
    assert is_loopback(Config.load(path, env={}).server.host)


def test_the_container_opens_all_interfaces_explicitly():
    assert "ASYNC_COSYVOICE__SERVER__HOST=0.0.0.0" in (ROOT / "Dockerfile").read_text()


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("[::1]") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.1.2.3")
    assert not is_loopback("myhost.example")


async def _never_ready(config):
    await asyncio.Event().wait()


@pytest.mark.parametrize("host, token, warned", [("0.0.0.0", None, True), ("0.0.0.0", "s3cret", False),
                                                 ("127.0.0.1", None, False)])
def test_binding_other_machines_without_a_token_is_logged(host, token, warned, tmp_path, caplog):
    cfg = Config.model_validate({"server": {"host": host, "port": 0, "auth_token": token, "grace_seconds": 0},
                                 "speakers": {"dir": str(tmp_path)}})
    with caplog.at_level(logging.WARNING, logger="grpc_async.server"):
        st = ServerThread(cfg, ready_timeout=None, synthesizer_factory=_never_ready)
        st.close(grace=0)
    said = [r.getMessage() for r in caplog.records if EXPOSED in r.getMessage()]
    assert bool(said) == warned
    if warned:
        assert "server.auth_token" in said[0] and host in said[0]

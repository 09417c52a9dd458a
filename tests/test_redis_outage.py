"""Redis as a real dependency (issue 26 item 7), with a real redis-server that is killed and
restarted under a real server (tiny fixture model, gRPC + HTTP on 127.0.0.1):

- while Redis is down, everything that needs the store is UNAVAILABLE with a message on every door
  (was INTERNAL), health is NOT_SERVING, and synthesis from prompt audio still runs;
- when Redis is back, health returns to SERVING by itself (back-off reconnect) and the stored
  speakers are there again;
- at start the server reads Redis' persistence settings and warns, or refuses by config, when
  acknowledged registrations could be lost.
"""
from __future__ import annotations

import asyncio
import json
import logging

import grpc
import httpx
import numpy as np
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from websockets.asyncio.client import connect as ws_connect

from async_cosyvoice.config import Config
from async_cosyvoice.errors import StoreUnavailable, Unsupported
from async_cosyvoice.speaker_redis import RedisSpeakerStore
from async_cosyvoice.speaker_store import open_speaker_store
from grpc_async.client import CosyVoiceClient, collect
from grpc_async.server import ServerThread

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def redis_config(redis_url: str, **speakers) -> dict:
    return {"backend": "redis", "redis_url": redis_url, "redis_prefix": "outage", "redis_timeout_seconds": 2,
            **speakers}


def prompt() -> tuple[np.ndarray, int]:
    rng = np.random.default_rng(3)
    t = np.arange(24000) / 16000
    return (0.3 * np.sin(2 * np.pi * 190 * t) + 0.02 * rng.standard_normal(t.size)).astype(np.float32), 16000


def test_redis_down_is_unavailable_and_health_follows_it(tiny_dir, make_redis_server):
    store_server = make_redis_server()
    cfg = Config.model_validate({
        "model": {"dir": str(tiny_dir)}, "speakers": redis_config(store_server.url),
        "server": {"port": 0, "http_port": 0, "grace_seconds": 1},
        "limits": {"max_concurrent_streams": 4, "max_text_chars": 400}})
    open_speaker_store(cfg.speakers).import_spk2info(tiny_dir / "spk2info.pt")
    st = ServerThread(cfg, ready_timeout=600)
    base = f"http://127.0.0.1:{st.server.http_port}"

    async def ws_error(voice):
        async with ws_connect(f"ws://127.0.0.1:{st.server.http_port}/v1/audio/speech/stream") as ws:
            await ws.send(json.dumps({"type": "config", "voice": voice}))
            message = json.loads(await ws.recv())
            await ws.wait_closed()
            return message, ws.close_code

    async def body():
        down, after = {}, {}
        async with CosyVoiceClient(st.target) as c, grpc.aio.insecure_channel(st.target) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
            statuses = [(await watch.read()).status]
            store_server.kill()

            async def failure(coro):
                try:
                    await coro
                except grpc.aio.AioRpcError as e:
                    return e.code(), e.details()
                return "OK", ""
            down["GetSpeaker"] = await failure(c.get_speaker("tiny_zs_spk"))
            down["RegisterSpeaker"] = await failure(c.register_speaker("new_one", "A prompt.", prompt()))
            down["Synthesize by id"] = await failure(collect(c.synthesize("Hi.", speaker_id="tiny_zs_spk",
                                                                          max_tokens=5)))
            down["ListSpeakers"] = await failure(c.list_speakers())
            statuses.append((await watch.read()).status)  # NOT_SERVING, from the first failed call
            with httpx.Client(base_url=base, timeout=60) as http:
                down["HTTP voices"] = http.get("/v1/audio/voices")
                down["HTTP readyz"] = http.get("/readyz")
            down["WS"] = await ws_error("tiny_zs_spk")
            # no stored speaker needed: still served
            spoken = await collect(c.synthesize("Hi.", mode="cross_lingual", prompt_audio=prompt(), seed=1,
                                                max_tokens=5))
            store_server.start()  # a supervisor restarts it; its append-only file has every record
            statuses.append((await asyncio.wait_for(watch.read(), 60)).status)
            watch.cancel()
            after["GetSpeaker"] = (await c.get_speaker("tiny_zs_spk")).speaker_id
            await c.register_speaker("new_one", "A prompt for a new speaker.", prompt())
            after["new_one"] = (await c.get_speaker("new_one")).speaker_id
            with httpx.Client(base_url=base, timeout=60) as http:
                after["HTTP readyz"] = http.get("/readyz").status_code
        return statuses, down, spoken.summary.speech_tokens, after

    try:
        statuses, down, spoken, after = asyncio.run(body())
    finally:
        st.close(grace=0)
    assert statuses == [SERVING, NOT_SERVING, SERVING]
    where = f"the speaker store (redis://127.0.0.1:{store_server.port}/0) is unreachable"
    for what in ("GetSpeaker", "RegisterSpeaker", "Synthesize by id", "ListSpeakers"):
        code, details = down[what]
        assert code == grpc.StatusCode.UNAVAILABLE and details.startswith(where), (what, code, details)
    for what in ("HTTP voices", "HTTP readyz"):
        r = down[what]
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable", (what, r.text)
        assert "unreachable" in r.json()["error"]["message"] and r.headers["retry-after"]
    message, close_code = down["WS"]
    assert (message["code"], message["status"], close_code) == ("store_unavailable", 503, 4503), message
    assert message["message"].startswith(where)
    assert spoken == 5
    assert after == {"GetSpeaker": "tiny_zs_spk", "new_one": "new_one", "HTTP readyz": 200}


def test_redis_down_at_start_is_not_fatal(tiny_dir, make_redis_server, caplog):
    """The server starts without Redis (NOT_SERVING, a warning), and serves once Redis answers."""
    store_server = make_redis_server()
    cfg = Config.model_validate({
        "model": {"dir": str(tiny_dir)}, "speakers": redis_config(store_server.url),
        "server": {"port": 0, "grace_seconds": 1}})
    open_speaker_store(cfg.speakers).import_spk2info(tiny_dir / "spk2info.pt")
    store_server.kill()
    with caplog.at_level(logging.WARNING, logger="grpc_async.server"):
        st = ServerThread(cfg, ready_timeout=600)
    assert any("cannot check the speaker store's persistence" in r.getMessage() for r in caplog.records)

    async def body():
        async with CosyVoiceClient(st.target) as c, grpc.aio.insecure_channel(st.target) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
            statuses = [(await watch.read()).status]
            store_server.start()
            statuses.append((await asyncio.wait_for(watch.read(), 60)).status)
            watch.cancel()
            got = await collect(c.synthesize("Hi.", speaker_id="tiny_zs_spk", seed=1, max_tokens=5))
            return statuses, got.summary.speech_tokens

    try:
        assert asyncio.run(body()) == ([NOT_SERVING, SERVING], 5)
    finally:
        st.close(grace=0)


async def _never_ready(config):
    await asyncio.Event().wait()


def _start_without_model(redis_url: str, ready_timeout: float | None = None, **speakers) -> ServerThread:
    cfg = Config.model_validate({"speakers": redis_config(redis_url, **speakers), "server": {"port": 0}})
    return ServerThread(cfg, ready_timeout=ready_timeout, synthesizer_factory=_never_ready)


def _wait_logged(st: ServerThread, predicate, timeout: float = 30.0) -> None:
    """Until the loader has passed its store check (it then waits for the never-ready model)."""
    async def passed():
        while not predicate():
            await asyncio.sleep(0.05)
    st.call(passed(), timeout=timeout)


def test_redis_persistence_is_checked_at_start(make_redis_server, caplog):
    store_server = make_redis_server()
    client = redis.Redis.from_url(store_server.url)
    client.config_set("appendonly", "no")
    client.config_set("save", "3600 1")
    store = RedisSpeakerStore(store_server.url)
    rdb = store.persistence_problem()
    assert "runs with appendonly no and only RDB snapshots (save '3600 1')" in rdb
    assert "registrations acknowledged since the last snapshot are lost when Redis crashes" in rdb

    def warned():
        return any("appendonly no" in r.getMessage() and "redis_durability: require" in r.getMessage()
                   for r in caplog.records)
    with caplog.at_level(logging.WARNING, logger="grpc_async.server"), \
            _start_without_model(store_server.url) as st:  # warn (the default): starts, says so
        _wait_logged(st, warned)
    with pytest.raises(Unsupported, match=r"appendonly no .* \(speakers.redis_durability: require"):
        _start_without_model(store_server.url, ready_timeout=30, redis_durability="require")

    client.config_set("appendonly", "yes")
    client.config_set("appendfsync", "everysec")
    assert "fsyncs its append-only file 'everysec', not 'always'" in store.persistence_problem()
    client.config_set("appendfsync", "always")
    assert store.persistence_problem() is None
    store_server.kill()
    with pytest.raises(StoreUnavailable, match="unreachable"):
        store.persistence_problem()

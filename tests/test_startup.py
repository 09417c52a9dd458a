"""The start's phases (async_cosyvoice/startup.py), and a server that says it is warming up on every
front door until it serves: gRPC UNAVAILABLE and HTTP 503 with "warming up" and the current step,
GetServerInfo's startup step; after SERVING the phase report in GetServerInfo and the metrics."""
from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import httpx
import pytest

from async_cosyvoice.config import Config
from async_cosyvoice.placement import create_synthesizer
from async_cosyvoice.speakers import SpeakerStore
from async_cosyvoice.startup import CAPTURES, PHASES, Startup
from grpc_async.client import CosyVoiceClient, collect
from grpc_async.server import ServerThread


def run(coro):
    return asyncio.run(coro)


def test_phases_take_captures_out_of_the_warm_up():
    startup = Startup()
    with startup.span("load weights", "loading weights"):
        assert "loading weights" in startup.status()
        time.sleep(0.02)
    with startup.span("warm-up", "warming up"):
        with CAPTURES.capturing("test graph"):
            time.sleep(0.05)
        time.sleep(0.02)
    report = startup.finish()
    assert list(report.phases) == list(PHASES)
    assert report.phases["load weights"] >= 0.02
    assert report.captured == {"test graph": 1} and report.capture_s["test graph"] >= 0.05
    assert report.phases["capture"] == pytest.approx(report.capture_s["test graph"])
    warm = report.phases["warm-up requests"] + report.phases["capture"] + report.phases["compile"]
    assert 0.07 <= warm <= report.total_s
    assert report.total_s >= sum(report.phases.values()) - 1e-6
    assert startup.finish() is report and startup.status().startswith("serving")
    assert "capture" in report.table() and "1 test graph CUDA graph(s)" in report.table()


def test_a_capture_started_before_the_start_is_not_counted():
    with CAPTURES.capturing("earlier graph"):
        pass
    assert "earlier graph" not in Startup().finish().captured


def server_with(cfg: Config, factory, holder: dict, known: asyncio.Event) -> ServerThread:
    """A ServerThread whose factory may read it from holder["st"] once `known` is set."""
    holder["st"] = st = ServerThread(cfg, ready_timeout=None, synthesizer_factory=factory)

    async def tell():
        known.set()
    st.call(tell())
    return st


@pytest.fixture(scope="module")
def warming_server(tmp_path_factory):
    """A server whose start stays in its first step: the factory runs the server's own Startup's
    "loading weights" span and never finishes it."""
    cfg = Config.model_validate({"server": {"port": 0, "http_port": 0, "grace_seconds": 0},
                                 "speakers": {"dir": str(tmp_path_factory.mktemp("spk-warming"))}})
    holder, known, entered = {}, asyncio.Event(), asyncio.Event()  # used on the server's loop only

    async def never_done(config):
        await known.wait()
        with holder["st"].server.servicer.startup.span("load weights", "loading weights"):
            entered.set()
            await asyncio.Event().wait()

    st = server_with(cfg, never_done, holder, known)
    st.call(entered.wait(), timeout=10)
    yield st
    st.close(grace=0)


def test_grpc_answers_unavailable_warming_up(warming_server):
    async def body():
        async with CosyVoiceClient(warming_server.target) as client:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(client.synthesize("Hi.", mode="sft", speaker_id="a"))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "warming up (loading weights" in e.value.details() and "retry" in e.value.details()
            info = await client.get_server_info()
            assert not info.ready and info.startup.step.startswith("loading weights")
            assert not info.startup.phases and info.startup.seconds == 0
    run(body())


def test_http_answers_503_warming_up(warming_server):
    base = f"http://127.0.0.1:{warming_server.server.http_port}"
    for r in (httpx.get(base + "/readyz"),
              httpx.post(base + "/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": "alloy"})):
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "warming up (loading weights" in r.json()["error"]["message"]


@pytest.mark.slow
def test_a_real_start_reports_its_phases(tiny_dir, tmp_path):
    spk_dir = tmp_path / "spk"
    SpeakerStore(spk_dir).import_spk2info(tiny_dir / "spk2info.pt")
    cfg = Config.model_validate({"model": {"dir": str(tiny_dir)}, "speakers": {"dir": str(spk_dir)},
                                 "server": {"port": 0, "metrics_port": 0, "grace_seconds": 0}})
    holder, known = {}, asyncio.Event()

    async def real(config):  # the server's own path, with the servicer's Startup
        await known.wait()
        return await create_synthesizer(config, startup=holder["st"].server.servicer.startup)

    st = server_with(cfg, real, holder, known)
    try:
        st.call(st.server.wait_ready(), timeout=600)

        async def info():
            async with CosyVoiceClient(st.target) as c:
                return await c.get_server_info()
        startup = run(info()).startup
        assert startup.step == "serving" and startup.seconds > 0
        assert [p.name for p in startup.phases] == list(PHASES)
        phases = {p.name: p.seconds for p in startup.phases}
        assert phases["load weights"] > 0 and phases["warm-up requests"] > 0
        assert startup.compile_cache == "off"  # CPU: nothing is compiled
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{st.server.metrics_port}/metrics").read().decode()
        assert 'cosyvoice_startup_seconds{phase="load weights"}' in metrics
        assert 'cosyvoice_startup_seconds{phase="total"}' in metrics
    finally:
        st.close(grace=0)

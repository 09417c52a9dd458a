"""Holding steady: corrupt speaker records, probes, the metrics port, the shutdown drain, and the
LM engine dying under a real server on 127.0.0.1 with the tiny fixture model."""
from __future__ import annotations

import asyncio
import logging
import re
import urllib.error
import urllib.request
from collections import Counter

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from async_cosyvoice.config import Config
from async_cosyvoice.errors import SpeakerCorrupt
from async_cosyvoice.request import Voice
from async_cosyvoice.speakers import SpeakerRecord, SpeakerStore, speaker_file_name
from grpc_async import SERVICE_NAME
from grpc_async.client import CosyVoiceClient, collect
from grpc_async.server import ENGINE_DEAD_EXIT_CODE, ServerThread

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG = {"stream": True, "max_tokens": 3000}  # forced length: runs for minutes unless stopped


def make_record(speaker_id: str, n_tokens: int = 12) -> SpeakerRecord:
    rng = np.random.default_rng(len(speaker_id))
    return SpeakerRecord(speaker_id, Voice(rng.integers(0, 6561, n_tokens, dtype=np.int32),
                                           rng.standard_normal((2 * n_tokens, 80)).astype(np.float32),
                                           rng.standard_normal(192).astype(np.float32), "hello",
                                           rng.integers(0, 1000, 7, dtype=np.int32)))


def corrupt_store(directory) -> SpeakerStore:
    """Three good speakers, one truncated inside its arrays, one with a garbled header."""
    store = SpeakerStore(directory)
    for sid in ("good_a", "good_b", "truncated", "garbled"):
        store.put(make_record(sid))
    path = store.dir / speaker_file_name("truncated")
    path.write_bytes(path.read_bytes()[:-500])
    path = store.dir / speaker_file_name("garbled")
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32
    path.write_bytes(bytes(data))
    return store


def make_config(tiny_dir, spk_dir, **server) -> Config:
    return Config.model_validate({
        "model": {"dir": str(tiny_dir)}, "speakers": {"dir": str(spk_dir)},
        "server": {"port": 0, "metrics_port": 0, "grace_seconds": 5, **server},
        "limits": {"max_concurrent_streams": 8, "max_text_chars": 400}})


async def first_audio(call_iter) -> None:
    async for chunk in call_iter:
        if chunk.num_samples:
            return
    raise AssertionError("ended before any audio")


# =============================================================================================
# Speaker store: unreadable records (no server)


def test_store_reports_unreadable_records_and_keeps_the_rest(tmp_path, caplog):
    store = corrupt_store(tmp_path)
    fresh = SpeakerStore(tmp_path)
    with caplog.at_level(logging.ERROR, logger="async_cosyvoice.speakers"):
        bad = dict(fresh.unreadable_records())
    assert set(bad) == {speaker_file_name("truncated"), speaker_file_name("garbled")}
    assert bad[speaker_file_name("truncated")].startswith("speaker 'truncated': ")
    assert bad[speaker_file_name("garbled")].startswith("speaker unknown (header unreadable): ")
    assert "2 unreadable record(s)" in caplog.text
    assert fresh.get("good_a").same_data(store.get("good_a"))
    with pytest.raises(SpeakerCorrupt, match=r"speaker 'truncated': the stored record is unreadable .* "
                                             r"must be registered again"):
        fresh.get("truncated")
    with pytest.raises(SpeakerCorrupt, match="'garbled'"):
        fresh.get("garbled")
    assert {"good_a", "good_b"} <= set(fresh.ids()) and "garbled" not in fresh.ids()
    fresh.put(make_record("truncated"), overwrite=True)  # registering again repairs it
    assert fresh.get("truncated").same_data(make_record("truncated"))
    assert [name for name, _ in fresh.unreadable_records()] == [speaker_file_name("garbled")]


# =============================================================================================
# One server: corrupt records over gRPC, probes, metrics port


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    spk_dir = tmp_path_factory.mktemp("spk-corrupt")
    corrupt_store(spk_dir)
    SpeakerStore(spk_dir).import_spk2info(tiny_dir / "spk2info.pt")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(logging.ERROR)
    logging.getLogger("async_cosyvoice.speakers").addHandler(handler)
    try:
        st = ServerThread(make_config(tiny_dir, spk_dir), ready_timeout=600)
    finally:
        logging.getLogger("async_cosyvoice.speakers").removeHandler(handler)
    st.startup_errors = records
    yield st
    st.close(grace=1)


def test_startup_reports_unreadable_records(server):
    assert any("speaker 'truncated'" in m and "register that speaker again" in m
               for m in server.startup_errors), server.startup_errors
    assert any("2 unreadable record(s)" in m for m in server.startup_errors)


def test_corrupt_record_gets_data_loss_and_others_still_work(server):
    async def body():
        async with CosyVoiceClient(server.target) as c:
            for sid in ("truncated", "garbled"):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.get_speaker(sid)
                assert e.value.code() == grpc.StatusCode.DATA_LOSS
                assert repr(sid) in e.value.details() and "registered again" in e.value.details()
                for mode in ("zero_shot_by_spk_id", "sft"):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await collect(c.synthesize("Hi.", mode=mode, speaker_id=sid, max_tokens=5))
                    assert e.value.code() == grpc.StatusCode.DATA_LOSS, e.value.details()
                    assert repr(sid) in e.value.details()
            ids = [s.speaker_id for s in await c.all_speakers()]
            assert {"good_a", "good_b", "tiny_zs_spk", "tiny_sft_spk"} <= set(ids)
            assert (await c.get_speaker("good_b")).speaker_id == "good_b"
            got = await collect(c.synthesize("Hi.", speaker_id="tiny_zs_spk", seed=1, max_tokens=5))
            assert got.summary.speech_tokens == 5
            await c.delete_speaker("garbled")  # a corrupt record can be deleted
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.get_speaker("garbled")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
    asyncio.run(body())


def test_health_list(server):
    async def body():
        async with grpc.aio.insecure_channel(server.target) as ch:
            return await health_pb2_grpc.HealthStub(ch).List(health_pb2.HealthListRequest(), timeout=10)
    statuses = {name: r.status for name, r in asyncio.run(body()).statuses.items()}
    assert statuses == {"": SERVING, SERVICE_NAME: SERVING}


def test_metrics_port_serves_only_metrics(server):
    base = f"http://127.0.0.1:{server.server.metrics_port}"
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert r.status == 200 and "cosyvoice_ready 1.0" in text and "cosyvoice_engine_alive 1.0" in text
    rss = [float(line.split()[1]) for line in text.splitlines() if line.startswith("process_resident_memory_bytes")]
    assert rss and rss[0] > 50e6
    for path in ("/", "/metricsx", "/foo/metrics", "/favicon.ico", "/../metrics"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + path, timeout=10)
        assert e.value.code == 404, path
    with urllib.request.urlopen(base + "/metrics?name[]=cosyvoice_ready", timeout=10) as r:
        assert r.read().decode().strip().endswith("cosyvoice_ready 1.0")


def synthesis_statuses(server) -> Counter:
    """The server's own count of finished Synthesize RPCs by status (its metrics port)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = Counter()
    for m in re.finditer(r'^cosyvoice_requests_total\{method="Synthesize",mode="[^"]*",status="(\w+)"\} (\S+)$',
                         text, re.M):
        out[m.group(1)] += int(float(m.group(2)))
    return out


def test_client_deadlines_are_counted_as_deadline_exceeded(server):
    """A client deadline reaches the server as a cancel, sometimes a few ms before the server's own
    copy of the deadline (it is later by the request's one-way delay): that is still
    DEADLINE_EXCEEDED in the server's log and metrics, and a plain cancel stays CANCELLED."""
    text = "This sentence keeps the engine busy for a while, and then some more words follow. " * 2

    async def body():
        async with CosyVoiceClient(server.target) as c:
            async def one(i, timeout=None):
                try:
                    await collect(c.synthesize(text, speaker_id="tiny_zs_spk", seed=i, stream=True, timeout=timeout,
                                               **({} if timeout else {"max_tokens": 30})))
                    return "OK"
                except grpc.aio.AioRpcError as e:
                    return e.code().name

            got = Counter()
            for round_ in range(6):  # 4 deadlines at a time beside 2 requests that load the server
                outcomes = await asyncio.gather(*(one(i, 0.05 + 0.06 * (i + round_)) for i in range(4)),
                                                one(100), one(101))
                got.update(outcomes[:4])
            cancelled = c.synthesize(text, speaker_id="tiny_zs_spk", seed=1, stream=True, timeout=60)
            await first_audio(cancelled)
            await cancelled.aclose()
            return got

    before = synthesis_statuses(server)
    client = asyncio.run(body())
    server.call(server.server.servicer.idle.wait(), timeout=30)  # the cancelled handlers have unwound
    after = synthesis_statuses(server)
    assert client == {"DEADLINE_EXCEEDED": 24}, client
    assert after["DEADLINE_EXCEEDED"] - before["DEADLINE_EXCEEDED"] == 24, (before, after)
    assert after["CANCELLED"] - before["CANCELLED"] == 1  # the one cancelled with 59 s to spare


def test_deleting_a_speaker_drops_its_cached_prompt_prefix(server):
    """A streamed synthesis caches the speaker's flow prompt prefix (~2 MiB for a 2 s prompt on
    the tiny model); DeleteSpeaker drops it instead of leaving it until the LRU budget (2 GiB)
    evicts it, which on CPU is resident memory that churning speakers would fill."""
    prefixes = server.server.synthesizer.batcher.runner.speaker_prefixes
    rng = np.random.default_rng(5)
    t = np.arange(32000) / 16000
    prompt = (0.3 * np.sin(2 * np.pi * 200 * t) + 0.02 * rng.standard_normal(t.size)).astype(np.float32)

    async def body():
        async with CosyVoiceClient(server.target) as c:
            before = len(prefixes)
            await c.register_speaker("short_lived", "A prompt for a speaker that is deleted soon.",
                                     (prompt, 16000), overwrite=True)
            await collect(c.synthesize("Hello there, how are you?", speaker_id="short_lived", seed=1, stream=True,
                                       max_tokens=80))
            cached = len(prefixes) - before
            await c.delete_speaker("short_lived")
            return cached, len(prefixes) - before

    assert asyncio.run(body()) == (1, 0)  # cached by the stream, dropped by the delete


def test_concurrent_requests_with_the_same_request_id_are_independent(server):
    """request_id labels logs and the summary; two requests that share one (a client retrying,
    two clients choosing the same id) both run to the end, and cancelling one leaves the other."""
    async def body():
        async with CosyVoiceClient(server.target) as c:
            def call(**opts):
                return c.synthesize("Hello there, how are you?", speaker_id="tiny_zs_spk", seed=3, max_tokens=30,
                                    request_id="same-id", **opts)

            async def streamed():
                return await collect(c.stream_synthesize(["Hello there, ", "how are you?"], speaker_id="tiny_zs_spk",
                                                         seed=3, max_tokens=30, request_id="same-id", stream=True))

            both = await asyncio.wait_for(asyncio.gather(collect(call(stream=True)), collect(call(stream=False)),
                                                         streamed()), 120)
            dropped, kept = call(stream=True), call(stream=True)
            await first_audio(dropped)
            await dropped.aclose()  # cancels that RPC while the other, same id, still runs
            return both, await asyncio.wait_for(collect(kept), 120)

    both, kept = asyncio.run(body())
    for got in (*both, kept):
        assert got.summary.request_id == "same-id" and got.summary.speech_tokens == 30


# =============================================================================================
# Shutdown: streams still running when the drain grace ends get UNAVAILABLE


def test_streams_past_the_drain_grace_get_unavailable(tiny_dir, tmp_path):
    spk_dir = tmp_path / "spk"
    SpeakerStore(spk_dir).import_spk2info(tiny_dir / "spk2info.pt")
    st = ServerThread(make_config(tiny_dir, spk_dir, grace_seconds=0.5), ready_timeout=600)

    async def body():
        async with CosyVoiceClient(st.target) as c:
            unary = c.synthesize("Hello there.", speaker_id="tiny_zs_spk", seed=1, **LONG)
            pieces = asyncio.Queue()
            pieces.put_nowait("Hello there, a first sentence. ")

            async def text():
                while True:
                    yield await pieces.get()

            bidi = c.stream_synthesize(text(), mode="sft", speaker_id="tiny_sft_spk", text_mode="sentence", **LONG)
            await asyncio.gather(first_audio(unary), first_audio(bidi))
            stopping = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(st.server.stop(), st.loop))
            results = []
            for call in (unary, bidi):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in call:
                        pass
                results.append((e.value.code(), e.value.details()))
            await stopping
            return results

    try:
        results = asyncio.run(body())
    finally:
        st.close(grace=0)
    for code, details in results:
        assert code == grpc.StatusCode.UNAVAILABLE, details
        assert "drain grace of 0.5 s ran out" in details


# =============================================================================================
# The native engine's step loop dies


def test_native_engine_death(tiny_dir, tmp_path):
    spk_dir = tmp_path / "spk"
    SpeakerStore(spk_dir).import_spk2info(tiny_dir / "spk2info.pt")
    st = ServerThread(make_config(tiny_dir, spk_dir, grace_seconds=2), ready_timeout=600)
    engine = st.server.synthesizer.engine

    def broken_schedule():
        # Fault injection: a bug inside the loop itself (not in a model step, which only fails
        # that step's requests) kills the step loop.
        raise RuntimeError("injected scheduler fault")

    async def break_engine():
        engine.scheduler.schedule = broken_schedule
        engine._wake.set()

    async def body():
        async with CosyVoiceClient(st.target) as c, grpc.aio.insecure_channel(st.target) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == SERVING
            inflight = c.synthesize("Hello there.", speaker_id="tiny_zs_spk", seed=1, **LONG)
            await first_audio(inflight)
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(break_engine(), st.loop))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in inflight:
                    pass
            inflight_error = (e.value.code(), e.value.details())
            assert (await watch.read()).status == NOT_SERVING
            watch.cancel()
            statuses = {n: r.status for n, r in (await health_pb2_grpc.HealthStub(ch).List(
                health_pb2.HealthListRequest())).statuses.items()}
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(c.synthesize("Hi.", mode="sft", speaker_id="tiny_sft_spk"))
            return inflight_error, statuses, (e.value.code(), e.value.details())

    try:
        inflight, statuses, new = asyncio.run(body())
        # what `serve` (and so the process) returns once the engine has died
        assert st.call(st.server.serve_until(asyncio.Event()), timeout=60) == ENGINE_DEAD_EXIT_CODE
    finally:
        st.close(grace=0)
    for code, details in (inflight, new):
        assert code == grpc.StatusCode.UNAVAILABLE, details
        assert "speech-token engine died" in details and "injected scheduler fault" in details
    assert set(statuses.values()) == {NOT_SERVING}

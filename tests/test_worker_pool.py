"""A worker process per device (`model.placement: workers`): a real gRPC server on 127.0.0.1 whose
two device workers run the fixture model on "cpu" (the device repeats, as two GPUs would not).
Routing, speakers reaching every worker, text streams, per-worker metrics, GetServerInfo, and one
worker SIGKILLed under load: its streams UNAVAILABLE naming its device, the other's succeed,
health stays SERVING (degraded), the worker comes back, and no speaker is lost."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import urllib.request

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from websockets.asyncio.client import connect as ws_connect

from async_cosyvoice.config import Config
from async_cosyvoice.limiter import MemoryBudget
from async_cosyvoice.worker_pool import WorkerPool
from grpc_async.client import CosyVoiceClient, chunk_samples
from grpc_async.server import ServerThread

pytestmark = pytest.mark.slow

TEXT = "Hello there, this is a small test."
PROMPT_TEXT = "The morning train was late again, so I walked along the river."


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    spk = tmp_path_factory.mktemp("spk")
    cfg = Config.model_validate({
        "model": {"dir": str(tiny_dir), "devices": ["cpu", "cpu"]},  # placement: workers (the default)
        "speakers": {"dir": str(spk)},
        "server": {"port": 0, "metrics_port": 0, "http_port": 0, "grace_seconds": 5},
        "workers": {"restart_backoff_s": 0.2},
    })
    with ServerThread(cfg, ready_timeout=900) as st:
        yield st


def _metric(st: ServerThread, name: str) -> dict[str, float]:
    """index -> value of a per-device series."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{st.server.metrics_port}/metrics", timeout=10).read().decode()
    found = re.findall(rf'^{name}{{device="cpu",index="(\d)",role="worker"}} ([0-9.e+]+)$', text, re.M)
    return {index: float(value) for index, value in found}


def _scalar(st: ServerThread, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{st.server.metrics_port}/metrics", timeout=10).read().decode()
    return float(re.search(rf"^{name} ([0-9.e+]+)$", text, re.M).group(1))


async def _health(target: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        return reply.status


def test_workers_route_register_and_stream(server, golden_dir):
    st = server
    pool = st.server.synthesizer
    assert isinstance(pool, WorkerPool) and [w.state for w in pool.workers] == ["serving", "serving"]
    assert len({w.pid for w in pool.workers} | {os.getpid()}) == 3  # two processes besides the server's
    prompt = (golden_dir / "prompt_24k.wav").read_bytes()

    async def scenario():
        async with CosyVoiceClient(st.target) as client:
            await client.register_speaker("pool_voice", PROMPT_TEXT, prompt)
            served = [w.served for w in pool.workers]

            async def one() -> np.ndarray:
                chunks = [c async for c in client.synthesize(TEXT, stream=True, encoding="float32", max_tokens=40,
                                                             seed=3, mode="zero_shot_by_spk_id",
                                                             speaker_id="pool_voice")]
                assert chunks[-1].is_final
                return np.concatenate([chunk_samples(c) for c in chunks])

            audio = await asyncio.gather(*(one() for _ in range(4)))
            spread = [w.served - s for w, s in zip(pool.workers, served)]
            # a text stream (sentence mode) through a worker
            streamed = [c async for c in client.stream_synthesize(["Hello there. ", "This is streamed."],
                                                                  mode="zero_shot_by_spk_id", speaker_id="pool_voice",
                                                                  max_tokens=20, text_mode="sentence")]
            info = await client.get_server_info()
            return audio, spread, streamed, info

    audio, spread, streamed, info = st.call(scenario(), timeout=600)
    assert spread == [2, 2]  # four at once: the fewest in flight alternates
    for a in audio[1:]:  # one seed, one voice: the same tokens on either worker
        assert a.shape == audio[0].shape and np.corrcoef(a, audio[0])[0, 1] > 0.95
    assert streamed and streamed[-1].is_final and sum(len(c.audio) for c in streamed) > 0
    assert not info.degraded
    assert [(d.device, d.role, d.state) for d in info.devices] == [("cpu", "worker", "serving")] * 2
    assert all(w.active == 0 for w in pool.workers)
    assert _metric(st, "cosyvoice_device_up") == {"0": 1.0, "1": 1.0}
    assert all(v > 0 for v in _metric(st, "cosyvoice_device_memory_bytes").values())
    assert all(v > 0 for v in _metric(st, "cosyvoice_device_busy_seconds_total").values())
    # each worker's CUDA graph state, asked for at the scrape (a CPU captures none): idle workers
    # reply to the scrape's "stats" call with fresh stats (a capture goes on after a worker's last reply)
    before = [w.stats for w in pool.workers]
    assert _metric(st, "cosyvoice_device_cuda_graph_background_captures_total") == {"0": 0.0, "1": 0.0}
    assert all(w.stats is not old and w.stats.graphs is not None for w, old in zip(pool.workers, before))
    assert _scalar(st, "cosyvoice_degraded") == 0.0


def test_speaker_errors_come_back_with_their_status(server):
    async def scenario():
        async with CosyVoiceClient(server.target) as client:
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                async for _ in client.synthesize(TEXT, mode="zero_shot_by_spk_id", speaker_id="nobody"):
                    pass
            return missing.value

    error = server.call(scenario(), timeout=120)
    assert error.code() == grpc.StatusCode.NOT_FOUND and "nobody" in error.details()


def test_model_dir_speakers_through_the_workers(server, golden_dir):
    """The fixture's spk2info.pt speakers, beside the store of the front (RequestFront): the sft one
    speaks on a worker, asked for in a zero-shot mode it says to use mode sft, and the read-only
    ones refuse a registration or a deletion with their status."""
    prompt = (golden_dir / "prompt_24k.wav").read_bytes()

    async def refused(call) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call
        return error.value

    async def scenario():
        async with CosyVoiceClient(server.target) as client:
            spoken = [c async for c in client.synthesize(TEXT, mode="sft", speaker_id="tiny_sft_spk", max_tokens=20,
                                                         encoding="float32")]

            async def zero_shot_of_sft():
                async for _ in client.synthesize(TEXT, mode="zero_shot_by_spk_id", speaker_id="tiny_sft_spk"):
                    pass

            return (spoken, await refused(zero_shot_of_sft()),
                    await refused(client.register_speaker("tiny_zs_spk", PROMPT_TEXT, prompt)),
                    await refused(client.delete_speaker("tiny_zs_spk")))

    spoken, sft_hint, register, delete = server.call(scenario(), timeout=300)
    assert spoken[-1].is_final and sum(len(chunk_samples(c)) for c in spoken) > 0
    assert sft_hint.code() == grpc.StatusCode.FAILED_PRECONDITION and "use mode sft" in sft_hint.details()
    assert register.code() == grpc.StatusCode.ALREADY_EXISTS and "read-only" in register.details()
    assert delete.code() == grpc.StatusCode.FAILED_PRECONDITION and "read-only" in delete.details()
    assert all(w.active == 0 for w in server.server.synthesizer.workers)


def test_bad_stream_input_and_bistream_through_a_worker(server, golden_dir):
    prompt = (golden_dir / "prompt_24k.wav").read_bytes()

    async def scenario():
        async with CosyVoiceClient(server.target) as client:
            with pytest.raises(grpc.aio.AioRpcError) as bad:  # refused by the worker's Synthesizer
                async for _ in client.stream_synthesize(["Hello."], mode="sft", speaker_id="nobody",
                                                        text_mode="sentence", text_normalization="raw"):
                    pass
            info = await client.get_server_info()
            chunks = []
            if info.bistream:  # one LM request fed the pieces as they arrive, in the worker
                chunks = [c async for c in client.stream_synthesize(["Hello there, ", "this is bistream."],
                                                                    max_tokens=20, text_mode="bistream",
                                                                    mode="cross_lingual",
                                                                    prompt_audio=prompt)]
            return bad.value, info, chunks

    bad, info, chunks = server.call(scenario(), timeout=300)
    assert bad.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), bad
    assert not info.bistream or (chunks and chunks[-1].is_final)
    assert all(w.active == 0 for w in server.server.synthesizer.workers)


def test_the_http_door_through_the_workers(server, golden_dir):
    """The same pool behind the HTTP door: a voice registered there reaches both workers, speech
    on both, a text stream over the WebSocket, and bad input refused with its status."""
    pool = server.server.synthesizer
    base = f"http://127.0.0.1:{server.server.http_port}"
    wav = (golden_dir / "prompt_16k.wav").read_bytes()
    r = httpx.post(base + "/v1/audio/voices", data={"id": "http_pool_voice", "transcript": PROMPT_TEXT},
                   files={"audio": ("p.wav", wav, "audio/wav")}, timeout=300)
    assert r.status_code == 201, r.text
    served = [w.served for w in pool.workers]

    async def speech():
        async with httpx.AsyncClient(base_url=base, timeout=300) as http:
            body = {"model": "tts-1", "input": TEXT, "voice": "http_pool_voice", "response_format": "pcm"}
            return await asyncio.gather(*(http.post("/v1/audio/speech", json=body) for _ in range(2)))

    replies = server.call(speech(), timeout=300)
    assert [r.status_code for r in replies] == [200, 200] and all(len(r.content) > 0 for r in replies)
    assert [w.served - n for w, n in zip(pool.workers, served)] == [1, 1]  # one each: both had the voice
    missing = httpx.post(base + "/v1/audio/speech", json={"model": "tts-1", "input": TEXT, "voice": "nobody"},
                         timeout=60)
    assert missing.status_code == 404 and "nobody" in missing.text

    async def websocket():
        messages = [{"type": "config", "voice": "http_pool_voice", "format": "pcm", "options": {"seed": 2}},
                    {"type": "text", "text": "Hello "}, {"type": "text", "text": "there."}, {"type": "end"}]
        url = f"ws://127.0.0.1:{server.server.http_port}/v1/audio/speech/stream"
        async with ws_connect(url, max_size=1 << 24) as ws:
            for m in messages:
                await ws.send(json.dumps(m))
            return [json.loads(frame) async for frame in ws]

    received = server.call(websocket(), timeout=300)
    kinds = [m["type"] for m in received]
    assert kinds[0] == "ready" and kinds[-1] == "done" and "audio" in kinds, kinds
    assert all(w.active == 0 for w in pool.workers)


def test_a_cancelled_request_is_aborted_in_its_worker(server, golden_dir):
    """The client leaves after the first chunk of a long request: the worker aborts its LLM request,
    so at the end of a next request on the same worker only that one is (or was) running there."""
    pool = server.server.synthesizer
    prompt = (golden_dir / "prompt_24k.wav").read_bytes()

    async def scenario():
        async with CosyVoiceClient(server.target) as client:
            served = [w.served for w in pool.workers]
            async for _ in client.synthesize(TEXT, stream=True, max_tokens=2000, mode="cross_lingual",
                                             prompt_audio=prompt):
                break  # leaving the loop cancels the RPC
            (first,) = [w for w, n in zip(pool.workers, served) if w.served > n]
            while True:  # the next request that lands on the same worker (at most a few: least loaded)
                served = first.served
                running = [first.stats.engine.running async for _ in client.synthesize(
                    TEXT, stream=True, max_tokens=20, mode="cross_lingual", prompt_audio=prompt)]
                if first.served > served:
                    return running

    running = server.call(scenario(), timeout=300)
    # not aborted, the 2000-token request would still be generating at the other's last chunk
    assert running and running[-1] <= 1, running
    assert all(w.active == 0 for w in pool.workers)


def test_the_front_admits_each_request_once_before_a_worker(server):
    """The memory budget (limits, cost.py) lives in the front: a request over max_request_bytes is
    refused (RESOURCE_EXHAUSTED) and one that finds the budget full is shed, neither reaching a
    worker; a running request holds its bound there once, released when it ends."""
    pool = server.server.synthesizer
    workers_default = pool.front.budget.max_request
    assert workers_default is not None and workers_default > 2**20  # the workers' device memory (no config)

    async def refused(**kwargs) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async with CosyVoiceClient(server.target) as client:
                async for _ in client.synthesize(TEXT, mode="sft", speaker_id="tiny_sft_spk", **kwargs):
                    pass
        return error.value

    async def scenario():
        served = [w.served for w in pool.workers]
        pool.front.budget = MemoryBudget(max_request=1, capacity=None, wait_seconds=0)
        too_large = await refused(max_tokens=20)
        unserved = [w.served for w in pool.workers] == served
        pool.front.budget = budget = MemoryBudget(max_request=None, capacity=2**40, wait_seconds=0)
        async with CosyVoiceClient(server.target) as client:
            chunks = client.synthesize(TEXT, mode="sft", speaker_id="tiny_sft_spk", max_tokens=40, stream=True)
            await anext(chunks)
            held = budget.used  # one request running: its bound, counted once
            budget.capacity = held  # full: the next one is shed at once (wait_seconds 0)
            served = [w.served for w in pool.workers]
            shed = await refused(max_tokens=40, stream=True)
            shed_unserved = [w.served for w in pool.workers] == served
            async for _ in chunks:
                pass
        return too_large, unserved, held, shed, shed_unserved, budget.used

    try:
        too_large, unserved, held, shed, shed_unserved, left = server.call(scenario(), timeout=300)
    finally:
        pool.front.budget = MemoryBudget(workers_default, None, 10.0)
    assert too_large.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limits.max_request_bytes" in too_large.details()
    assert unserved and shed_unserved
    assert held > 0 and left == 0
    assert shed.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limits.memory_budget_bytes" in shed.details()


def test_a_killed_worker_fails_its_streams_and_comes_back(server, golden_dir):
    st = server
    pool = st.server.synthesizer
    victim = pool.workers[0]
    prompt = (golden_dir / "prompt_24k.wav").read_bytes()

    async def scenario():
        async with CosyVoiceClient(st.target) as client:
            await client.register_speaker("kept_voice", PROMPT_TEXT, prompt, overwrite=True)
            started = [asyncio.Event() for _ in range(4)]

            async def one(i: int) -> tuple[int, str, str]:
                try:
                    async for _ in client.synthesize(TEXT, stream=True, max_tokens=150, mode="zero_shot_by_spk_id",
                                                     speaker_id="kept_voice"):
                        started[i].set()
                    return i, "OK", ""
                except grpc.aio.AioRpcError as e:
                    return i, e.code().name, e.details() or ""
                finally:
                    started[i].set()

            tasks = [asyncio.create_task(one(i)) for i in range(4)]
            await asyncio.gather(*(e.wait() for e in started))
            on_victim = victim.active
            os.kill(victim.pid, signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            health = await _health(st.target)
            info = await client.get_server_info()
            return on_victim, results, health, info

    on_victim, results, health, info = st.call(scenario(), timeout=600)
    codes = [code for _, code, _ in results]
    assert on_victim == 2 and codes.count("OK") == 2 and codes.count("UNAVAILABLE") == 2, results
    for _, code, details in results:
        if code == "UNAVAILABLE":
            assert "worker process on cpu (worker 0) died" in details and "signal 9" in details
    assert health == health_pb2.HealthCheckResponse.SERVING
    assert info.degraded and info.devices[0].state in ("restarting", "serving")

    st.call(asyncio.wait_for(victim.wait_serving(), 300), timeout=310)
    assert victim.restarts == 1 and pool.workers[1].restarts == 0
    assert _metric(st, "cosyvoice_device_restarts_total") == {"0": 1.0, "1": 0.0}

    async def after():  # the speaker registered before the death is served by both workers
        async with CosyVoiceClient(st.target) as client:
            async def one():
                return [c async for c in client.synthesize(TEXT, max_tokens=20, mode="zero_shot_by_spk_id",
                                                           speaker_id="kept_voice")]
            done = await asyncio.gather(*(one() for _ in range(2)))
            return done, await client.get_server_info()

    served = [w.served for w in pool.workers]
    done, info = st.call(after(), timeout=300)
    assert all(chunks[-1].is_final for chunks in done)
    assert [w.served - s for w, s in zip(pool.workers, served)] == [1, 1]
    assert not info.degraded and _scalar(st, "cosyvoice_degraded") == 0.0

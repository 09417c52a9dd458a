"""Bounded memory and time per request (issue 26 items 1, 2, 4, 8, 9) on every front door, against a
real server (gRPC + HTTP + WebSocket on 127.0.0.1, tiny fixture model) with real, slow clients."""
from __future__ import annotations

import asyncio
import io
import json
import socket
import time

import grpc
import httpx
import numpy as np
import pytest
import soundfile as sf
import torch
from websockets.asyncio.client import connect as ws_connect

from async_cosyvoice.config import Config
from async_cosyvoice.cost import utterance_bytes
from async_cosyvoice.errors import Overloaded, TooLarge
from async_cosyvoice.frontend import audio as A
from async_cosyvoice.limiter import MemoryBudget
from async_cosyvoice.model_dir import load_model_dir
from async_cosyvoice.request import SEED_MAX, derived_seed
from async_cosyvoice.speakers import SpeakerStore
from grpc_async._stubs import load as load_stubs
from grpc_async.server import ServerThread

pb2, pb2_grpc = load_stubs()

PROMPT_TEXT = "The morning train was late again."
FIRST_MESSAGE = 1.5   # limits.first_message_seconds
BODY_READ = 1.5       # limits.body_read_seconds
IDLE = 2.0            # limits.idle_connection_seconds
MAX_TEXT, MAX_STREAM_TEXT = 600, 1500
FORCED_OK, FORCED_TOO_MANY = 40, 3000


@pytest.fixture(scope="module")
def max_request_bytes(tiny_dir) -> int:
    """Between the bound of FORCED_OK tokens and that of FORCED_TOO_MANY (cost.py)."""
    dims = load_model_dir(tiny_dir).dims
    return utterance_bytes(dims, 100, 1500, torch.float32)


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory, max_request_bytes):
    spk_dir = tmp_path_factory.mktemp("spk-bounds")
    SpeakerStore(spk_dir).import_spk2info(tiny_dir / "spk2info.pt")
    cfg = Config.model_validate({
        "model": {"dir": str(tiny_dir)}, "speakers": {"dir": str(spk_dir)},
        "engine": {"max_model_len": 1024},
        "server": {"port": 0, "http_port": 0, "grace_seconds": 2},
        "limits": {"max_concurrent_streams": 6, "max_text_chars": MAX_TEXT, "max_stream_text_chars": MAX_STREAM_TEXT,
                   "first_message_seconds": FIRST_MESSAGE, "body_read_seconds": BODY_READ,
                   "idle_connection_seconds": IDLE, "text_idle_seconds": 5.0, "max_prompt_seconds": 10.0,
                   "max_request_bytes": max_request_bytes}})
    st = ServerThread(cfg, ready_timeout=900)
    st.base = f"http://127.0.0.1:{st.server.http_port}"
    st.ws = f"ws://127.0.0.1:{st.server.http_port}/v1/audio/speech/stream"
    yield st
    st.close(grace=1)


def grpc_call(server, fn):
    async def body():
        async with grpc.aio.insecure_channel(server.target) as channel:
            return await fn(pb2_grpc.CosyVoiceStub(channel))
    return asyncio.run(body())


async def drain(call) -> list:
    return [chunk async for chunk in call]


def grpc_error(server, fn) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        grpc_call(server, fn)
    return info.value


async def ws_session(url: str, messages: list) -> tuple[list[dict], int | None, str]:
    received = []
    async with ws_connect(url, max_size=1 << 24) as ws:
        for m in messages:
            await ws.send(json.dumps(m))
        try:
            async for frame in ws:
                received.append(json.loads(frame))
        except Exception:
            pass
        return received, ws.close_code, ws.close_reason


def wav(rate: int, seconds: float = 2.0) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    x = (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


# =============================================================================================
# 1. Odd prompt sample rates: bounded memory and time, absurd rates refused


def test_resampling_odd_rates_is_bounded_and_close_to_the_exact_kernel():
    for rate in (16004, 16001, 48001, 191999):
        for target in (16000, 24000):
            g = np.gcd(rate, target)
            assert A.exact_kernel_elements(rate // g, target // g) > A.MAX_EXACT_KERNEL_ELEMENTS  # soxr's
            x = (0.5 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)).astype(np.float32)
            y = A.resample(x, rate, target)
            assert y.dtype == np.float32 and len(y) == -(-len(x) * target // rate)
            ref = 0.5 * np.sin(2 * np.pi * 440 * np.arange(len(y)) / target)
            inner = slice(target // 20, -target // 20)
            assert np.abs(y[inner] - ref[inner]).max() < 2e-3, (rate, target)
    # every usual rate keeps the exact (torchaudio-identical) kernel, and the cache holds few bytes
    for rate in (8000, 11025, 12000, 22050, 32000, 44100, 48000, 88200, 96000, 176400, 192000):
        for target in (16000, 24000):
            g = np.gcd(rate, target)
            assert A.exact_kernel_elements(rate // g, target // g) <= A.MAX_EXACT_KERNEL_ELEMENTS, (rate, target)
    assert A._sinc_kernel.cache_info().maxsize * 4 * A.MAX_EXACT_KERNEL_ELEMENTS <= A.KERNEL_CACHE_BYTES


def test_odd_and_absurd_prompt_rates_on_grpc(server):
    async def register(stub, data):
        return await stub.RegisterSpeaker(pb2.RegisterSpeakerRequest(
            speaker_id="odd_rate", prompt_text=PROMPT_TEXT, prompt_audio=pb2.AudioData(file=data), overwrite=True))
    t0 = time.monotonic()
    speaker = grpc_call(server, lambda stub: register(stub, wav(16001)))  # was a > 6 GB kernel
    assert speaker.speaker_id == "odd_rate" and speaker.prompt_speech_tokens > 0

    pcm = pb2.RawPcm(data=np.zeros(32000, "<i2").tobytes(), encoding=pb2.PCM_ENCODING_S16LE, sample_rate=4294967295)
    err = grpc_error(server, lambda stub: drain(stub.Synthesize(pb2.SynthesizeRequest(
        text="Hi.", zero_shot=pb2.ZeroShot(prompt_audio=pb2.AudioData(pcm=pcm), prompt_text=PROMPT_TEXT)))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 192000 Hz" in err.details(), err.details()
    err = grpc_error(server, lambda stub: stub.RegisterSpeaker(pb2.RegisterSpeakerRequest(
        speaker_id="absurd", prompt_text=PROMPT_TEXT, prompt_audio=pb2.AudioData(pcm=pcm))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 192000 Hz" in err.details()
    assert time.monotonic() - t0 < 60  # was INTERNAL after 57 s for the absurd rate alone


def test_odd_and_absurd_prompt_rates_on_http(server):
    with httpx.Client(base_url=server.base, timeout=120) as http:
        form = {"id": "odd_rate_http", "transcript": PROMPT_TEXT, "overwrite": "true"}
        r = http.post("/v1/audio/voices", data=form, files={"audio": ("p.wav", wav(48001), "audio/wav")})
        assert r.status_code == 201, r.text
        r = http.post("/v1/audio/voices", data={**form, "id": "absurd_http"},
                      files={"audio": ("p.wav", wav(400000, 0.5), "audio/wav")})
        assert r.status_code == 400 and "at most 192000 Hz" in r.json()["error"]["message"], r.text


# =============================================================================================
# 2. A cost bound before a request runs: refused over limits.max_request_bytes, waits or sheds


def test_server_info_reports_the_new_limits(server, max_request_bytes):
    limits = grpc_call(server, lambda stub: stub.GetServerInfo(pb2.GetServerInfoRequest())).limits
    assert (limits.max_stream_text_chars, limits.first_message_seconds, limits.max_request_bytes) == (
        MAX_STREAM_TEXT, FIRST_MESSAGE, max_request_bytes)


def test_request_over_the_memory_bound_is_refused_before_it_runs_grpc(server):
    def options(n):
        return pb2.SynthesisOptions(stream=True, seed=1, max_tokens=n)
    err = grpc_error(server, lambda stub: drain(stub.Synthesize(pb2.SynthesizeRequest(
        text="Hi.", sft=pb2.Sft(speaker_id="tiny_sft_spk"), options=options(FORCED_TOO_MANY)))))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limits.max_request_bytes" in err.details()

    async def stream(stub, n, refused=False):
        async def messages():
            yield pb2.StreamSynthesizeRequest(config=pb2.StreamConfig(sft=pb2.Sft(speaker_id="tiny_sft_spk"),
                                                                      options=options(n)))
            if refused:  # the server answers the config alone; a write racing its status fails in the client
                await asyncio.Event().wait()
            yield pb2.StreamSynthesizeRequest(text="Hi.")
            yield pb2.StreamSynthesizeRequest(end=pb2.StreamEnd())
        return await drain(stub.StreamSynthesize(messages()))
    err = grpc_error(server, lambda stub: stream(stub, FORCED_TOO_MANY, refused=True))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limits.max_request_bytes" in err.details()
    chunks = grpc_call(server, lambda stub: stream(stub, FORCED_OK))  # within the bound: runs
    assert chunks[-1].is_final and sum(c.num_samples for c in chunks) > 0


def test_request_over_the_memory_bound_is_refused_before_it_runs_http(server):
    # non-streamed (speed != 1): up to offline_segments_ahead segments render at once, each bounded
    # by 20 speech tokens per text token and max_model_len: a text of two segments is over the limit
    text = " ".join(["The quick brown fox jumps over the lazy dog again."] * 12)[:MAX_TEXT]
    with httpx.Client(base_url=server.base, timeout=120) as http:
        r = http.post("/v1/audio/speech", json={"model": "tts-1", "input": text, "voice": "tiny_sft_spk",
                                                "speed": 0.9, "response_format": "pcm"})
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert error["code"] == "request_too_large" and "limits.max_request_bytes" in error["message"]


def test_memory_budget_waits_then_sheds_and_never_oversubscribes():
    async def body():
        budget = MemoryBudget(max_request=100, capacity=150, wait_seconds=0.3)
        with pytest.raises(TooLarge, match="limits.max_request_bytes"):
            async with budget.reserve(101):
                pass
        order = []
        async with budget.reserve(100):
            async def second():
                async with budget.reserve(80):
                    order.append(("second", budget.used))
            task = asyncio.create_task(second())
            await asyncio.sleep(0.05)
            assert budget.used == 100 and not order  # waiting: 100 + 80 > 150
        await task  # admitted once the first ended
        assert order == [("second", 80)] and budget.used == 0
        async with budget.reserve(100):
            with pytest.raises(Overloaded, match="limits.admission_wait_seconds"):
                async with budget.reserve(100):
                    pass
        assert budget.used == 0
    asyncio.run(body())


# =============================================================================================
# 4. Seeds: 0..2^64-1 on every door, one rule, refused beyond


def test_seed_fold_is_the_old_value_below_the_old_overflow():
    assert derived_seed(12345, 1000, 3) == 12345 * 1000 + 3
    assert derived_seed(SEED_MAX, 1000, 7) == (SEED_MAX * 1000 + 7) % 2**64
    torch.Generator().manual_seed(derived_seed(SEED_MAX, 1000, 7))  # in a generator's range


def test_huge_seeds_on_every_door(server):
    seed = SEED_MAX - 5  # > 1.8e16: overflowed `seed * 1000 + segment` (HTTP 500 / WS 4500)
    chunks = grpc_call(server, lambda stub: drain(stub.Synthesize(pb2.SynthesizeRequest(
        text="Hi.", sft=pb2.Sft(speaker_id="tiny_sft_spk"),
        options=pb2.SynthesisOptions(stream=True, seed=seed, max_tokens=FORCED_OK)))))
    assert chunks[-1].is_final and sum(c.num_samples for c in chunks) > 0
    with httpx.Client(base_url=server.base, timeout=120) as http:
        body = {"model": "tts-1", "input": "Hi.", "voice": "tiny_sft_spk", "response_format": "pcm"}
        same = [http.post("/v1/audio/speech", json={**body, "seed": seed}) for _ in range(2)]
        assert [r.status_code for r in same] == [200, 200]
        # the seed holds: the same tokens, so the same audio, up to a few LSB where the adaptive hop
        # (it follows the listener's buffer, so the machine's load) cut the chunks elsewhere
        a, b = (np.frombuffer(r.content, np.int16).astype(np.int32) for r in same)
        assert a.size == b.size > 0 and np.abs(a - b).max() <= 16
        r = http.post("/v1/audio/speech", json={**body, "seed": 2**64})
        assert r.status_code == 400 and "seed must be an integer in 0..18446744073709551615" in r.text
        r = http.post("/v1/audio/speech", json={**body, "seed": -1})
        assert r.status_code == 400 and "seed must be an integer in 0.." in r.text
    config = {"type": "config", "voice": "tiny_sft_spk", "options": {"seed": seed}}
    received, code, _ = asyncio.run(ws_session(server.ws, [config, {"type": "text", "text": "Hi."},
                                                           {"type": "end"}]))
    assert code == 1000 and received[-1]["type"] == "done", received[-1]
    received, code, _ = asyncio.run(ws_session(server.ws, [{**config, "options": {"seed": 2**64}},
                                                           {"type": "text", "text": "Hi."}]))
    assert code == 4400 and "seed must be an integer in 0.." in received[-1]["message"]


# =============================================================================================
# 8. Text streams: each piece <= max_text_chars, the stream <= max_stream_text_chars, every door


def _grpc_stream(server, pieces: list[str]):
    async def call(stub):
        async def messages():
            yield pb2.StreamSynthesizeRequest(config=pb2.StreamConfig(
                sft=pb2.Sft(speaker_id="tiny_sft_spk"), options=pb2.SynthesisOptions(stream=True, seed=1),
                text_mode=pb2.TEXT_MODE_SENTENCE))
            for piece in pieces:
                yield pb2.StreamSynthesizeRequest(text=piece)
            yield pb2.StreamSynthesizeRequest(end=pb2.StreamEnd())
        return await drain(stub.StreamSynthesize(messages()))
    return grpc_error(server, call)


def test_stream_text_limits_grpc(server):
    err = _grpc_stream(server, ["x" * (MAX_TEXT + 1)])  # was unbounded (a 1 MB piece ran > 120 s)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "limits.max_text_chars" in err.details()
    err = _grpc_stream(server, [" " * MAX_TEXT] * 3)  # 1800 characters in all (spaces: nothing to synthesize)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "limits.max_stream_text_chars" in err.details()


def test_stream_text_limits_websocket(server):
    config = {"type": "config", "voice": "tiny_sft_spk", "text_mode": "sentence"}
    received, code, _ = asyncio.run(ws_session(server.ws, [config, {"type": "text", "text": "x" * (MAX_TEXT + 1)}]))
    assert code == 4400 and "limits.max_text_chars" in received[-1]["message"]
    pieces = [{"type": "text", "text": " " * MAX_TEXT}] * 3
    received, code, _ = asyncio.run(ws_session(server.ws, [config, *pieces]))
    assert code == 4400 and "limits.max_stream_text_chars" in received[-1]["message"], received[-1]


# =============================================================================================
# 9. Slow clients: config, request head and body within their limits; idle connections closed


def test_stream_synthesize_without_config_ends_with_deadline_exceeded(server):
    async def call(stub):
        never = asyncio.Event()

        async def messages():  # opens the call and sends nothing
            await never.wait()
            yield pb2.StreamSynthesizeRequest()
        return await drain(stub.StreamSynthesize(messages()))
    t0 = time.monotonic()
    err = grpc_error(server, call)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "limits.first_message_seconds" in err.details()
    assert FIRST_MESSAGE <= time.monotonic() - t0 < FIRST_MESSAGE + 10


def test_websocket_without_config_is_closed_with_a_reason(server):
    async def body():
        t0 = time.monotonic()
        async with ws_connect(server.ws) as ws:
            error = json.loads(await ws.recv())
            await ws.wait_closed()
            return error, ws.close_code, ws.close_reason, time.monotonic() - t0
    error, code, reason, waited = asyncio.run(body())
    assert error["type"] == "error" and "limits.first_message_seconds" in error["message"]
    assert code == 4408 and reason == "timeout" and FIRST_MESSAGE <= waited < FIRST_MESSAGE + 10


def _raw(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.server.http_port), timeout=30)
    return s


def _read_all(s: socket.socket) -> tuple[bytes, float]:
    """Everything until the server closes the socket, and how long that took."""
    t0, data = time.monotonic(), b""
    while chunk := s.recv(65536):
        data += chunk
    return data, time.monotonic() - t0


def test_http_body_shorter_than_its_content_length_gets_408(server):
    with _raw(server) as s:
        body = b'{"model": "tts-1", "input": "Hi.", "voice": "tiny_sft_spk"}'
        s.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % (len(body) + 100) + body)
        data, waited = _read_all(s)
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b"limits.body_read_seconds" in data and BODY_READ <= waited < BODY_READ + 10


@pytest.mark.parametrize("sent", [b"", b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n"])
def test_http_connection_without_a_complete_request_head_is_closed(server, sent):
    with _raw(server) as s:
        s.sendall(sent)
        data, waited = _read_all(s)
    assert data == b"" and FIRST_MESSAGE <= waited < FIRST_MESSAGE + 10


def test_idle_connections_are_closed(server):
    with _raw(server) as s:  # HTTP keep-alive after a response
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        data, waited = _read_all(s)
    assert data.startswith(b"HTTP/1.1 200") and waited < IDLE + 10

    async def grpc_idle():
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb2_grpc.CosyVoiceStub(channel)
            await stub.GetServerInfo(pb2.GetServerInfoRequest())
            assert channel.get_state() == grpc.ChannelConnectivity.READY
            t0 = time.monotonic()  # the server sends GOAWAY after limits.idle_connection_seconds (and jitter)
            await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), IDLE + 10)
            assert time.monotonic() - t0 >= IDLE * 0.8  # grpc's idle timer has a +-20% jitter
            return channel.get_state()
    assert asyncio.run(grpc_idle()) == grpc.ChannelConnectivity.IDLE

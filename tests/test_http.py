"""The HTTP front door against a real server on 127.0.0.1 (tiny fixture model), with real clients:
the official `openai` SDK, httpx, the `websockets` client and headless Chromium.

One server per module (gRPC + HTTP in one loop, bearer token on both, aliases `alloy` ->
tiny_zs_spk). Each response format is decoded back with PyAV and its duration compared with the
PCM of the same seed; every output format of every door round-trips (read back by libsndfile
where it knows the format, PyAV otherwise, and registered back as a voice's prompt).
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import re
import shutil
import threading
import time

import av
import grpc
import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
import websockets
from websockets.asyncio.client import connect as ws_connect

from cosyvoice_cli.cli import build_parser, serve_config
from async_cosyvoice.config import Config
from async_cosyvoice.speakers import SpeakerStore
from grpc_async.client import ENCODINGS, CosyVoiceClient, collect, pb2
from http_api.audio import OPENAI_FORMATS, STREAM_FORMATS
from grpc_async.server import ServerThread

TOKEN = "http-s3cret"
TEXT = "Hi there."  # the random-weight model speaks to its length limit: keep it short
PROMPT_TEXT = "The morning train was late again, so I walked along the river."
RATE = 24000
CHUNK_SLACK = 15 * 960  # "within one chunk": a first chunk of the default hop (15 tokens) at 24 kHz
LIMIT = 6
TEXT_IDLE = 4.0  # limits.text_idle_seconds


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    spk_dir = tmp_path_factory.mktemp("spk")
    SpeakerStore(spk_dir).import_spk2info(tiny_dir / "spk2info.pt")  # tiny_zs_spk, tiny_sft_spk
    cfg = Config.model_validate({
        "model": {"dir": str(tiny_dir)},
        "speakers": {"dir": str(spk_dir)},
        "server": {"port": 0, "http_port": 0, "metrics_port": 0, "grace_seconds": 2, "auth_token": TOKEN,
                   "voice_aliases": {"alloy": "tiny_zs_spk", "echo": "tiny_sft_spk"}},
        "limits": {"max_concurrent_streams": LIMIT, "max_text_chars": 300, "max_prompt_seconds": 10.0,
                   "max_message_bytes": 2 * 1024 * 1024, "text_idle_seconds": TEXT_IDLE},
    })
    st = ServerThread(cfg, ready_timeout=900)
    st.base = f"http://127.0.0.1:{st.server.http_port}"
    st.ws = f"ws://127.0.0.1:{st.server.http_port}/v1/audio/speech/stream"
    yield st
    st.close(grace=1)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=TOKEN, timeout=120, max_retries=0)


def wait_idle(st: ServerThread, timeout: float = 30.0) -> None:
    """No stream slot held and no engine request running (a cancelled request was aborted)."""
    async def busy():
        return st.server.servicer.limiter.active, st.server.synthesizer.engine_stats().running
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if st.call(busy(), timeout=10) == (0, 0):
            return
        time.sleep(0.05)
    raise AssertionError(f"still busy after {timeout} s: (slots, engine requests) = {st.call(busy(), timeout=10)}")


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """Any response format -> mono float samples and their rate (pcm: OpenAI's 24 kHz s16le)."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768, RATE
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(stream)]
        return np.concatenate(frames).astype(np.float32), stream.rate


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def test_cli_serve_ports():
    config = serve_config(build_parser().parse_args(["serve", "--http-port", "8080"]))
    assert config.server.http_port == 8080 and config.server.port == 50051
    config = serve_config(build_parser().parse_args(["serve", "--http-port", "0", "--port", "-1"]))
    assert config.server.http_port == 0 and config.server.port is None  # HTTP only
    assert serve_config(build_parser().parse_args(["serve"])).server.http_port is None  # off by default


# ---------------------------------------------------------------------------------------------
# HTTP only (gRPC off), model never ready: no model load needed


async def _never_ready(config):
    await asyncio.Event().wait()


def test_http_only_server_while_loading(tmp_path):
    cfg = Config.model_validate({"server": {"port": None, "http_port": 0, "grace_seconds": 0},
                                 "speakers": {"dir": str(tmp_path)}})
    st = ServerThread(cfg, ready_timeout=None, synthesizer_factory=_never_ready)
    try:
        assert st.port is None and st.server.http_port  # no gRPC port was bound
        base = f"http://127.0.0.1:{st.server.http_port}"
        assert httpx.get(base + "/healthz").status_code == 200
        ready = httpx.get(base + "/readyz")
        assert ready.status_code == 503 and error_of(ready)["code"] == "unavailable"
        r = httpx.post(base + "/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": "alloy"})
        assert r.status_code == 503 and "warming up" in error_of(r)["message"]
        assert httpx.get(base + "/").headers["content-type"].startswith("text/html")
    finally:
        st.close(grace=0)
    with pytest.raises(httpx.ConnectError):  # stopped: the port is closed
        httpx.get(base + "/healthz")


# ---------------------------------------------------------------------------------------------
# REST: health, models, voices, auth


def test_health_models_voices_and_auth(server, http):
    assert httpx.get(server.base + "/healthz").json() == {"status": "ok"}
    assert httpx.get(server.base + "/readyz").json() == {"status": "ready"}  # no token needed
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["cosyvoice2"]
    voices = {v["id"]: v for v in http.get("/v1/audio/voices").json()["data"]}
    assert voices["tiny_zs_spk"]["kind"] == "zero_shot" and voices["tiny_zs_spk"]["aliases"] == ["alloy"]
    assert voices["tiny_sft_spk"]["kind"] == "sft"

    no_token = httpx.get(server.base + "/v1/audio/voices")
    assert no_token.status_code == 401 and error_of(no_token)["code"] == "invalid_api_key"
    assert "Bearer" in error_of(no_token)["message"]
    wrong = httpx.post(server.base + "/v1/audio/speech", headers={"Authorization": "Bearer nope"},
                       json={"model": "tts-1", "input": "Hi.", "voice": "alloy"})
    assert wrong.status_code == 401 and error_of(wrong)["message"] == "invalid bearer token"

    async def grpc_with(token):  # the same token guards the gRPC front door
        async with CosyVoiceClient(server.target, token=token) as c:
            return await c.list_speakers()
    assert len(server.call(grpc_with(TOKEN), timeout=30).speakers) >= 2
    with pytest.raises(grpc.aio.AioRpcError) as e:
        server.call(grpc_with("nope"), timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_register_list_and_delete_voice(http, golden_dir):
    wav = (golden_dir / "prompt_16k.wav").read_bytes()
    form = {"id": "http_voice", "transcript": PROMPT_TEXT}
    r = http.post("/v1/audio/voices", data=form, files={"audio": ("p.wav", wav, "audio/wav")})
    assert r.status_code == 201, r.text
    assert r.json()["id"] == "http_voice" and r.json()["kind"] == "zero_shot" and r.json()["prompt_seconds"] > 1
    assert "http_voice" in [v["id"] for v in http.get("/v1/audio/voices").json()["data"]]

    again = http.post("/v1/audio/voices", data=form, files={"audio": ("p.wav", wav, "audio/wav")})
    assert again.status_code == 409 and error_of(again)["code"] == "voice_exists"
    garbage = http.post("/v1/audio/voices", data={"id": "bad_voice", "transcript": "x"},
                        files={"audio": ("p.wav", b"not audio at all", "audio/wav")})
    assert garbage.status_code == 400 and error_of(garbage)["message"].startswith("audio:")
    bad_id = http.post("/v1/audio/voices", data={"id": "../etc", "transcript": "x"},
                       files={"audio": ("p.wav", wav, "audio/wav")})
    assert bad_id.status_code == 400 and "'/'" in error_of(bad_id)["message"]
    missing = http.post("/v1/audio/voices", data={"id": "no_audio", "transcript": "x"})
    assert missing.status_code == 400 and error_of(missing)["param"] == "audio"

    assert http.delete("/v1/audio/voices/http_voice").json()["deleted"] is True
    gone = http.delete("/v1/audio/voices/http_voice")
    assert gone.status_code == 404 and error_of(gone)["code"] == "voice_not_found"


# ---------------------------------------------------------------------------------------------
# POST /v1/audio/speech


@pytest.fixture(scope="module")
def reference_pcm(client) -> np.ndarray:
    """PCM of TEXT with seed 7: the length every other format must match."""
    data = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="pcm",
                                      extra_body={"seed": 7}).content
    samples, _ = decode(data, "pcm")
    assert len(samples) > RATE // 2
    return samples


def test_openai_sdk_streaming_response(server, client, reference_pcm):
    t0 = time.perf_counter()
    with client.audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice={"id": "tiny_zs_spk"}, input=TEXT, response_format="pcm",
            extra_body={"seed": 7}) as response:
        assert response.headers["content-type"] == "audio/pcm"
        assert response.headers["transfer-encoding"] == "chunked"
        pieces = list(response.iter_bytes())
    assert len(pieces) > 1  # streamed, not one body
    samples, _ = decode(b"".join(pieces), "pcm")
    assert len(samples) == len(reference_pcm)  # same seed, same tokens, same length
    assert time.perf_counter() - t0 < 120


@pytest.mark.parametrize("fmt", ["wav", "mp3", "opus", "aac", "flac"])
def test_every_response_format_decodes(client, reference_pcm, fmt, request):
    data = client.audio.speech.create(model="cosyvoice2", voice="alloy", input=TEXT, response_format=fmt,
                                      extra_body={"seed": 7}).content
    samples, rate = decode(data, fmt)
    assert rate == (48000 if fmt == "opus" else RATE)  # Opus decoders always give 48 kHz
    n = len(samples) * RATE / rate
    assert abs(n - len(reference_pcm)) <= CHUNK_SLACK, (fmt, n, len(reference_pcm))
    assert np.abs(samples).max() > 1e-3  # not silence


# ---- every output format round-trips: read back as a user would, and accepted back as prompt audio

LIBSNDFILE_READS = ("wav", "flac", "opus", "mp3")  # libsndfile 1.2.2 has no AAC and no WebM
CODEC_SLACK = {"mp3": 3 * 1152, "aac": 3 * 1024}   # encoder priming (no end trim in these streams)


def read_like_a_user(data: bytes, fmt: str, rate: int = RATE) -> tuple[np.ndarray, int]:
    """python-soundfile (libsndfile) where it knows the format, numpy for raw PCM, PyAV otherwise."""
    if fmt in LIBSNDFILE_READS:
        return sf.read(io.BytesIO(data), dtype="float32")
    if fmt in ("pcm", "pcm16", "f32", "float32"):
        return (np.frombuffer(data, "<i2").astype(np.float32) / 32768 if fmt in ("pcm", "pcm16")
                else np.frombuffer(data, "<f4")), rate
    return decode(data, fmt)


def check_length(fmt: str, got: int, want: int) -> None:
    assert want <= got <= want + CODEC_SLACK.get(fmt, 0), (fmt, got, want)


def raw_pcm(data: bytes, fmt: str, rate: int = RATE) -> pb2.AudioData:
    encoding = pb2.PCM_ENCODING_S16LE if fmt in ("pcm", "pcm16") else pb2.PCM_ENCODING_F32LE
    return pb2.AudioData(pcm=pb2.RawPcm(data=data, encoding=encoding, sample_rate=rate, channels=1))


def register_back(server, http, speaker_id: str, data: bytes, fmt: str) -> None:
    """The server's own output as a new voice's prompt: files over HTTP, raw PCM over gRPC."""
    if fmt in ("pcm", "pcm16", "f32", "float32"):
        async def body():
            async with CosyVoiceClient(server.target, token=TOKEN) as c:
                await c.register_speaker(speaker_id, PROMPT_TEXT, raw_pcm(data, fmt))
        asyncio.run(body())
    else:
        r = http.post("/v1/audio/voices", data={"id": speaker_id, "transcript": PROMPT_TEXT},
                      files={"audio": (f"prompt.{fmt}", data)})
        assert r.status_code == 201, r.text
    assert http.delete(f"/v1/audio/voices/{speaker_id}").status_code == 200


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize("fmt", OPENAI_FORMATS)
def test_every_format_round_trips_through_http(server, http, reference_pcm, fmt):
    r = http.post("/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": TEXT,
                                            "response_format": fmt, "seed": 7})
    assert r.status_code == 200, r.text
    samples, rate = read_like_a_user(r.content, fmt)
    assert rate == RATE
    check_length(fmt, len(samples), len(reference_pcm))
    register_back(server, http, f"rt_http_{fmt}", r.content, fmt)


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize("fmt", STREAM_FORMATS)
def test_every_format_round_trips_through_the_websocket(server, http, fmt):
    messages = [{"type": "config", "voice": "alloy", "format": fmt, "options": {"seed": 7}},
                {"type": "text", "text": TEXT}, {"type": "end"}]
    received, code = asyncio.run(ws_session(server.ws, messages))
    assert code == 1000, received[-1]
    data = check_audio_messages(received)
    samples, rate = read_like_a_user(data, fmt)
    assert rate == (48000 if fmt == "webm" else RATE)  # FFmpeg decodes Opus at 48 kHz
    check_length(fmt, round(len(samples) * RATE / rate), round(received[-1]["audio_seconds"] * RATE))
    register_back(server, http, f"rt_ws_{fmt}", data, fmt)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_every_format_round_trips_through_grpc(server, http, encoding, stream):
    rate = 16000 if encoding != "webm" else 48000

    async def body():
        async with CosyVoiceClient(server.target, token=TOKEN) as c:
            return [ch async for ch in c.synthesize(TEXT, speaker_id="tiny_zs_spk", seed=7, stream=stream,
                                                    encoding=encoding, sample_rate=rate)]
    chunks = asyncio.run(body())
    data = b"".join(ch.audio for ch in chunks)
    samples, got_rate = read_like_a_user(data, encoding, rate)
    assert got_rate == rate
    check_length(encoding, len(samples), sum(ch.num_samples for ch in chunks))
    register_back(server, http, f"rt_grpc_{encoding}", data, encoding)


def test_sse_events(http, reference_pcm):
    body = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm", "stream_format": "sse",
            "seed": 7}
    events = []
    with http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 0
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(audio) // 2 == len(reference_pcm)


def test_log_line_says_where_the_first_chunk_went(http, caplog):
    """As on gRPC: the request's log line splits the first chunk into tokens, wait and t2w (ms)."""
    with caplog.at_level(logging.INFO, logger="http_api"):
        r = http.post("/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": TEXT,
                                                "response_format": "pcm", "seed": 7})
        assert r.status_code == 200
        # this request's line (an earlier test's request may log after its response has gone out)
        ours = f"id={r.headers['x-request-id']} "
        deadline = time.monotonic() + 10  # the line is written once the response has gone out
        while time.monotonic() < deadline and not [m for m in caplog.messages if ours in m]:
            time.sleep(0.05)
    (line,) = [m for m in caplog.messages if ours in m]
    assert "POST /v1/audio/speech" in line
    parts = re.search(r"first_chunk_parts=tokens:([0-9.]+),wait:([0-9.]+),t2w:([0-9.]+),first_token:([0-9.]+) ", line)
    assert parts, line
    first_ms = float(re.search(r"first_chunk_ms=([0-9.]+)", line).group(1))
    tokens, wait, t2w, first_token = (float(v) for v in parts.groups())
    assert tokens + wait + t2w <= first_ms + 1.0 and first_token <= tokens, line


def test_instructions_and_speed(http):
    r = http.post("/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": "Hi.", "seed": 1,
                                            "instructions": "Speak slowly.", "speed": 1.5, "response_format": "wav"})
    assert r.status_code == 200, r.text
    samples, rate = decode(r.content, "wav")
    assert rate == RATE and len(samples) > 0


@pytest.mark.parametrize("body,status,code,message", [
    ({"voice": "nobody"}, 404, "voice_not_found", "'nobody' is not a registered speaker"),
    ({"voice": "bad/id"}, 400, "invalid_request", "contains '/'"),
    ({"model": "whisper-1"}, 400, "invalid_request", "model 'whisper-1' is not served"),
    ({"response_format": "ogg"}, 400, "invalid_request", "response_format 'ogg' is not supported"),
    ({"speed": 3.0}, 400, "invalid_request", "speed must be in [0.5, 2.0]"),
    ({"input": "   "}, 400, "invalid_request", "input is empty"),
    ({"input": "x" * 301}, 400, "invalid_request", "the limit is 300"),
    ({"stream_format": "ws"}, 400, "invalid_request", "stream_format"),
    ({"input": None}, 400, "invalid_request", "input"),
    ({"voice": "echo", "instructions": "Whisper."}, 400, "invalid_request", "cannot follow instructions"),
])
def test_bad_requests_get_precise_errors(http, body, status, code, message):
    payload = {"model": "tts-1", "voice": "alloy", "input": "Hi.", **body}
    r = http.post("/v1/audio/speech", json=payload)
    assert r.status_code == status, r.text
    error = error_of(r)
    assert error["code"] == code and message in error["message"], error


def test_malformed_and_oversized_bodies(server, http):
    r = http.post("/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_request"
    big = http.post("/v1/audio/speech", content=b"x" * (3 * 1024 * 1024),
                    headers={"content-type": "application/json"})
    assert big.status_code == 413 and "limits.max_message_bytes" in error_of(big)["message"]

    def chunked():  # no content-length: counted while it streams in
        yield b'{"model": "tts-1", "voice": "alloy", "input": "'
        for _ in range(48):
            yield b"x" * 65536
    streamed = http.post("/v1/audio/speech", content=chunked(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413 and "limits.max_message_bytes" in error_of(streamed)["message"]
    unknown = http.get("/v1/nothing")
    assert unknown.status_code == 404 and "error" in unknown.json()
    # the server keeps serving
    assert http.post("/v1/audio/speech", json={"model": "tts-1", "voice": "echo", "input": "Hi.",
                                               "response_format": "pcm"}).status_code == 200
    wait_idle(server)


def test_client_disconnect_cancels_synthesis(server, http):
    long_text = "This sentence keeps the engine busy for a while, with more words after it. " * 3
    with http.stream("POST", "/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": long_text,
                                                       "response_format": "mp3"}) as r:
        assert r.status_code == 200
        first = next(r.iter_raw())
        assert first
    # leaving the block closed the connection mid-stream: the engine request is aborted, the slot freed
    wait_idle(server)


def test_one_limit_for_grpc_and_http(server, http):
    """gRPC streams that hold every slot make the HTTP front door answer 429 (one shared limiter)."""
    async def body():
        clients = [CosyVoiceClient(server.target, token=TOKEN) for _ in range(LIMIT)]

        async def pieces():
            await asyncio.Event().wait()  # never any text: the stream holds its slot
            yield ""

        holders = [asyncio.create_task(collect(c.stream_synthesize(pieces(), speaker_id="tiny_sft_spk",
                                                                   mode="sft"))) for c in clients]
        try:
            for _ in range(400):
                if server.server.servicer.limiter.active == LIMIT:
                    break
                await asyncio.sleep(0.05)
            r = await asyncio.to_thread(http.post, "/v1/audio/speech",
                                        json={"model": "tts-1", "voice": "alloy", "input": "Hi."})
            return r
        finally:
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            for c in clients:
                await c.close()
    r = asyncio.run(body())
    assert r.status_code == 429 and error_of(r)["code"] == "overloaded" and r.headers["retry-after"] == "1"
    assert "max_concurrent_streams" in error_of(r)["message"]
    wait_idle(server)
    metrics = httpx.get(f"http://127.0.0.1:{server.server.metrics_port}/metrics").text
    assert 'method="POST /v1/audio/speech",mode="zero_shot_by_spk_id",status="429"} 1.0' in metrics
    assert "cosyvoice_rejected_streams_total 1.0" in metrics  # the gRPC servicer's counter counted it


# ---------------------------------------------------------------------------------------------
# WebSocket /v1/audio/speech/stream (the `websockets` client)

AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def ws_session(url: str, messages: list, headers=AUTH) -> tuple[list[dict], int | None]:
    """Send `messages` (dicts as JSON, bytes as binary), then read until the server closes."""
    received = []
    async with ws_connect(url, additional_headers=headers, max_size=1 << 24) as ws:
        try:
            for m in messages:
                await ws.send(m if isinstance(m, bytes) else json.dumps(m))
        except websockets.ConnectionClosed:
            pass  # the server may close first (a bad token is answered at once)
        try:
            async for frame in ws:
                received.append(json.loads(frame))
        except websockets.ConnectionClosed:
            pass
        return received, ws.close_code


def check_audio_messages(received: list[dict]) -> bytes:
    kinds = [m["type"] for m in received]
    assert kinds[0] == "ready" and kinds[-1] == "done", kinds
    audio = [m for m in received if m["type"] == "audio"]
    assert kinds[1:-1] == ["audio"] * len(audio)
    assert [m["index"] for m in audio] == list(range(len(audio)))
    assert [m["is_final"] for m in audio] == [False] * (len(audio) - 1) + [True]
    offset = 0
    for m in audio:
        assert m["sample_offset"] == offset
        offset += m["num_samples"]
    assert received[-1]["audio_seconds"] == pytest.approx(offset / RATE, abs=1e-3)
    assert received[-1]["first_chunk_latency_seconds"] > 0
    return b"".join(base64.b64decode(m["audio"]) for m in audio)


def test_websocket_streams_text_pieces(server):
    messages = [{"type": "config", "voice": "alloy", "format": "pcm", "options": {"seed": 3}},
                {"type": "text", "text": "H"}, {"type": "text", "text": "i."}, {"type": "text", "text": " Yo"},
                {"type": "flush"}, {"type": "end"}]
    received, code = asyncio.run(ws_session(server.ws, messages))
    assert code == 1000
    assert received[0] == {"type": "ready", "request_id": received[0]["request_id"], "format": "pcm",
                           "sample_rate": RATE, "content_type": "audio/pcm", "text_mode": "bistream"}
    pcm = check_audio_messages(received)
    samples, _ = decode(pcm, "pcm")
    assert len(samples) == sum(m.get("num_samples", 0) for m in received)  # pcm at 24 kHz: 1:1
    assert np.abs(samples).max() > 1e-3
    wait_idle(server)


def test_websocket_compressed_format_and_query_token(server):
    url = server.ws + "?api_key=" + TOKEN  # browsers cannot set headers on a WebSocket
    messages = [{"type": "config", "voice": "tiny_sft_spk", "format": "webm", "options": {"seed": 1}},
                {"type": "text", "text": "Hi."}, {"type": "end"}]
    received, code = asyncio.run(ws_session(url, messages, headers=None))
    assert code == 1000 and received[0]["content_type"] == "audio/webm;codecs=opus"
    data = check_audio_messages(received)
    samples, rate = decode(data, "webm")
    n = len(samples) * RATE / rate
    assert abs(n - received[-1]["audio_seconds"] * RATE) <= CHUNK_SLACK


@pytest.mark.parametrize("messages,headers,code,message", [
    ([{"type": "text", "text": "Hi."}], AUTH, "invalid_request", 'the first message must be {"type": "config"'),
    ([{"type": "config", "voice": "nobody"}], AUTH, "voice_not_found", "'nobody' is not a registered speaker"),
    ([{"type": "config", "voice": "alloy", "format": "ogg"}], AUTH, "invalid_request", "config.format 'ogg'"),
    ([{"type": "config", "voice": "alloy", "options": {"seed": "x"}}], AUTH, "invalid_request",
     "config.options.seed must be int"),
    ([{"type": "config", "voice": "alloy", "options": {"temperature": 1}}], AUTH, "invalid_request",
     "unknown temperature"),
    ([{"type": "config", "voice": "alloy", "sample_rate": 44100, "format": "opus"}], AUTH, "invalid_request",
     "opus supports sample rates"),
    ([{"type": "config", "voice": "alloy"}, {"type": "shout"}], AUTH, "invalid_request",
     "unknown message type 'shout'"),
    ([{"type": "config", "voice": "alloy"}, {"type": "text", "text": 5}], AUTH, "invalid_request",
     '"text": a string'),
    ([{"type": "config", "voice": "alloy"}, {"type": "config", "voice": "alloy"}], AUTH, "invalid_request",
     "config may be sent only once"),
    ([{"type": "config", "voice": "alloy"}, b"\x00\x01"], AUTH, "invalid_request", "binary frames"),
    ([{"type": "config", "voice": "alloy", "text_mode": "paragraph"}, {"type": "text", "text": "Hi."}], AUTH,
     "invalid_request", "config.text_mode must be 'bistream' or 'sentence', got \"paragraph\""),
    ([{"type": "config", "voice": "alloy", "text_normalization": "fancy"}, {"type": "text", "text": "Hi."}], AUTH,
     "invalid_request", "text_normalization must be 'safe' or 'raw'"),
    ([{"type": "config", "voice": "alloy", "text_mode": "sentence", "text_normalization": "raw"},
      {"type": "text", "text": "Hi."}], AUTH, "invalid_request", "sentence mode normalizes whole sentences"),
    ([{"type": "config", "voice": "alloy"}], {"Authorization": "Bearer nope"}, "invalid_api_key",
     "invalid bearer token"),
    ([{"type": "config", "voice": "alloy"}], None, "invalid_api_key", "missing"),
])
def test_websocket_errors(server, messages, headers, code, message):
    received, close_code = asyncio.run(ws_session(server.ws, messages, headers=headers))
    error = received[-1]
    assert error["type"] == "error" and error["code"] == code and message in error["message"], received
    assert close_code == 4000 + error["status"]


def test_websocket_text_idle_timeout(server):
    """A session that stops sending text (and never ends) is closed after limits.text_idle_seconds."""
    t0 = time.monotonic()
    received, close_code = asyncio.run(ws_session(server.ws, [{"type": "config", "voice": "alloy"}]))
    assert received[-1]["code"] == "text_timeout" and "limits.text_idle_seconds" in received[-1]["message"]
    assert close_code == 4408 and time.monotonic() - t0 >= TEXT_IDLE
    wait_idle(server)


def test_websocket_invalid_json_after_audio_started(server):
    async def body():
        async with ws_connect(server.ws, additional_headers=AUTH) as ws:
            await ws.send(json.dumps({"type": "config", "voice": "alloy", "text_mode": "sentence"}))
            assert json.loads(await ws.recv())["text_mode"] == "sentence"
            await ws.send(json.dumps({"type": "text", "text": "Hi there."}))
            await ws.send(json.dumps({"type": "flush"}))
            assert json.loads(await ws.recv())["type"] == "audio"
            await ws.send("{oops")
            while (m := json.loads(await ws.recv()))["type"] == "audio":
                pass
            return m
    error = asyncio.run(body())
    assert error["code"] == "invalid_request" and "not valid JSON" in error["message"]
    wait_idle(server)


def test_websocket_close_cancels_synthesis(server):
    long_text = "This sentence keeps the engine busy for a while, with more words after it. " * 3

    async def body():
        async with ws_connect(server.ws, additional_headers=AUTH) as ws:
            await ws.send(json.dumps({"type": "config", "voice": "alloy", "options": {"seed": 2}}))
            await ws.recv()
            await ws.send(json.dumps({"type": "text", "text": long_text}))
            await ws.send(json.dumps({"type": "flush"}))
            first = json.loads(await ws.recv())
            assert first["type"] == "audio" and not first["is_final"]
        # the socket is closed mid-utterance
    asyncio.run(body())
    wait_idle(server)


# ---------------------------------------------------------------------------------------------
# The web page in a real browser (Debian's chromium driven by Playwright)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--autoplay-policy=no-user-gesture-required"]


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        pytest.skip(f"BROWSER TEST SKIPPED: playwright is not installed ({e}); pip install playwright")
    if not shutil.which(CHROMIUM):
        pytest.skip("BROWSER TEST SKIPPED: no chromium binary; apt-get install -y chromium (.ci/run does)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


def test_web_page_speaks_in_chromium(server, browser, tmp_path, golden_dir):
    page = browser.new_page()
    console = []
    page.on("console", lambda m: console.append(m.text))
    page.goto(server.base + "/")
    page.fill("#token", TOKEN)
    page.dispatch_event("#token", "change")  # loads the voices with the token
    page.wait_for_selector("#voice option[value=tiny_zs_spk]", state="attached", timeout=30_000)
    page.select_option("#voice", "tiny_zs_spk")
    page.fill("#text", TEXT)
    page.click("#speak")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('Done')", timeout=120_000)
    assert page.input_value("#voice") == "tiny_zs_spk"
    assert page.text_content("#error") == "", console
    latency = page.text_content("#latency")
    assert latency.endswith(" ms") and int(latency[:-3]) > 0
    seconds = float(page.text_content("#audio-seconds").split()[0])
    assert seconds > 0.5  # audio data arrived and was scheduled for playback
    chunks, received = map(int, page.text_content("#received").split(" / "))
    assert received >= seconds * RATE * 2 - 2 and chunks >= 1
    assert float(page.text_content("#rtf")) > 0
    page.screenshot(path=str(tmp_path / "web_page.png"), full_page=True)
    print(f"screenshot: {tmp_path / 'web_page.png'}")

    # an error is shown in the page: an embedding-only voice cannot follow instructions
    page.select_option("#voice", "tiny_sft_spk")
    page.fill("#instructions", "Whisper.")
    page.click("#speak")
    page.wait_for_function("document.getElementById('error').textContent.length > 0", timeout=30_000)
    assert "400 invalid_request" in page.text_content("#error")
    assert "cannot follow instructions" in page.text_content("#error")

    # a new voice from an uploaded recording + transcript is registered and selected
    page.fill("#new-id", "page_voice")
    page.set_input_files("#new-audio", str(golden_dir / "prompt_16k.wav"))
    page.fill("#new-transcript", PROMPT_TEXT)
    page.click("#register")
    page.wait_for_function("document.getElementById('register-status').textContent === 'Registered page_voice.'",
                           timeout=60_000)
    assert page.input_value("#voice") == "page_voice" and page.text_content("#error") == ""
    page.close()
    assert httpx.delete(server.base + "/v1/audio/voices/page_voice", headers=AUTH).status_code == 200
    wait_idle(server)


def open_page(server, browser, **context):
    page = browser.new_context(accept_downloads=True, **context).new_page()
    page.console = []
    page.bad_responses = []
    page.on("console", lambda m: page.console.append(f"{m.type}: {m.text}"))
    page.on("response", lambda r: r.status >= 400 and page.bad_responses.append((r.status, r.url)))
    page.goto(server.base + "/")
    page.fill("#token", TOKEN)
    page.dispatch_event("#token", "change")
    page.wait_for_selector("#voice option[value=tiny_zs_spk]", state="attached", timeout=30_000)
    return page


def speak_on_page(page, voice: str, fmt: str) -> float:
    """Speak TEXT in `fmt`; the seconds of audio the page reports."""
    page.select_option("#voice", voice)
    page.select_option("#format", fmt)
    page.fill("#text", TEXT)
    page.fill("#instructions", "")
    page.click("#speak")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('Done')", timeout=120_000)
    assert page.text_content("#error") == "", page.console
    return float(page.text_content("#audio-seconds").split()[0])


def test_web_page_favicon_and_formats_from_the_server(server, browser):
    page = open_page(server, browser)
    icon = page.evaluate("""async () => {
        const r = await fetch(document.querySelector("link[rel=icon]").href);
        return [r.status, r.headers.get("content-type")];
    }""")
    assert icon == [200, "image/svg+xml"]
    assert httpx.get(server.base + "/favicon.ico").status_code == 200  # without a token, as browsers ask
    offered = [f["id"] for f in httpx.get(server.base + "/v1/audio/formats", headers=AUTH).json()["data"]
               if f["speech"]]
    assert offered == list(OPENAI_FORMATS)
    assert page.eval_on_selector_all("#format option", "os => os.map(o => o.value)") == offered
    assert page.input_value("#format") == "pcm"
    # the only failed requests: the voices/formats/models asked before the token was typed (401)
    assert all(status == 401 for status, _ in page.bad_responses), page.bad_responses
    assert not [m for m in page.console if "404" in m], page.console
    page.close()


@pytest.mark.parametrize("fmt", ["pcm", "mp3"])
def test_web_page_plays_with_a_level_view_and_downloads(server, browser, tmp_path, fmt):
    page = open_page(server, browser)
    assert not page.is_visible("#download")  # nothing spoken yet
    seconds = speak_on_page(page, "tiny_zs_spk", fmt)
    assert seconds > 0.5
    # the level view drew frames while the audio played, and saw sound
    page.wait_for_function("Number(document.getElementById('wave').dataset.peak || 0) > 0.001", timeout=30_000)
    assert int(page.get_attribute("#wave", "data-frames")) > 3
    inked = page.evaluate("""() => {
        const c = document.getElementById('wave');
        const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < px.length; i += 4) n += px[i] > 0; return n;
    }""")
    assert inked > 100  # a waveform is drawn, not an empty canvas
    # what was spoken can be downloaded, as a file a player (and libsndfile / FFmpeg) reads
    assert page.is_visible("#download")
    with page.expect_download() as info:
        page.click("#download")
    path = tmp_path / info.value.suggested_filename
    info.value.save_as(path)
    assert path.name == ("speech.wav" if fmt == "pcm" else "speech.mp3")
    samples, rate = read_like_a_user(path.read_bytes(), "wav" if fmt == "pcm" else fmt)
    assert rate == RATE
    assert abs(len(samples) / rate - seconds) <= 0.01 + CODEC_SLACK.get(fmt, 0) / RATE, (len(samples), seconds)
    page.close()
    wait_idle(server)


def test_web_page_register_errors_stay_with_their_form_and_overwrite(server, browser, golden_dir):
    page = open_page(server, browser)
    page.fill("#new-id", "tiny_zs_spk")  # exists already
    page.set_input_files("#new-audio", str(golden_dir / "prompt_16k.wav"))
    page.fill("#new-transcript", PROMPT_TEXT)
    page.click("#register")
    page.wait_for_function("document.getElementById('register-error').textContent.length > 0", timeout=60_000)
    assert "409 voice_exists" in page.text_content("#register-error")
    assert "Overwrite" in page.text_content("#register-error")  # says how to replace it
    assert page.text_content("#error") == "" and page.text_content("#server-error") == ""
    # a Speak error stays in the Speak form
    page.select_option("#voice", "tiny_sft_spk")
    page.fill("#instructions", "Whisper.")
    page.click("#speak")
    page.wait_for_function("document.getElementById('error').textContent.length > 0", timeout=30_000)
    assert "cannot follow instructions" in page.text_content("#error")
    assert "cannot follow" not in page.text_content("#register-error")
    # with the overwrite box ticked the same registration replaces the voice
    page.fill("#new-id", "page_overwrite")
    page.click("#register")
    page.wait_for_function("document.getElementById('register-status').textContent === 'Registered page_overwrite.'",
                           timeout=60_000)
    page.click("#register")
    page.wait_for_function("document.getElementById('register-error').textContent.includes('409')", timeout=60_000)
    page.check("#new-overwrite")
    page.click("#register")
    page.wait_for_function("document.getElementById('register-error').textContent === '' && "
                           "document.getElementById('register-status').textContent === 'Registered page_overwrite.'",
                           timeout=60_000)
    page.close()
    assert httpx.delete(server.base + "/v1/audio/voices/page_overwrite", headers=AUTH).status_code == 200
    wait_idle(server)


def test_web_page_phone_layout_keeps_fields_wide(server, browser):
    page = open_page(server, browser, viewport={"width": 390, "height": 844}, device_scale_factor=3,
                     is_mobile=True, has_touch=True)
    form = page.locator("#register-form").bounding_box()
    for field in ("#new-id", "#new-audio", "#voice", "#format", "#text"):
        box = page.locator(field).bounding_box()
        assert box["width"] >= 0.85 * form["width"], (field, box, form)  # one field per line
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing runs off the screen
    page.close()


# ---------------------------------------------------------------------------------------------
# Last: shutting the module's server down


def test_shutdown_drains_an_http_stream(server, reference_pcm):
    """stop(): new requests are refused while an HTTP stream in flight runs to its end, then the
    port closes (one drain for both front doors: the shared limiter's idle event)."""
    got, first = {}, threading.Event()

    def listen():
        body = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm", "seed": 7}
        with httpx.stream("POST", server.base + "/v1/audio/speech", json=body, headers=AUTH, timeout=120) as r:
            pieces = []
            for piece in r.iter_raw():
                pieces.append(piece)
                first.set()
            got["data"] = b"".join(pieces)

    listener = threading.Thread(target=listen)
    listener.start()
    assert first.wait(120)
    stopping = server.call(_stop_later(server), timeout=10)
    refused = httpx.post(server.base + "/v1/audio/speech", headers=AUTH,
                         json={"model": "tts-1", "voice": "alloy", "input": "Hi."})
    assert refused.status_code == 503 and "shutting down" in error_of(refused)["message"]
    listener.join(120)
    assert len(got["data"]) // 2 == len(reference_pcm)  # the stream in flight was not cut
    server.call(_wait(stopping), timeout=120)
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.base + "/healthz")


async def _stop_later(st: ServerThread) -> asyncio.Future:
    """Start a graceful stop on the server's loop and return its future (to await later)."""
    stop = asyncio.ensure_future(st.server.stop(grace=60))
    await asyncio.sleep(0)  # let it flip to closing before we return
    return stop


async def _wait(future: asyncio.Future):
    return await future


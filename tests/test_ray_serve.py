"""The Ray Serve application on a local Ray cluster (127.0.0.1): two replicas of the fixture
model behind Ray's gRPC and HTTP ingress, speakers in a real redis-server. Ray and the replicas
start once per module (the expensive part).

The HTTP tests compare Ray's HTTP proxy with a plain server (gRPC + HTTP in one process, the same
config and Redis store): the same seed gives the same audio, bad requests get the same status
and JSON error, responses stream, the WebSocket works, and voices registered through either
ingress are used through the other. The last test walks the failure story: a speaker registered
through one replica is used through the other; the bidirectional StreamSynthesize works through
the ingress; under load one replica is killed (ray.kill): its in-flight requests fail with
UNAVAILABLE, the others finish, later requests succeed, nothing acknowledged is lost, and Serve
replaces the replica.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from dataclasses import dataclass

import grpc
import httpx
import numpy as np
import pytest
import ray
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed
from ray import serve
from ray.serve.config import gRPCOptions, HTTPOptions

from cosyvoice_cli.cli import main as cli_main
from async_cosyvoice.config import Config
from grpc_async import pb2, pb2_grpc
from grpc_async.client import CosyVoiceClient, audio_data
from grpc_async.server import ServerThread
from ray_app.deployments import CosyVoiceIngress, CosyVoiceModel
from ray_app.remote import REPLICA_TRAILER
from ray_app.stubs import GRPC_SERVICER_FUNCTIONS

pytestmark = pytest.mark.slow

TEXT = "Hello there, this is a small test."
PROMPT_TEXT = "The morning train was late again, so I walked along the river."
TOKEN = "ray-s3cret"  # server.auth_token: both ingresses check it, as the plain server does
AUTH = (("authorization", f"Bearer {TOKEN}"),)  # gRPC metadata
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
REPLICA_REQUESTS = 3  # max_ongoing_requests of each of the two model replicas
STREAM_LIMIT = 2 * REPLICA_REQUESTS  # limits.max_concurrent_streams of the ingress: what both replicas run


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Endpoints:
    grpc: str   # host:port
    http: str   # http://host:port

    @property
    def ws(self) -> str:
        return self.http.replace("http://", "ws://") + "/v1/audio/speech/stream"


@pytest.fixture(scope="module")
def app_config(tiny_dir, redis_server) -> dict:
    """The config of the Ray application and of the plain server beside it (one Redis store)."""
    return {
        "model": {"dir": str(tiny_dir)},
        "speakers": {"backend": "redis", "redis_url": redis_server.url, "redis_prefix": f"ray-{uuid.uuid4().hex}"},
        "server": {"port": 0, "http_port": 0, "grace_seconds": 1, "auth_token": TOKEN},
        "limits": {"max_concurrent_streams": STREAM_LIMIT},
    }


@pytest.fixture(scope="module")
def ray_cosyvoice(app_config):
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False,
             namespace=f"test-{uuid.uuid4().hex[:8]}")
    grpc_port, http_port = _free_port(), _free_port()
    serve.start(grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS),
                http_options=HTTPOptions(host="127.0.0.1", port=http_port))
    config = Config.model_validate(app_config).model_dump_json()
    # at most 3 requests per replica: the 6 streams of the kill test land 3 and 3
    model = CosyVoiceModel.options(max_ongoing_requests=REPLICA_REQUESTS, autoscaling_config={
        "min_replicas": 2, "max_replicas": 2, "target_ongoing_requests": 2})
    serve.run(CosyVoiceIngress.bind(model.bind(config), config), name="cosyvoice")
    yield Endpoints(f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}")
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def plain(app_config):
    """A plain server (gRPC + HTTP, one process) on the Ray application's config and store."""
    with ServerThread(Config.model_validate(app_config), ready_timeout=900) as st:
        yield Endpoints(st.target, f"http://127.0.0.1:{st.server.http_port}")


def _request(client: CosyVoiceClient, **kwargs) -> pb2.SynthesizeRequest:
    return client.synthesize_request(TEXT, stream=True, encoding="pcm16", max_tokens=40, **kwargs)


async def _synthesize(stub, request, started: asyncio.Event | None = None) -> tuple[str, str]:
    """-> (status name, replica that served it)."""
    call = stub.Synthesize(request, metadata=AUTH)
    try:
        final = False
        async for chunk in call:
            if started is not None:
                started.set()
            final = chunk.is_final
        assert final
    except grpc.aio.AioRpcError as e:
        return e.code().name, e.details()
    trailers = dict(await call.trailing_metadata())
    return "OK", trailers.get(REPLICA_TRAILER, "")


HTTP_TEXT = "Hi there."  # the random-weight model speaks to its length limit: keep it short


def _speech(base: str, voice: str, **fields) -> httpx.Response:
    body = {"model": "tts-1", "input": HTTP_TEXT, "voice": voice, "response_format": "pcm", **fields}
    return httpx.post(f"{base}/v1/audio/speech", json=body, headers=HEADERS, timeout=300)


def _register(base: str, voice: str, prompt: bytes) -> httpx.Response:
    return httpx.post(f"{base}/v1/audio/voices", data={"id": voice, "transcript": PROMPT_TEXT},
                      files={"audio": ("prompt.wav", prompt, "audio/wav")}, headers=HEADERS, timeout=300)


def _pcm(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.frombuffer(response.content, "<i2").astype(np.float32) / 32768


def _sse(data: bytes) -> list[dict]:
    return [json.loads(line[len(b"data: "):]) for line in data.split(b"\n\n") if line.startswith(b"data: ")]


def test_http_ingress_speaks_like_the_plain_server_and_shares_voices(ray_cosyvoice, plain, golden_dir):
    prompt = (golden_dir / "prompt_24k.wav").read_bytes()
    # a voice registered through Ray's HTTP ingress...
    registered = _register(ray_cosyvoice.http, "http_voice", prompt)
    assert registered.status_code == 201, registered.text
    assert registered.json()["id"] == "http_voice" and registered.json()["kind"] == "zero_shot"
    # ... speaks through it as through the plain server, for the same seed (one replica, one
    # request at a time: the same tokens, and audio equal up to float summation order)
    through_ray = _pcm(_speech(ray_cosyvoice.http, "http_voice", seed=11))
    plain_audio = _pcm(_speech(plain.http, "http_voice", seed=11))
    assert through_ray.size > 0 and through_ray.shape == plain_audio.shape
    assert np.corrcoef(through_ray, plain_audio)[0, 1] > 0.99, np.abs(through_ray - plain_audio).max()

    async def through_grpc():
        async with CosyVoiceClient(ray_cosyvoice.grpc, token=TOKEN) as client:
            # ... and through Ray's gRPC ingress
            chunks = [c async for c in client.synthesize(HTTP_TEXT, stream=True, encoding="pcm16", max_tokens=20,
                                                         mode="zero_shot_by_spk_id", speaker_id="http_voice")]
            assert chunks[-1].is_final and chunks[-1].summary.speech_tokens == 20
            # a voice registered through the gRPC ingress is listed and used through HTTP (below)
            await client.register_speaker("grpc_voice", PROMPT_TEXT, prompt)

    asyncio.run(through_grpc())
    listed = httpx.get(f"{ray_cosyvoice.http}/v1/audio/voices", headers=HEADERS, timeout=60).json()
    assert {"http_voice", "grpc_voice"} <= {v["id"] for v in listed["data"]}

    # streaming through Ray's proxy: SSE events arrive as they are made, in several reads
    with httpx.Client(headers=HEADERS, timeout=300) as http, http.stream(
            "POST", f"{ray_cosyvoice.http}/v1/audio/speech", json={
                "model": "tts-1", "input": HTTP_TEXT, "voice": "grpc_voice", "response_format": "pcm",
                "stream_format": "sse"}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        reads = list(response.iter_raw())
    events = _sse(b"".join(reads))
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 0
    assert len(events) >= 3 and len(reads) >= 2, (len(events), len(reads))
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(audio) == events[-1]["usage"]["output_tokens"] * 960 * 2  # 25 tokens/s, 24 kHz, s16

    # a voice deleted through HTTP is gone for gRPC too
    assert httpx.delete(f"{ray_cosyvoice.http}/v1/audio/voices/grpc_voice", headers=HEADERS,
                        timeout=60).status_code == 200

    async def gone():
        async with CosyVoiceClient(ray_cosyvoice.grpc, token=TOKEN) as client:
            stub = pb2_grpc.CosyVoiceStub(client.channel)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetSpeaker(pb2.GetSpeakerRequest(speaker_id="grpc_voice"), metadata=AUTH)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(gone())


@pytest.fixture(scope="module")
def taken_voice(ray_cosyvoice, golden_dir) -> str:
    response = _register(ray_cosyvoice.http, "taken_voice", (golden_dir / "prompt_24k.wav").read_bytes())
    assert response.status_code == 201, response.text
    return "taken_voice"


def test_http_errors_through_ray_are_the_plain_servers(ray_cosyvoice, plain, taken_voice, golden_dir):
    prompt = (golden_dir / "prompt_24k.wav").read_bytes()
    speech = {"model": "tts-1", "input": HTTP_TEXT, "voice": taken_voice, "response_format": "pcm"}
    cases = [  # (expected status, method, path, httpx arguments)
        (400, "POST", "/v1/audio/speech", {"json": {**speech, "response_format": "wma"}}),
        (400, "POST", "/v1/audio/speech", {"json": {**speech, "model": "gpt-9"}}),
        (400, "POST", "/v1/audio/speech", {"json": {k: v for k, v in speech.items() if k != "input"}}),
        (400, "POST", "/v1/audio/speech", {"json": {**speech, "input": "x" * 5000}}),
        (400, "POST", "/v1/audio/speech", {"json": {**speech, "speed": 3.0}}),  # checked on a model replica
        (404, "POST", "/v1/audio/speech", {"json": {**speech, "voice": "nobody"}}),
        (404, "DELETE", "/v1/audio/voices/nobody", {}),
        (404, "GET", "/v1/no/such/route", {}),
        (400, "POST", "/v1/audio/voices", {"data": {"id": "bad/id", "transcript": PROMPT_TEXT},
                                           "files": {"audio": ("p.wav", prompt, "audio/wav")}}),
        (409, "POST", "/v1/audio/voices", {"data": {"id": taken_voice, "transcript": PROMPT_TEXT},
                                           "files": {"audio": ("p.wav", prompt, "audio/wav")}}),
        (401, "GET", "/v1/audio/voices", {"headers": {"Authorization": "Bearer wrong"}}),
        (401, "POST", "/v1/audio/speech", {"json": speech, "headers": {"Authorization": ""}}),
    ]
    with httpx.Client(headers=HEADERS, timeout=300) as http:
        # the routes without a token: probes, models, the web page
        for path in ["/healthz", "/readyz", "/v1/models", "/"]:
            through_ray, direct = http.get(ray_cosyvoice.http + path), http.get(plain.http + path)
            assert through_ray.status_code == direct.status_code == 200, path
            assert through_ray.content == direct.content, path
        for status, method, path, kwargs in cases:
            through_ray = http.request(method, ray_cosyvoice.http + path, **kwargs)
            direct = http.request(method, plain.http + path, **kwargs)
            assert (through_ray.status_code, direct.status_code) == (status, status), (path, through_ray.text)
            assert through_ray.json() == direct.json() and set(direct.json()) == {"error"}, path

    # gRPC: the token is checked through Ray too (health exempt), with the plain server's status
    async def without_token(target: str) -> list[tuple[str, str]]:
        async with CosyVoiceClient(target) as client:
            await client.wait_ready(60)  # health needs no token
            statuses = []
            for call in [client.stub.ListSpeakers(pb2.ListSpeakersRequest()),
                         client.stub.Synthesize(client.synthesize_request(HTTP_TEXT, mode="zero_shot_by_spk_id",
                                                                          speaker_id=taken_voice)),
                         client.stub.GetServerInfo(pb2.GetServerInfoRequest(), metadata=(("authorization", "x"),))]:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await (call.read() if isinstance(call, grpc.aio.UnaryStreamCall) else call)
                statuses.append((e.value.code().name, e.value.details()))
            return statuses

    through_ray, direct = asyncio.run(without_token(ray_cosyvoice.grpc)), asyncio.run(without_token(plain.grpc))
    assert through_ray == direct and {code for code, _ in direct} == {"UNAUTHENTICATED"}, through_ray


def test_server_info_through_ray(ray_cosyvoice, plain):
    async def info(target: str) -> pb2.GetServerInfoResponse:
        async with CosyVoiceClient(target, token=TOKEN) as client:
            return await client.stub.GetServerInfo(pb2.GetServerInfoRequest(), metadata=AUTH)

    through_ray, direct = asyncio.run(info(ray_cosyvoice.grpc)), asyncio.run(info(plain.grpc))
    assert through_ray.ready and not through_ray.bistream  # bistream is not served through Ray
    assert through_ray.default_text_mode == pb2.TEXT_MODE_SENTENCE  # so an unset text_mode is sentence there
    assert direct.default_text_mode == pb2.TEXT_MODE_BISTREAM
    for field in ["model", "modes", "audio_encodings", "native_sample_rate", "default_encoding", "limits",
                  "engine", "version"]:
        assert getattr(through_ray, field) == getattr(direct, field), field


async def _websocket(url: str, voice: str, texts: list[str] | None, **config) -> tuple[list[dict], int | None]:
    """One WebSocket session (texts None: the config only): -> the server's messages and the close code."""
    async with ws_connect(url, max_size=None, additional_headers=HEADERS) as ws:
        await ws.send(json.dumps({"type": "config", "voice": voice, "format": "pcm", "options": {"seed": 2},
                                  **config}))
        for text in texts or ():
            await ws.send(json.dumps({"type": "text", "text": text}))
        if texts is not None:
            await ws.send(json.dumps({"type": "end"}))
        messages = []
        with contextlib.suppress(ConnectionClosed):  # a close with an error code ends the iteration with it
            async for message in ws:
                messages.append(json.loads(message))
        return messages, ws.close_code


def test_websocket_through_ray(ray_cosyvoice, plain, taken_voice):
    messages, code = asyncio.run(_websocket(ray_cosyvoice.ws, taken_voice, ["Hi there. ", "Bye now."]))
    assert code == 1000 and messages[0]["type"] == "ready" and messages[-1]["type"] == "done", messages[-1]
    audio = [m for m in messages if m["type"] == "audio"]
    assert audio[-1]["is_final"] and sum(m["num_samples"] for m in audio) > 0
    assert [m["index"] for m in audio] == list(range(len(audio)))
    assert sum(len(base64.b64decode(m["audio"])) for m in audio) == 2 * sum(m["num_samples"] for m in audio)
    # an error closes the socket with the same message and code through Ray as on the plain server
    through_ray = asyncio.run(_websocket(ray_cosyvoice.ws, "nobody", None))
    direct = asyncio.run(_websocket(plain.ws, "nobody", None))
    assert through_ray == direct and through_ray[1] == 4404, through_ray
    assert through_ray[0][-1]["code"] == "voice_not_found"
    # bistream needs one LM request fed for the whole text, which a replica call cannot be
    messages, code = asyncio.run(_websocket(ray_cosyvoice.ws, taken_voice, None, text_mode="bistream"))
    assert code == 4400 and messages[-1]["code"] == "unsupported", messages


def test_http_overload_through_ray_is_429(ray_cosyvoice, taken_voice):
    """gRPC and HTTP share the ingress's stream limit, as in the plain server. (Next come tests
    that need at most 2 slots: the cancelled streams have time to let theirs go.)"""
    async def scenario():
        async with CosyVoiceClient(ray_cosyvoice.grpc, token=TOKEN) as client:
            stub = pb2_grpc.CosyVoiceStub(client.channel)
            long = client.synthesize_request(TEXT, stream=True, encoding="pcm16", max_tokens=400,
                                             mode="zero_shot_by_spk_id", speaker_id=taken_voice)
            calls = [stub.Synthesize(long, metadata=AUTH) for _ in range(STREAM_LIMIT)]
            try:
                for call in calls:  # each has its first chunk: each holds a slot
                    assert (await call.read()).index == 0
                async with httpx.AsyncClient(headers=HEADERS, timeout=60) as http:
                    return await http.post(f"{ray_cosyvoice.http}/v1/audio/speech", json={
                        "model": "tts-1", "input": HTTP_TEXT, "voice": taken_voice, "response_format": "pcm"})
            finally:
                for call in calls:
                    call.cancel()

    response = asyncio.run(scenario())
    assert response.status_code == 429 and response.headers["retry-after"] == "1", response.text
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("overloaded", "rate_limit_error")
    assert error["message"].startswith(f"{STREAM_LIMIT} synthesis streams are already running")


def test_bench_against_the_ray_app(ray_cosyvoice, tmp_path):
    out = tmp_path / "bench.json"
    code = cli_main(["bench", "--target", ray_cosyvoice.grpc, "--token", TOKEN, "--concurrency", "2", "--requests", "4", "--tokens", "20",
                     "--prompt-seconds", "1", "--no-warmup", "--quiet", "--no-plots", "--out", str(out)])
    (level,) = json.loads(out.read_text())["levels"]
    assert code == 0 and level["errors"] == 0 and level["requests"] == 4
    assert level["audio_s"] == pytest.approx(4 * 20 * 0.04)  # the forced token count went through Ray


def test_two_replicas_share_speakers_and_survive_a_kill(ray_cosyvoice, golden_dir):
    prompt = audio_data((golden_dir / "prompt_24k.wav").read_bytes())

    async def scenario():
        async with CosyVoiceClient(ray_cosyvoice.grpc, token=TOKEN) as client:
            stub = pb2_grpc.CosyVoiceStub(client.channel)
            # register through one replica...
            call = stub.RegisterSpeaker(pb2.RegisterSpeakerRequest(
                speaker_id="ray_voice", prompt_text=PROMPT_TEXT, prompt_audio=prompt), metadata=AUTH)
            await call
            first = dict(await call.trailing_metadata())[REPLICA_TRAILER]
            # ... and use it through the other
            by_speaker = _request(client, mode="zero_shot_by_spk_id", speaker_id="ray_voice")
            served = set()
            deadline = time.monotonic() + 60
            while not served - {first} and time.monotonic() < deadline:
                results = await asyncio.gather(*(_synthesize(stub, by_speaker) for _ in range(3)))
                assert all(status == "OK" for status, _ in results), results
                served |= {replica for _, replica in results}
            assert served - {first}, f"every request went to {first}"
            other = (served - {first}).pop()

            # bidirectional StreamSynthesize through Ray's ingress
            chunks = [c async for c in client.stream_synthesize(
                ["Hello there. ", "This is a small test."], mode="zero_shot_by_spk_id",
                speaker_id="ray_voice", max_tokens=20)]
            assert chunks and chunks[-1].is_final and chunks[-1].summary.speech_tokens == 40

            # errors keep their status codes across the replica boundary
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetSpeaker(pb2.GetSpeakerRequest(speaker_id="nobody"), metadata=AUTH)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            missing = _request(client, mode="zero_shot_by_spk_id", speaker_id="nobody")
            assert (await _synthesize(stub, missing))[0] == "NOT_FOUND"

            # under load (6 streams and 4 registrations), kill the replica that registered ray_voice
            long = client.synthesize_request(TEXT, stream=True, encoding="pcm16", max_tokens=200,
                                             mode="zero_shot_by_spk_id", speaker_id="ray_voice")
            started = [asyncio.Event() for _ in range(6)]
            streams = [asyncio.create_task(_synthesize(stub, long, s)) for s in started]
            registrations = [asyncio.ensure_future(stub.RegisterSpeaker(pb2.RegisterSpeakerRequest(
                speaker_id=f"load_{i}", prompt_text=PROMPT_TEXT, prompt_audio=prompt), metadata=AUTH))
                for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 120)
            ray.kill(ray.get_actor(first, namespace="serve"), no_restart=True)
            results = await asyncio.gather(*streams)
            statuses = [status for status, _ in results]
            assert set(statuses) <= {"OK", "UNAVAILABLE"}, statuses
            assert "UNAVAILABLE" in statuses and "OK" in statuses, statuses  # both replicas had load
            assert {replica for status, replica in results if status == "OK"} == {other}
            acked = []
            for i, task in enumerate(registrations):
                try:
                    await task
                    acked.append(f"load_{i}")
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE, err

            # later requests succeed; nothing acknowledged is lost; the killed replica is replaced
            assert (await _synthesize(stub, by_speaker))[0] == "OK"
            ids = [s.speaker_id for s in await client.all_speakers()]
            assert set(acked) | {"ray_voice"} <= set(ids), ids
            replicas = {other}
            deadline = time.monotonic() + 120
            while len(replicas) < 2 and time.monotonic() < deadline:
                results = await asyncio.gather(*(_synthesize(stub, by_speaker) for _ in range(3)))
                assert all(status == "OK" for status, _ in results), results
                replicas |= {replica for _, replica in results}
            assert first not in replicas and len(replicas) == 2, replicas  # a new replica serves

    asyncio.run(scenario())

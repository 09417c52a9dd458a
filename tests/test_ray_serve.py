"""The Ray Serve application on a local Ray cluster (127.0.0.1): two replicas of the fixture
model behind Ray's gRPC ingress, speakers in a real redis-server.

One test walks the whole story, because starting Ray and two replicas is the expensive part:
a speaker registered through one replica is used through the other; the bidirectional
StreamSynthesize works through the ingress; under load one replica is killed (ray.kill): its
in-flight requests fail with UNAVAILABLE, the others finish, later requests succeed, nothing
acknowledged is lost, and Serve replaces the replica.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import grpc
import pytest
import ray
from ray import serve
from ray.serve.config import gRPCOptions, HTTPOptions

from cosyvoice_cli.cli import main as cli_main
from async_cosyvoice.config import Config
from grpc_async import pb2, pb2_grpc
from grpc_async.client import CosyVoiceClient, audio_data
from ray_app.deployments import CosyVoiceIngress, CosyVoiceModel
from ray_app.remote import REPLICA_TRAILER
from ray_app.stubs import GRPC_SERVICER_FUNCTIONS

pytestmark = pytest.mark.slow

TEXT = "Hello there, this is a small test."
PROMPT_TEXT = "The morning train was late again, so I walked along the river."


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cosyvoice(tiny_dir, redis_server):
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False,
             namespace=f"test-{uuid.uuid4().hex[:8]}")
    grpc_port = _free_port()
    serve.start(grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS),
                http_options=HTTPOptions(host="127.0.0.1", port=_free_port()))
    config = Config.model_validate({
        "model": {"dir": str(tiny_dir)},
        "speakers": {"backend": "redis", "redis_url": redis_server.url, "redis_prefix": f"ray-{uuid.uuid4().hex}"},
    }).model_dump_json()
    # at most 3 requests per replica: the 6 streams of the kill test land 3 and 3
    model = CosyVoiceModel.options(max_ongoing_requests=3, autoscaling_config={
        "min_replicas": 2, "max_replicas": 2, "target_ongoing_requests": 2})
    serve.run(CosyVoiceIngress.bind(model.bind(config), config), name="cosyvoice")
    yield f"127.0.0.1:{grpc_port}"
    serve.shutdown()
    ray.shutdown()


def _request(client: CosyVoiceClient, **kwargs) -> pb2.SynthesizeRequest:
    return client.synthesize_request(TEXT, stream=True, encoding="pcm16", max_tokens=40, **kwargs)


async def _synthesize(stub, request, started: asyncio.Event | None = None) -> tuple[str, str]:
    """-> (status name, replica that served it)."""
    call = stub.Synthesize(request)
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


def test_bench_against_the_ray_app(ray_cosyvoice, tmp_path):
    out = tmp_path / "bench.json"
    code = cli_main(["bench", "--target", ray_cosyvoice, "--concurrency", "2", "--requests", "4", "--tokens", "20",
                     "--prompt-seconds", "1", "--no-warmup", "--quiet", "--no-plots", "--out", str(out)])
    (level,) = json.loads(out.read_text())["levels"]
    assert code == 0 and level["errors"] == 0 and level["requests"] == 4
    assert level["audio_s"] == pytest.approx(4 * 20 * 0.04)  # the forced token count went through Ray


def test_two_replicas_share_speakers_and_survive_a_kill(ray_cosyvoice, golden_dir):
    prompt = audio_data((golden_dir / "prompt_24k.wav").read_bytes())

    async def scenario():
        async with CosyVoiceClient(ray_cosyvoice) as client:
            stub = pb2_grpc.CosyVoiceStub(client.channel)
            # register through one replica...
            call = stub.RegisterSpeaker(pb2.RegisterSpeakerRequest(
                speaker_id="ray_voice", prompt_text=PROMPT_TEXT, prompt_audio=prompt))
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
                await stub.GetSpeaker(pb2.GetSpeakerRequest(speaker_id="nobody"))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            missing = _request(client, mode="zero_shot_by_spk_id", speaker_id="nobody")
            assert (await _synthesize(stub, missing))[0] == "NOT_FOUND"

            # under load (6 streams and 4 registrations), kill the replica that registered ray_voice
            long = client.synthesize_request(TEXT, stream=True, encoding="pcm16", max_tokens=200,
                                             mode="zero_shot_by_spk_id", speaker_id="ray_voice")
            started = [asyncio.Event() for _ in range(6)]
            streams = [asyncio.create_task(_synthesize(stub, long, s)) for s in started]
            registrations = [asyncio.ensure_future(stub.RegisterSpeaker(pb2.RegisterSpeakerRequest(
                speaker_id=f"load_{i}", prompt_text=PROMPT_TEXT, prompt_audio=prompt))) for i in range(4)]
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

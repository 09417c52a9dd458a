"""CosyVoice3 through the Ray Serve application on a local Ray cluster (127.0.0.1): one model
replica of the CosyVoice3 tiny fixture (COSYVOICE3_TINY_FIXTURE) behind Ray's gRPC and HTTP
ingress, speakers in a real redis-server.

A voice registered from a prompt through Ray's gRPC ingress is a CosyVoice3 voice; a request by that
voice and one with its prompt inline (streamed and not, seeded) give, through Ray, the audio the
library (an in-process Synthesizer on the same config and store) gives for the same request: the
same number of speech tokens and the same samples up to float summation order. GetServerInfo and
the HTTP voice list name the model kind.
"""
from __future__ import annotations

import asyncio
import uuid

import httpx
import numpy as np
import pytest
import ray
from ray import serve
from ray.serve.config import gRPCOptions, HTTPOptions

from async_cosyvoice.config import Config
from async_cosyvoice.frontend.audio import load_audio
from async_cosyvoice.request import Mode, SynthesisOptions, SynthesisRequest
from async_cosyvoice.tts import SyncSynthesizer
from grpc_async import pb2
from grpc_async.client import CosyVoiceClient, chunk_samples
from ray_app.deployments import CosyVoiceIngress, CosyVoiceModel
from ray_app.stubs import GRPC_SERVICER_FUNCTIONS

pytestmark = pytest.mark.slow

TEXT = "Hello there, how are you today?"
TRANSCRIPT = "The morning train was late again, so I walked along the river."
SAMPLES_PER_TOKEN = 960
AUDIO_ATOL = 1e-4  # float summation order (another process, its own thread count)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_config(tiny3_dir, redis_server) -> dict:
    return {
        "model": {"dir": str(tiny3_dir)},
        "token2wav": {"adaptive": False},  # the chunk schedule (and so the streamed audio) fixed by the config
        "speakers": {"backend": "redis", "redis_url": redis_server.url, "redis_prefix": f"ray3-{uuid.uuid4().hex}"},
        "server": {"port": 0, "http_port": 0, "grace_seconds": 1},
        "limits": {"max_concurrent_streams": 4},
    }


@pytest.fixture(scope="module")
def ray_grpc(app_config):
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             namespace=f"test-{uuid.uuid4().hex[:8]}")
    grpc_port, http_port = _free_port(), _free_port()
    serve.start(grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS),
                http_options=HTTPOptions(host="127.0.0.1", port=http_port))
    config = Config.model_validate(app_config).model_dump_json()
    model = CosyVoiceModel.options(max_ongoing_requests=4, autoscaling_config={
        "min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 2})
    serve.run(CosyVoiceIngress.bind(model.bind(config), config), name="cosyvoice3")
    yield f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def library(app_config, ray_grpc):
    """The library on the same config and store (after the Ray app, so the voice Ray registers is there)."""
    s = SyncSynthesizer(Config.model_validate(app_config))
    yield s
    s.close()


async def _through_ray(target: str, text: str, **kw) -> list[pb2.AudioChunk]:
    async with CosyVoiceClient(target) as client:
        return [c async for c in client.synthesize(text, encoding="float32", **kw)]


def test_cosyvoice3_through_ray_is_the_librarys_audio(ray_grpc, library, tiny3_dir):
    target, http = ray_grpc
    prompt_wav = (tiny3_dir / "golden" / "prompt_24k.wav").read_bytes()

    async def register_and_info():
        async with CosyVoiceClient(target) as client:
            info = await client.register_speaker("ray3_voice", TRANSCRIPT, prompt_wav)
            server = await client.stub.GetServerInfo(pb2.GetServerInfoRequest())
            return info, server

    info, server = asyncio.run(register_and_info())
    assert info.model_kind == "cosyvoice3" and info.prompt_seconds > 0
    assert server.model == "cosyvoice3" and server.ready
    listed = httpx.get(f"{http}/v1/audio/voices", timeout=60).json()["data"]
    assert {v["id"]: v["model_kind"] for v in listed}["ray3_voice"] == "cosyvoice3"

    prompt = load_audio(tiny3_dir / "golden" / "prompt_24k.wav")
    cases = [  # (gRPC keywords, the library's request)
        (dict(mode="zero_shot_by_spk_id", speaker_id="ray3_voice", stream=True, seed=5, max_tokens=60),
         SynthesisRequest(Mode.ZERO_SHOT_BY_SPK_ID, text=TEXT, speaker_id="ray3_voice",
                          options=SynthesisOptions(stream=True, seed=5, max_tokens=60))),
        (dict(mode="zero_shot", prompt_audio=prompt_wav, prompt_text=TRANSCRIPT, stream=False, seed=7, max_tokens=50),
         SynthesisRequest(Mode.ZERO_SHOT, text=TEXT, prompt_audio=prompt, prompt_text=TRANSCRIPT,
                          options=SynthesisOptions(stream=False, seed=7, max_tokens=50))),
    ]
    for kw, request in cases:
        chunks = asyncio.run(_through_ray(target, TEXT, **kw))
        audio = np.concatenate([chunk_samples(c) for c in chunks])
        mine = list(library.synthesize(request))
        want = np.concatenate([c.samples for c in mine])
        tokens = sum(len(c.segment_tokens) for c in mine)
        assert chunks[-1].is_final and chunks[-1].summary.speech_tokens == tokens == kw["max_tokens"], kw["mode"]
        assert len(audio) == len(want) == SAMPLES_PER_TOKEN * tokens, kw["mode"]
        if kw["stream"]:
            assert [chunk_samples(c).size for c in chunks] == [c.samples.size for c in mine]
        assert float(np.abs(audio - want).max()) <= AUDIO_ATOL, (kw["mode"], float(np.abs(audio - want).max()))

"""The two Ray Serve deployments: model replicas and the ingress (gRPC and HTTP)."""
from __future__ import annotations

import logging

from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.handle import DeploymentHandle

from async_cosyvoice.config import Config
from async_cosyvoice.heap import HeapTrimmer, fix_mmap_threshold
from async_cosyvoice.placement import create_synthesizer
from async_cosyvoice.rules import RequestRules
from async_cosyvoice.speaker_store import open_speaker_store
from async_cosyvoice.request import Audio, SynthesisRequest
from async_cosyvoice.request_front import MAX_STREAM_SENTENCE_CHARS
from grpc_async.auth import BearerToken
from grpc_async.metrics import Metrics
from grpc_async.servicer import CosyVoiceServicer
from http_api import Backend, create_app

from .context import serve_streaming, serve_unary
from .remote import RemoteSynthesizer, ServedBy

log = logging.getLogger(__name__)

# Defaults; `serve deploy` configs (deploy/ray-serve.yaml) override them per deployment.
MODEL_AUTOSCALING = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}


@serve.deployment(name="CosyVoiceModel", max_ongoing_requests=32, autoscaling_config=MODEL_AUTOSCALING,
                  health_check_period_s=5)
class CosyVoiceModel:
    """One Synthesizer per replica (its devices: the replica's `num_gpus`, `model.devices`)."""

    async def __init__(self, config_json: str):
        config = Config.model_validate_json(config_json)
        # the replica's actor process is this deployment's own: its heap policy, as the server's
        # entry point sets it (async_cosyvoice/heap.py)
        fix_mmap_threshold(config.server.heap_mmap_threshold_kib * 1024)
        self.heap = HeapTrimmer(config.server.heap_trim_seconds)
        self.synth = await create_synthesizer(config)
        self.replica = serve.get_replica_context().replica_id.to_full_id_str()

    def describe(self) -> dict:
        return {"sample_rate": self.synth.sample_rate, "replica": self.replica}

    async def synthesize(self, request: SynthesisRequest):
        yield ServedBy(self.replica)
        try:
            async for chunk in self.synth.synthesize(request):
                yield chunk
        finally:
            self.heap.stream_ended()

    async def register_speaker(self, speaker_id: str, prompt_text: str, audio: Audio, overwrite: bool):
        record = await self.synth.register_speaker(speaker_id, prompt_text, audio, overwrite=overwrite)
        return self.replica, record

    def check_health(self) -> None:
        if not self.synth.ready:
            raise RuntimeError("the synthesizer is not ready")


@serve.deployment(name="CosyVoiceIngress", max_ongoing_requests=256)
@serve.ingress()  # the app is built per replica, by __serve_build_asgi_app__
class CosyVoiceIngress:
    """Both of Ray's proxies end here. The gRPC proxy calls the methods below by RPC name, each
    running our grpc servicer's handler; the HTTP proxy calls the http_api app. As in the plain
    server, both front doors share one synthesizer (here the model deployment's handle), one
    stream limiter and one Metrics."""

    async def __init__(self, model: DeploymentHandle, config_json: str):
        config = Config.model_validate_json(config_json)
        info = await model.describe.remote()  # waits for a model replica
        metrics = Metrics()
        self.servicer = CosyVoiceServicer(config, metrics)
        self.servicer.synth = RemoteSynthesizer(model, open_speaker_store(config.speakers), info["sample_rate"],
                                                RequestRules.from_config(config),
                                                text_idle_seconds=config.limits.text_idle_seconds,
                                                max_sentence_chars=min(MAX_STREAM_SENTENCE_CHARS,
                                                                       config.limits.max_text_chars))
        self.http = Backend(config=config, metrics=metrics, limiter=self.servicer.limiter,
                            synthesizer=self.servicer._synth)
        # server.auth_token on gRPC (health exempt) is checked here, since Ray's proxy runs no
        # interceptors; the HTTP app checks it itself
        self.auth = BearerToken(config.server.auth_token) if config.server.auth_token else None

    def __serve_build_asgi_app__(self):
        return create_app(self.http)

    async def Synthesize(self, request, grpc_context):
        async for message in serve_streaming(self.servicer.Synthesize, request, grpc_context, self.auth):
            yield message

    async def StreamSynthesize(self, request_stream, grpc_context):
        async for message in serve_streaming(self.servicer.StreamSynthesize, request_stream, grpc_context,
                                             self.auth):
            yield message

    async def RegisterSpeaker(self, request, grpc_context):
        return await serve_unary(self.servicer.RegisterSpeaker, request, grpc_context, self.auth)

    async def GetSpeaker(self, request, grpc_context):
        return await serve_unary(self.servicer.GetSpeaker, request, grpc_context, self.auth)

    async def ListSpeakers(self, request, grpc_context):
        return await serve_unary(self.servicer.ListSpeakers, request, grpc_context, self.auth)

    async def DeleteSpeaker(self, request, grpc_context):
        return await serve_unary(self.servicer.DeleteSpeaker, request, grpc_context, self.auth)

    async def GetServerInfo(self, request, grpc_context):
        return await serve_unary(self.servicer.GetServerInfo, request, grpc_context, self.auth)

    # grpc.health.v1: this ingress exists once a model replica answered (see __init__); Ray
    # replaces dead model replicas behind it.
    async def Check(self, request, grpc_context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def Watch(self, request, grpc_context):
        yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

"""The Ray Serve application: `serve run ray_app.app:build config=<yaml>`.

The config is our usual YAML (plus ASYNC_COSYVOICE__* overrides, read where the app is built);
speakers should be `backend: redis` so that every replica shares them. Ray's HTTP proxy (port
8000 by default) serves the HTTP API (http_api) as it is; for gRPC, start Serve with the gRPC
proxy on, naming our servicer functions (deploy/ray-serve.yaml does):

    grpc_options:
      port: 9000
      grpc_servicer_functions: [ray_app.stubs.add_CosyVoiceServicer_to_server,
                                ray_app.stubs.add_HealthServicer_to_server]
"""
from __future__ import annotations

from ray.serve import Application

from async_cosyvoice.config import Config

from .deployments import CosyVoiceIngress, CosyVoiceModel



def build(args: dict) -> Application:
    config = Config.load(args.get("config"))
    config_json = config.model_dump_json()
    return CosyVoiceIngress.bind(CosyVoiceModel.bind(config_json), config_json)

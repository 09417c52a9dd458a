"""The HTTP front door: OpenAI-compatible `/v1/audio/speech`, voices, a text-in WebSocket and a web page.

A transport beside `grpc_async/` over the same Synthesizer, concurrency limiter, auth token and
metrics; `HttpFrontDoor` runs uvicorn in the gRPC server's event loop. The library never imports it.
"""
from .app import create_app
from .backend import Backend
from .server import HttpFrontDoor

__all__ = ["Backend", "create_app", "HttpFrontDoor"]

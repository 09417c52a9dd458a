"""async_cosyvoice on Ray Serve: model replicas behind Ray's gRPC and HTTP ingress.

    serve run ray_app.app:build config=configs/ray.yaml      # or: serve deploy deploy/ray-serve.yaml

`CosyVoiceModel` replicas each hold a Synthesizer (on their `num_gpus` devices, `model.devices`
inside a replica works as in a plain server) and autoscale on ongoing requests;
`CosyVoiceIngress` serves the cosyvoice.v1 service (all seven RPCs, the bidirectional
StreamSynthesize included) through our own servicer and the HTTP API (OpenAI /v1/audio/speech,
voices, the WebSocket, the web page) through the http_api app, both over one RemoteSynthesizer
that turns a model replica that dies under a request into UNAVAILABLE / 503 (or a retry on
another replica if no audio was sent yet). Speakers live in Redis (`speakers.backend: redis`),
so every replica sees every registration at once.
"""

# Every Ray process that touches this package can unpickle cosyvoice.v1 messages (see stubs.py).
from . import stubs  # noqa: E402,F401

"""RemoteSynthesizer: the Synthesizer interface the servicer needs, over the model deployment.

Requests go through a Ray Serve DeploymentHandle (Ray picks the replica; power of two choices on
queue length). A replica that dies under a request is handled here: if it had sent no chunk yet
the request is retried on another replica; after the first chunk the caller gets NotReady
(UNAVAILABLE: "retry"), since audio was already sent. Library errors raised in a replica
(SpeakerNotFound, InvalidRequest, ...) come back as themselves, so their status codes hold.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import AsyncIterator

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from async_cosyvoice.engine.base import EngineStats
from async_cosyvoice.errors import CosyVoiceError, NotReady
from async_cosyvoice.speakers import SpeakerStoreBase
from async_cosyvoice.tts import Audio, AudioChunk, SynthesisRequest

from .context import current_call

log = logging.getLogger(__name__)

REPLICA_TRAILER = "x-cosyvoice-replica"
ATTEMPTS = 3  # a request that has not started survives this many replica deaths minus one
_REPLICA_GONE = (RayActorError, DeploymentUnavailableError)


@dataclass(frozen=True)
class ServedBy:
    """The first item of a model replica's synthesis stream: which replica serves it."""
    replica: str


def _library_error(e: RayTaskError) -> BaseException:
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, CosyVoiceError) else e


def _tag(replica: str) -> None:
    call = current_call.get()
    if call is not None:
        call.add_trailer(REPLICA_TRAILER, replica)


class RemoteSynthesizer:
    ready = True

    def __init__(self, model: DeploymentHandle, speakers: SpeakerStoreBase, sample_rate: int):
        self.model = model
        self.speakers = speakers
        self.sample_rate = sample_rate

    async def synthesize(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        stream = self.model.options(stream=True)
        for attempt in range(1, ATTEMPTS + 1):
            started = False
            try:
                async for item in stream.synthesize.remote(request):
                    if isinstance(item, ServedBy):
                        _tag(item.replica)
                        continue
                    started = True
                    yield item
                return
            except RayTaskError as e:
                raise _library_error(e) from None
            except _REPLICA_GONE as e:
                if started or attempt == ATTEMPTS:
                    raise NotReady(f"the replica serving request {request.request_id} died "
                                   f"{'mid-stream' if started else 'before it started'}; retry") from e
                log.warning("request %s: replica died before the first chunk (%s); retrying on another",
                            request.request_id, type(e).__name__)

    def synthesize_stream(self, *args, **kwargs):
        raise NotImplementedError("StreamSynthesize is served by the ingress, one Synthesize per sentence")

    async def register_speaker(self, speaker_id: str, prompt_text: str, audio: Audio, overwrite: bool = False):
        try:
            replica, record = await self.model.register_speaker.remote(speaker_id, prompt_text, audio, overwrite)
        except RayTaskError as e:
            raise _library_error(e) from None
        except _REPLICA_GONE as e:
            # not acknowledged: it may or may not be stored; a retry with overwrite=False says which
            raise NotReady(f"the replica registering {speaker_id!r} died; retry") from e
        _tag(replica)
        return record

    def engine_stats(self) -> EngineStats:
        return EngineStats()  # each model replica reports its own; the ingress runs no engine

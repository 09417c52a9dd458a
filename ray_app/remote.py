"""RemoteSynthesizer: the Synthesizer interface the servicer needs, over the model deployment.

Requests go through a Ray Serve DeploymentHandle (Ray picks the replica; power of two choices on
queue length). A replica that dies under a request is handled here: if it had sent no chunk yet
the request is retried on another replica; after the first chunk the caller gets NotReady
(UNAVAILABLE: "retry"), since audio was already sent. Library errors raised in a replica
(SpeakerNotFound, InvalidRequest, ...) come back as themselves, so their status codes hold.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import AsyncIterator

import numpy as np
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from async_cosyvoice.engine.base import EngineStats
from async_cosyvoice.errors import CosyVoiceError, InvalidRequest, NotReady, Unsupported
from async_cosyvoice.frontend.sentences import complete_sentences
from async_cosyvoice.request import Audio, AudioChunk, SynthesisRequest
from async_cosyvoice.rules import RequestRules
from async_cosyvoice.speakers import SpeakerStoreBase
from async_cosyvoice.request_front import MAX_STREAM_SENTENCE_CHARS, checked_pieces

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
    """What the front doors (gRPC servicer, HTTP app) call on a Synthesizer: synthesis and
    registration run on a model replica; speakers are read from the shared store, and `rules`
    (the same limits as the replicas') check text before a replica is asked."""
    ready = True
    supports_bistream = False  # so StreamSynthesize's default (text_mode unset) is sentence mode here

    def __init__(self, model: DeploymentHandle, speakers: SpeakerStoreBase, sample_rate: int, rules: RequestRules,
                 text_idle_seconds: float = 30.0, max_sentence_chars: int = MAX_STREAM_SENTENCE_CHARS):
        self.model = model
        self.speakers = speakers
        self.sample_rate = sample_rate
        self.rules = rules
        self.text_idle_seconds = text_idle_seconds
        self.max_sentence_chars = max_sentence_chars

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

    async def synthesize_stream(self, text, request: SynthesisRequest, *, text_mode: str | None = None,
                                text_normalization: str | None = None) -> AsyncIterator[AudioChunk]:
        """Sentence mode across the replica boundary (also when text_mode is unset): each complete
        sentence is one Synthesize on some replica, its chunks renumbered into one stream ending
        with a final chunk. Bistream needs one LM request fed for the whole text, which a Ray
        handle call cannot be; so is its raw text feeding."""
        if text_mode == "bistream":
            raise Unsupported("text_mode 'bistream' is not served through Ray Serve (each sentence is its own "
                              "replica request); use 'sentence'")
        if text_normalization == "raw":
            raise InvalidRequest("text_normalization 'raw' feeds bistream pieces as upstream does; Ray Serve "
                                 "serves sentence mode, which normalizes whole sentences")
        index = offset = tokens = n = 0
        pieces = checked_pieces(text, self.text_idle_seconds)
        async for sentence in complete_sentences(pieces, self.max_sentence_chars):
            segment = dataclasses.replace(request, text=sentence, request_id=f"{request.request_id}.{n}")
            async for chunk in self.synthesize(segment):
                tokens += chunk.n_tokens if chunk.is_final else 0
                yield dataclasses.replace(chunk, index=index, sample_offset=offset, is_final=False, segment_index=n)
                index, offset = index + 1, offset + len(chunk.samples)
            n += 1
        if n == 0:
            raise InvalidRequest("no text was received (or only punctuation)")
        yield AudioChunk(np.zeros(0, np.float32), self.sample_rate, index, True, offset, segment_index=n - 1,
                         n_tokens=tokens)

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

    async def delete_speaker(self, speaker_id: str) -> None:
        """From the shared store. A model replica's cached flow prefix of this speaker stays until its
        LRU evicts it (prefixes are keyed by the prompt's tokens, so it is never served stale)."""
        await asyncio.to_thread(self.speakers.delete, speaker_id)

    def engine_stats(self) -> EngineStats:
        return EngineStats()  # each model replica reports its own; the ingress runs no engine

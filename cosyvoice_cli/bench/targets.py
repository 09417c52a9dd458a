"""Where requests go: a Synthesizer in this process or a server over gRPC, each yielding the audio
seconds of every chunk as it arrives; and registering the bench speaker there."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, AsyncIterator, Protocol

from .workload import SpeakerSpec, Workload

if TYPE_CHECKING:
    from async_cosyvoice.tts import Synthesizer


class Target(Protocol):
    """Where requests go. `stream` yields the audio seconds of each chunk as it arrives."""
    name: str

    def stream(self, workload: Workload, seed: int) -> AsyncIterator[float]: ...


class InProcessTarget:
    """Requests straight into a Synthesizer in this process (same event loop)."""
    name = "in-process"

    def __init__(self, synth: "Synthesizer"):
        self.synth = synth

    async def stream(self, workload: Workload, seed: int) -> AsyncIterator[float]:
        from async_cosyvoice.request import Mode, SynthesisOptions, SynthesisRequest

        opts = SynthesisOptions(stream=workload.stream, seed=seed, max_tokens=workload.tokens,
                                **({"first_hop": workload.first_hop} if workload.first_hop else {}))
        request = SynthesisRequest(Mode.ZERO_SHOT_BY_SPK_ID, text=workload.text, speaker_id=workload.speaker_id,
                                   options=opts)
        async with contextlib.aclosing(self.synth.synthesize(request)) as chunks:
            async for chunk in chunks:
                yield len(chunk.samples) / chunk.sample_rate


class GrpcTarget:
    """Requests over gRPC with `grpc_async.client.CosyVoiceClient` (pcm16 chunks)."""
    name = "grpc"

    def __init__(self, client):
        self.client = client

    async def stream(self, workload: Workload, seed: int) -> AsyncIterator[float]:
        if workload.first_hop:
            raise ValueError("first_hop is a server setting over gRPC (token2wav.first_hop)")
        request = self.client.synthesize_request(workload.text, speaker_id=workload.speaker_id,
                                                 stream=workload.stream, seed=seed, encoding="pcm16")
        if workload.tokens is not None:
            request.options.max_tokens = workload.tokens
        async for chunk in self.client.synthesize(request=request):
            yield chunk.num_samples / chunk.sample_rate if chunk.sample_rate else 0.0


async def register_in_process(synth: "Synthesizer", spec: SpeakerSpec) -> int:
    """Register (overwriting) or look up the speaker; returns its prompt speech token count."""
    if spec.register:
        record = await synth.register_speaker(spec.speaker_id, spec.prompt_text, spec.audio(), overwrite=True)
    else:
        record = synth.speakers.get(spec.speaker_id)
    return record.voice.n_tokens


async def register_grpc(client, spec: SpeakerSpec) -> float | None:
    """Register (overwriting) or look up the speaker on the server; returns its prompt seconds."""
    if spec.register:
        a = spec.audio()
        s = await client.register_speaker(spec.speaker_id, spec.prompt_text, (a.samples, a.sample_rate),
                                          overwrite=True)
    else:
        s = await client.get_speaker(spec.speaker_id)
    return float(s.prompt_seconds) if s.prompt_seconds else None

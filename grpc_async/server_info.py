"""The GetServerInfo answer: what this server offers, from its config and (once loaded) model."""
from __future__ import annotations

from importlib import metadata

from async_cosyvoice.config import Config
from async_cosyvoice.demo import served_model_name
from async_cosyvoice.placement import device_stats
from async_cosyvoice.request_front import default_text_mode
from async_cosyvoice.startup import Startup

from ._stubs import load as _load_stubs
from .encoding import DEFAULT_ENCODING, encoding_info

pb2, _ = _load_stubs()

NATIVE_SAMPLE_RATE = 24000
TEXT_MODES = {"bistream": pb2.TEXT_MODE_BISTREAM, "sentence": pb2.TEXT_MODE_SENTENCE}
TEXT_NORMALIZATIONS = {"safe": pb2.TEXT_NORMALIZATION_SAFE, "raw": pb2.TEXT_NORMALIZATION_RAW}


def _version() -> str:
    try:
        return metadata.version("async_cosyvoice")
    except metadata.PackageNotFoundError:   # run from a source tree without an install
        return "0+source"


def startup_info(startup: Startup) -> pb2.Startup:
    report = startup.report
    if report is None:
        return pb2.Startup(step=startup.status(), compile_cache=startup.compile_cache)
    return pb2.Startup(step="serving", seconds=report.total_s, compile_cache=report.compile_cache,
                       phases=[pb2.StartupPhase(name=n, seconds=s) for n, s in report.phases.items()],
                       cuda_graphs=report.captured)


def server_info(config: Config, synth, startup: Startup | None = None) -> pb2.GetServerInfoResponse:
    """`synth`: the Synthesizer, or None while the model loads; `startup`: the server's start."""
    limits = config.limits
    return pb2.GetServerInfoResponse(
        model=served_model_name(config),
        modes=[f.name for f in pb2.SynthesizeRequest.DESCRIPTOR.oneofs_by_name["mode"].fields],
        audio_encodings=encoding_info(),
        native_sample_rate=synth.sample_rate if synth is not None else NATIVE_SAMPLE_RATE,
        default_encoding=DEFAULT_ENCODING,
        limits=pb2.ServerLimits(
            max_concurrent_streams=limits.max_concurrent_streams, max_text_chars=limits.max_text_chars,
            max_prompt_seconds=limits.max_prompt_seconds, max_source_seconds=limits.max_source_seconds,
            max_forced_tokens=limits.max_forced_tokens, max_message_bytes=limits.max_message_bytes,
            max_stream_text_chars=limits.max_stream_text_chars, first_message_seconds=limits.first_message_seconds,
            max_request_bytes=limits.max_request_bytes or 0),
        engine=config.engine.kind,
        bistream=synth is not None and synth.supports_bistream,
        default_text_mode=(pb2.TEXT_MODE_UNSPECIFIED if synth is None else
                           TEXT_MODES[default_text_mode(synth.supports_bistream)]),
        ready=synth is not None and synth.ready,
        version=_version(),
        degraded=synth is not None and getattr(synth, "degraded", False),
        devices=[] if synth is None else device_infos(synth),
        startup=startup_info(startup) if startup is not None else None)


def device_infos(synth) -> list:
    """One DeviceInfo per device of a server on several devices (none with one device)."""
    stats = device_stats(synth)
    if len(stats) == 1 and stats[0].role == "all":
        return []
    return [pb2.DeviceInfo(device=s.device, role=s.role, state=s.state, active=s.active, restarts=s.restarts)
            for s in stats]

"""Which speaker store a server uses: `speakers.backend` in the config.

    directory  one safetensors file per speaker under `speakers.dir` (the embedded default;
               shared only by processes on one host)
    redis      `speakers.redis_url`: one store for every replica on every host

Both implement `speakers.SpeakerStoreBase` and store the same record bytes.
"""
from __future__ import annotations

from .config import SpeakerConfig
from .speaker_redis import RedisSpeakerStore
from .speakers import SpeakerStore, SpeakerStoreBase, VoiceFit


def open_speaker_store(config: SpeakerConfig, fit: VoiceFit | None = None) -> SpeakerStoreBase:
    """fit: the model's (`VoiceFit.of(dims)`): records that do not fit it are SpeakerCorrupt on load."""
    if config.backend == "redis":
        return RedisSpeakerStore(config.redis_url, prefix=config.redis_prefix, fit=fit,
                                 timeout=config.redis_timeout_seconds)
    return SpeakerStore(config.dir, cache_size=config.cache_size, fit=fit)

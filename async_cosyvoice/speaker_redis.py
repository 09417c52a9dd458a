"""RedisSpeakerStore: registered voices shared by every replica through one Redis server.

Keys (prefix `speakers.redis_prefix`, default `async_cosyvoice:speakers`):

    <prefix>:record:<speaker_id>   the record as `SpeakerRecord.to_bytes()` (the same bytes as a file
                                   of the directory store)
    <prefix>:index                 hash speaker_id -> JSON `SpeakerInfo` (what listing shows)

A record and its index entry change together in one Lua script, which Redis runs atomically
and writes to its append-only file as one MULTI/EXEC block, so no reader (and no restart after
a crash) sees one without the other. `put(overwrite=False)` checks and writes inside the script:
of concurrent registrations of one id on any number of replicas exactly one wins. Nothing is
cached in the process, so a registration acknowledged by one replica is visible to all at once.
Durability across a Redis crash is Redis's: run it with `appendonly yes` (and `appendfsync
always` for "acknowledged means on disk"); `persistence_problem()` reads Redis' settings (CONFIG
GET appendonly / appendfsync / save) and says what could be lost, which the server logs at start
(or refuses to start over, `speakers.redis_durability: require`).

Redis down: every call that cannot reach it (refused, reset, timed out after
`speakers.redis_timeout_seconds`) raises `StoreUnavailable` (UNAVAILABLE, not INTERNAL) and flips
`reachable`, which the server's health follows; redis-py reconnects on the next call.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from typing import Iterator

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from .errors import SpeakerExists, SpeakerNotFound, StoreUnavailable
from .speakers import SpeakerInfo, SpeakerRecord, SpeakerStoreBase, VoiceFit, validate_speaker_id

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "async_cosyvoice:speakers"

# KEYS: record key, index key. ARGV: speaker id, record bytes, info JSON, "1" to overwrite.
# Returns 1 when written, 0 when the id exists and overwrite was not asked for.
_PUT = """
if ARGV[4] ~= '1' and redis.call('EXISTS', KEYS[1]) == 1 then
    return 0
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return 1
"""

# KEYS: record key, index key. ARGV: speaker id. Returns 1 when deleted, 0 when absent.
_DELETE = """
local removed = redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return removed
"""


class RedisSpeakerStore(SpeakerStoreBase):
    """Speaker registry in Redis. Thread-safe (the client holds a connection pool)."""

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX, client: redis.Redis | None = None,
                 fit: VoiceFit | None = None, timeout: float = 5.0):
        if not prefix:
            raise ValueError("the Redis key prefix must not be empty")
        super().__init__(fit)
        self.url = url
        self.prefix = prefix
        # one quick retry (a pooled connection that died with a restarted Redis), then StoreUnavailable
        self._redis = client if client is not None else redis.Redis.from_url(
            url, socket_connect_timeout=timeout, socket_timeout=timeout,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 1))
        kw = self._redis.connection_pool.connection_kwargs
        self.where = f"redis://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"  # no password
        self._index_key = f"{prefix}:index"
        self._put = self._redis.register_script(_PUT)
        self._delete = self._redis.register_script(_DELETE)

    def __repr__(self) -> str:
        return f"RedisSpeakerStore({self.where!r}, prefix={self.prefix!r})"

    @contextlib.contextmanager
    def _reaching(self) -> Iterator[None]:
        """Around every call: connection failures -> StoreUnavailable, and `reachable` follows."""
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self._reached(False)
            raise StoreUnavailable(f"the speaker store ({self.where}) is unreachable ({e}); "
                                   "retry when the server's health is SERVING again") from None
        self._reached(True)

    def ping(self) -> None:
        with self._reaching():
            self._redis.ping()

    def persistence_problem(self) -> str | None:
        with self._reaching():
            try:
                conf = {**self._redis.config_get("appendonly"), **self._redis.config_get("appendfsync"),
                        **self._redis.config_get("save")}
            except redis.ResponseError as e:
                return (f"cannot read Redis' persistence settings at {self.where} (CONFIG GET: {e}); "
                        "acknowledged registrations survive a Redis crash only with appendonly yes and "
                        "appendfsync always")
        if conf.get("appendonly") != "yes":
            save = conf.get("save") or ""
            kept = f"only RDB snapshots (save '{save}')" if save else "no snapshots either (save '')"
            return (f"Redis at {self.where} runs with appendonly no and {kept}: registrations acknowledged "
                    "since the last snapshot are lost when Redis crashes; run it with appendonly yes and "
                    "appendfsync always")
        if conf.get("appendfsync") != "always":
            return (f"Redis at {self.where} fsyncs its append-only file {conf.get('appendfsync')!r}, not "
                    "'always': up to a second of acknowledged registrations is lost if the machine crashes; "
                    "set appendfsync always")
        return None

    def _record_key(self, speaker_id: str) -> str:
        return f"{self.prefix}:record:{speaker_id}"  # ids are validated: no ':' or spaces

    def put(self, record: SpeakerRecord, overwrite: bool = False) -> None:
        info = json.dumps(dataclasses.asdict(record.info))
        with self._reaching():
            written = self._put(keys=[self._record_key(record.speaker_id), self._index_key],
                                args=[record.speaker_id, record.to_bytes(), info, "1" if overwrite else "0"])
        if not written:
            raise SpeakerExists(
                f"speaker {record.speaker_id!r} already exists; delete it first or set overwrite")

    def get(self, speaker_id: str) -> SpeakerRecord:
        validate_speaker_id(speaker_id)
        with self._reaching():
            data = self._redis.get(self._record_key(speaker_id))
        if data is None:
            raise SpeakerNotFound(f"speaker {speaker_id!r} not found")
        try:
            record = self.decode(data, f"redis {self._record_key(speaker_id)}")
        except (ValueError, KeyError) as e:
            raise self.corrupt(speaker_id, e) from None
        if record.speaker_id != speaker_id:  # written by hand under the wrong key
            log.error("speaker store %s: key of %r holds %r", self, speaker_id, record.speaker_id)
            raise SpeakerNotFound(f"speaker {speaker_id!r} not found")
        return record

    def exists(self, speaker_id: str) -> bool:
        validate_speaker_id(speaker_id)
        with self._reaching():
            return bool(self._redis.exists(self._record_key(speaker_id)))

    def delete(self, speaker_id: str) -> None:
        validate_speaker_id(speaker_id)
        with self._reaching():
            deleted = self._delete(keys=[self._record_key(speaker_id), self._index_key], args=[speaker_id])
        if not deleted:
            raise SpeakerNotFound(f"speaker {speaker_id!r} not found")

    def infos(self) -> list[SpeakerInfo]:
        infos = []
        with self._reaching():
            index = self._redis.hgetall(self._index_key)
        for key, value in index.items():
            try:
                info = SpeakerInfo(**json.loads(value))
                if info.speaker_id != key.decode("utf-8"):
                    raise ValueError(f"index entry {key!r} describes {info.speaker_id!r}")
            except (TypeError, ValueError) as e:
                log.warning("speaker store %s: skipping index entry %r: %s", self, key, e)
                continue
            infos.append(info)
        return sorted(infos, key=lambda i: i.speaker_id)

    def close(self) -> None:
        self._redis.close()

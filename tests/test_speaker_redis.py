"""The Redis speaker store beyond the shared store tests (tests/test_speakers.py runs those on both
backends): selection by config, and SIGKILL of the server or of a client mid-registration."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import redis

from async_cosyvoice.config import Config
from async_cosyvoice.speaker_redis import RedisSpeakerStore
from async_cosyvoice.speaker_store import open_speaker_store
from async_cosyvoice.speakers import SpeakerStore

REPO = Path(__file__).resolve().parents[1]


def test_backend_is_chosen_by_config_and_environment(tmp_path, redis_server):
    config = Config.load(env={"ASYNC_COSYVOICE__SPEAKERS__BACKEND": "redis",
                              "ASYNC_COSYVOICE__SPEAKERS__REDIS_URL": redis_server.url})
    store = open_speaker_store(config.speakers)
    assert isinstance(store, RedisSpeakerStore) and store.url == redis_server.url
    assert isinstance(open_speaker_store(Config().speakers.model_copy(update={"dir": tmp_path})), SpeakerStore)
    with pytest.raises(ValueError, match="needs speakers.redis_url"):
        Config.load(env={"ASYNC_COSYVOICE__SPEAKERS__BACKEND": "redis"})


# Registers storm-0, storm-1, ... (distinct sizes and values) and prints each id once Redis has
# acknowledged it; exits when the connection goes.
_STORM = textwrap.dedent("""
    import sys
    import numpy as np
    from async_cosyvoice.speaker_redis import RedisSpeakerStore
    from async_cosyvoice.request import Voice
    from async_cosyvoice.speakers import SpeakerRecord
    store = RedisSpeakerStore(sys.argv[1], prefix="storm")
    start = int(sys.argv[2])
    for i in range(start, start + 100000):
        n = 50 + i % 200
        store.put(SpeakerRecord(f"storm-{i}", Voice(np.arange(n, dtype=np.int32), np.full((2 * n, 80), i, np.float32),
                                                    np.full(192, i, np.float32), "t", np.arange(3, dtype=np.int32))))
        print(f"storm-{i}", flush=True)
""")


def _storm(url: str, start: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _STORM, url, str(start)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _acknowledged(proc: subprocess.Popen, n: int) -> list[str]:
    acked = []
    for line in proc.stdout:
        acked.append(line.strip())
        if len(acked) == n:
            break
    assert len(acked) == n, "the registration storm stopped early"
    return acked


def _check_consistent(url: str, acked: list[str]) -> list[str]:
    """Every acknowledged record is whole; the index and the records name the same speakers."""
    store = RedisSpeakerStore(url, prefix="storm")
    client = redis.Redis.from_url(url)
    keys = sorted(k.decode().removeprefix("storm:record:") for k in client.scan_iter("storm:record:*"))
    ids = store.ids()
    assert ids == keys, "index and records disagree"
    assert set(acked) <= set(ids), f"acknowledged but lost: {sorted(set(acked) - set(ids))}"
    for speaker_id in ids:  # including one that may have landed just before the kill
        rec = store.get(speaker_id)
        i = int(speaker_id.removeprefix("storm-"))
        assert rec.voice.n_tokens == 50 + i % 200
        assert np.all(rec.voice.speech_feat == i) and np.all(rec.voice.embedding == i)
    store.close()
    client.close()
    return ids


def test_kill9_of_server_or_client_loses_nothing_acknowledged(make_redis_server):
    server = make_redis_server()
    # the server dies under a registration storm; it restarts from its append-only file
    proc = _storm(server.url, 0)
    acked = _acknowledged(proc, 40)
    server.kill()
    proc.wait(timeout=60)
    acked += [line.strip() for line in proc.stdout]  # acks printed just before the kill
    server.start()
    ids = _check_consistent(server.url, acked)
    assert len(ids) in (len(acked), len(acked) + 1)  # at most the one in flight also landed

    # a client dies mid-storm: what it had acknowledged stays, nothing half-written shows
    proc = _storm(server.url, 10000)
    acked2 = _acknowledged(proc, 40)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    acked2 += [line.strip() for line in proc.stdout]
    _check_consistent(server.url, acked + acked2)

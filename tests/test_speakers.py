"""Speaker stores: records, persistence, ids, pagination, concurrency, crash safety, spk2info.pt.

Tests taking `open_store` run against both backends (the folder and a real redis-server)."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
from safetensors.numpy import save as st_save

from async_cosyvoice.config import SpeakerConfig
from async_cosyvoice.errors import InvalidRequest, SpeakerCorrupt, SpeakerExists, SpeakerNotFound
from async_cosyvoice.request import Voice
from async_cosyvoice.speaker_store import open_speaker_store
from async_cosyvoice.speakers import (MAX_ID_LENGTH, SpeakerRecord, SpeakerStore, VoiceFit, speaker_file_name,
                                      validate_speaker_id)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["directory", "redis"])
def store_config(request, tmp_path) -> SpeakerConfig:
    """One empty store per test: a folder, or a fresh key prefix on the session's redis-server."""
    if request.param == "directory":
        return SpeakerConfig(dir=tmp_path / "store")
    server = request.getfixturevalue("redis_server")
    return SpeakerConfig(backend="redis", redis_url=server.url, redis_prefix=f"test-{uuid.uuid4().hex}")


@pytest.fixture
def open_store(store_config):
    """Opens another handle on the test's store (as another replica would)."""
    return lambda: open_speaker_store(store_config)


def make_record(speaker_id: str, n_tokens: int = 12, value: float = 0.5, text: str = "hello") -> SpeakerRecord:
    rng = np.random.default_rng(abs(hash((speaker_id, n_tokens, value))) % 2**32)
    return SpeakerRecord(speaker_id, Voice(
        prompt_text=text, prompt_text_tokens=rng.integers(0, 1000, 7, dtype=np.int32),
        speech_tokens=rng.integers(0, 6561, n_tokens, dtype=np.int32),
        speech_feat=np.full((2 * n_tokens, 80), value, np.float32),
        embedding=np.full(192, value, np.float32)))


def test_round_trip(open_store):
    store = open_store()
    rec = make_record("alice", text="The morning train.")
    store.put(rec)
    again = open_store().get("alice")  # a fresh handle reads it back
    assert again.same_data(rec)
    assert again.created_at == pytest.approx(rec.created_at)
    for name, dtype in (("prompt_text_tokens", np.int32), ("speech_tokens", np.int32),
                        ("speech_feat", np.float32), ("embedding", np.float32)):
        assert getattr(again.voice, name).dtype == dtype
    assert again.voice.speech_feat.shape == (24, 80)
    info = store.list().speakers[0]
    assert (info.speaker_id, info.kind, info.prompt_text, info.n_speech_tokens) == ("alice", "zero_shot",
                                                                                     "The morning train.", 12)
    assert "alice" in store and "bob" not in store and "../x" not in store


def test_sft_record_round_trip(open_store):
    store = open_store()
    store.put(SpeakerRecord.sft("narrator", np.arange(192, dtype=np.float32)))
    rec = store.get("narrator")
    assert rec.kind == "sft" and rec.voice.n_tokens == 0 and rec.voice.speech_feat.shape == (0, 80)
    np.testing.assert_array_equal(rec.voice.embedding, np.arange(192, dtype=np.float32))


def test_record_validation():
    with pytest.raises(InvalidRequest, match="frames, expected 2 x 12"):
        SpeakerRecord("a", Voice(np.zeros(12, np.int32), np.zeros((23, 80), np.float32), np.zeros(192, np.float32)))
    with pytest.raises(InvalidRequest, match="kind"):
        Voice([], np.zeros((0, 80)), np.zeros(192), kind="pickle")
    with pytest.raises(InvalidRequest, match="non-finite"):
        SpeakerRecord.sft("a", np.full(192, np.nan))
    with pytest.raises(InvalidRequest, match="integer"):
        Voice(np.zeros(1, np.float32), np.zeros((2, 80), np.float32), np.zeros(192, np.float32))
    with pytest.raises(InvalidRequest, match="embedding only"):
        Voice(np.zeros(0, np.int32), np.zeros((0, 80)), np.zeros(192), prompt_text="hi", kind="sft")
    with pytest.raises(InvalidRequest, match="speaker_id"):
        SpeakerRecord("../x", Voice.embedding_only(np.zeros(192)))


def test_overwrite_rules(open_store):
    store = open_store()
    store.put(make_record("alice", value=0.1))
    with pytest.raises(SpeakerExists, match="'alice' already exists"):
        store.put(make_record("alice", value=0.2))
    assert store.get("alice").voice.embedding[0] == np.float32(0.1)  # untouched
    store.put(make_record("alice", value=0.2), overwrite=True)
    assert store.get("alice").voice.embedding[0] == np.float32(0.2)
    store.delete("alice")
    with pytest.raises(SpeakerNotFound, match="'alice' not found"):
        store.get("alice")
    with pytest.raises(SpeakerNotFound):
        store.delete("alice")
    store.put(make_record("alice", value=0.3))  # free again after delete


@pytest.mark.parametrize("bad, message", [
    ("", "empty"),
    ("../x", "contains '/'"),
    ("a/b", "contains '/'"),
    ("a\\b", "contains"),
    ("x" * (MAX_ID_LENGTH + 1), "65 characters long; the limit is 64"),
    (".hidden", "must not start with '.'"),
    ("..", "must not start with '.'"),
    ("a b", "contains ' '"),
    ("名字", "contains"),
    ("a\x00b", "contains"),
])
def test_bad_ids(open_store, bad, message):
    store = open_store()
    with pytest.raises(InvalidRequest, match=message):
        validate_speaker_id(bad)
    with pytest.raises(InvalidRequest, match=message):
        store.get(bad)
    with pytest.raises(InvalidRequest, match=message):
        store.delete(bad)
    with pytest.raises(InvalidRequest, match=message):
        make_record(bad)
    assert store.ids() == []


def test_good_ids_and_file_names(tmp_path):
    store = SpeakerStore(tmp_path)
    ids = ["a", "A-b_c.d", "x" * MAX_ID_LENGTH, "0", "-dash", "a..b"]
    for i in ids:
        store.put(make_record(i))
    names = sorted(os.listdir(tmp_path))
    assert names == sorted([".lock"] + [speaker_file_name(i) for i in ids])
    assert all(re.fullmatch(r"[0-9a-f]{64}\.safetensors", n) for n in names if n != ".lock")  # never raw ids
    assert store.ids() == sorted(ids)


def test_pagination(open_store):
    store = open_store()
    ids = [f"spk{i:02d}" for i in range(25)]
    for i in reversed(ids):
        store.put(SpeakerRecord.sft(i, np.ones(192)))
    seen, token, pages = [], "", 0
    while True:
        page = store.list(page_size=10, page_token=token)
        assert len(page.speakers) <= 10
        seen += [s.speaker_id for s in page.speakers]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert seen == ids and pages == 3
    assert [s.speaker_id for s in store.list().speakers] == ids  # 0 -> default page size
    assert store.list(page_size=25).next_page_token == ""
    # a token stays valid when the speaker it points at is deleted
    page = store.list(page_size=5)
    store.delete("spk04")
    assert store.list(page_size=5, page_token=page.next_page_token).speakers[0].speaker_id == "spk05"
    with pytest.raises(InvalidRequest, match="page_token is not valid"):
        store.list(page_token="!!!not-a-token")
    with pytest.raises(InvalidRequest, match="page_size"):
        store.list(page_size=-1)


def test_lru_cache_is_bounded_and_sees_other_writers(tmp_path):
    store = SpeakerStore(tmp_path, cache_size=2)
    for i in range(4):
        store.put(make_record(f"s{i}", value=i))
        store.get(f"s{i}")
    assert len(store._cache) == 2 and list(store._cache) == ["s2", "s3"]
    assert store.get("s3") is store.get("s3")  # served from the cache
    SpeakerStore(tmp_path).put(make_record("s3", value=9.0), overwrite=True)  # another writer
    assert store.get("s3").voice.embedding[0] == np.float32(9.0)
    SpeakerStore(tmp_path).delete("s2")
    with pytest.raises(SpeakerNotFound):
        store.get("s2")


def test_concurrent_registrations_threads(open_store):
    store = open_store()
    barrier = threading.Barrier(16)
    outcomes: list[str] = []
    lock = threading.Lock()

    def worker(k: int):
        barrier.wait()
        store.put(make_record(f"own{k}", value=k))
        try:
            store.put(make_record("shared", value=k))
            result = f"won{k}"
        except SpeakerExists:
            result = "exists"
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [o for o in outcomes if o.startswith("won")]
    assert len(winners) == 1 and outcomes.count("exists") == 15
    k = int(winners[0][3:])
    assert store.get("shared").voice.embedding[0] == np.float32(k)
    assert store.ids() == sorted(["shared"] + [f"own{k}" for k in range(16)])


def test_overwrites_never_tear_reads(open_store):
    store = open_store()
    store.put(make_record("v", n_tokens=400, value=0.0))
    stop = threading.Event()
    errors = []

    def writer(k):
        i = 0
        while not stop.is_set():
            open_store().put(make_record("v", n_tokens=400, value=float(k * 1000 + i)), overwrite=True)
            i += 1

    def reader():
        reader_store = open_store()
        for _ in range(200):
            rec = reader_store.get("v")
            value = rec.voice.embedding[0]
            if not (np.all(rec.voice.embedding == value) and np.all(rec.voice.speech_feat == value)):
                errors.append("torn record")

    writers = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    readers = [threading.Thread(target=reader) for _ in range(3)]
    for t in writers + readers:
        t.start()
    for t in readers:
        t.join()
    stop.set()
    for t in writers:
        t.join()
    assert not errors


_PROCESS_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from async_cosyvoice.errors import SpeakerExists
    from async_cosyvoice.config import SpeakerConfig
    from async_cosyvoice.speaker_store import open_speaker_store
    from async_cosyvoice.speakers import SpeakerRecord
    store, k = open_speaker_store(SpeakerConfig.model_validate_json(sys.argv[1])), int(sys.argv[2])
    for i in range(5):
        store.put(SpeakerRecord.sft(f"p{k}-{i}", np.full(192, k, np.float32)))
    try:
        store.put(SpeakerRecord.sft("shared", np.full(192, k, np.float32)))
        print("won")
    except SpeakerExists:
        print("exists")
""")


def test_concurrent_registrations_processes(store_config, open_store):
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS_WRITER, store_config.model_dump_json(), str(k)],
                              stdout=subprocess.PIPE, text=True, cwd=REPO) for k in range(4)]
    results = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(results) == ["exists", "exists", "exists", "won"]
    store = open_store()
    assert len(store) == 21
    assert store.get("shared").voice.embedding[0] == np.float32(results.index("won"))


# A writer that dies (os._exit, no cleanup, like SIGKILL) after the first 1 MiB block of the
# temporary file plus a partial second block reached the disk.
_CRASHING_WRITER = textwrap.dedent("""
    import os, sys
    import numpy as np
    from async_cosyvoice import speakers
    from async_cosyvoice.request import Voice
    store = speakers.SpeakerStore(sys.argv[1])
    real_write, calls = os.write, [0]
    def dying_write(fd, data):
        calls[0] += 1
        if calls[0] == 2:
            real_write(fd, bytes(data[:5000]))
            os._exit(17)
        return real_write(fd, data)
    speakers.os.write = dying_write
    n = 8000  # 8000 x 2 x 80 float32 = 5 MiB of features: several blocks
    rec = speakers.SpeakerRecord(sys.argv[2], Voice(np.arange(n, dtype=np.int32) % 6561,
                                                    np.full((2 * n, 80), 7.0, np.float32),
                                                    np.full(192, 7.0, np.float32), "new", np.arange(3, dtype=np.int32)))
    store.put(rec, overwrite=True)
    os._exit(0)
""")


def _crash_write(directory: Path, speaker_id: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _CRASHING_WRITER, str(directory), speaker_id],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 17, proc.stderr


def test_crash_during_overwrite_keeps_old_record(tmp_path):
    store = SpeakerStore(tmp_path)
    old = make_record("victim", value=0.25)
    store.put(old)
    _crash_write(tmp_path, "victim")
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    assert leftovers and os.path.getsize(tmp_path / leftovers[0]) > (1 << 20)  # really died mid-write
    assert store.get("victim").same_data(old)            # the running store still reads the old one
    assert store.ids() == ["victim"]                      # and lists it once, ignoring the temp file
    fresh = SpeakerStore(tmp_path)                        # reopening cleans the debris
    assert fresh.get("victim").same_data(old)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    fresh.put(make_record("victim", value=0.5), overwrite=True)  # lock was released by the dead writer
    assert fresh.get("victim").voice.embedding[0] == np.float32(0.5)


def test_crash_during_first_write_leaves_nothing(tmp_path):
    store = SpeakerStore(tmp_path)
    store.put(make_record("bystander"))
    _crash_write(tmp_path, "newbie")
    with pytest.raises(SpeakerNotFound):
        store.get("newbie")
    assert SpeakerStore(tmp_path).ids() == ["bystander"]


def test_corrupt_file_is_skipped_in_listing(tmp_path):
    store = SpeakerStore(tmp_path)
    store.put(make_record("good"))
    (tmp_path / speaker_file_name("bad")).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert store.ids() == ["good"]
    with pytest.raises(SpeakerCorrupt, match="'bad'.*registered again"):
        store.get("bad")


# ---- upstream spk2info.pt --------------------------------------------------------------------


def test_import_fixture_spk2info_matches_golden(open_store, tiny_dir, golden_dir):
    store = open_store()
    imported = store.import_spk2info(tiny_dir / "spk2info.pt")
    assert sorted(imported) == ["tiny_sft_spk", "tiny_zs_spk"]
    golden = np.load(golden_dir / "model_inputs.npz")

    zs = open_store().get("tiny_zs_spk")
    assert zs.kind == "zero_shot"
    np.testing.assert_array_equal(zs.voice.prompt_text_tokens, golden["zero_shot_spk/prompt_text"][0])
    np.testing.assert_array_equal(zs.voice.speech_tokens, golden["zero_shot_spk/llm_prompt_speech_token"][0])
    np.testing.assert_array_equal(zs.voice.speech_tokens, golden["zero_shot_spk/flow_prompt_speech_token"][0])
    np.testing.assert_array_equal(zs.voice.speech_feat, golden["zero_shot_spk/prompt_speech_feat"][0])
    np.testing.assert_array_equal(zs.voice.embedding, golden["zero_shot_spk/llm_embedding"][0])
    np.testing.assert_array_equal(zs.voice.embedding, golden["zero_shot_spk/flow_embedding"][0])
    assert zs.voice.speech_tokens.dtype == np.int32 and zs.voice.speech_feat.dtype == np.float32

    sft = store.get("tiny_sft_spk")
    assert sft.kind == "sft"
    np.testing.assert_array_equal(sft.voice.embedding, golden["sft/flow_embedding"][0])
    np.testing.assert_array_equal(sft.voice.embedding, golden["sft/llm_embedding"][0])

    with pytest.raises(SpeakerExists, match="tiny_sft_spk, tiny_zs_spk"):
        store.import_spk2info(tiny_dir / "spk2info.pt")
    assert sorted(store.import_spk2info(tiny_dir / "spk2info.pt", rename={"tiny_zs_spk": "copy"},
                                        overwrite=True)) == ["copy", "tiny_sft_spk"]
    assert store.get("copy").same_data(zs.replace_id("copy"))


def test_export_round_trips_to_upstream_layout(open_store, tmp_path, tiny_dir):
    import torch

    store = open_store()
    store.import_spk2info(tiny_dir / "spk2info.pt")
    out = tmp_path / "exported.pt"
    assert sorted(store.export_spk2info(out)) == ["tiny_sft_spk", "tiny_zs_spk"]
    original = torch.load(tiny_dir / "spk2info.pt", weights_only=True)
    exported = torch.load(out, weights_only=True)
    assert exported.keys() == original.keys()
    for spk, entry in original.items():
        assert exported[spk].keys() == entry.keys()
        for key, value in entry.items():
            assert torch.equal(exported[spk][key].to(value.dtype), value), (spk, key)


def test_import_rejects_invalid_ids(open_store, tmp_path):
    import torch

    bad = tmp_path / "bad.pt"
    torch.save({"中文女": {"embedding": torch.zeros(1, 192)}}, bad)
    store = open_store()
    with pytest.raises(InvalidRequest, match="rename"):
        store.import_spk2info(bad)
    assert store.ids() == []
    assert store.import_spk2info(bad, rename={"中文女": "zh_female"}) == ["zh_female"]


# ---- records you can trust: a checksum, old records, a fit to the model (issue 26 item 5) --------

def _raw(store, speaker_id: str) -> bytes:
    if isinstance(store, SpeakerStore):
        return (store.dir / speaker_file_name(speaker_id)).read_bytes()
    return redis.Redis.from_url(store.url).get(store._record_key(speaker_id))


def _write_raw(store, speaker_id: str, data: bytes) -> None:
    if isinstance(store, SpeakerStore):
        (store.dir / speaker_file_name(speaker_id)).write_bytes(data)
    else:
        redis.Redis.from_url(store.url).set(store._record_key(speaker_id), data)


def test_a_flipped_byte_in_array_data_is_data_loss(open_store):
    store = open_store()
    store.put(make_record("flipped", n_tokens=40))
    store.put(make_record("intact", n_tokens=40))
    data = bytearray(_raw(store, "flipped"))
    data_start = 8 + int.from_bytes(data[:8], "little")
    data[data_start + (len(data) - data_start) // 2] ^= 0x10  # inside speech_feat: still a valid file
    _write_raw(store, "flipped", bytes(data))
    fresh = open_store()
    with pytest.raises(SpeakerCorrupt, match=r"speaker 'flipped': the stored record is unreadable .*registered again"):
        fresh.get("flipped")
    assert fresh.get("intact").same_data(make_record("intact", n_tokens=40))
    with pytest.raises(ValueError, match="checksum mismatch"):
        SpeakerRecord.from_bytes(bytes(data))


def test_records_without_a_checksum_are_read_with_a_warning(open_store, caplog):
    """Format 1 (before checksums) stays readable; overwriting it writes format 2."""
    record = make_record("old_one", n_tokens=20)
    meta = {"format": "async_cosyvoice.speaker", "version": "1", "speaker_id": "old_one", "kind": "zero_shot",
            "prompt_text": record.prompt_text, "n_speech_tokens": "20", "created_at": repr(record.created_at)}
    store = open_store()
    store.put(make_record("old_one", n_tokens=5))  # the index entry (Redis); replaced below
    _write_raw(store, "old_one", st_save(record._arrays(), metadata=meta))
    fresh = open_store()
    with caplog.at_level(logging.WARNING, logger="async_cosyvoice.speakers"):
        assert fresh.get("old_one").same_data(record)
        fresh.get("old_one")
    warnings = [r for r in caplog.records if "has no checksum (format version 1)" in r.getMessage()]
    assert len(warnings) == 1  # once per speaker, not per read
    fresh.put(record, overwrite=True)
    assert b'"version":"2"' in _raw(fresh, "old_one") and b"sha256:" in _raw(fresh, "old_one")


def test_records_that_do_not_fit_the_model_are_data_loss(store_config, open_store):
    fit = VoiceFit(speech_vocab=6561, mel_bins=80, embedding_dim=192)
    store = open_speaker_store(store_config, fit=fit)
    good = make_record("fits", n_tokens=30)
    tokens = good.voice.speech_tokens.copy()
    tokens[3] = 6561  # one past the vocabulary: an IndexError in the flow's embedding if it got there
    high = SpeakerRecord("too_high", Voice(tokens, good.voice.speech_feat, good.voice.embedding, "hi",
                                           good.voice.prompt_text_tokens))
    tokens = tokens.copy()
    tokens[3] = -1
    negative = SpeakerRecord("negative", Voice(tokens, good.voice.speech_feat, good.voice.embedding, "hi",
                                               good.voice.prompt_text_tokens))
    wide = SpeakerRecord("wide_mel", Voice(good.voice.speech_tokens, np.zeros((60, 100), np.float32),
                                           good.voice.embedding, "hi", good.voice.prompt_text_tokens))
    for record in (good, high, negative, wide):
        open_store().put(record)  # a store without a model accepts them (import, CLI)
    assert store.get("fits").same_data(good)
    with pytest.raises(SpeakerCorrupt, match=r"'too_high': the stored record does not fit this model \(1 speech "
                                             r"token\(s\) outside the model's vocabulary 0\.\.6560, the first 6561 "
                                             r"at position 3\) and must be registered again"):
        store.get("too_high")
    with pytest.raises(SpeakerCorrupt, match=r"the first -1 at position 3"):
        store.get("negative")
    with pytest.raises(SpeakerCorrupt, match="100 mel bins wide, the model's 80"):
        store.get("wide_mel")
    if isinstance(store, SpeakerStore):  # the start-up scan reports them too
        bad = dict(store.unreadable_records())
        assert set(bad) == {speaker_file_name(i) for i in ("too_high", "negative", "wide_mel")}

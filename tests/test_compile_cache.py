"""The persistent compile cache (async_cosyvoice/compile_cache.py): a key mismatch is ignored with one
log line and never handed to torch, a damaged file is ignored and rebuilt, a hit loads torch's
artifacts so the next compile hits inductor's cache (and, with precompile, Dynamo's)."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from torch._dynamo.utils import counters
from torch.compiler._cache import CacheArtifactManager

from async_cosyvoice.compile_cache import (
    CompileCacheKey,
    CorruptCache,
    PersistentCompileCache,
    artifacts_path,
    decode,
    encode,
    model_fingerprint,
    open_compile_cache,
    use_compile_cache,
)
from async_cosyvoice.config import Config

KEY = CompileCacheKey({"torch": torch.__version__, "device": "NVIDIA H200 sm90", "model": "abc"})


def cache_at(tmp_path, key=KEY) -> PersistentCompileCache:
    return PersistentCompileCache(artifacts_path(tmp_path, "server"), key)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.endswith("compile_cache")]


def test_encode_decode_round_trip():
    stored, payload = decode(encode(KEY, b"payload bytes"))
    assert stored == KEY.fields and payload == b"payload bytes"


def test_missing_file_is_a_miss(tmp_path, caplog):
    cache = cache_at(tmp_path)
    assert cache.load() == "miss"
    assert warnings_of(caplog) == []


def test_key_mismatch_is_ignored_with_one_line_and_never_loaded(tmp_path, caplog):
    other = CompileCacheKey({**KEY.fields, "device": "NVIDIA A100 sm80", "torch": "2.11.0"})
    # a payload torch could not read: were it handed to torch, the outcome would be "corrupt"
    artifacts_path(tmp_path, "server").parent.mkdir(parents=True)
    artifacts_path(tmp_path, "server").write_bytes(encode(other, b"not torch's format"))
    cache = cache_at(tmp_path)
    with caplog.at_level(logging.INFO):
        assert cache.load() == "mismatch"
    lines = warnings_of(caplog)
    assert len(lines) == 1
    assert "device: NVIDIA A100 sm80 -> NVIDIA H200 sm90" in lines[0] and "torch: 2.11.0 ->" in lines[0]
    assert cache.loaded == set()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "bad header", "torch cannot read it"])
def test_damaged_file_is_ignored_never_raised(tmp_path, caplog, damage):
    path = artifacts_path(tmp_path, "server")
    path.parent.mkdir(parents=True)
    good = encode(KEY, b"x" * 1000)
    path.write_bytes({
        "garbage": b"\x00\x01garbage",
        "truncated": good[:-10],
        "bad header": good[:len(b"ACVCOMPILE\n")] + b"\xff\xff\x00\x00{",
        "torch cannot read it": good,  # header and checksum fine, the blob is not torch's
    }[damage])
    cache = cache_at(tmp_path)
    assert cache.load() == "corrupt"
    assert len(warnings_of(caplog)) == 1


def test_decode_rejects_a_bad_checksum():
    data = bytearray(encode(KEY, b"abcdef"))
    data[-1] ^= 1
    with pytest.raises(CorruptCache, match="checksum"):
        decode(bytes(data))


def test_model_fingerprint_follows_contents_not_mtime(tmp_path, tiny_dir):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("cosyvoice2.yaml", "hift.pt"):
        shutil.copy(tiny_dir / name, model / name)
    first = model_fingerprint(model)
    os.utime(model / "hift.pt", (1, 1))  # a copy or a re-download: same bytes, another mtime
    assert model_fingerprint(model) == first
    with open(model / "cosyvoice2.yaml", "a") as f:  # another hyperparameter: another model
        f.write("\n# changed\n")
    assert model_fingerprint(model) != first


def test_key_covers_torch_device_model_dtypes_and_graph_config(tiny_dir):
    config = Config()
    key = CompileCacheKey.for_server(config, tiny_dir, torch.device("cpu"))
    assert {"torch", "cuda", "device", "model", "dtypes", "graph_config"} <= set(key.fields)
    bigger = config.model_copy(update={"engine": config.engine.model_copy(update={"max_num_seqs": 128})})
    assert CompileCacheKey.for_server(bigger, tiny_dir, torch.device("cpu")).differences(key.fields) == [
        f"graph_config: {key.fields['graph_config']} -> "
        f"{CompileCacheKey.for_server(bigger, tiny_dir, torch.device('cpu')).fields['graph_config']}"]


def test_precompile_is_switched_on_and_its_expected_guard_warnings_are_quiet(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "recorded, so that teardown restores what was there")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    config = Config.model_validate({"warmup": {"precompile": True, "compile_cache_dir": str(tmp_path / "tc")}})
    guards = logging.getLogger("torch._dynamo.guards")
    with torch._dynamo.config.patch(caching_precompile=False):
        assert use_compile_cache(config) == tmp_path / "tc"
        assert torch._dynamo.config.caching_precompile
        with caplog.at_level(logging.WARNING, logger=guards.name):
            guards.warning("MODULE_MATCH guard on G['torch'] is dropped with caching_precompile=True.")
            guards.warning("another guard warning")
    assert [r.getMessage() for r in caplog.records if r.name == guards.name] == ["another guard warning"]


def test_a_file_saved_without_precompile_is_not_used_with_it(tmp_path, tiny_dir, caplog):
    """Switching warmup.precompile makes the stored file another setup's: one log line, not loaded."""
    configs = [Config.model_validate({"warmup": {"precompile": p, "compile_cache_dir": str(tmp_path)}})
               for p in (False, True)]
    keys = [CompileCacheKey.for_server(c, tiny_dir, torch.device("cpu")) for c in configs]
    path = artifacts_path(tmp_path, "server")
    path.parent.mkdir(parents=True)
    path.write_bytes(encode(keys[0], b"not torch's format"))  # handed to torch, this would be "corrupt"
    cache = PersistentCompileCache(path, keys[1])
    assert cache.load() == "mismatch"
    assert warnings_of(caplog) == [w for w in warnings_of(caplog) if "precompile: False -> True" in w]
    assert len(warnings_of(caplog)) == 1


def test_open_compile_cache_off(tmp_path, tiny_dir):
    config = Config.model_validate({"warmup": {"persistent_compile_cache": False, "compile_cache_dir": str(tmp_path)}})
    assert open_compile_cache(config, tiny_dir, torch.device("cpu")) is None


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.proj(x)) * 2 + 1


def compile_tiny() -> None:
    torch.manual_seed(0)
    fn = torch.compile(Tiny(), dynamic=True)
    with torch.inference_mode():
        fn(torch.randn(3, 8))


@pytest.fixture
def fresh_compiler(tmp_path, monkeypatch):
    """A 'process' of torch.compile with empty caches: its own inductor folder, Dynamo reset."""
    def fresh(name: str) -> None:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / name))
        torch._dynamo.reset()
        counters.clear()
        CacheArtifactManager.clear()  # what this "process" compiled: nothing yet
    yield fresh
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("precompile", [False, True])
def test_a_hit_loads_compiled_code_and_a_damaged_file_is_rebuilt(tmp_path, fresh_compiler, precompile):
    with torch._dynamo.config.patch(caching_precompile=precompile):
        hit_after_a_damaged_file(tmp_path, fresh_compiler, precompile)


def hit_after_a_damaged_file(tmp_path, fresh_compiler, precompile: bool) -> None:
    key = CompileCacheKey({**KEY.fields, "precompile": str(precompile)})
    path = artifacts_path(tmp_path / "store", "server")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"damaged by a crash")

    # first start: the damaged file is ignored; after the compile it is rebuilt
    fresh_compiler("first")
    first = PersistentCompileCache(path, key)
    assert first.load() == "corrupt"
    compile_tiny()
    assert counters["inductor"]["fxgraph_cache_miss"] >= 1
    assert first.save()
    assert decode(path.read_bytes())[0] == key.fields

    # a restart on an empty inductor folder: the file's artifacts make the compile a cache hit
    fresh_compiler("second")
    second = PersistentCompileCache(path, key)
    assert second.load() == "hit" and second.loaded
    # precompile's own entry (Dynamo's traced frame) travels in the same file, only when it is on
    assert ("precompile" in {kind for kind, _ in second.loaded}) is precompile
    compile_tiny()
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1
    assert counters["inductor"]["fxgraph_cache_miss"] == 0
    if precompile:  # Dynamo's traced frame came from the file: no tracing
        assert counters["dynamo_cache"]["dynamo_cache_hit"] == 1
    before = path.read_bytes()
    if precompile:
        # torch 2.13 records an AOTAutograd entry under a new key behind a Dynamo cache hit here, so
        # the file may be rewritten; it must stay a valid cache of this key
        second.save()
        assert decode(path.read_bytes())[0] == key.fields
    else:
        assert not second.save()  # nothing new was compiled: the file is left as it is
        assert path.read_bytes() == before


@pytest.mark.slow
def test_without_the_file_the_same_compile_misses(tmp_path, fresh_compiler):
    """The control of the test above: the hit came from the file, not from this process's memory."""
    fresh_compiler("warm")
    compile_tiny()
    fresh_compiler("cold")
    compile_tiny()
    assert counters["inductor"]["fxgraph_cache_miss"] >= 1
    assert counters["inductor"]["fxgraph_cache_hit"] == 0

"""torch.compile's work kept across restarts, in one file per process role, keyed by what it depends on.

torch.compile writes inductor's FX graphs, AOTAutograd entries and Triton kernels into a cache
folder (`warmup.use_compile_cache`), but a restart still spends tens of seconds in it, and a fresh
machine starts from nothing. torch's portable "mega-cache" (`torch.compiler.save_cache_artifacts()`
/ `load_cache_artifacts()`) bundles everything this process compiled into one blob that a later
process hot-loads into its caches before it compiles: the compile then hits instead of generating
code. With `precompile` on (torch's experimental `torch._dynamo.config.caching_precompile`) the blob
also holds Dynamo's traced frames, so a hit skips Dynamo's tracing too (measured on the H200:
~40 s of a restart were Dynamo re-tracing with inductor's cache warm).

The file is `<compile cache dir>/artifacts/<role>.bin`: a header (the key, as JSON, and the
payload's sha256) then the blob. The key (`CompileCacheKey`) holds torch's and CUDA's versions, the
GPU's name and compute capability, a fingerprint of the model files, the dtypes and a hash of the
config sections that shape the compiled graphs (engine, token2wav). A file made under another key
is ignored with one log line (which fields differ) and replaced after this start's warm-up; a file
that is damaged in any way (truncated, a bad checksum, a blob torch cannot read) is ignored with one
log line and rebuilt; neither ever stops the start.

Model fingerprint: each weight/config file's name, size and a sha256 of its first and last MiB,
not a full hash (the LLM alone is ~2 GB, seconds to read on every start, more on network storage)
and not its mtime (a copy, a re-download or an image layer changes the mtime of identical weights,
which would make every deploy a cold start). It tells one model architecture from another: the
yaml with every hyperparameter is small and hashed whole, and a torch checkpoint's first MiB holds
its pickled tensor list (names, shapes, dtypes). Two checkpoints of the same shapes that differ only
in their middle bytes (a fine-tune) share a fingerprint, which is right: inductor compiles weights
as inputs, not constants (freezing is off), so their kernels are the same.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from .files import atomic_write_bytes, cache_root

if TYPE_CHECKING:
    from .config import Config

log = logging.getLogger(__name__)

FORMAT_VERSION = "1"      # of the file layout; a new one invalidates old files
MAGIC = b"ACVCOMPILE\n"   # the file's first bytes
_HEADER_LEN = struct.Struct("<I")
FINGERPRINT_BYTES = 1 << 20  # hashed at each end of a model file
MODEL_FILE_SUFFIXES = (".yaml", ".pt", ".pth", ".safetensors")
Outcome = Literal["off", "hit", "miss", "mismatch", "corrupt"]


def compile_in_use(config: Config) -> bool:
    """Whether anything will be torch.compile'd or captured as a CUDA graph."""
    return config.model.device.startswith("cuda") and (
        config.engine.cuda_graphs or config.engine.compile or config.token2wav.estimator == "compiled")


def file_fingerprint(path: Path) -> str:
    """sha256 over the size and the first and last FINGERPRINT_BYTES of a file (the whole of a small one)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(FINGERPRINT_BYTES))
        if size > FINGERPRINT_BYTES:
            f.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
            h.update(f.read())
    return h.hexdigest()


def model_fingerprint(model_dir: Path) -> str:
    """One hash over the model directory's weight and yaml files (see the module docstring)."""
    h = hashlib.sha256()
    for path in sorted(p for p in Path(model_dir).iterdir() if p.is_file() and p.suffix in MODEL_FILE_SUFFIXES):
        h.update(f"{path.name}:{file_fingerprint(path)}\n".encode())
    return h.hexdigest()[:16]


def device_name(device: torch.device) -> str:
    """The GPU's name and compute capability ("NVIDIA H200 sm90"), or the device type."""
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"
    return device.type


def graph_config_hash(config: Config) -> str:
    """A hash of the config sections whose fields decide what is compiled and at which shapes."""
    shaping = {"engine": config.engine.model_dump(mode="json"), "token2wav": config.token2wav.model_dump(mode="json")}
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CompileCacheKey:
    """What a compile cache depends on; any field that differs makes a cache unusable."""
    fields: dict[str, str]

    @classmethod
    def for_server(cls, config: Config, model_dir: Path, device: torch.device) -> "CompileCacheKey":
        return cls({
            "format": FORMAT_VERSION,
            "torch": torch.__version__,
            "cuda": torch.version.cuda or "none",
            "device": device_name(device),
            "model": model_fingerprint(model_dir),
            "dtypes": f"llm={config.model.llm_dtype} flow={config.model.flow_dtype}",
            "graph_config": graph_config_hash(config),
            "precompile": str(config.warmup.precompile),
        })

    def differences(self, other: dict) -> list[str]:
        """'name: theirs -> ours' for every field that differs from `other` (a stored key)."""
        names = sorted(set(self.fields) | set(other))
        return [f"{n}: {other.get(n, '-')} -> {self.fields.get(n, '-')}" for n in names if other.get(n) != self.fields.get(n)]


class CorruptCache(Exception):
    """The file is not a compile cache this code wrote in full."""


def encode(key: CompileCacheKey, payload: bytes) -> bytes:
    header = json.dumps({"key": key.fields, "sha256": hashlib.sha256(payload).hexdigest(),
                         "created": time.time()}, sort_keys=True).encode()
    return MAGIC + _HEADER_LEN.pack(len(header)) + header + payload


def decode(data: bytes) -> tuple[dict, bytes]:
    """(stored key fields, payload); raises CorruptCache."""
    if not data.startswith(MAGIC):
        raise CorruptCache("not a compile cache file (bad magic)")
    at = len(MAGIC)
    if len(data) < at + _HEADER_LEN.size:
        raise CorruptCache("truncated header")
    (n,) = _HEADER_LEN.unpack_from(data, at)
    at += _HEADER_LEN.size
    try:
        header = json.loads(data[at:at + n])
        key, digest = header["key"], header["sha256"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCache(f"unreadable header ({e})") from None
    if not isinstance(key, dict):
        raise CorruptCache("unreadable header (key is not a mapping)")
    payload = data[at + n:]
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CorruptCache("checksum mismatch (truncated or overwritten)")
    return key, payload


def _artifact_keys(info) -> set[tuple[str, str]]:
    """(cache, key) pairs of a torch.compiler CacheInfo."""
    return {(kind, k) for kind, keys in getattr(info, "artifacts", {}).items() for k in keys}


@dataclass
class PersistentCompileCache:
    """Load before anything is compiled (`load`), save after the warm-up (`save`)."""
    path: Path
    key: CompileCacheKey
    outcome: Outcome = "miss"
    loaded: set[tuple[str, str]] = field(default_factory=set)  # artifacts the loaded file held
    seconds: float = 0.0  # spent loading and saving

    def load(self) -> Outcome:
        t = time.perf_counter()
        try:
            self.outcome = self._load()
        finally:
            self.seconds += time.perf_counter() - t
        return self.outcome

    def _load(self) -> Outcome:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            log.info("compile cache %s: none yet; it is written after this start's warm-up", self.path)
            return "miss"
        except OSError as e:
            log.warning("compile cache %s is unreadable (%s): ignored, rebuilt after this start's warm-up", self.path, e)
            return "corrupt"
        try:
            stored, payload = decode(data)
        except CorruptCache as e:
            log.warning("compile cache %s is damaged (%s): ignored, rebuilt after this start's warm-up", self.path, e)
            return "corrupt"
        if stored != self.key.fields:
            log.warning("compile cache %s was made for another setup (%s): not used; replaced after this start's "
                        "warm-up", self.path, "; ".join(self.key.differences(stored)))
            return "mismatch"
        try:
            info = torch.compiler.load_cache_artifacts(payload)
        except Exception as e:  # noqa: BLE001 — a cache must never stop the start
            log.warning("compile cache %s could not be loaded by torch (%s: %s): ignored, rebuilt after this "
                        "start's warm-up", self.path, type(e).__name__, e)
            return "corrupt"
        if info is None:  # torch could not un-pickle it (it logs why)
            log.warning("compile cache %s could not be read by torch: ignored, rebuilt after this start's warm-up",
                        self.path)
            return "corrupt"
        self.loaded = _artifact_keys(info)
        log.info("compile cache %s loaded: %d artifacts (%.1f MB)", self.path, len(self.loaded), len(payload) / 1e6)
        return "hit"

    def save(self) -> bool:
        """Write what this process compiled, unless the file already holds all of it. Returns whether
        a file was written; a failure to write is logged, never raised."""
        t = time.perf_counter()
        try:
            saved = torch.compiler.save_cache_artifacts()
            if saved is None:
                return False
            payload, info = saved
            keys = _artifact_keys(info)
            if not keys or (self.outcome == "hit" and keys <= self.loaded):
                return False
            atomic_write_bytes(self.path, encode(self.key, payload), fsync=False)
            log.info("compile cache %s written: %d artifacts (%.1f MB)", self.path, len(keys), len(payload) / 1e6)
            return True
        except Exception as e:  # noqa: BLE001 — serving matters more than the next start's cache
            log.warning("compile cache %s not written (%s: %s)", self.path, type(e).__name__, e)
            return False
        finally:
            self.seconds += time.perf_counter() - t


def artifacts_path(cache_dir: Path, role: str) -> Path:
    """Where a process role's file lives ("server"; a token2wav child may use its own role)."""
    return Path(cache_dir) / "artifacts" / f"{role}.bin"


def operator_inductor_dir() -> str | None:
    """TORCHINDUCTOR_CACHE_DIR as the operator set it, or None. Importing torch._dynamo (which much
    of torch does) sets it to inductor's default (/tmp/torchinductor_<user>) when unset, so that
    value is taken as unset: else `warmup.compile_cache_dir` would be ignored in every server."""
    explicit = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if explicit is None:
        return None
    # Imported here, when compiling is about to start: torch._inductor imports torch._dynamo (over a
    # second), which a process that compiles nothing (a CPU server, a token2wav child) never needs.
    try:  # inductor's own default folder (private; absent in some builds)
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # pragma: no cover
        return explicit
    return None if os.path.abspath(explicit) == os.path.abspath(default_cache_dir()) else explicit


def compile_cache_dir(config: Config) -> Path:
    """Where torch.compile's caches are: an explicit TORCHINDUCTOR_CACHE_DIR in the environment
    (`operator_inductor_dir`), else `warmup.compile_cache_dir` (default: <cache root>/torch-compile)."""
    explicit = operator_inductor_dir()
    if explicit is not None:
        return Path(explicit)
    return Path(config.warmup.compile_cache_dir or cache_root() / "torch-compile").expanduser()


def _expected_guard_drops(record: logging.LogRecord) -> bool:
    """Precompile drops Dynamo's guards on global modules (`torch`, `torch.nn.functional`, ...), which
    torch warns about once per guard per compiled frame: dozens of expected lines at every start."""
    return "is dropped with caching_precompile" not in record.getMessage()


def use_compile_cache(config: Config) -> Path:
    """torch.compile's caches in `compile_cache_dir(config)` (and Dynamo's frames kept too with
    `warmup.precompile`). Inductor reads the folder when it first compiles, so this runs before the
    models are built."""
    chosen = compile_cache_dir(config)
    if operator_inductor_dir() is None:
        chosen.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(chosen)
    if config.warmup.precompile:
        torch._dynamo.config.caching_precompile = True
        logging.getLogger("torch._dynamo.guards").addFilter(_expected_guard_drops)
    log.info("torch.compile cache: %s", chosen)
    return chosen


def open_compile_cache(config: Config, model_dir: Path, device: torch.device,
                       role: str = "server") -> PersistentCompileCache | None:
    """After `use_compile_cache`: this role's persistent artifacts, loaded (None when
    `warmup.persistent_compile_cache` is off)."""
    if not config.warmup.persistent_compile_cache:
        return None
    cache = PersistentCompileCache(artifacts_path(compile_cache_dir(config), role),
                                   CompileCacheKey.for_server(config, model_dir, device))
    cache.load()
    return cache


# -- no compiling beside the capture thread ------------------------------------------------------------

_no_compile_holders = 0
_no_compile_lock = threading.Lock()


def stop_compiling() -> None:
    """From now on torch.compile'd code in this process runs only what it has compiled already; a call
    that would need a new program (a recompile, or a first compile) runs eagerly instead
    (`torch.compiler.set_stance("eager_on_recompile")`: in torch 2.13 it compiles nothing new).

    Why: a token2wav batcher's capture thread runs compiled code beside its device thread and the
    LLM's, and a compile in one thread makes every compiled call in another fail while it traces
    ("Detected that you are using FX to symbolically trace a dynamo-optimized function"); on an H100
    the flow estimator then fell back to eager for good. So it is called once everything in the
    process has compiled and warmed up (`Token2WavBatcher.serve_captures`), and counted: the
    stance returns to torch's default when the last holder calls `resume_compiling`."""
    global _no_compile_holders
    with _no_compile_lock:
        if _no_compile_holders == 0:
            torch.compiler.set_stance("eager_on_recompile")
            log.info("torch.compile: nothing compiles from now on (a call that would compile runs eagerly)")
        _no_compile_holders += 1


def resume_compiling() -> None:
    """Undo one `stop_compiling`."""
    global _no_compile_holders
    with _no_compile_lock:
        _no_compile_holders -= 1
        if _no_compile_holders == 0:
            torch.compiler.set_stance("default")

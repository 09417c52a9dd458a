"""SpeakerStore: registered voices, persisted as one safetensors file per speaker.

On disk (folder `speakers.dir`, default the data folder's `speakers/`, see `files.data_root`):

    <sha256(speaker_id)>.safetensors   arrays + JSON metadata (speaker id, kind, prompt text, time)
    .lock                              fcntl lock taken by every writer (threads and processes)

A record is exactly one file, written to a temporary file in the same folder, fsynced and moved
into place with `os.replace`, so a crash mid-write leaves the previous record or none, never a
torn one. The speaker id is validated and only ever used through its hash, never as a path.
Nothing is pickled; upstream `spk2info.pt` files are read with `torch.load(weights_only=True)`
by `frontend.spk2info` and converted to records here.

Trust: a record (format version 2) carries a sha256 of its metadata and arrays, checked on every
read, so a flipped byte anywhere is `SpeakerCorrupt` (DATA_LOSS), never a wrong voice. Records of
format version 1 (written before checksums) are still read, unchecked, with one warning per
speaker; registering the speaker again (overwrite) writes version 2. A store given the model's
`VoiceFit` also checks on load that a record fits the model (speech tokens in the vocabulary, mel
and embedding widths): a record that does not is `SpeakerCorrupt` for that id alone.
"""
from __future__ import annotations

import abc
import base64
import binascii
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from .errors import InvalidRequest, SpeakerCorrupt, SpeakerExists, SpeakerNotFound
from .frontend.spk2info import load_spk2info, save_spk2info
from .models.dims import MODEL_KINDS
from .request import Voice, VoiceKind

log = logging.getLogger(__name__)


MAX_ID_LENGTH = 64
_ID_CHARS = re.compile(r"[A-Za-z0-9_.\-]")
_ID_RULE = f"1-{MAX_ID_LENGTH} characters from A-Z a-z 0-9 _ . -, not starting with '.'"

FORMAT_NAME = "async_cosyvoice.speaker"
FORMAT_VERSION = "2"          # 2: a "checksum" in the metadata
_UNCHECKED_VERSION = "1"      # written before checksums; read without one
SUFFIX = ".safetensors"
_TMP_PREFIX = ".tmp-"
_LOCK_NAME = ".lock"
_WRITE_BLOCK = 1 << 20

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


def validate_speaker_id(speaker_id: object, what: str = "speaker_id") -> str:
    """Return the id unchanged if valid, else raise InvalidRequest saying exactly what is wrong."""
    if not isinstance(speaker_id, str):
        raise InvalidRequest(f"{what} must be a string, got {type(speaker_id).__name__}")
    if not speaker_id:
        raise InvalidRequest(f"{what} is empty; use {_ID_RULE}")
    if len(speaker_id) > MAX_ID_LENGTH:
        raise InvalidRequest(
            f"{what} is {len(speaker_id)} characters long; the limit is {MAX_ID_LENGTH}")
    for ch in speaker_id:
        if not _ID_CHARS.fullmatch(ch):
            raise InvalidRequest(
                f"{what} {speaker_id!r} contains {ch!r}; allowed are A-Z a-z 0-9 _ . - "
                "(ids are names, not paths)")
    if speaker_id.startswith("."):
        raise InvalidRequest(f"{what} {speaker_id!r} must not start with '.'")
    return speaker_id


def speaker_file_name(speaker_id: str) -> str:
    """The file holding a speaker: the hex sha256 of its UTF-8 id (the id itself never reaches a path)."""
    return hashlib.sha256(speaker_id.encode("utf-8")).hexdigest() + SUFFIX


# records written before the model kind was stored were CosyVoice2's (the only model then served)
LEGACY_MODEL_KIND = "cosyvoice2"


@dataclass(frozen=True)
class SpeakerInfo:
    """What listing shows: the record without its arrays (read from the file header only)."""
    speaker_id: str
    kind: VoiceKind
    prompt_text: str
    n_speech_tokens: int
    created_at: float  # unix seconds
    model_kind: str = LEGACY_MODEL_KIND  # the model whose speech tokenizer and mel made the voice


@dataclass(frozen=True, eq=False)
class SpeakerRecord:
    """A registered speaker: a validated `Voice` plus its id and creation time.

    zero_shot voices carry everything the zero-shot and instruct2 modes need (upstream
    `add_zero_shot_spk`); sft voices the embedding only (upstream `spk2info` `{"embedding": ...}`).
    `model_kind` ("cosyvoice2" / "cosyvoice3"): the model the voice was made for; its speech tokens
    and prompt mel mean nothing to the other model, so a server serves only its own kind's speakers.
    """
    speaker_id: str
    voice: Voice
    created_at: float = field(default_factory=time.time)
    model_kind: str = LEGACY_MODEL_KIND

    def __post_init__(self):
        validate_speaker_id(self.speaker_id)
        if not isinstance(self.voice, Voice):
            raise InvalidRequest(f"speaker {self.speaker_id!r}: voice must be a Voice")
        if self.voice.kind == "zero_shot" and not self.voice.is_aligned:
            raise InvalidRequest(
                f"zero_shot speaker {self.speaker_id!r}: speech_feat has {self.voice.speech_feat.shape[0]} "
                f"frames, expected 2 x {self.voice.n_tokens} speech tokens")
        object.__setattr__(self, "created_at", float(self.created_at))
        if self.model_kind not in MODEL_KINDS:
            raise InvalidRequest(f"speaker {self.speaker_id!r}: model_kind must be one of {MODEL_KINDS}, "
                                 f"got {self.model_kind!r}")

    @classmethod
    def sft(cls, speaker_id: str, embedding, created_at: float | None = None,
            model_kind: str = LEGACY_MODEL_KIND) -> "SpeakerRecord":
        return cls(speaker_id, Voice.embedding_only(embedding), time.time() if created_at is None else created_at,
                   model_kind)

    @property
    def kind(self) -> str:
        return self.voice.kind

    @property
    def prompt_text(self) -> str:
        return self.voice.prompt_text

    @property
    def info(self) -> SpeakerInfo:
        return SpeakerInfo(self.speaker_id, self.kind, self.prompt_text, self.voice.n_tokens, self.created_at,
                           self.model_kind)

    def replace_id(self, speaker_id: str) -> "SpeakerRecord":
        return SpeakerRecord(speaker_id, self.voice, self.created_at, self.model_kind)

    def same_data(self, other: "SpeakerRecord") -> bool:
        """Equal ids, model kinds and voices (created_at is not compared)."""
        return (self.speaker_id == other.speaker_id and self.model_kind == other.model_kind
                and self.voice.same_data(other.voice))

    # ---- serialization (safetensors bytes; metadata is string -> string) ----

    def _arrays(self) -> dict[str, np.ndarray]:
        v = self.voice
        return {"prompt_text_tokens": v.prompt_text_tokens, "speech_tokens": v.speech_tokens,
                "speech_feat": v.speech_feat, "embedding": v.embedding}

    def to_bytes(self) -> bytes:
        metadata = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "speaker_id": self.speaker_id,
            "kind": self.kind,
            "prompt_text": self.prompt_text,
            "n_speech_tokens": str(self.voice.n_tokens),
            "created_at": repr(self.created_at),
            "model_kind": self.model_kind,
        }
        arrays = self._arrays()
        metadata["checksum"] = record_checksum(metadata, arrays)
        return st_save(arrays, metadata=metadata)

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "<bytes>") -> "SpeakerRecord":
        """The record, or ValueError saying why the bytes are not one (truncated, a checksum
        mismatch, a bad header). Version-1 records (no checksum) are read unchecked."""
        metadata = _read_header(data, source)
        meta = _info_from_metadata(metadata, source)
        try:
            arrays = st_load(data)
        except SafetensorError as e:
            raise ValueError(f"{source}: not a valid speaker file ({e})") from e
        if metadata.get("version") != _UNCHECKED_VERSION:
            stored = metadata.get("checksum")
            if stored != record_checksum(metadata, arrays):
                raise ValueError(f"{source}: checksum mismatch: the record changed after it was written"
                                 if stored else f"{source}: the record has no checksum")
        voice = Voice(arrays["speech_tokens"], arrays["speech_feat"], arrays["embedding"], meta.prompt_text,
                      arrays["prompt_text_tokens"], meta.kind)
        return cls(meta.speaker_id, voice, meta.created_at, meta.model_kind)


def record_checksum(metadata: Mapping[str, str], arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over the metadata (but the checksum) and every array's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps({k: v for k, v in metadata.items() if k != "checksum"}, sort_keys=True).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"\0{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    return "sha256:" + h.hexdigest()


@dataclass(frozen=True)
class VoiceFit:
    """What a stored voice must fit to be used with a model: token ids below `speech_vocab`, mel
    frames `mel_bins` wide, an embedding of `embedding_dim`."""
    speech_vocab: int
    mel_bins: int
    embedding_dim: int

    @classmethod
    def of(cls, dims) -> "VoiceFit":
        """From a model directory's `dims` (the flow's and the LM's speech vocabularies)."""
        return cls(min(dims.flow.vocab_size, dims.lm.speech_token_size), dims.flow.output_size,
                   dims.flow.spk_embed_dim)

    def problem(self, voice: Voice) -> str | None:
        """Why `voice` does not fit, or None."""
        outside = np.flatnonzero((voice.speech_tokens < 0) | (voice.speech_tokens >= self.speech_vocab))
        if outside.size:
            return (f"{outside.size} speech token(s) outside the model's vocabulary 0..{self.speech_vocab - 1}, "
                    f"the first {int(voice.speech_tokens[outside[0]])} at position {int(outside[0])}")
        if voice.speech_feat.size and voice.speech_feat.shape[1] != self.mel_bins:
            return f"speech_feat is {voice.speech_feat.shape[1]} mel bins wide, the model's {self.mel_bins}"
        if voice.embedding.shape[0] != self.embedding_dim:
            return f"the embedding has {voice.embedding.shape[0]} values, the model's {self.embedding_dim}"
        return None


@dataclass(frozen=True)
class SpeakerPage:
    speakers: list[SpeakerInfo]
    next_page_token: str  # "" on the last page


class RecordMisfit(ValueError):
    """A valid record that does not fit the model it would be used with (`VoiceFit`)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _read_header(data: bytes, source: str) -> dict:
    if len(data) < 8:
        raise ValueError(f"{source}: truncated speaker file")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError(f"{source}: truncated speaker file")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{source}: bad speaker file header ({e})") from e
    return header.get("__metadata__") or {}


def _info_from_metadata(meta: dict, source: str) -> SpeakerInfo:
    if meta.get("format") != FORMAT_NAME:
        raise ValueError(f"{source}: not an {FORMAT_NAME} file")
    if meta.get("version") not in (FORMAT_VERSION, _UNCHECKED_VERSION):
        raise ValueError(f"{source}: unsupported speaker file version {meta.get('version')!r}")
    try:
        return SpeakerInfo(meta["speaker_id"], meta["kind"], meta.get("prompt_text", ""),
                           int(meta.get("n_speech_tokens", 0)), float(meta.get("created_at", 0.0)),
                           meta.get("model_kind", LEGACY_MODEL_KIND))
    except (KeyError, ValueError) as e:
        raise ValueError(f"{source}: bad speaker metadata ({e})") from e


def _read_header_file(path: Path) -> dict:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated speaker file")
        n = int.from_bytes(head, "little")
        if n > 100_000_000:
            raise ValueError(f"{path}: bad speaker file header")
        return _read_header(head + f.read(n), str(path))


def _speaker_of(path: Path) -> str:
    """Whose record a file is, as far as its header still says."""
    try:
        return f"speaker {_info_from_metadata(_read_header_file(path), str(path)).speaker_id!r}"
    except (OSError, ValueError):
        return "speaker unknown (header unreadable)"


def encode_page_token(last_id: str) -> str:
    return base64.urlsafe_b64encode(last_id.encode("utf-8")).decode("ascii").rstrip("=")


def decode_page_token(token: str) -> str:
    try:
        last_id = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode("utf-8")
        return validate_speaker_id(last_id)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise InvalidRequest(
            "page_token is not valid: pass the next_page_token of the previous page, or empty") from None


def _stat_key(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


class SpeakerStoreBase(abc.ABC):
    """The speaker store interface, and what every backend does the same way: listing pages,
    membership, spk2info import and export. A backend (this folder's `SpeakerStore`,
    `speaker_redis.RedisSpeakerStore`) implements get / put / exists / delete / infos, each
    validating ids with `validate_speaker_id`; `speaker_store.open_speaker_store` picks one.

    All methods are blocking; call them from a worker thread in async code.
    """

    def __init__(self, fit: VoiceFit | None = None):
        self.fit = fit  # given (a store opened for a model): records are checked against it on load
        self._unchecked_warned: set[str] = set()
        self._listeners: list[Callable[[bool], None]] = []
        self.reachable = True  # whether the store answered its last call

    def decode(self, data: bytes, source: str) -> SpeakerRecord:
        """Stored bytes -> a record this store may serve, or ValueError (RecordMisfit when it is a
        valid record that does not fit the model)."""
        record = SpeakerRecord.from_bytes(data, source)
        problem = self.fit.problem(record.voice) if self.fit is not None else None
        if problem is not None:
            raise RecordMisfit(f"{source}: {problem}", problem)
        unchecked = _read_header(data, source).get("version") == _UNCHECKED_VERSION
        if unchecked and record.speaker_id not in self._unchecked_warned:
            self._unchecked_warned.add(record.speaker_id)
            log.warning("speaker store %s: the record of %r has no checksum (format version 1): it is read "
                            "unchecked; register it again (overwrite) to store it with one", self, record.speaker_id)
        return record

    def corrupt(self, speaker_id: str, error: Exception) -> SpeakerCorrupt:
        """Log where and why (the location stays in the log), tell the caller what to do."""
        log.error("speaker store %s: the record of %r is unusable: %s", self, speaker_id, error)
        what = (f"does not fit this model ({error.reason})" if isinstance(error, RecordMisfit)
                else "is unreadable (truncated or corrupt)")
        return SpeakerCorrupt(f"speaker {speaker_id!r}: the stored record {what} and must be registered again "
                              "(RegisterSpeaker with overwrite, or DeleteSpeaker first)")

    # ---- reachability (a store behind a network: Redis) ----

    def watch(self, listener: Callable[[bool], None]) -> None:
        """`listener(reachable)` on every change of `reachable`, called in the thread that saw it."""
        self._listeners.append(listener)

    def _reached(self, reachable: bool) -> None:
        if reachable != self.reachable:
            self.reachable = reachable
            for listener in self._listeners:
                listener(reachable)

    def ping(self) -> None:
        """Returns when the store answers; StoreUnavailable when it does not."""

    def persistence_problem(self) -> str | None:
        """How an acknowledged `put` could be lost if the store's server crashed, or None."""
        return None

    def close(self) -> None:
        """Release connections (a store behind a network)."""

    @abc.abstractmethod
    def get(self, speaker_id: str) -> SpeakerRecord:
        """The record, or SpeakerNotFound."""

    @abc.abstractmethod
    def put(self, record: SpeakerRecord, overwrite: bool = False) -> None:
        """Store atomically. An existing id raises SpeakerExists unless `overwrite`."""

    @abc.abstractmethod
    def exists(self, speaker_id: str) -> bool: ...

    @abc.abstractmethod
    def delete(self, speaker_id: str) -> None:
        """Remove, or SpeakerNotFound."""

    @abc.abstractmethod
    def infos(self) -> list[SpeakerInfo]:
        """Every speaker without its arrays, sorted by id."""

    def check_put(self, speaker_id: str, overwrite: bool = False) -> None:
        """Raise what `put` would for this id before the caller computes a record for it."""
        if not overwrite and self.exists(speaker_id):
            raise SpeakerExists(f"speaker {speaker_id!r} exists; pass overwrite to replace it")

    def unreadable_records(self) -> list[tuple[str, str]]:
        """(where, why) for every stored record that cannot be read, each logged; the server
        calls it at start-up. A backend that cannot hold a torn record returns []."""
        return []

    def __contains__(self, speaker_id: object) -> bool:
        try:
            return self.exists(speaker_id)  # type: ignore[arg-type]
        except InvalidRequest:
            return False

    def ids(self) -> list[str]:
        return [i.speaker_id for i in self.infos()]

    def __len__(self) -> int:
        return len(self.infos())

    def list(self, page_size: int = 0, page_token: str = "") -> SpeakerPage:
        """One page of speakers sorted by id. page_size 0 means DEFAULT_PAGE_SIZE; sizes above
        MAX_PAGE_SIZE are clamped. Pass the returned next_page_token to get the next page."""
        if page_size < 0:
            raise InvalidRequest(f"page_size must be >= 0, got {page_size}")
        page_size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        after = decode_page_token(page_token) if page_token else None
        infos = self.infos()
        if after is not None:
            infos = [i for i in infos if i.speaker_id > after]
        page = infos[:page_size]
        next_token = encode_page_token(page[-1].speaker_id) if len(infos) > page_size else ""
        return SpeakerPage(page, next_token)

    # ---- upstream spk2info.pt ----

    def import_spk2info(self, path: str | os.PathLike, overwrite: bool = False,
                        rename: Mapping[str, str] | None = None,
                        tokenize: Callable[[str], Sequence[int]] | None = None,
                        model_kind: str = LEGACY_MODEL_KIND) -> list[str]:
        """Import every entry of an upstream (or peer-layout) `spk2info.pt`.

        The file does not say which model made it: `model_kind` is the model directory's it came
        with. Entry keys become speaker ids, through `rename` where given. Peer entries that store the
        prompt transcript only as text need `tokenize` (the model's text tokenizer). All ids are
        validated and checked for existence before anything is written. Returns the imported ids.
        """
        rename = dict(rename or {})
        records = []
        for key, voice in load_spk2info(path, tokenize).items():
            new_id = rename.get(key, key)
            try:
                validate_speaker_id(new_id)
            except InvalidRequest as e:
                raise InvalidRequest(f"{path}: entry {key!r} cannot be imported: {e}; "
                                     "map it to a valid id with rename") from None
            records.append(SpeakerRecord(new_id, voice, model_kind=model_kind))
        if not overwrite:
            existing = [r.speaker_id for r in records if self.exists(r.speaker_id)]
            if existing:
                raise SpeakerExists(f"speakers already exist: {', '.join(sorted(existing))}; "
                                    "pass overwrite to replace them")
        for rec in records:
            self.put(rec, overwrite=overwrite)
        return [r.speaker_id for r in records]

    def export_spk2info(self, path: str | os.PathLike, speaker_ids: Iterable[str] | None = None) -> list[str]:
        """Write speakers (all by default) as an upstream-loadable `spk2info.pt` (keys = speaker
        ids). Returns the exported ids."""
        ids = self.ids() if speaker_ids is None else [validate_speaker_id(i) for i in speaker_ids]
        save_spk2info({i: self.get(i).voice for i in ids}, path)
        return ids


class SpeakerStore(SpeakerStoreBase):
    """Thread- and process-safe speaker registry on a folder, with a bounded LRU cache.

    All methods are blocking (file I/O); call them from a worker thread in async code.
    """

    def __init__(self, directory: str | os.PathLike, cache_size: int = 256, fit: VoiceFit | None = None):
        if cache_size < 1:
            raise ValueError("cache_size must be >= 1")
        super().__init__(fit)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cache_size = cache_size
        self._thread_lock = threading.RLock()
        self._cache: OrderedDict[str, tuple[tuple[int, int, int], SpeakerRecord]] = OrderedDict()
        self._index: dict[str, tuple[tuple[int, int, int], SpeakerInfo | None]] = {}
        self._index_lock = threading.Lock()
        self._clean_temp_files()

    @classmethod
    def from_config(cls, config) -> "SpeakerStore":
        """From a `Config` (uses `config.speakers.dir` and `.cache_size`)."""
        return cls(config.speakers.dir, config.speakers.cache_size)

    def __repr__(self) -> str:
        return f"SpeakerStore({str(self.dir)!r})"

    # ---- locking ----

    @contextlib.contextmanager
    def _write_lock(self) -> Iterator[None]:
        """Serialize writers: a thread lock inside this process, flock across processes."""
        with self._thread_lock:
            fd = os.open(self.dir / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the flock

    def _clean_temp_files(self) -> None:
        """Remove temp files a crashed writer left. Writers hold the lock while theirs exist."""
        with self._write_lock():
            for entry in os.scandir(self.dir):
                if entry.name.startswith(_TMP_PREFIX):
                    log.warning("speaker store %s: removing %s left by an interrupted write",
                                self.dir, entry.name)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _path(self, speaker_id: str) -> Path:
        return self.dir / speaker_file_name(speaker_id)

    # ---- public API ----

    def put(self, record: SpeakerRecord, overwrite: bool = False) -> None:
        """Store a record. An existing id raises SpeakerExists unless `overwrite`."""
        data = record.to_bytes()
        path = self._path(record.speaker_id)
        with self._write_lock():
            if not overwrite and path.exists():
                raise SpeakerExists(
                    f"speaker {record.speaker_id!r} already exists; delete it first or set overwrite")
            self._write_atomic(path, data)
        with self._thread_lock:
            self._cache.pop(record.speaker_id, None)

    def _write_atomic(self, path: Path, data: bytes) -> None:
        tmp = self.dir / f"{_TMP_PREFIX}{path.stem[:16]}-{os.getpid()}-{threading.get_ident()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            for start in range(0, len(view), _WRITE_BLOCK):
                block = view[start:start + _WRITE_BLOCK]
                while block:
                    block = block[os.write(fd, block):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)
        self._fsync_dir()

    def get(self, speaker_id: str) -> SpeakerRecord:
        validate_speaker_id(speaker_id)
        path = self._path(speaker_id)
        for _ in range(3):  # a concurrent overwrite may swap the file between stat and open
            try:
                key = _stat_key(os.stat(path))
            except FileNotFoundError:
                with self._thread_lock:
                    self._cache.pop(speaker_id, None)
                raise SpeakerNotFound(f"speaker {speaker_id!r} not found") from None
            with self._thread_lock:
                hit = self._cache.get(speaker_id)
                if hit is not None and hit[0] == key:
                    self._cache.move_to_end(speaker_id)
                    return hit[1]
            try:
                with open(path, "rb") as f:
                    if _stat_key(os.fstat(f.fileno())) != key:
                        continue
                    data = f.read()
            except FileNotFoundError:
                continue
            try:
                record = self.decode(data, str(path))
            except (ValueError, KeyError) as e:
                raise self.corrupt(speaker_id, e) from e
            if record.speaker_id != speaker_id:  # sha256 collision or a file moved by hand
                log.error("speaker store %s: %s holds %r, not %r", self.dir, path.name,
                          record.speaker_id, speaker_id)
                raise SpeakerNotFound(f"speaker {speaker_id!r} not found")
            with self._thread_lock:
                self._cache[speaker_id] = (key, record)
                self._cache.move_to_end(speaker_id)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            return record
        raise SpeakerNotFound(f"speaker {speaker_id!r} not found")

    def unreadable_records(self) -> list[tuple[str, str]]:
        """Read every record in full: (file name, reason) for each one that cannot be used, each
        also logged. The server calls this at start-up so a corrupt store is noticed before a
        client asks for the speaker."""
        bad = []
        for entry in sorted(os.scandir(self.dir), key=lambda e: e.name):
            if not entry.name.endswith(SUFFIX) or entry.name.startswith("."):
                continue
            try:
                with open(entry.path, "rb") as f:
                    record = self.decode(f.read(), entry.path)
                if speaker_file_name(record.speaker_id) != entry.name:
                    raise ValueError(f"{entry.path}: file name does not match its speaker id "
                                     f"{record.speaker_id!r}")
            except FileNotFoundError:  # deleted meanwhile
                continue
            except (OSError, ValueError, KeyError) as e:
                bad.append((entry.name, f"{_speaker_of(Path(entry.path))}: {e}"))
        for name, reason in bad:
            log.error("speaker store %s: unreadable record %s: %s; register that speaker again",
                      self.dir, name, reason)
        if bad:
            log.error("speaker store %s: %d unreadable record(s); requests for them get DATA_LOSS",
                      self.dir, len(bad))
        return bad

    def exists(self, speaker_id: str) -> bool:
        validate_speaker_id(speaker_id)
        return self._path(speaker_id).exists()

    def delete(self, speaker_id: str) -> None:
        validate_speaker_id(speaker_id)
        path = self._path(speaker_id)
        with self._write_lock():
            try:
                os.unlink(path)
            except FileNotFoundError:
                raise SpeakerNotFound(f"speaker {speaker_id!r} not found") from None
            self._fsync_dir()
        with self._thread_lock:
            self._cache.pop(speaker_id, None)

    def infos(self) -> list[SpeakerInfo]:
        """Every speaker (header data only), sorted by id."""
        seen: dict[str, tuple[tuple[int, int, int], SpeakerInfo | None]] = {}
        with self._index_lock:
            for entry in os.scandir(self.dir):
                name = entry.name
                if not name.endswith(SUFFIX) or name.startswith("."):
                    continue
                try:
                    key = _stat_key(entry.stat())
                except FileNotFoundError:
                    continue
                old = self._index.get(name)
                if old is not None and old[0] == key:
                    seen[name] = old
                    continue
                try:
                    info = _info_from_metadata(_read_header_file(Path(entry.path)), entry.path)
                    if speaker_file_name(info.speaker_id) != name:
                        raise ValueError(f"{entry.path}: file name does not match its speaker id")
                except FileNotFoundError:
                    continue
                except (OSError, ValueError) as e:
                    log.warning("speaker store %s: skipping %s: %s", self.dir, name, e)
                    info = None
                seen[name] = (key, info)
            self._index = seen
        return sorted((info for _, info in seen.values() if info is not None),
                      key=lambda i: i.speaker_id)

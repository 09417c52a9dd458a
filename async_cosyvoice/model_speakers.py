"""The speakers a model directory ships in its own `spk2info.pt` (as upstream CosyVoice2 loads
them): usable by id at once, read-only, beside the speaker store.

Where both have an id, the store's record wins: it was put there on purpose (a registration, or
an import of the same file, which writes to the store). Registering an id that only the model directory
has is ALREADY_EXISTS, overwriting or deleting it FAILED_PRECONDITION: those voices belong to the
model, not to the store.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from .errors import InvalidRequest, SpeakerExists, SpeakerNotFound, Unsupported
from .frontend.spk2info import Tokenize, load_spk2info
from .speakers import LEGACY_MODEL_KIND, SpeakerInfo, SpeakerRecord, SpeakerStoreBase, validate_speaker_id

log = logging.getLogger(__name__)

SPK2INFO = "spk2info.pt"


def with_model_speakers(store: SpeakerStoreBase, model_dir: Path | None,
                        tokenize: Tokenize | None = None, model_kind: str = LEGACY_MODEL_KIND) -> SpeakerStoreBase:
    """`store`, plus the speakers of `model_dir`/spk2info.pt where it has any (speakers of
    `model_kind`, the directory's)."""
    if model_dir is None or not (Path(model_dir) / SPK2INFO).is_file():
        return store
    records = read_model_speakers(Path(model_dir) / SPK2INFO, tokenize, model_kind)
    return ModelDirSpeakers(store, Path(model_dir) / SPK2INFO, records) if records else store


def read_model_speakers(path: Path, tokenize: Tokenize | None = None,
                        model_kind: str = LEGACY_MODEL_KIND) -> dict[str, SpeakerRecord]:
    """The usable entries of a model directory's spk2info.pt; an unusable file or entry is logged
    and left out (the store's speakers still serve)."""
    try:
        voices = load_spk2info(path, tokenize)
    except (OSError, InvalidRequest) as e:
        log.error("%s: its speakers cannot be used: %s", path, e)
        return {}
    records = {}
    for speaker_id, voice in voices.items():
        try:
            records[speaker_id] = SpeakerRecord(validate_speaker_id(speaker_id), voice, created_at=0.0,
                                                model_kind=model_kind)
        except InvalidRequest as e:
            log.warning("%s: speaker %r left out (%s); import it under another id with "
                        "SpeakerStore.import_spk2info(rename=...)", path, speaker_id, e)
    return records


class ModelDirSpeakers(SpeakerStoreBase):
    """A speaker store with the model directory's speakers beside it, read-only."""

    def __init__(self, store: SpeakerStoreBase, path: Path, records: dict[str, SpeakerRecord]):
        self.store = store
        self.path = path
        self.records = records

    def __repr__(self) -> str:
        return f"{self.store!r} + {len(self.records)} read-only speaker(s) from {self.path}"

    def _read_only(self, speaker_id: str, what: str) -> Unsupported:
        return Unsupported(f"speaker {speaker_id!r} comes with the model directory ({self.path}) and is "
                           f"read-only: it cannot be {what}; register your voice under another id")

    def _model_only(self, speaker_id: str) -> bool:
        return speaker_id in self.records and not self.store.exists(speaker_id)

    def get(self, speaker_id: str) -> SpeakerRecord:
        try:
            return self.store.get(speaker_id)
        except SpeakerNotFound:
            if speaker_id in self.records:
                return self.records[speaker_id]
            raise

    def _refuse_model_only(self, speaker_id: str, overwrite: bool) -> None:
        if self._model_only(speaker_id):
            if overwrite:
                raise self._read_only(speaker_id, "overwritten")
            raise SpeakerExists(f"speaker {speaker_id!r} exists: it comes with the model directory "
                                f"({self.path}) and is read-only; register your voice under another id")

    def check_put(self, speaker_id: str, overwrite: bool = False) -> None:
        self._refuse_model_only(speaker_id, overwrite)
        self.store.check_put(speaker_id, overwrite)

    def put(self, record: SpeakerRecord, overwrite: bool = False) -> None:
        self._refuse_model_only(record.speaker_id, overwrite)
        self.store.put(record, overwrite)

    def exists(self, speaker_id: str) -> bool:
        return self.store.exists(speaker_id) or speaker_id in self.records

    def delete(self, speaker_id: str) -> None:
        if self._model_only(speaker_id):
            raise self._read_only(speaker_id, "deleted")
        self.store.delete(speaker_id)

    def infos(self) -> list[SpeakerInfo]:
        stored = self.store.infos()
        shadowed = {i.speaker_id for i in stored}
        model = [r.info for i, r in self.records.items() if i not in shadowed]
        return sorted(stored + model, key=lambda i: i.speaker_id)

    def import_spk2info(self, path, overwrite: bool = False, rename=None, tokenize=None,
                        model_kind: str = LEGACY_MODEL_KIND) -> list[str]:
        """Into the store, as deliberate records (checked against the store only): they shadow the
        model directory's speakers of the same ids, e.g. an import of the model's own file."""
        return self.store.import_spk2info(path, overwrite=overwrite, rename=rename, tokenize=tokenize,
                                          model_kind=model_kind)

    def unreadable_records(self) -> list[tuple[str, str]]:
        return self.store.unreadable_records()

    # reachability is the store's: the model directory's speakers are in memory (health follows Redis)

    @property
    def reachable(self) -> bool:
        return self.store.reachable

    def watch(self, listener: Callable[[bool], None]) -> None:
        self.store.watch(listener)

    def ping(self) -> None:
        self.store.ping()

    def persistence_problem(self) -> str | None:
        return self.store.persistence_problem()

    def close(self) -> None:
        self.store.close()

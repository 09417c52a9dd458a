"""Where speakers come from: the store under the data folder (never the current directory) and the
model directory's own spk2info.pt, read-only beside it."""
from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
import torch
from serve_process import run_cli

from async_cosyvoice.config import Config
from async_cosyvoice.errors import SpeakerExists, SpeakerNotFound, StoreUnavailable, Unsupported
from async_cosyvoice.files import data_root
from async_cosyvoice.model_speakers import ModelDirSpeakers, with_model_speakers
from async_cosyvoice.speaker_redis import RedisSpeakerStore
from async_cosyvoice.speakers import SpeakerRecord, SpeakerStore
from cosyvoice_cli.cli import main

# ---- the data folder ------------------------------------------------------------------------

def test_the_data_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("ASYNC_COSYVOICE_DATA", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data_root() == tmp_path / "home" / ".local" / "share" / "async_cosyvoice"
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert data_root() == tmp_path / "xdg" / "async_cosyvoice"
    monkeypatch.setenv("ASYNC_COSYVOICE_DATA", str(tmp_path / "mine"))
    assert data_root() == tmp_path / "mine"
    assert Config.load(env={}).speakers.dir == tmp_path / "mine" / "speakers"
    # a path given in the config is kept as given (an existing ./spk2info store stays readable)
    assert Config.model_validate({"speakers": {"dir": "spk2info"}}).speakers.dir == Path("spk2info")


@pytest.mark.slow
def test_speakers_list_reads_the_data_folder_from_anywhere(tiny_dir, tmp_path):
    data = tmp_path / "data"
    SpeakerStore(data / "speakers").import_spk2info(tiny_dir / "spk2info.pt")
    elsewhere = tmp_path / "somewhere"
    elsewhere.mkdir()
    r = run_cli("speakers", "list", cwd=elsewhere, ASYNC_COSYVOICE_DATA=str(data))
    assert r.returncode == 0, r.stderr
    assert [line.split("\t")[0] for line in r.stdout.splitlines()] == ["tiny_sft_spk", "tiny_zs_spk"]
    assert list(elsewhere.iterdir()) == []  # no ./spk2info, no .lock where the command ran


# ---- the model directory's spk2info.pt --------------------------------------------------------

@pytest.fixture
def speakers(tiny_dir, tmp_path) -> ModelDirSpeakers:
    both = with_model_speakers(SpeakerStore(tmp_path / "store"), tiny_dir)
    assert isinstance(both, ModelDirSpeakers)
    return both


def test_model_dir_speakers_are_there_at_once(speakers, tiny_dir):
    assert [i.speaker_id for i in speakers.infos()] == ["tiny_sft_spk", "tiny_zs_spk"]
    assert speakers.get("tiny_zs_spk").kind == "zero_shot" and speakers.get("tiny_sft_spk").kind == "sft"
    assert "tiny_zs_spk" in speakers and speakers.store.infos() == []
    assert str(tiny_dir / "spk2info.pt") in repr(speakers)
    with pytest.raises(SpeakerNotFound):
        speakers.get("nobody")


def test_model_dir_speakers_are_read_only(speakers):
    record = speakers.get("tiny_zs_spk")
    with pytest.raises(SpeakerExists, match="comes with the model directory"):
        speakers.put(record)
    with pytest.raises(Unsupported, match="read-only: it cannot be overwritten"):
        speakers.put(record, overwrite=True)
    with pytest.raises(Unsupported, match="read-only: it cannot be deleted"):
        speakers.delete("tiny_sft_spk")
    assert [i.speaker_id for i in speakers.infos()] == ["tiny_sft_spk", "tiny_zs_spk"]
    speakers.put(record.replace_id("mine"))  # other ids go to the store
    assert speakers.store.ids() == ["mine"] and len(speakers) == 3


def test_the_store_wins_an_id_both_have(speakers):
    sft = speakers.get("tiny_sft_spk")
    speakers.store.put(SpeakerRecord("tiny_sft_spk", speakers.get("tiny_zs_spk").voice))  # e.g. imported earlier
    assert speakers.get("tiny_sft_spk").kind == "zero_shot"
    assert [i.kind for i in speakers.infos() if i.speaker_id == "tiny_sft_spk"] == ["zero_shot"]
    speakers.put(speakers.get("tiny_zs_spk").replace_id("tiny_sft_spk"), overwrite=True)  # the store's own record
    speakers.delete("tiny_sft_spk")  # removes the store's record: the model's is back
    assert speakers.get("tiny_sft_spk").same_data(sft)


def test_unusable_model_speakers_are_left_out_with_a_reason(tmp_path, tiny_dir, caplog):
    model = tmp_path / "model"
    model.mkdir()
    entries = torch.load(tiny_dir / "spk2info.pt", weights_only=True)
    torch.save({"中文女": entries["tiny_sft_spk"], "ok_id": entries["tiny_sft_spk"]}, model / "spk2info.pt")
    with caplog.at_level(logging.WARNING, logger="async_cosyvoice.model_speakers"):
        both = with_model_speakers(SpeakerStore(tmp_path / "store"), model)
    assert [i.speaker_id for i in both.infos()] == ["ok_id"]
    assert "中文女" in caplog.text and "rename" in caplog.text
    (model / "spk2info.pt").write_bytes(b"not a torch file")
    with caplog.at_level(logging.ERROR, logger="async_cosyvoice.model_speakers"):
        broken = with_model_speakers(SpeakerStore(tmp_path / "store"), model)
    assert isinstance(broken, SpeakerStore) and "cannot be used" in caplog.text  # the store alone
    assert with_model_speakers(broken, tmp_path / "no-model") is broken


def test_the_command_line_shows_and_protects_them(tiny_dir, tmp_path, capsys):
    common = ["--model-dir", str(tiny_dir), "--speakers-dir", str(tmp_path / "store")]
    assert main(["speakers", "list", *common]) == 0
    assert [line.split("\t")[:2] for line in capsys.readouterr().out.splitlines()] == [
        ["tiny_sft_spk", "sft"], ["tiny_zs_spk", "zero_shot"]]
    assert main(["speakers", "rm", "tiny_zs_spk", *common]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "read-only" in err and "tiny_zs_spk" in err


def test_a_registration_is_refused_before_its_voice_is_computed(speakers):
    """What the Synthesizer asks before encoding a prompt (check_put) says the same as put."""
    with pytest.raises(SpeakerExists, match="read-only; register your voice under another id"):
        speakers.check_put("tiny_zs_spk")
    with pytest.raises(Unsupported, match="cannot be overwritten"):
        speakers.check_put("tiny_zs_spk", overwrite=True)
    speakers.check_put("new_voice")
    speakers.put(speakers.get("tiny_zs_spk").replace_id("new_voice"))
    with pytest.raises(SpeakerExists, match="pass overwrite"):
        speakers.check_put("new_voice")
    speakers.check_put("new_voice", overwrite=True)


def test_an_import_writes_to_the_store(speakers, tiny_dir):
    """Importing the model's own file (what users did before these speakers were served) puts
    copies into the store, which then win; nothing about the model directory changes."""
    assert speakers.import_spk2info(tiny_dir / "spk2info.pt") == ["tiny_zs_spk", "tiny_sft_spk"]
    assert speakers.store.ids() == ["tiny_sft_spk", "tiny_zs_spk"]
    speakers.delete("tiny_sft_spk")  # the store's copy
    assert speakers.store.ids() == ["tiny_zs_spk"] and "tiny_sft_spk" in speakers


def test_reachability_is_the_stores(tiny_dir):
    """Health follows the store behind the model's speakers: the server reads `reachable` and
    watches it on whatever store it holds (a server on the fixture holds this wrapper)."""
    with socket.socket() as s:  # a port nobody listens on: Redis is down
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    both = with_model_speakers(RedisSpeakerStore(f"redis://127.0.0.1:{port}/0", timeout=1.0), tiny_dir)
    assert isinstance(both, ModelDirSpeakers) and both.reachable
    heard = []
    both.watch(heard.append)
    with pytest.raises(StoreUnavailable):
        both.infos()
    assert not both.reachable and heard == [False]
    with pytest.raises(StoreUnavailable):
        both.ping()
    both.close()

"""CosyVoice3 served end to end on the public fixture: the Synthesizer (native engine, silence cap,
token2wav batcher) in every mode CosyVoice3 has upstream, streamed and not, and a real gRPC server
on 127.0.0.1; registered speakers are keyed by model kind.

The audio of a request is checked against upstream's semantics on the tokens the request rendered:
`DiTFlow.inference` + `CausalHiFT.inference` single calls (non-streaming: one call; streaming:
upstream's schedule of re-runs), whose parity with upstream's goldens tests/test_cv3_* and
tests/test_cosyvoice3_lm.py check."""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import numpy as np
import pytest
import torch

from async_cosyvoice.config import Config
from async_cosyvoice.errors import Unsupported
from async_cosyvoice.frontend.audio import load_audio
from async_cosyvoice.model_dir import build_models, load_model_dir
from async_cosyvoice.request import Mode, SynthesisOptions, SynthesisRequest
from async_cosyvoice.speakers import SpeakerRecord, SpeakerStore
from async_cosyvoice.token2wav import ChunkSchedule
from async_cosyvoice.tts import SyncSynthesizer
from grpc_async.client import CosyVoiceClient, chunk_samples
from grpc_async.server import ServerThread
from websockets.asyncio.client import connect as ws_connect

SAMPLES_PER_TOKEN = 960
TEXT = "Hello there, how are you today?"
TRANSCRIPT = "The morning train was late again, so I walked along the river."
CV3_MODES = [Mode.ZERO_SHOT, Mode.CROSS_LINGUAL, Mode.INSTRUCT2, Mode.SFT, Mode.ZERO_SHOT_BY_SPK_ID,
             Mode.INSTRUCT2_BY_SPK_ID, Mode.VC]


def _store(spk_dir, tiny_dir, tiny3_dir) -> SpeakerStore:
    store = SpeakerStore(spk_dir)
    store.import_spk2info(tiny3_dir / "spk2info.pt", model_kind="cosyvoice3")  # tiny_zs_spk
    # an embedding-only (sft) speaker: upstream's inference_sft, which CosyVoice3 inherits
    store.put(SpeakerRecord.sft("sft3", store.get("tiny_zs_spk").voice.embedding, model_kind="cosyvoice3"))
    store.import_spk2info(tiny_dir / "spk2info.pt", rename={"tiny_zs_spk": "cv2_zs_spk", "tiny_sft_spk": "cv2_sft_spk"},
                          model_kind="cosyvoice2")
    return store


@pytest.fixture(scope="module")
def synth3(tiny_dir, tiny3_dir, tmp_path_factory):
    spk_dir = tmp_path_factory.mktemp("spk3")
    _store(spk_dir, tiny_dir, tiny3_dir)
    config = Config.model_validate({"model": {"dir": str(tiny3_dir)}, "token2wav": {"adaptive": False},
                                    "speakers": {"dir": str(spk_dir)}})
    s = SyncSynthesizer(config)
    s.register_speaker("reg3", TRANSCRIPT, load_audio(tiny3_dir / "golden" / "prompt_24k.wav"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def prompt(tiny3_dir):
    return load_audio(tiny3_dir / "golden" / "prompt_24k.wav")


@pytest.fixture(scope="module")
def reference_models(tiny3_dir):
    return build_models(load_model_dir(tiny3_dir), with_llm=False)


def _request(mode, prompt, stream, **kw) -> SynthesisRequest:
    voice = {
        Mode.ZERO_SHOT: dict(prompt_audio=prompt, prompt_text=TRANSCRIPT),
        Mode.CROSS_LINGUAL: dict(prompt_audio=prompt),
        Mode.INSTRUCT2: dict(prompt_audio=prompt, instruct_text="请用四川话表达。"),
        Mode.SFT: dict(speaker_id="sft3"),
        Mode.ZERO_SHOT_BY_SPK_ID: dict(speaker_id="reg3"),
        Mode.INSTRUCT2_BY_SPK_ID: dict(speaker_id="tiny_zs_spk", instruct_text="Speak slowly."),
        Mode.VC: dict(prompt_audio=prompt, source_audio=prompt),
    }[mode]
    opts = SynthesisOptions(stream=stream, seed=kw.pop("seed", 3), **kw.pop("options", {}))
    return SynthesisRequest(mode, text="" if mode == Mode.VC else TEXT, options=opts, **voice, **kw)


def _reference_audio(models, voice_inputs, tokens, stream: bool, schedule: ChunkSchedule) -> np.ndarray:
    """Upstream's token2wav on `tokens`: one finalizing call, or upstream's streaming re-runs on the
    service's hops (`schedule`: first hop, doubling to max_hop, the first not padded to the prompt):
    flow over prompt + all tokens so far, the vocoder over the whole mel, samples past the last end."""
    flow, hift = models.flow, models.hift
    prompt_token, prompt_feat, embedding = voice_inputs
    token = torch.tensor(tokens).reshape(1, -1)
    if not stream:
        mel = flow.inference(token, prompt_token, prompt_feat, embedding, streaming=False, finalize=True)
        return hift.inference(mel, finalize=True)[0][0].numpy()
    out, offset, hop, emitted, full = [], 0, schedule.first_hop, 0, None
    while True:
        this_hop = hop
        if len(tokens) - offset < this_hop + 3:
            break
        mel = flow.inference(token[:, :offset + this_hop + 3], prompt_token, prompt_feat, embedding,
                             streaming=True, finalize=False)
        full = mel if full is None else torch.cat([full, mel[:, :, offset * 2:]], dim=2)
        speech = hift.inference(full, finalize=False)[0][0].numpy()
        out.append(speech[emitted:])
        emitted = len(speech)
        offset += this_hop
        hop = min(schedule.max_hop, hop * schedule.hop_scale)
    mel = flow.inference(token, prompt_token, prompt_feat, embedding, streaming=False, finalize=True)
    full = mel if full is None else torch.cat([full, mel[:, :, offset * 2:]], dim=2)
    out.append(hift.inference(full, finalize=True)[0][0].numpy()[emitted:])
    return np.concatenate(out)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("mode", CV3_MODES, ids=[m.value for m in CV3_MODES])
def test_every_mode_renders_its_tokens_as_upstream(synth3, prompt, reference_models, mode, stream):
    options = {"max_tokens": 60} if stream and mode != Mode.VC else {}
    request = _request(mode, prompt, stream, options=options)
    chunks = list(synth3.synthesize(request))
    assert [c.is_final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    tokens = [t for c in chunks for t in c.segment_tokens]
    audio = np.concatenate([c.samples for c in chunks])
    assert len(audio) == SAMPLES_PER_TOKEN * len(tokens) > 0 and np.isfinite(audio).all()
    if stream and mode != Mode.VC:
        assert len(chunks) >= 2
    voice = synth3.call(synth3.synth.prepare_voice(synth3.synth.rules.check(request)))
    inputs = synth3.call(synth3.synth.model_inputs(synth3.synth.rules.check(request), voice))[0]
    voice_inputs = (torch.tensor(inputs.flow_prompt_speech_token).reshape(1, -1),
                    torch.tensor(inputs.prompt_speech_feat)[None], torch.tensor(inputs.flow_embedding).reshape(1, -1))
    t2w = synth3.synth.config.token2wav
    schedule = ChunkSchedule(first_hop=t2w.first_hop, max_hop_multiple=t2w.max_hop_multiple)
    want = _reference_audio(reference_models, voice_inputs, tokens, stream, schedule)
    assert len(want) == len(audio)
    assert float(np.abs(want - audio).max()) <= 1e-3


def test_lm_text_carries_the_system_prompt(synth3, prompt):
    s = synth3.synth
    tok = s.tokenizer
    system = tok.encode("You are a helpful assistant.<|endofprompt|>")
    for mode in (Mode.ZERO_SHOT, Mode.CROSS_LINGUAL, Mode.INSTRUCT2):
        request = s.rules.check(_request(mode, prompt, False))
        voice = synth3.call(s.prepare_voice(request))
        [mi] = synth3.call(s.model_inputs(request, voice))
        lm_text = list(mi.lm_text_tokens)
        assert lm_text[:len(system) - 1] == system[:-1] and 151646 in lm_text, mode
    [mi] = synth3.call(s.model_inputs(s.rules.check(_request(Mode.INSTRUCT2, prompt, False)), voice))
    assert tok.decode(mi.prompt_text, skip_special_tokens=False) == \
        "You are a helpful assistant. 请用四川话表达。<|endofprompt|>"


def test_speakers_are_keyed_by_model_kind(synth3, prompt):
    s = synth3.synth
    assert s.speakers.get("reg3").model_kind == "cosyvoice3"
    assert s.speakers.get("cv2_zs_spk").model_kind == "cosyvoice2"
    request = SynthesisRequest(Mode.ZERO_SHOT_BY_SPK_ID, text=TEXT, speaker_id="cv2_zs_spk")
    with pytest.raises(Unsupported, match=r"speaker 'cv2_zs_spk' was registered with a cosyvoice2 model and "
                                          r"this server runs cosyvoice3"):
        list(synth3.synthesize(request))


def test_silence_cap_reaches_the_flow(synth3):
    """5 silent tokens in a row pass, the sixth on is dropped before token2wav (the LM saw them)."""
    from async_cosyvoice.engine.silence import SilenceCap, cap_silences

    async def engine_tokens():
        yield [7, 1, 2, 28, 29]
        yield [55, 248, 494]
        yield [9, 1]

    async def run():
        return [t async for b in cap_silences(engine_tokens(), SilenceCap(synth3.synth.dims.lm.silent_tokens))
                for t in b]
    assert synth3.call(run()) == [7, 1, 2, 28, 29, 55, 9, 1]


# ---- a real gRPC server ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server3(tiny_dir, tiny3_dir, tmp_path_factory):
    spk_dir = tmp_path_factory.mktemp("spk3grpc")
    _store(spk_dir, tiny_dir, tiny3_dir)
    cfg = Config.model_validate({
        "model": {"dir": str(tiny3_dir)},
        "speakers": {"dir": str(spk_dir)},
        "server": {"port": 0, "http_port": 0, "metrics_port": 0, "grace_seconds": 5},
        "limits": {"max_concurrent_streams": 8, "max_text_chars": 400, "max_prompt_seconds": 5.0},
    })
    st = ServerThread(cfg, ready_timeout=None)
    st.call(st.server.wait_ready(), timeout=900)
    st.base = f"http://127.0.0.1:{st.server.http_port}"
    yield st
    st.close(grace=1)


async def _synth(st, text, **kw):
    async with CosyVoiceClient(st.target) as client:
        return [c async for c in client.synthesize(text, **kw)]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("mode", ["zero_shot", "cross_lingual", "instruct2", "sft", "zero_shot_by_spk_id",
                                  "instruct2_by_spk_id", "vc"])
def test_grpc_every_mode(server3, tiny3_dir, mode, stream):
    p24 = (tiny3_dir / "golden" / "prompt_24k.wav").read_bytes()
    p16 = (tiny3_dir / "golden" / "prompt_16k.wav").read_bytes()
    kw = {"zero_shot": dict(prompt_audio=p24, prompt_text=TRANSCRIPT), "cross_lingual": dict(prompt_audio=p16),
          "instruct2": dict(prompt_audio=p24, instruct_text="Speak slowly."), "sft": dict(speaker_id="sft3"),
          "zero_shot_by_spk_id": dict(speaker_id="tiny_zs_spk"),
          "instruct2_by_spk_id": dict(speaker_id="tiny_zs_spk", instruct_text="Speak slowly."),
          "vc": dict(source_audio=p16, prompt_audio=p24)}[mode]
    chunks = asyncio.run(_synth(server3, "" if mode == "vc" else TEXT, mode=mode, stream=stream, seed=5,
                                encoding="float32", max_tokens=None if mode == "vc" or not stream else 60, **kw))
    audio = np.concatenate([chunk_samples(c) for c in chunks])
    summary = chunks[-1].summary
    assert summary.speech_tokens > 0 and len(audio) == SAMPLES_PER_TOKEN * summary.speech_tokens
    assert np.isfinite(audio).all()
    if stream and mode != "vc":
        assert len(chunks) > 1


def test_grpc_refuses_a_cosyvoice2_speaker(server3):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(_synth(server3, TEXT, mode="zero_shot_by_spk_id", speaker_id="cv2_zs_spk"))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "registered with a cosyvoice2 model and this server runs cosyvoice3" in e.value.details()


def test_grpc_registers_and_lists_cosyvoice3_speakers(server3, tiny3_dir):
    async def body():
        async with CosyVoiceClient(server3.target) as client:
            s = await client.register_speaker("grpc3", TRANSCRIPT, tiny3_dir / "golden" / "prompt_24k.wav")
            listed = {x.speaker_id: x.model_kind for x in await client.all_speakers()}
            return s, listed
    s, listed = asyncio.run(body())
    assert s.model_kind == "cosyvoice3"
    assert listed["grpc3"] == "cosyvoice3" and listed["cv2_zs_spk"] == "cosyvoice2"


def test_grpc_server_info_names_the_model(server3):
    async def body():
        async with CosyVoiceClient(server3.target) as client:
            return await client.get_server_info()
    assert asyncio.run(body()).model == "cosyvoice3"


# ---- the HTTP door and its WebSocket (same server) ------------------------------------------

def test_http_models_voices_and_speech(server3):
    with httpx.Client(base_url=server3.base, timeout=120) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["cosyvoice3"]
        voices = {v["id"]: v for v in http.get("/v1/audio/voices").json()["data"]}
        assert voices["tiny_zs_spk"]["model_kind"] == "cosyvoice3"
        assert voices["cv2_zs_spk"]["model_kind"] == "cosyvoice2"
        r = http.post("/v1/audio/speech", json={"model": "cosyvoice3", "voice": "tiny_zs_spk", "input": TEXT,
                                                "response_format": "pcm", "seed": 5,
                                                "instructions": "Speak slowly."})
        assert r.status_code == 200, r.text
        samples = np.frombuffer(r.content, "<i2")
        assert len(samples) > 0 and len(samples) % SAMPLES_PER_TOKEN == 0
        refused = http.post("/v1/audio/speech", json={"model": "cosyvoice3", "voice": "cv2_zs_spk", "input": TEXT})
        assert refused.status_code == 400
        assert "registered with a cosyvoice2 model" in refused.json()["error"]["message"]


def test_websocket_streams_text_into_the_cosyvoice3_lm(server3):
    """Text pieces go into one LM request (bistream: the system prompt after sos, fills 6564)."""
    async def session():
        received = []
        url = f"ws://127.0.0.1:{server3.server.http_port}/v1/audio/speech/stream"
        async with ws_connect(url, max_size=1 << 24) as ws:
            # seed 1: the random-weight fixture samples no stray stop id while the text streams
            for m in ({"type": "config", "voice": "tiny_zs_spk", "format": "pcm", "options": {"seed": 1}},
                      {"type": "text", "text": "Hi there, "}, {"type": "text", "text": "how are"},
                      {"type": "text", "text": " you today?"}, {"type": "end"}):
                await ws.send(json.dumps(m))
            async for frame in ws:
                received.append(json.loads(frame))
        return received
    received = asyncio.run(session())
    assert received[0]["type"] == "ready" and received[0]["text_mode"] == "bistream"
    assert received[-1]["type"] == "done", received[-1]
    audio = [m for m in received if m["type"] == "audio"]
    assert audio and sum(m["num_samples"] for m in audio) % SAMPLES_PER_TOKEN == 0


# ---- the command line, in-process ----------------------------------------------------------------

@pytest.mark.slow
def test_cli_speakers_and_synthesize(tiny3_dir, tmp_path, capsys):
    from cosyvoice_cli.cli import main

    common = ["--model-dir", str(tiny3_dir), "--speakers-dir", str(tmp_path / "spk")]
    assert main(["speakers", "import", str(tiny3_dir / "spk2info.pt"), *common]) == 0
    assert "imported 1 cosyvoice3 speakers: tiny_zs_spk" in capsys.readouterr().out
    assert main(["speakers", "show", "tiny_zs_spk", *common]) == 0
    assert json.loads(capsys.readouterr().out)["model_kind"] == "cosyvoice3"
    out = tmp_path / "out.wav"
    assert main(["synthesize", "--speaker", "tiny_zs_spk", "--text", "Hello there.", "--stream", "--seed", "1",
                 "--max-tokens", "30", "--out", str(out), *common]) == 0
    import soundfile as sf
    audio, rate = sf.read(out)
    assert rate == 24000 and audio.shape == (30 * 960,)
    assert main(["synthesize", "--prompt-wav", str(tiny3_dir / "golden" / "prompt_24k.wav"), "--text", "Hi.",
                 "--instruct", "Speak slowly.", "--max-tokens", "20", "--out", str(out), *common]) == 0

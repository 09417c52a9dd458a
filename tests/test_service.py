"""The gRPC service against a real server on 127.0.0.1 with the fixture model.

One server per module (a background-thread event loop, `ServerThread`); each test drives its
client with `asyncio.run`. The first part needs no model: encoders, the sentence splitter,
request validation, and a server whose model never finishes loading (health, auth).
"""
from __future__ import annotations

import asyncio
import io
import logging
import re
import time
import urllib.request

import grpc
import numpy as np
import pytest
import soundfile as sf
from grpc_health.v1 import health_pb2, health_pb2_grpc

from async_cosyvoice.config import Config
from async_cosyvoice.errors import InvalidRequest
from async_cosyvoice.rules import RequestRules
from async_cosyvoice.speakers import SpeakerStore
from grpc_async import SERVICE_NAME, pb2, pb2_grpc
from grpc_async.client import CosyVoiceClient, audio_data, chunk_samples, collect
from async_cosyvoice.frontend.sentences import SentenceSplitter
from grpc_async.encoding import AudioEncoder, wav_header
from grpc_async.server import ServerThread
from grpc_async.servicer import CosyVoiceServicer, _decode_audio
from grpc_async.metrics import Metrics

SAMPLES_PER_TOKEN = 960  # at 24 kHz
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def run(coro):
    return asyncio.run(coro)


# =============================================================================================
# Unit: output encoding


def _decode(chunks: list[pb2.AudioChunk]) -> np.ndarray:
    return np.concatenate([chunk_samples(c) for c in chunks]) if chunks else np.zeros(0, np.float32)


def _feed(encoder: AudioEncoder, sizes: list[int], seed: int = 0) -> tuple[np.ndarray, list[pb2.AudioChunk]]:
    rng = np.random.default_rng(seed)
    x = (0.3 * rng.standard_normal(sum(sizes))).astype(np.float32)
    out, start = [], 0
    for k, n in enumerate(sizes):
        out += encoder.push(x[start:start + n], final=k == len(sizes) - 1)
        start += n
    return x, out


def _check_chunks(chunks: list[pb2.AudioChunk]) -> None:
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert [c.is_final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    offset = 0
    for c in chunks:
        assert c.sample_offset == offset
        offset += c.num_samples


@pytest.mark.parametrize("encoding", [pb2.AUDIO_ENCODING_PCM16, pb2.AUDIO_ENCODING_FLOAT32])
def test_encoder_native_rate(encoding):
    enc = AudioEncoder(encoding, 24000, 24000, stream=True)
    x, chunks = _feed(enc, [14400, 0, 28800, 9600])
    _check_chunks(chunks)
    assert len(chunks) == 3  # the empty push made no chunk
    assert sum(c.num_samples for c in chunks) == len(x) == enc.samples
    if encoding == pb2.AUDIO_ENCODING_FLOAT32:
        np.testing.assert_array_equal(_decode(chunks), x)  # float32 passes through unclipped
    else:
        np.testing.assert_allclose(_decode(chunks), np.clip(x, -1, 1), atol=2 / 32767)
    assert all(c.sample_rate == 24000 and c.encoding == encoding for c in chunks)


@pytest.mark.parametrize("rate", [16000, 22050, 48000])
def test_encoder_resamples_statefully(rate):
    sizes = [14400, 960 * 17, 960 * 45, 960 * 3]
    enc = AudioEncoder(pb2.AUDIO_ENCODING_FLOAT32, 24000, rate, stream=True)
    _, chunks = _feed(enc, sizes)
    _check_chunks(chunks)
    assert enc.samples == round(sum(sizes) * rate / 24000)
    # streamed = one-shot resampling: no clicks at chunk boundaries
    one = AudioEncoder(pb2.AUDIO_ENCODING_FLOAT32, 24000, rate, stream=True)
    _, whole = _feed(one, [sum(sizes)])
    np.testing.assert_allclose(_decode(chunks), _decode(whole), atol=1e-5)


def test_encoder_wav_non_stream_has_exact_header_and_splits():
    enc = AudioEncoder(pb2.AUDIO_ENCODING_WAV, 24000, 16000, stream=False, max_chunk_bytes=20000)
    x, chunks = _feed(enc, [24000, 24000, 4800])
    _check_chunks(chunks)
    assert len(chunks) > 1 and all(len(c.audio) <= 20000 + 44 for c in chunks)
    data = b"".join(c.audio for c in chunks)
    assert data[:4] == b"RIFF" and int.from_bytes(data[4:8], "little") == len(data) - 8
    assert int.from_bytes(data[40:44], "little") == len(data) - 44
    y, sr = sf.read(io.BytesIO(data), dtype="float32")
    assert sr == 16000 and len(y) == round(len(x) * 16000 / 24000) == enc.samples


def test_encoder_wav_stream_header_in_first_chunk():
    enc = AudioEncoder(pb2.AUDIO_ENCODING_WAV, 24000, 24000, stream=True)
    x, chunks = _feed(enc, [0, 9600, 9600])
    _check_chunks(chunks)
    assert chunks[0].audio[:4] == b"RIFF" and chunks[0].num_samples == 9600
    assert not chunks[1].audio.startswith(b"RIFF")
    data = b"".join(c.audio for c in chunks)
    assert data[4:8] == b"\xff\xff\xff\xff"  # streaming: length unknown when the header left
    y, sr = sf.read(io.BytesIO(data), dtype="float32")  # libsndfile copes
    assert len(y) == len(x) and sr == 24000


def test_encoder_final_without_samples():
    enc = AudioEncoder(pb2.AUDIO_ENCODING_PCM16, 24000, 24000, stream=True)
    assert enc.push(np.zeros(0, np.float32), final=True)[0].is_final
    with pytest.raises(RuntimeError):
        enc.push(np.zeros(10, np.float32), final=True)


def test_wav_header_layout():
    h = wav_header(100, 24000)
    assert len(h) == 44 and h[:4] == b"RIFF" and h[8:16] == b"WAVEfmt " and h[36:40] == b"data"
    assert int.from_bytes(h[24:28], "little") == 24000 and int.from_bytes(h[40:44], "little") == 200


# =============================================================================================
# Unit: sentence splitting for StreamSynthesize


def test_sentence_splitter_cuts_complete_sentences():
    sp = SentenceSplitter()
    got = []
    for piece in ["Hello", " there", ".", " How are", " you?", " Pi is 3", ".14", ", roughly", ". ",
                  "今天天气很好。", "我们走吧", "！\u201d", "Bye"]:
        got.append(sp.feed(piece))
    assert got == [[], [], [], ["Hello there."], ["How are you?"], [], [], [], ["Pi is 3.14, roughly."],
                   ["今天天气很好。"], [], ["我们走吧！\u201d"], []]
    assert sp.flush() == ["Bye"]
    assert sp.flush() == []


def test_sentence_splitter_drops_punctuation_and_bounds_length():
    sp = SentenceSplitter(max_chars=40)
    assert sp.feed("... !! ") == []
    long = "word " * 30
    parts = sp.feed(long)
    assert parts and all(len(p) <= 40 for p in parts)
    assert " ".join(parts + sp.flush()).split() == long.split()


# =============================================================================================
# Unit: request validation (no model needed)


@pytest.fixture(scope="module")
def servicer():
    cfg = Config.model_validate({"limits": {"max_text_chars": 50, "max_prompt_seconds": 2.0}})
    return CosyVoiceServicer(cfg, Metrics())


def _wav_bytes(seconds: float, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def test_options_defaults_are_safe(servicer):
    req = pb2.SynthesizeRequest(text="Hi.", sft=pb2.Sft(speaker_id="a"))
    sreq, out = servicer._synthesis_request(req, req.text, "rid")
    assert sreq.options.speed == 1.0 and sreq.options.text_frontend is True and sreq.options.seed is None
    assert out.encoding == pb2.AUDIO_ENCODING_PCM16 and out.sample_rate == 24000 and not out.stream
    req.options.text_frontend = False
    req.options.seed = 0
    req.options.speed = 1.5
    sreq, _ = servicer._synthesis_request(req, req.text, "rid")
    assert sreq.options.text_frontend is False and sreq.options.seed == 0 and sreq.options.speed == 1.5


@pytest.mark.parametrize("mutate, message", [
    (lambda r: setattr(r.options, "speed", 0.0), r"speed must be in \[0.5, 2.0\]"),
    (lambda r: setattr(r.options, "speed", 2.5), "speed must be"),
    (lambda r: setattr(r.options, "speed", float("nan")), "speed must be"),
    (lambda r: (setattr(r.options, "speed", 1.5), setattr(r.options, "stream", True)), "stream = false"),
    (lambda r: setattr(r.options, "sample_rate", 100), "sample_rate"),
    (lambda r: setattr(r.options, "encoding", 9), "not a known AudioEncoding"),
    (lambda r: setattr(r, "text", "  "), "text is empty"),
    (lambda r: setattr(r, "text", "x" * 51), "51 characters long; the limit is 50"),
    (lambda r: r.ClearField("sft"), "no mode set"),
    (lambda r: setattr(r.sft, "speaker_id", "../etc/passwd"), "contains '/'"),
    (lambda r: setattr(r.options, "max_tokens", 0), "max_tokens must be in 1..3000"),
])
def test_invalid_requests(servicer, mutate, message):
    """Proto shape errors come from the servicer, value errors from the library's one rule book."""
    req = pb2.SynthesizeRequest(text="Hi.", sft=pb2.Sft(speaker_id="a"))
    mutate(req)
    rules = RequestRules.from_config(servicer.config)
    with pytest.raises(InvalidRequest, match=message):
        rules.check(servicer._synthesis_request(req, req.text, "rid")[0])


def test_invalid_request_id(servicer):
    with pytest.raises(InvalidRequest, match="request_id"):
        servicer._request_id("bad id!")


def test_audio_decoding_errors(servicer):
    with pytest.raises(InvalidRequest, match="prompt_audio: cannot decode"):
        _decode_audio(pb2.AudioData(file=b"definitely not audio"), "prompt_audio")
    with pytest.raises(InvalidRequest, match="prompt_audio is missing"):
        _decode_audio(pb2.AudioData(), "prompt_audio")
    with pytest.raises(InvalidRequest, match="sample_rate is required"):
        _decode_audio(pb2.AudioData(pcm=pb2.RawPcm(data=b"\0\0", encoding=pb2.PCM_ENCODING_S16LE)), "prompt_audio")
    with pytest.raises(InvalidRequest, match="encoding must be"):
        _decode_audio(pb2.AudioData(pcm=pb2.RawPcm(data=b"\0\0", sample_rate=16000)), "p")
    with pytest.raises(InvalidRequest, match="not a multiple"):
        _decode_audio(pb2.AudioData(pcm=pb2.RawPcm(data=b"\0\0\0", encoding=pb2.PCM_ENCODING_S16LE,
                                                   sample_rate=16000)), "p")
    stereo = np.stack([np.full(1600, 0.5), np.full(1600, -0.5)], axis=1).astype(np.float32)
    audio = _decode_audio(audio_data((stereo, 16000)), "p")
    assert audio.sample_rate == 16000 and audio.samples.shape == (1600,) and np.allclose(audio.samples, 0)
    assert _decode_audio(pb2.AudioData(file=_wav_bytes(1.0)), "p").seconds == pytest.approx(1.0)


# =============================================================================================
# A real server whose model never finishes loading: health, auth, UNAVAILABLE


async def _never_ready(config):
    await asyncio.Event().wait()


@pytest.fixture(scope="module")
def loading_server(tmp_path_factory):
    cfg = Config.model_validate({"server": {"port": 0, "auth_token": "s3cret"},
                                 "speakers": {"dir": str(tmp_path_factory.mktemp("spk-loading"))}})
    st = ServerThread(cfg, ready_timeout=None, synthesizer_factory=_never_ready)
    yield st
    st.close()


def test_health_not_serving_while_loading_and_auth(loading_server):
    async def body():
        async with grpc.aio.insecure_channel(loading_server.target) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", SERVICE_NAME):  # health is exempt from auth
                assert (await health.Check(health_pb2.HealthCheckRequest(service=service))).status == NOT_SERVING
            stub = pb2_grpc.CosyVoiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ListSpeakers(pb2.ListSpeakersRequest())
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ListSpeakers(pb2.ListSpeakersRequest(), metadata=(("authorization", "Bearer nope"),))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "invalid" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Synthesize(pb2.SynthesizeRequest(text="x", sft=pb2.Sft(speaker_id="a"))):
                    pass
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        async with CosyVoiceClient(loading_server.target, token="s3cret") as client:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.list_speakers()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "warming up" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(client.synthesize("Hi.", mode="sft", speaker_id="a"))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    run(body())


# =============================================================================================
# The real server with the fixture model


PROMPT_TEXT = "The morning train was late again, so I walked along the river."
TEXT = "Hello there, this is a small test."


@pytest.fixture(scope="module")
def fixture_audio(golden_dir):
    return {"p24": (golden_dir / "prompt_24k.wav").read_bytes(),
            "p16": (golden_dir / "prompt_16k.wav").read_bytes()}


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    spk_dir = tmp_path_factory.mktemp("spk")
    SpeakerStore(spk_dir).import_spk2info(tiny_dir / "spk2info.pt")  # tiny_zs_spk, tiny_sft_spk
    cfg = Config.model_validate({
        "model": {"dir": str(tiny_dir)},
        "speakers": {"dir": str(spk_dir)},
        "server": {"port": 0, "metrics_port": 0, "grace_seconds": 5},
        "limits": {"max_concurrent_streams": 20, "max_text_chars": 400, "max_prompt_seconds": 5.0},
        "token2wav": {"first_hop": 20},  # not the default: tests/test_service.py checks it is honoured
    })
    st = ServerThread(cfg, ready_timeout=None)
    health = []

    async def check():
        async with grpc.aio.insecure_channel(st.target) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            return r.status

    health.append(st.call(check(), timeout=30))  # right after start: still loading
    st.call(st.server.wait_ready(), timeout=900)
    health.append(st.call(check(), timeout=30))
    st.health_seen = health
    yield st
    st.close(grace=1)


def engine_running(st: ServerThread) -> int:
    async def stats():
        return st.server.synthesizer.engine_stats().running
    return st.call(stats(), timeout=10)


def wait_idle(st: ServerThread, timeout: float = 20.0) -> None:
    """Engine and servicer back to no work."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if engine_running(st) == 0 and st.server.servicer.active == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"still busy after {timeout} s: engine running {engine_running(st)}, "
                         f"active streams {st.server.servicer.active}")


async def _synth(st, text=TEXT, **kw):
    async with CosyVoiceClient(st.target) as client:
        chunks = [c async for c in client.synthesize(text, **kw)]
    return chunks


def check_response(chunks: list[pb2.AudioChunk], rate: int = 24000) -> np.ndarray:
    """Contiguous indices, one final chunk carrying the summary, offsets, and the length rule."""
    assert chunks, "no chunks"
    _check_chunks(chunks)
    assert all(c.sample_rate == rate for c in chunks)
    assert not any(c.HasField("summary") for c in chunks[:-1]) and chunks[-1].HasField("summary")
    audio = _decode(chunks)
    summary = chunks[-1].summary
    assert summary.speech_tokens > 0
    assert len(audio) == sum(c.num_samples for c in chunks)
    assert len(audio) == round(SAMPLES_PER_TOKEN * summary.speech_tokens * rate / 24000)
    assert summary.audio_seconds == pytest.approx(len(audio) / rate)
    assert 0 < summary.first_chunk_latency_seconds <= summary.total_seconds
    assert summary.rtf == pytest.approx(summary.total_seconds / summary.audio_seconds)
    assert np.isfinite(audio).all()
    return audio


def test_health_flips_to_serving_after_warmup(server):
    assert server.health_seen == [NOT_SERVING, SERVING]
    assert server.server.synthesizer.ready

    async def body():
        async with grpc.aio.insecure_channel(server.target) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert r.status == SERVING
    run(body())


def _voice_kwargs(mode: str, audio: dict) -> dict:
    return {
        "zero_shot": dict(prompt_audio=audio["p24"], prompt_text=PROMPT_TEXT),
        "cross_lingual": dict(prompt_audio=audio["p16"]),
        "instruct2": dict(prompt_audio=audio["p24"], instruct_text="Speak slowly."),
        "sft": dict(speaker_id="tiny_sft_spk"),
        "zero_shot_by_spk_id": dict(speaker_id="tiny_zs_spk"),
        "instruct2_by_spk_id": dict(speaker_id="tiny_zs_spk", instruct_text="Speak slowly."),
        "vc": dict(source_audio=audio["p16"], prompt_audio=audio["p24"]),
    }[mode]


MODES = ["zero_shot", "cross_lingual", "instruct2", "sft", "zero_shot_by_spk_id", "instruct2_by_spk_id", "vc"]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("mode", MODES)
def test_every_mode(server, fixture_audio, mode, stream):
    text = "" if mode == "vc" else TEXT
    chunks = run(_synth(server, text, mode=mode, stream=stream, seed=7, encoding="float32",
                        **_voice_kwargs(mode, fixture_audio)))
    check_response(chunks)
    if stream and mode != "vc":
        assert len(chunks) > 1  # really streamed
    assert chunks[-1].summary.request_id


@pytest.mark.slow
@pytest.mark.parametrize("rate", [16000, 48000])
@pytest.mark.parametrize("encoding", ["pcm16", "float32", "wav"])
@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_output_rates_and_encodings(server, rate, encoding, stream):
    chunks = run(_synth(server, mode="zero_shot_by_spk_id", speaker_id="tiny_zs_spk", seed=3,
                        stream=stream, encoding=encoding, sample_rate=rate))
    audio = check_response(chunks, rate)
    if encoding == "wav":
        data = b"".join(c.audio for c in chunks)
        y, sr = sf.read(io.BytesIO(data), dtype="float32")
        assert sr == rate and len(y) == len(audio)
        if not stream:
            assert int.from_bytes(data[40:44], "little") == 2 * len(audio)


def test_same_seed_same_audio(server):
    a = run(_synth(server, "Same.", mode="sft", speaker_id="tiny_sft_spk", seed=11, encoding="float32"))
    b = run(_synth(server, "Same.", mode="sft", speaker_id="tiny_sft_spk", seed=11, encoding="float32"))
    np.testing.assert_array_equal(_decode(a), _decode(b))


def test_log_line_says_where_the_first_chunk_went(server, caplog):
    """The RPC's log line splits the first chunk: until its speech tokens were there, waiting for a
    token2wav batch, the batch; together they are at most the first-chunk latency the client saw."""
    with caplog.at_level(logging.INFO, logger="grpc_async.server"):
        chunks = run(_synth(server, TEXT, mode="sft", speaker_id="tiny_sft_spk", seed=3, stream=True,
                            request_id="parts-1"))
    check_response(chunks)
    (line,) = [r.getMessage() for r in caplog.records if "id=parts-1 " in r.getMessage()]
    first_ms = float(re.search(r"first_chunk_ms=([0-9.]+)", line).group(1))
    parts = dict(p.split(":") for p in re.search(r"first_chunk_parts=(\S+)", line).group(1).split(","))
    assert set(parts) == {"tokens", "wait", "t2w", "first_token"}, line
    values = {k: float(v) for k, v in parts.items()}
    assert all(v >= 0 for v in values.values()) and values["tokens"] > 0 and values["t2w"] > 0
    assert 0 < values["first_token"] <= values["tokens"], line  # the first token is a part of the tokens' time
    assert values["tokens"] + values["wait"] + values["t2w"] <= first_ms + 1.0, line


def test_first_chunk_parts_need_a_rendered_first_chunk():
    from async_cosyvoice.request import ChunkTiming, Timeline

    timeline = Timeline(submitted=10.0)
    assert timeline.first_chunk_parts() is None
    timeline.chunks.append(ChunkTiming(queued=10.05, started=10.06))
    assert timeline.first_chunk_parts() is None  # not back yet
    timeline.chunks[0].done = 10.1
    parts = timeline.first_chunk_parts()  # no token came through an LM (voice conversion): all of tokens
    assert str(parts) == "tokens:50.0,wait:10.0,t2w:40.0,first_token:50.0"
    timeline.first_token = 10.02
    parts = timeline.first_chunk_parts()
    assert str(parts) == "tokens:50.0,wait:10.0,t2w:40.0,first_token:20.0"
    assert (parts.tokens, parts.wait, parts.t2w, parts.first_token) == pytest.approx((0.05, 0.01, 0.04, 0.02))


# ---- compressed encodings, GetServerInfo, error details (issue 12) ----

COMPRESSED = ["opus", "mp3", "aac", "flac", "webm"]


@pytest.mark.parametrize("encoding, rate, stream", [(e, 48000 if e != "mp3" else 24000, True) for e in COMPRESSED]
                         + [("opus", 16000, False)])
def test_compressed_encodings_decode_back(server, encoding, rate, stream):
    """Forced token count, so the audio length is known: 40 tokens = 1.6 s."""
    async def body():
        async with CosyVoiceClient(server.target) as c:
            chunks = [ch async for ch in c.synthesize("Hello there.", mode="sft", speaker_id="tiny_sft_spk",
                                                      seed=2, max_tokens=40, stream=stream,
                                                      encoding=encoding, sample_rate=rate)]
            async def replay():
                for ch in chunks:
                    yield ch
            return chunks, await collect(replay())

    chunks, result = run(body())
    _check_chunks(chunks)
    expected = 40 * SAMPLES_PER_TOKEN * rate // 24000
    assert sum(c.num_samples for c in chunks) == expected
    assert chunks[-1].summary.audio_seconds == pytest.approx(expected / rate)
    assert all(c.encoding == pb2.AudioEncoding.Value(f"AUDIO_ENCODING_{encoding.upper()}".replace("WEBM", "WEBM_OPUS"))
               and c.sample_rate == rate for c in chunks)
    if stream and encoding != "flac":  # FLAC comes whole at the end (its header needs the length)
        assert len(chunks) >= 2 and chunks[0].audio  # audio came before the end
    seconds = len(result.audio) / result.sample_rate
    assert abs(seconds - expected / rate) < 0.6, seconds      # within one chunk
    assert np.sqrt(np.mean(result.audio ** 2)) > 1e-3         # not silence


def test_get_server_info(server):
    async def body():
        async with CosyVoiceClient(server.target) as c:
            return await c.get_server_info()

    info = run(body())
    cfg = server.config
    assert info.model and info.ready and info.engine == cfg.engine.kind == "native"
    assert info.bistream is bool(getattr(server.server.synthesizer.engine, "supports_bistream", False)) is True
    assert info.default_text_mode == pb2.TEXT_MODE_BISTREAM  # what StreamConfig.text_mode unset gets
    assert list(info.modes) == MODES
    assert info.native_sample_rate == 24000 and info.default_encoding == pb2.AUDIO_ENCODING_PCM16
    assert info.limits.max_text_chars == cfg.limits.max_text_chars == 400
    assert info.limits.max_concurrent_streams == cfg.limits.max_concurrent_streams
    assert info.limits.max_prompt_seconds == 5.0 and info.limits.max_forced_tokens == cfg.limits.max_forced_tokens
    by_encoding = {e.encoding: e for e in info.audio_encodings}
    assert set(by_encoding) == set(pb2.AudioEncoding.values()) - {pb2.AUDIO_ENCODING_UNSPECIFIED}
    opus = by_encoding[pb2.AUDIO_ENCODING_OPUS]
    assert list(opus.sample_rates) == [8000, 12000, 16000, 24000, 48000]
    assert opus.content_type == "audio/ogg;codecs=opus" and opus.bitrate > 0
    pcm = by_encoding[pb2.AUDIO_ENCODING_PCM16]
    assert not pcm.sample_rates and (pcm.min_sample_rate, pcm.max_sample_rate) == (8000, 192000)


def _status_details(error: grpc.aio.AioRpcError) -> list:
    """The google.rpc details of a failed call, unpacked."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    status = rpc_status.from_call(error)
    assert status is not None, "no grpc-status-details-bin trailer"
    assert status.code == error.code().value[0] and status.message == error.details()
    out = []
    for detail in status.details:
        for cls in (error_details_pb2.BadRequest, error_details_pb2.RetryInfo):
            if detail.Is(cls.DESCRIPTOR):
                msg = cls()
                detail.Unpack(msg)
                out.append(msg)
    return out


_REPR = re.compile(r"object at 0x|<[\w.]+[ >]|\[\'|\{\'|Mode\.|array\(|dtype=|Traceback")


def test_invalid_argument_carries_field_violations(server):
    ok = pb2.ZeroShotBySpeaker(speaker_id="tiny_zs_spk")
    cases = [
        (pb2.SynthesizeRequest(text="Hi.", zero_shot_by_spk_id=ok, options=pb2.SynthesisOptions(
            encoding=pb2.AUDIO_ENCODING_OPUS, sample_rate=44100)), "options.sample_rate", "opus supports"),
        (pb2.SynthesizeRequest(text="Hi.", zero_shot_by_spk_id=ok, options=pb2.SynthesisOptions(speed=9)),
         "options.speed", "speed must be"),
        (pb2.SynthesizeRequest(text=" ", zero_shot_by_spk_id=ok), "text", "text is empty"),
        (pb2.SynthesizeRequest(text="Hi."), "mode", "no mode set"),
        (pb2.SynthesizeRequest(text="Hi.", zero_shot=pb2.ZeroShot(prompt_text="x", prompt_audio=pb2.AudioData(
            file=b"not audio at all"))), "zero_shot.prompt_audio", "cannot decode"),
        (pb2.SynthesizeRequest(text="Hi.", zero_shot_by_spk_id=ok, options=pb2.SynthesisOptions(encoding=42)),
         "options.encoding", "OPUS = 4"),
        (pb2.SynthesizeRequest(text="Hi.", sft=pb2.Sft(speaker_id="a/b")), "sft.speaker_id", "speaker_id"),
    ]

    async def body():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = pb2_grpc.CosyVoiceStub(ch)
            for request, field, text in cases:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.Synthesize(request):
                        pass
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in e.value.details()
                assert not _REPR.search(e.value.details()), e.value.details()
                (bad_request,) = _status_details(e.value)
                assert [(v.field, v.description) for v in bad_request.field_violations] == \
                    [(field, e.value.details())]
            # StreamSynthesize: the same option sits under config
            config = pb2.StreamConfig(sft=pb2.Sft(speaker_id="tiny_sft_spk"),
                                      options=pb2.SynthesisOptions(sample_rate=5))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.StreamSynthesize(iter([pb2.StreamSynthesizeRequest(config=config)])):
                    pass
            (bad_request,) = _status_details(e.value)
            assert bad_request.field_violations[0].field == "config.options.sample_rate"
            # a register with garbage audio: libsndfile's message used to show "<_io.BytesIO object at 0x..>"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.RegisterSpeaker(pb2.RegisterSpeakerRequest(
                    speaker_id="x", prompt_text="t", prompt_audio=pb2.AudioData(file=b"RIFF garbage")))
            assert "cannot decode" in e.value.details() and not _REPR.search(e.value.details()), e.value.details()
            assert _status_details(e.value)[0].field_violations[0].field == "prompt_audio"
    run(body())


def test_no_python_reprs_in_error_messages(server, fixture_audio):
    async def body():
        async with grpc.aio.insecure_channel(server.target) as ch:
            raw = ch.unary_stream(f"/{SERVICE_NAME}/Synthesize", request_serializer=lambda b: b,
                                  response_deserializer=pb2.AudioChunk.FromString)
            stub = pb2_grpc.CosyVoiceStub(ch)
            for name, request, code, text in _bad_requests(fixture_audio):
                call = raw(request) if isinstance(request, bytes) else stub.Synthesize(request)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in call:
                        pass
                assert not _REPR.search(e.value.details()), (name, e.value.details())
    run(body())


def test_retry_info_on_unavailable(loading_server):
    async def body():
        async with CosyVoiceClient(loading_server.target, token="s3cret") as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.list_speakers()
            info = await c.get_server_info()    # answers while loading
        return e.value, info

    error, info = run(body())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    (retry,) = _status_details(error)
    assert retry.retry_delay.ToNanoseconds() > 0
    assert not info.ready and info.engine == "native" and len(info.audio_encodings) == 8


def test_retry_info_on_resource_exhausted():
    """The trailer built for RESOURCE_EXHAUSTED (the real-server path is the same `_fail`)."""
    from google.rpc import error_details_pb2, status_pb2

    from grpc_async.status_details import error_trailer

    (key, value), = error_trailer(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
    status = status_pb2.Status.FromString(value)
    retry = error_details_pb2.RetryInfo()
    assert key == "grpc-status-details-bin" and status.code == 8 and status.details[0].Unpack(retry)
    assert retry.retry_delay.ToNanoseconds() == 10**9
    assert error_trailer(grpc.StatusCode.NOT_FOUND, "gone") == ()


def test_speaker_lifecycle(server, fixture_audio):
    async def body():
        async with CosyVoiceClient(server.target) as c:
            spk = await c.register_speaker("svc-alice", PROMPT_TEXT, fixture_audio["p24"])
            assert spk.speaker_id == "svc-alice" and spk.kind == pb2.SPEAKER_KIND_ZERO_SHOT
            assert spk.prompt_speech_tokens > 0 and spk.prompt_seconds == pytest.approx(spk.prompt_speech_tokens / 25)
            assert abs(spk.created_at.ToSeconds() - time.time()) < 600
            got = await c.get_speaker("svc-alice")
            assert got.prompt_speech_tokens == spk.prompt_speech_tokens
            chunks = [ch async for ch in c.synthesize("Hi.", speaker_id="svc-alice", seed=1)]
            check_response(chunks)
            ids = [s.speaker_id for s in await c.all_speakers(page_size=1)]
            assert "svc-alice" in ids and ids == sorted(ids)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.register_speaker("svc-alice", PROMPT_TEXT, fixture_audio["p24"])
            assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
            again = await c.register_speaker("svc-alice", PROMPT_TEXT, fixture_audio["p16"], overwrite=True)
            assert again.speaker_id == "svc-alice"
            await c.delete_speaker("svc-alice")
            for call in (c.get_speaker("svc-alice"), c.delete_speaker("svc-alice"),
                         collect(c.synthesize("Hi.", speaker_id="svc-alice"))):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == grpc.StatusCode.NOT_FOUND and "svc-alice" in e.value.details()
    run(body())


@pytest.mark.parametrize("bad", ["../x", "a/b", "x" * 65, "", ".hidden", "../../etc/passwd"])
def test_bad_speaker_ids_rejected(server, fixture_audio, bad):
    async def body():
        async with CosyVoiceClient(server.target) as c:
            for call in (c.register_speaker(bad, PROMPT_TEXT, fixture_audio["p24"]), c.get_speaker(bad),
                         c.delete_speaker(bad), collect(c.synthesize("Hi.", mode="sft", speaker_id=bad))):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
                assert "speaker_id" in e.value.details()
    run(body())
    assert all(not p.name.startswith(".") or p.name == ".lock"
               for p in server.config.speakers.dir.iterdir())


def _bad_requests(audio: dict) -> list[tuple[str, pb2.SynthesizeRequest | bytes, grpc.StatusCode, str]]:
    ok_voice = pb2.ZeroShotBySpeaker(speaker_id="tiny_zs_spk")
    six_seconds = _wav_bytes(6.0)
    unknown_mode = pb2.SynthesizeRequest(text="Hello.").SerializeToString() + bytes([0x7A, 0x02, 0x08, 0x01])
    return [
        ("malformed audio", pb2.SynthesizeRequest(text="Hi.", zero_shot=pb2.ZeroShot(
            prompt_text="x", prompt_audio=pb2.AudioData(file=b"RIFF....garbage"))),
         grpc.StatusCode.INVALID_ARGUMENT, "cannot decode"),
        ("raw pcm without rate", pb2.SynthesizeRequest(text="Hi.", cross_lingual=pb2.CrossLingual(
            prompt_audio=pb2.AudioData(pcm=pb2.RawPcm(data=b"\0\0" * 100, encoding=pb2.PCM_ENCODING_S16LE)))),
         grpc.StatusCode.INVALID_ARGUMENT, "sample_rate is required"),
        ("empty text", pb2.SynthesizeRequest(text="", zero_shot_by_spk_id=ok_voice),
         grpc.StatusCode.INVALID_ARGUMENT, "text is empty"),
        ("no mode", pb2.SynthesizeRequest(text="Hello."), grpc.StatusCode.INVALID_ARGUMENT, "no mode set"),
        ("unknown mode", unknown_mode, grpc.StatusCode.INVALID_ARGUMENT, "no mode set"),
        ("oversize prompt", pb2.SynthesizeRequest(text="Hi.", cross_lingual=pb2.CrossLingual(
            prompt_audio=pb2.AudioData(file=six_seconds))),
         grpc.StatusCode.INVALID_ARGUMENT, "limit is 5 s"),
        ("speed 0", pb2.SynthesizeRequest(text="Hi.", zero_shot_by_spk_id=ok_voice,
                                          options=pb2.SynthesisOptions(speed=0.0)),
         grpc.StatusCode.INVALID_ARGUMENT, "speed must be in"),
        ("text too long", pb2.SynthesizeRequest(text="word " * 100, zero_shot_by_spk_id=ok_voice),
         grpc.StatusCode.INVALID_ARGUMENT, "limits.max_text_chars"),
        ("vc with text", pb2.SynthesizeRequest(text="Hi.", vc=pb2.VoiceConversion(
            source_audio=pb2.AudioData(file=audio["p16"]), prompt_audio=pb2.AudioData(file=audio["p24"]))),
         grpc.StatusCode.INVALID_ARGUMENT, "takes no text"),
        ("unknown speaker", pb2.SynthesizeRequest(text="Hi.", sft=pb2.Sft(speaker_id="nobody")),
         grpc.StatusCode.NOT_FOUND, "nobody"),
        ("zero-shot mode on an sft speaker", pb2.SynthesizeRequest(
            text="Hi.", zero_shot_by_spk_id=pb2.ZeroShotBySpeaker(speaker_id="tiny_sft_spk")),
         grpc.StatusCode.FAILED_PRECONDITION, "embedding-only"),
        ("zero_shot without transcript", pb2.SynthesizeRequest(text="Hi.", zero_shot=pb2.ZeroShot(
            prompt_audio=pb2.AudioData(file=audio["p24"]))),
         grpc.StatusCode.INVALID_ARGUMENT, "transcript (prompt_text)"),
    ]


def test_bad_requests_get_status_codes_and_server_keeps_serving(server, fixture_audio):
    async def body():
        async with grpc.aio.insecure_channel(server.target) as ch:
            raw = ch.unary_stream(f"/{SERVICE_NAME}/Synthesize", request_serializer=lambda b: b,
                                  response_deserializer=pb2.AudioChunk.FromString)
            stub = pb2_grpc.CosyVoiceStub(ch)
            for name, request, code, text in _bad_requests(fixture_audio):
                call = raw(request) if isinstance(request, bytes) else stub.Synthesize(request)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in call:
                        pass
                assert e.value.code() == code, (name, e.value.details())
                assert text in e.value.details(), (name, e.value.details())
        return await _synth(server, "Still here.", mode="sft", speaker_id="tiny_sft_spk", seed=1)
    check_response(run(body()))
    wait_idle(server)


@pytest.mark.slow
def test_stream_synthesize_speaks_before_text_is_complete(server):
    """Sentence mode: the first sentence is spoken while the rest is still held back."""
    async def body():
        first_audio = asyncio.Event()
        sent = []

        async def pieces():
            for piece in ["Hello", " there", "!", " How are"]:
                sent.append(piece)
                yield piece
            await asyncio.wait_for(first_audio.wait(), 120)  # audio must come before the rest
            for piece in [" you today", "? Fine", ", thanks."]:
                sent.append(piece)
                yield piece

        async with CosyVoiceClient(server.target) as c:
            chunks = []
            async for chunk in c.stream_synthesize(pieces(), speaker_id="tiny_zs_spk", stream=True, seed=5,
                                                   text_mode="sentence"):
                if chunk.num_samples and not first_audio.is_set():
                    assert sent[-1] == " How are"  # the last piece is not sent yet
                    first_audio.set()
                chunks.append(chunk)
        return chunks

    chunks = run(body())
    check_response(chunks)
    wait_idle(server)


def test_config_first_hop_over_grpc(server):
    """The server's token2wav.first_hop (20 here) sets the first streamed chunk: 20 x 960 samples
    minus the 3840 that HiFT keeps for the next cross-fade."""
    async def body():
        async with CosyVoiceClient(server.target) as c:
            async for chunk in c.synthesize("Hello there.", speaker_id="tiny_zs_spk", stream=True, seed=3,
                                            max_tokens=40):
                return chunk
    assert run(body()).num_samples == 20 * 960 - 3840
    wait_idle(server)


@pytest.mark.parametrize("normalization", [None, "raw"], ids=["safe", "raw"])
def test_stream_synthesize_default_is_bistream(server, normalization):
    """text_mode unset: one LM request for the whole text (max_tokens bounds the whole stream;
    sentence mode would force 30 tokens for each of the two sentences)."""
    async def body():
        async with CosyVoiceClient(server.target) as c:
            pieces = ["We paid 12", " dollars. Then", " we went", " home and rested."]
            return [ch async for ch in c.stream_synthesize(pieces, speaker_id="tiny_sft_spk", mode="sft", stream=True,
                                                           seed=4, max_tokens=30, text_normalization=normalization)]

    chunks = run(body())
    assert chunks[-1].is_final and 0 < chunks[-1].summary.speech_tokens <= 30
    assert sum(c.num_samples for c in chunks) == 960 * chunks[-1].summary.speech_tokens
    wait_idle(server)


def test_stream_synthesize_encodes_the_voice_once(server, fixture_audio):
    encoder = server.server.servicer.synth.prompt_encoder

    async def body():
        async with CosyVoiceClient(server.target) as c:
            pieces = ["One sentence. Another", " sentence here. And a", " third one."]
            return [ch async for ch in c.stream_synthesize(pieces, prompt_audio=fixture_audio["p24"],
                                                           prompt_text=PROMPT_TEXT, stream=True, seed=4,
                                                           max_tokens=20, text_mode="sentence")]

    before = encoder.prompts_encoded
    chunks = run(body())
    assert encoder.prompts_encoded - before == 1
    assert chunks[-1].is_final and chunks[-1].summary.speech_tokens == 3 * 20
    wait_idle(server)


def test_stream_synthesize_protocol_errors(server):
    async def body():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = pb2_grpc.CosyVoiceStub(ch)
            config = pb2.StreamConfig(sft=pb2.Sft(speaker_id="tiny_sft_spk"))
            cases = [
                ([pb2.StreamSynthesizeRequest(text="Hi.")], grpc.StatusCode.INVALID_ARGUMENT, "first"),
                ([pb2.StreamSynthesizeRequest(config=config), pb2.StreamSynthesizeRequest(config=config)],
                 grpc.StatusCode.INVALID_ARGUMENT, "only once"),
                ([pb2.StreamSynthesizeRequest(config=config), pb2.StreamSynthesizeRequest(end=pb2.StreamEnd())],
                 grpc.StatusCode.INVALID_ARGUMENT, "no text"),
                ([pb2.StreamSynthesizeRequest(config=pb2.StreamConfig(sft=pb2.Sft(speaker_id="ghost")))],
                 grpc.StatusCode.NOT_FOUND, "ghost"),
                ([pb2.StreamSynthesizeRequest(config=pb2.StreamConfig(sft=pb2.Sft(speaker_id="tiny_sft_spk"),
                                                                      text_normalization=7))],
                 grpc.StatusCode.INVALID_ARGUMENT, "config.text_normalization 7 is not a known TextNormalization"),
                ([pb2.StreamSynthesizeRequest(config=pb2.StreamConfig(
                    sft=pb2.Sft(speaker_id="tiny_sft_spk"), text_mode=pb2.TEXT_MODE_SENTENCE,
                    text_normalization=pb2.TEXT_NORMALIZATION_RAW))],
                 grpc.StatusCode.INVALID_ARGUMENT, "sentence mode normalizes whole sentences"),
                ([pb2.StreamSynthesizeRequest(config=config), pb2.StreamSynthesizeRequest(text="Hi there."),
                  pb2.StreamSynthesizeRequest(end=pb2.StreamEnd()), pb2.StreamSynthesizeRequest(text="More.")],
                 grpc.StatusCode.INVALID_ARGUMENT, "after `end`"),
            ]
            for messages, code, text in cases:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stub.StreamSynthesize(iter(messages)):
                        pass
                assert e.value.code() == code and text in e.value.details(), e.value.details()
    run(body())
    wait_idle(server)


LONG_TEXT = ("This sentence is long enough to keep the engine busy for a while, and then some more "
             "words follow so that the stream has many chunks before it ends. ") * 2


def test_cancel_mid_stream_stops_engine_work(server):
    async def body():
        async with CosyVoiceClient(server.target) as c:
            n = 0
            async for chunk in c.synthesize(LONG_TEXT, speaker_id="tiny_zs_spk", stream=True, seed=2):
                n += 1
                if n == 2:
                    assert not chunk.is_final
                    assert server.server.servicer.active == 1
                    break  # leaving the loop cancels the RPC
    run(body())
    wait_idle(server)


def test_deadline_exceeded_stops_engine_work(server):
    async def body():
        async with CosyVoiceClient(server.target) as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(c.synthesize(LONG_TEXT, speaker_id="tiny_zs_spk", stream=True, timeout=0.5))
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    run(body())
    wait_idle(server)


def test_concurrency_limit_resource_exhausted(server):
    """Hold every stream slot with StreamSynthesize calls that never send text."""
    limit = server.config.limits.max_concurrent_streams

    async def body():
        clients = [CosyVoiceClient(server.target) for _ in range(limit)]

        async def pieces():
            await asyncio.Event().wait()  # never any text
            yield ""

        async def hold(c):
            return await collect(c.stream_synthesize(pieces(), speaker_id="tiny_sft_spk", mode="sft"))

        holders = [asyncio.create_task(hold(c)) for c in clients]
        try:
            for _ in range(400):
                if server.server.servicer.active == limit:
                    break
                await asyncio.sleep(0.05)
            assert server.server.servicer.active == limit
            async with CosyVoiceClient(server.target) as extra:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await collect(extra.synthesize("Hi.", mode="sft", speaker_id="tiny_sft_spk"))
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "max_concurrent_streams" in e.value.details()
        finally:
            for task in holders:
                task.cancel()  # the clients go away: their slots are freed
            await asyncio.gather(*holders, return_exceptions=True)
            for c in clients:
                await c.close()
    run(body())
    wait_idle(server)
    chunks = run(_synth(server, "Free again.", mode="sft", speaker_id="tiny_sft_spk", seed=1))
    check_response(chunks)


@pytest.mark.slow
def test_16_concurrent_clients(server, fixture_audio):
    async def one(k: int):
        kw = [dict(speaker_id="tiny_zs_spk"), dict(mode="sft", speaker_id="tiny_sft_spk"),
              dict(prompt_audio=fixture_audio["p16"])][k % 3]
        async with CosyVoiceClient(server.target) as c:
            return [ch async for ch in c.synthesize(f"Hi, client {k}.", stream=k % 2 == 0,
                                                    seed=k, sample_rate=[0, 16000][k % 2], **kw)]

    async def body():
        return await asyncio.gather(*(one(k) for k in range(16)))

    results = run(body())
    for k, chunks in enumerate(results):
        check_response(chunks, [24000, 16000][k % 2])
    wait_idle(server)


def test_metrics_endpoint(server):
    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def part_counts(text: str) -> dict[str, float]:
        return {p: float(n) for p, n in re.findall(r'^cosyvoice_first_chunk_part_seconds_count\{part="(\w+)"\} (\S+)$',
                                                   text, re.M)}

    before = part_counts(scrape())
    run(_synth(server, "Hi.", mode="sft", speaker_id="tiny_sft_spk", seed=1, stream=True))
    text = scrape()
    assert 'cosyvoice_requests_total{method="Synthesize",mode="sft",status="OK"}' in text
    for name in ("cosyvoice_active_streams", "cosyvoice_first_chunk_latency_seconds_bucket", "cosyvoice_rtf_bucket",
                 "cosyvoice_engine_running_requests", "cosyvoice_engine_waiting_requests", "cosyvoice_ready 1.0"):
        assert name in text, name
    deadline = time.monotonic() + 10  # the handler records its metrics just after the client's last message
    while (after := part_counts(scrape())) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    # the request's first chunk, split three ways, and the first token's share of its tokens' time
    assert {p: after[p] - before.get(p, 0) for p in after} == {"tokens": 1, "wait": 1, "t2w": 1, "first_token": 1}


def test_reflection_lists_the_service(server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def body():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            async for response in call:
                return [s.name for s in response.list_services_response.service]

    names = run(body())
    assert SERVICE_NAME in names and "grpc.health.v1.Health" in names


def test_forced_token_count_over_grpc(server):
    """SynthesisOptions.max_tokens fixes the workload: exactly N tokens, 960 samples each."""
    chunks = asyncio.run(_synth(server, "Hi.", speaker_id="tiny_sft_spk", mode="sft", stream=True, max_tokens=33))
    assert chunks[-1].summary.speech_tokens == 33
    assert sum(c.num_samples for c in chunks) == 33 * 960
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(_synth(server, "Hi.", speaker_id="tiny_sft_spk", mode="sft", max_tokens=10**6))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

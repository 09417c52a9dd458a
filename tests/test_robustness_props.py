"""Property-based: any SynthesizeRequest either converts/synthesizes or gets a precise status.

Three levels, each with bounded examples and no deadline (the box is shared):
1. audio decoding (`_decode_audio`): any AudioData gives finite mono samples at a positive rate,
   or InvalidRequest naming the field;
2. the servicer's proto -> SynthesisRequest conversion: any message converts, or raises an error
   whose status is INVALID_ARGUMENT; what converts is then accepted or refused (INVALID_ARGUMENT) by the library's rule book;
3. a real server on 127.0.0.1 with the tiny model: any message ends OK or with one of the
   statuses a client can act on, never INTERNAL / UNKNOWN, and the server keeps serving.
"""
from __future__ import annotations

import asyncio
import io

import grpc
import numpy as np
import pytest
import soundfile as sf

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is in the dev extra: pip install -e '.[dev]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from async_cosyvoice.config import Config  # noqa: E402
from async_cosyvoice.errors import CosyVoiceError  # noqa: E402
from async_cosyvoice.speakers import SpeakerStore  # noqa: E402
from async_cosyvoice.rules import RequestRules  # noqa: E402
from grpc_async import pb2  # noqa: E402
from grpc_async.client import CosyVoiceClient  # noqa: E402
from grpc_async.metrics import Metrics  # noqa: E402
from grpc_async.server import ServerThread  # noqa: E402
from grpc_async.servicer import CosyVoiceServicer, _decode_audio, status_for  # noqa: E402

MAX_TEXT = 80
MAX_PROMPT_SECONDS = 3.0
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.function_scoped_fixture])
ACTIONABLE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}
SPEAKERS = ("tiny_zs_spk", "tiny_sft_spk")

# ---------------------------------------------------------------------------------------------
# strategies

uint32 = st.integers(0, 2**32 - 1)
good_text = st.sampled_from(["Hello there.", "Hi.", "你好。", "1,000 km/h at 3:45 pm!"])
any_text = st.one_of(st.text(max_size=20), st.sampled_from(["", " ", "...", "\x00"]),
                     st.text(min_size=MAX_TEXT - 2, max_size=MAX_TEXT + 5))


@st.composite
def wav_files(draw, wild: bool = True) -> bytes:
    rate = draw(st.integers(1, 400_000) if wild else st.sampled_from([8000, 16000, 22050, 24000, 48000]))
    frames = draw(st.integers(0, 3000) if wild else st.integers(800, 3000))
    channels = draw(st.integers(1, 3))
    fmt, subtype = draw(st.sampled_from([("WAV", "PCM_16"), ("WAV", "FLOAT"), ("FLAC", "PCM_16")]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = rng.uniform(-1, 1, (frames, channels)).astype(np.float32)
    buf = io.BytesIO()
    try:
        sf.write(buf, x, rate, format=fmt, subtype=subtype)
    except (sf.LibsndfileError, RuntimeError, ValueError):  # a rate the container cannot hold
        sf.write(buf, x, 16000, format="WAV", subtype="PCM_16")
    data = buf.getvalue()
    cut = draw(st.one_of(st.none(), st.integers(0, len(data)))) if wild else None
    return data if cut is None else data[:cut]


@st.composite
def raw_pcm(draw) -> pb2.RawPcm:
    encoding = draw(st.one_of(st.sampled_from([pb2.PCM_ENCODING_S16LE, pb2.PCM_ENCODING_F32LE]),
                              st.integers(0, 7)))
    data = draw(st.one_of(st.binary(max_size=4000),
                          st.builds(lambda n, s: np.random.default_rng(s).uniform(-1, 1, n).astype("<f4").tobytes(),
                                    st.integers(0, 2000), st.integers(0, 100))))
    return pb2.RawPcm(data=data, encoding=encoding,
                      sample_rate=draw(st.one_of(st.sampled_from([0, 16000, 24000]), uint32)),
                      channels=draw(st.one_of(st.integers(0, 3), uint32)))


any_audio = st.one_of(
    st.just(pb2.AudioData()),
    st.builds(lambda b: pb2.AudioData(file=b), st.one_of(wav_files(), st.binary(max_size=300))),
    st.builds(lambda p: pb2.AudioData(pcm=p), raw_pcm()))
good_audio = st.builds(lambda b: pb2.AudioData(file=b), wav_files(wild=False))


@st.composite
def options(draw, wild: bool) -> pb2.SynthesisOptions:
    stream = draw(st.booleans())
    o = pb2.SynthesisOptions(
        stream=stream,
        encoding=draw(st.integers(-5, 100) if wild else st.integers(0, 3)),
        sample_rate=draw(uint32 if wild else st.sampled_from([0, 8000, 16000, 44100, 48000])))
    if draw(st.booleans()):
        o.speed = draw(st.floats(allow_nan=True, allow_infinity=True, width=32) if wild
                       else st.just(1.0) if stream else st.floats(0.5, 2.0, width=32))
    if draw(st.booleans()):
        o.text_frontend = draw(st.booleans())
    if draw(st.booleans()):
        o.seed = draw(uint32)
    if draw(st.booleans()):
        o.max_tokens = draw(uint32 if wild else st.integers(1, 10))
    return o


FIELDS = ("text", "audio", "speaker", "options", "request_id", "mode")


@st.composite
def synthesize_requests(draw) -> pb2.SynthesizeRequest:
    """A plausible request with up to two fields drawn from anything the wire can carry."""
    wild = draw(st.sets(st.sampled_from(FIELDS), max_size=2))
    text = any_text if "text" in wild else good_text
    audio = any_audio if "audio" in wild else good_audio
    speaker = st.text(max_size=70) if "speaker" in wild else st.sampled_from(SPEAKERS)
    r = pb2.SynthesizeRequest(text=draw(text), options=draw(options("options" in wild)),
                              request_id=draw(st.text(max_size=70) if "request_id" in wild else st.just("")))
    modes = ["zero_shot", "cross_lingual", "instruct2", "sft", "zero_shot_by_spk_id", "instruct2_by_spk_id", "vc"]
    mode = draw(st.sampled_from(modes + [None] if "mode" in wild else modes))
    if mode == "zero_shot":
        r.zero_shot.CopyFrom(pb2.ZeroShot(prompt_text=draw(text), prompt_audio=draw(audio)))
    elif mode == "cross_lingual":
        r.cross_lingual.CopyFrom(pb2.CrossLingual(prompt_audio=draw(audio)))
    elif mode == "instruct2":
        r.instruct2.CopyFrom(pb2.Instruct2(instruct_text=draw(text), prompt_audio=draw(audio)))
    elif mode == "sft":
        r.sft.CopyFrom(pb2.Sft(speaker_id=draw(speaker)))
    elif mode == "zero_shot_by_spk_id":
        r.zero_shot_by_spk_id.CopyFrom(pb2.ZeroShotBySpeaker(speaker_id=draw(speaker)))
    elif mode == "instruct2_by_spk_id":
        r.instruct2_by_spk_id.CopyFrom(pb2.Instruct2BySpeaker(speaker_id=draw(speaker), instruct_text=draw(text)))
    elif mode == "vc":
        if "text" not in wild:
            r.text = ""
        r.vc.CopyFrom(pb2.VoiceConversion(source_audio=draw(audio), prompt_audio=draw(audio)))
    return r


# ---------------------------------------------------------------------------------------------
# 1 + 2: no server


@pytest.fixture(scope="module")
def servicer():
    cfg = Config.model_validate({"limits": {"max_text_chars": MAX_TEXT, "max_prompt_seconds": MAX_PROMPT_SECONDS,
                                            "max_source_seconds": MAX_PROMPT_SECONDS}})
    return CosyVoiceServicer(cfg, Metrics())


@FAST
@given(audio=st.one_of(any_audio, good_audio))
def test_audio_decoding_gives_samples_or_invalid_argument(audio):
    try:
        out = _decode_audio(audio, "prompt_audio")
        RequestRules.check_audio(out, "prompt_audio", MAX_PROMPT_SECONDS, "max_prompt_seconds")
    except CosyVoiceError as e:
        assert status_for(e) == grpc.StatusCode.INVALID_ARGUMENT, e
        assert str(e).startswith("prompt_audio")
        return
    assert out.sample_rate > 0 and out.samples.dtype == np.float32 and out.samples.ndim == 1
    assert 0 < len(out.samples) and np.isfinite(out.samples).all()
    assert out.seconds <= MAX_PROMPT_SECONDS


@FAST
@given(request=synthesize_requests())
def test_conversion_converts_or_invalid_argument(servicer, request):
    # what the Synthesize handler runs (proto shape) and then the library's rule book (values)
    rules = RequestRules.from_config(servicer.config)
    try:
        request_id = servicer._request_id(request.request_id)
        converted, _ = servicer._synthesis_request(request, request.text, request_id)
        checked = rules.check(converted)
    except CosyVoiceError as e:
        assert status_for(e) == grpc.StatusCode.INVALID_ARGUMENT, e
        assert str(e)
        return
    assert checked.request_id == request_id and checked.options.first_hop is not None


# ---------------------------------------------------------------------------------------------
# 3: a real server


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    spk_dir = tmp_path_factory.mktemp("spk-props")
    SpeakerStore(spk_dir).import_spk2info(tiny_dir / "spk2info.pt")
    cfg = Config.model_validate({
        "model": {"dir": str(tiny_dir)}, "speakers": {"dir": str(spk_dir)}, "server": {"port": 0},
        "limits": {"max_text_chars": MAX_TEXT, "max_prompt_seconds": MAX_PROMPT_SECONDS,
                   "max_source_seconds": MAX_PROMPT_SECONDS, "max_forced_tokens": 6}})
    st_ = ServerThread(cfg, ready_timeout=600)
    yield st_
    st_.close(grace=1)


@pytest.mark.slow
@SLOW
@given(request=synthesize_requests())
def test_any_request_on_a_real_server_gets_ok_or_an_actionable_status(server, request):
    # bound the work of the requests that do synthesize: at most 6 tokens a segment
    if not request.options.HasField("max_tokens") or request.options.max_tokens > 6:
        request.options.max_tokens = 4

    async def body():
        async with CosyVoiceClient(server.target) as c:
            try:
                final = [ch async for ch in c.synthesize(request=request, timeout=120)][-1]
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()
            assert final.is_final
            return grpc.StatusCode.OK, ""

    code, details = asyncio.run(body())
    assert code == grpc.StatusCode.OK or code in ACTIONABLE, (code, details)

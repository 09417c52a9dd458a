"""The async client library and `async-cosyvoice synthesize|speakers --target` against a real
server (fixture model, bearer auth on), the same verbs in-process, plus TLS and graceful shutdown."""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json

import grpc
import numpy as np
import pytest
import soundfile as sf

from async_cosyvoice.config import Config
from async_cosyvoice.speakers import SpeakerStore
from cosyvoice_cli.cli import main
from grpc_async.client import CosyVoiceClient, collect, fix_wav_sizes
from grpc_async.encoding import wav_header
from grpc_async.server import ServerThread

TOKEN = "test-token-123"
PROMPT_TEXT = "The morning train was late again, so I walked along the river."


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    spk_dir = tmp_path_factory.mktemp("spk-client")
    SpeakerStore(spk_dir).import_spk2info(tiny_dir / "spk2info.pt")
    cfg = Config.model_validate({
        "model": {"dir": str(tiny_dir)},
        "speakers": {"dir": str(spk_dir)},
        "server": {"port": 0, "auth_token": TOKEN},
    })
    with ServerThread(cfg, ready_timeout=900) as st:
        yield st


@pytest.fixture
def cli(server, monkeypatch, capsys):
    monkeypatch.delenv("ASYNC_COSYVOICE_TOKEN", raising=False)

    def call(*args: str, token: str | None = TOKEN) -> tuple[int, str, str]:
        argv = list(args) + ["--target", server.target] + (["--token", token] if token else [])
        rc = main(argv)
        out = capsys.readouterr()
        return rc, out.out, out.err
    return call


@pytest.mark.slow
def test_cli_register_list_show_synthesize_delete(cli, golden_dir, tmp_path):
    prompt = str(golden_dir / "prompt_24k.wav")
    rc, out, err = cli("speakers", "add", "cli-bob", "--prompt-wav", prompt, "--prompt-text", PROMPT_TEXT)
    assert rc == 0, err
    assert out.startswith("cli-bob\tzero_shot\t")

    rc, out, _ = cli("speakers", "list")
    assert rc == 0 and "cli-bob\t" in out and "tiny_zs_spk\t" in out and "tiny_sft_spk\tsft" in out
    rc, out, _ = cli("speakers", "show", "cli-bob")
    shown = json.loads(out)
    assert rc == 0 and shown["kind"] == "zero_shot" and shown["prompt_text"] == PROMPT_TEXT

    wav = tmp_path / "bob.wav"
    rc, out, err = cli("synthesize", "--text", "Hello from the command line.", "--speaker", "cli-bob",
                       "--seed", "1", "--out", str(wav))
    assert rc == 0, err
    assert "wrote" in out and "speech tokens" in out
    audio, rate = sf.read(wav, dtype="float32")
    info = sf.info(wav)
    assert rate == 24000 and info.subtype == "PCM_16" and info.channels == 1
    assert len(audio) > 0 and len(audio) % 960 == 0

    wav16 = tmp_path / "bob16.wav"
    rc, out, err = cli("synthesize", "--text", "Streaming this one.", "--speaker", "cli-bob", "--stream",
                       "--sample-rate", "16000", "--seed", "2", "--out", str(wav16))
    assert rc == 0, err
    audio, rate = sf.read(wav16, dtype="float32")
    assert rate == 16000 and len(audio) > 0 and len(audio) % 640 == 0

    rc, out, err = cli("speakers", "rm", "cli-bob")
    assert rc == 0 and "deleted cli-bob" in out
    rc, out, err = cli("speakers", "show", "cli-bob")
    assert rc == 2 and "NOT_FOUND" in err and "cli-bob" in err


@pytest.mark.slow
def test_cli_zero_shot_from_prompt_wav_and_sft(cli, golden_dir, tmp_path):
    out_wav = tmp_path / "zs.wav"
    rc, out, err = cli("synthesize", "--text", "Zero shot from a file.", "--prompt-wav",
                       str(golden_dir / "prompt_16k.wav"), "--prompt-text", PROMPT_TEXT, "--out", str(out_wav))
    assert rc == 0, err
    assert sf.info(out_wav).samplerate == 24000 and sf.info(out_wav).frames % 960 == 0
    rc, out, err = cli("synthesize", "--text", "Embedding only.", "--mode", "sft", "--speaker", "tiny_sft_spk",
                       "--out", str(tmp_path / "sft.wav"))
    assert rc == 0, err


def test_cli_max_tokens_and_compressed_encoding(cli, tmp_path):
    """--max-tokens fixes the length; --encoding opus writes the Ogg stream as it came."""
    out = tmp_path / "hi.opus"
    rc, text, err = cli("synthesize", "--text", "Hi there.", "--mode", "sft", "--speaker", "tiny_sft_spk",
                        "--max-tokens", "30", "--encoding", "opus", "--stream", "--sample-rate", "48000",
                        "--seed", "3", "--out", str(out))
    assert rc == 0, err
    assert "30 speech tokens" in text
    data = out.read_bytes()
    assert data[:4] == b"OggS" and b"OpusHead" in data[:64]
    audio, rate = sf.read(out, dtype="float32")                 # libsndfile reads Ogg Opus
    assert rate == 48000 and len(audio) == 30 * 960 * 2         # Ogg granules trim exactly
    rc, _, err = cli("synthesize", "--text", "Hi.", "--speaker", "tiny_sft_spk", "--mode", "sft",
                     "--encoding", "opus", "--sample-rate", "44100", "--out", str(tmp_path / "x.opus"))
    assert rc == 2 and "INVALID_ARGUMENT" in err and "opus supports sample rates" in err


def test_client_default_encoding_is_the_servers(server):
    from grpc_async import pb2
    from grpc_async.client import options

    assert options().encoding == pb2.AUDIO_ENCODING_UNSPECIFIED   # the server decides

    async def body():
        async with CosyVoiceClient(server.target, token=TOKEN) as c:
            info = await c.get_server_info()
            chunks = [ch async for ch in c.synthesize("Hi.", mode="sft", speaker_id="tiny_sft_spk", max_tokens=5)]
        return info, chunks

    info, chunks = run(body())
    assert {c.encoding for c in chunks} == {info.default_encoding} == {pb2.AUDIO_ENCODING_PCM16}


def test_docstring_example_runs(server, golden_dir, tmp_path, monkeypatch):
    """The module docstring's example, verbatim but for the address and the token of this server."""
    import textwrap

    import grpc_async.client as client_module

    doc = client_module.__doc__
    example = textwrap.dedent(doc[doc.index("    import asyncio"):doc.index("\n\n`synthesize`")])
    target = '"127.0.0.1:50051"'
    assert target in example
    example = example.replace(target, f'"{server.target}", token="{TOKEN}"')
    (tmp_path / "prompt.wav").write_bytes((golden_dir / "prompt_24k.wav").read_bytes())
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "grpc_async.client docstring", "exec"), {"__name__": "__example__"})
    data = (tmp_path / "hello.opus").read_bytes()
    assert data[:4] == b"OggS"
    assert sf.info(tmp_path / "hello.opus").duration > 0


def test_cli_errors(cli, tmp_path, capsys):
    rc, _, err = cli("speakers", "list", token=None)
    assert rc == 2 and "UNAUTHENTICATED" in err
    rc, _, err = cli("speakers", "list", token="wrong")
    assert rc == 2 and "UNAUTHENTICATED" in err
    rc, _, err = cli("speakers", "add", "../evil", "--prompt-wav", str(tmp_path / "missing.wav"),
                     "--prompt-text", "x")
    assert rc == 2 and "missing.wav" in err
    rc, _, err = cli("synthesize", "--text", "Hi.", "--speaker", "nobody", "--out", str(tmp_path / "x.wav"))
    assert rc == 2 and "NOT_FOUND" in err
    assert not (tmp_path / "x.wav").exists()
    rc, _, err = cli("synthesize", "--text", "Hi.", "--speaker", "nobody", "--model-dir", str(tmp_path),
                     "--out", str(tmp_path / "x.wav"))
    assert rc == 2 and "--model-dir: in-process only" in err
    rc, _, err = cli("synthesize", "--text", "Hi.", "--speaker", "nobody", "--save-tokens", str(tmp_path / "t.json"),
                     "--out", str(tmp_path / "x.wav"))
    assert rc == 2 and "--save-tokens: in-process only" in err
    rc, _, err = cli("synthesize", "--text", "Hi.", "--out", str(tmp_path / "x.wav"))
    assert rc == 2 and "give a voice" in err
    with pytest.raises(SystemExit) as e:  # import/export work on a local store only: no --target
        cli("speakers", "import", str(tmp_path / "spk2info.pt"))
    assert e.value.code == 2
    assert main(["speakers", "list", "--token", TOKEN, "--speakers-dir", str(tmp_path)]) == 2
    assert "--token: only with --target" in capsys.readouterr().err


@pytest.mark.slow
def test_same_verbs_in_process_and_by_a_server(cli, server, tiny_dir, tmp_path, capsys):
    """`speakers list|show` and `synthesize` print the same things and write the same audio in-process
    (on a store of their own) and with --target (the server's store), from the same spk2info."""
    local = ["--model-dir", str(tiny_dir), "--speakers-dir", str(tmp_path / "spk")]
    assert main(["speakers", "import", str(tiny_dir / "spk2info.pt"), "--speakers-dir", str(tmp_path / "spk")]) == 0
    capsys.readouterr()

    def without_created(listing: str) -> list[list[str]]:
        return [[f for i, f in enumerate(row.split("\t")) if i != 3] for row in listing.splitlines()]

    assert main(["speakers", "list", *local]) == 0
    here = without_created(capsys.readouterr().out)
    rc, there, err = cli("speakers", "list")
    assert rc == 0, err
    assert here and all(row in without_created(there) for row in here)
    assert ["tiny_sft_spk", "sft", "0.00s", ""] in here

    assert main(["speakers", "show", "tiny_zs_spk", *local]) == 0
    shown_here = json.loads(capsys.readouterr().out)
    rc, out, err = cli("speakers", "show", "tiny_zs_spk")
    shown_there = json.loads(out)
    assert rc == 0, err
    assert {k: v for k, v in shown_here.items() if k in shown_there and k != "created_at"} == {
        k: v for k, v in shown_there.items() if k != "created_at"}

    args = ["synthesize", "--text", "Both ways.", "--mode", "sft", "--speaker", "tiny_sft_spk", "--seed", "5",
            "--max-tokens", "12", "--stream"]
    assert main([*args, "--out", str(tmp_path / "here.wav"), *local]) == 0
    said_here = capsys.readouterr().out
    rc, said_there, err = cli(*args, "--out", str(tmp_path / "there.wav"))
    assert rc == 0, err
    for said in (said_here, said_there):
        assert "at 24000 Hz" in said and "12 speech tokens" in said
    here_audio, rate_here = sf.read(tmp_path / "here.wav", dtype="float32")
    there_audio, rate_there = sf.read(tmp_path / "there.wav", dtype="float32")
    assert rate_here == rate_there == 24000 and len(here_audio) == len(there_audio) == 12 * 960
    assert np.abs(here_audio - there_audio).max() <= 1.5 / 32768  # the same audio; two 16-bit writers round


def test_library_auth_and_health(server):
    async def body():
        async with CosyVoiceClient(server.target) as anonymous:
            await anonymous.wait_ready(timeout=10)  # health needs no token
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await anonymous.list_speakers()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(anonymous.synthesize("Hi.", mode="sft", speaker_id="tiny_sft_spk"))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        async with CosyVoiceClient(server.target, token=TOKEN) as client:
            page = await client.list_speakers(page_size=1)
            assert len(page.speakers) == 1 and page.next_page_token
            assert [s.speaker_id for s in await client.all_speakers(page_size=1)] == sorted(
                s.speaker_id for s in await client.all_speakers())
    run(body())


@pytest.mark.slow
def test_library_synthesize_and_stream_synthesize(server, golden_dir):
    async def body():
        async with CosyVoiceClient(server.target, token=TOKEN) as client:
            pcm, rate = sf.read(golden_dir / "prompt_16k.wav", dtype="float32")
            result = await collect(client.synthesize("Raw samples as the prompt.", prompt_audio=(pcm, rate),
                                                     seed=4, encoding="pcm16"))
            assert result.sample_rate == 24000 and len(result.audio) == 960 * result.summary.speech_tokens
            streamed = await collect(client.stream_synthesize(
                ["First sentence", " here. ", "Second", " one!"], speaker_id="tiny_zs_spk", stream=True, seed=4))
            assert len(streamed.audio) == 960 * streamed.summary.speech_tokens
            assert streamed.chunks > 1
            wav = [c async for c in client.synthesize("Wave file.", mode="sft", speaker_id="tiny_sft_spk",
                                                      stream=True, encoding="wav")]
            data = b"".join(c.audio for c in wav)
            fixed = fix_wav_sizes(data)
            assert int.from_bytes(fixed[40:44], "little") == len(data) - 44
    run(body())


def test_fix_wav_sizes():
    body = np.arange(10, dtype="<i2").tobytes()
    fixed = fix_wav_sizes(wav_header(None, 16000) + body)
    assert fixed == wav_header(10, 16000) + body


# ---- TLS (no model needed: a server that is still loading answers UNAVAILABLE over TLS) ------


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return tmp_path / "cert.pem", tmp_path / "key.pem"


async def _never_ready(config):
    await asyncio.Event().wait()


def test_tls(tmp_path):
    cert, key = _self_signed(tmp_path)
    cfg = Config.model_validate({"server": {"host": "localhost", "port": 0, "tls_cert": str(cert),
                                            "tls_key": str(key)},
                                 "speakers": {"dir": str(tmp_path / "spk")}})
    with ServerThread(cfg, ready_timeout=None, synthesizer_factory=_never_ready) as st:
        async def body():
            async with CosyVoiceClient(st.target, tls=cert) as client:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await client.list_speakers(timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in e.value.details()
            async with CosyVoiceClient(st.target) as plaintext:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await plaintext.list_speakers(timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "loading" not in (e.value.details() or "")
        run(body())


# ---- graceful shutdown ----------------------------------------------------------------------


@pytest.mark.slow
def test_graceful_shutdown_drains_in_flight_streams(tiny_dir, tmp_path):
    cfg = Config.model_validate({"model": {"dir": str(tiny_dir)}, "speakers": {"dir": str(tmp_path)},
                                 "server": {"port": 0, "grace_seconds": 60}})
    SpeakerStore(tmp_path).import_spk2info(tiny_dir / "spk2info.pt")
    st = ServerThread(cfg, ready_timeout=900)
    try:
        async def body():
            async with CosyVoiceClient(st.target) as client:
                chunks = []
                stopping = None
                async for chunk in client.synthesize("One short sentence to finish.", speaker_id="tiny_zs_spk",
                                                     stream=True, seed=1):
                    chunks.append(chunk)
                    if stopping is None:  # first chunk: start shutting down under the stream
                        loop = asyncio.get_running_loop()
                        stopping = loop.run_in_executor(None, lambda: st.call(st.server.stop()))
                        for _ in range(100):
                            if st.server.servicer.closing:
                                break
                            await asyncio.sleep(0.02)
                        async with CosyVoiceClient(st.target) as late:
                            with pytest.raises(grpc.aio.AioRpcError) as e:
                                await collect(late.synthesize("Too late.", mode="sft", speaker_id="tiny_sft_spk"))
                            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                await stopping
                return chunks

        chunks = run(body())
        assert chunks[-1].is_final and [c.index for c in chunks] == list(range(len(chunks)))
        assert sum(c.num_samples for c in chunks) == 960 * chunks[-1].summary.speech_tokens
    finally:
        st.close()

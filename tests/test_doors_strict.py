"""Every door equally strict, before a model is even loaded (issue 26 items 3, 10, 11; issue 25
item 4): a server on 127.0.0.1 whose model never finishes loading answers these on its own.

- gRPC: request bytes that do not decode (garbage, invalid UTF-8 in a string) are INVALID_ARGUMENT.
- HTTP: TLS whenever TLS is configured (the gRPC certificate or the door's own), /docs and
  /openapi.json behind the token (or off), uvicorn's own 400s in the JSON error shape, an
  x-request-id on every response including errors, a body that is not JSON named as such, and
  strict types (`"speed": true` is not 1.0).
"""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import socket
import ssl

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from async_cosyvoice.config import Config
from grpc_async import SERVICE_NAME
from grpc_async.client import CosyVoiceClient
from grpc_async.server import ServerThread
from grpc_async.servicer import pb2

TOKEN = "strict-s3cret"


async def _never_ready(config):
    await asyncio.Event().wait()


def _self_signed(directory):
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
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    (directory / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return directory / "cert.pem", directory / "key.pem"


def _server(tmp_path, **server) -> ServerThread:
    cfg = Config.model_validate({"server": {"host": "127.0.0.1", "port": 0, "http_port": 0, "auth_token": TOKEN,
                                            "grace_seconds": 1, **server},
                                 "speakers": {"dir": str(tmp_path / "spk")}})
    return ServerThread(cfg, ready_timeout=None, synthesizer_factory=_never_ready)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    with _server(tmp_path_factory.mktemp("plain")) as st:
        st.base = f"http://127.0.0.1:{st.server.http_port}"
        yield st


# ---- gRPC: undecodable request bytes (issue 26 item 3) ----------------------------------------------

def _invalid_utf8(message) -> bytes:
    """`message` serialized with its one string "é" turned into invalid UTF-8 (0xC3 0x28)."""
    data = message.SerializeToString()
    assert data.count("é".encode()) == 1
    return data.replace("é".encode(), b"\xc3\x28")


def test_undecodable_grpc_requests_are_invalid_argument(plain):
    method = f"/{SERVICE_NAME}/"
    auth = (("authorization", f"Bearer {TOKEN}"),)
    garbage = b"\xff\xff\xff\xff\x0f"  # a varint that never ends

    async def body():
        async with grpc.aio.insecure_channel(plain.target) as ch:
            async def unary(name, data, stream=False):
                call = (ch.unary_stream if stream else ch.unary_unary)(method + name)  # identity serializers
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    if stream:
                        async for _ in call(data, metadata=auth, timeout=10):
                            pass
                    else:
                        await call(data, metadata=auth, timeout=10)
                return e.value.code(), e.value.details()

            got = {
                "GetSpeaker garbage": await unary("GetSpeaker", garbage),
                "GetSpeaker utf8": await unary("GetSpeaker", _invalid_utf8(pb2.GetSpeakerRequest(speaker_id="é"))),
                "Synthesize utf8": await unary("Synthesize", _invalid_utf8(pb2.SynthesizeRequest(text="é")), True),
            }
            stream = ch.stream_stream(method + "StreamSynthesize")(metadata=auth, timeout=10)
            await stream.write(_invalid_utf8(pb2.StreamSynthesizeRequest(text="é")))
            await stream.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stream:
                    pass
            got["StreamSynthesize utf8"] = (e.value.code(), e.value.details())
            check = ch.unary_unary("/grpc.health.v1.Health/Check")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await check(garbage, timeout=10)
            got["Health garbage"] = (e.value.code(), e.value.details())
            # well-formed bytes still reach the handler (the model is loading: UNAVAILABLE)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(method + "GetSpeaker")(pb2.GetSpeakerRequest(speaker_id="x").SerializeToString(),
                                                            metadata=auth, timeout=10)
            got["GetSpeaker valid"] = (e.value.code(), e.value.details())
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return got, health.status

    got, health = asyncio.run(body())
    valid = got.pop("GetSpeaker valid")
    assert valid[0] == grpc.StatusCode.UNAVAILABLE and "loading" in valid[1]
    for what, (code, details) in got.items():
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, details)
        assert "cannot be decoded" in details and "DecodeError" in details, (what, details)
    assert "/cosyvoice.v1.CosyVoice/Synthesize" in got["Synthesize utf8"][1]
    assert health == health_pb2.HealthCheckResponse.NOT_SERVING  # the server answers on as before


# ---- HTTP: x-request-id on errors, a body that is not JSON, strict types (25.4, 26.11) ----------------

def test_every_http_response_carries_a_request_id_and_errors_are_precise(plain):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=plain.base, timeout=30) as http:
        responses = {
            "garbage body": http.post("/v1/audio/speech", content=b"{not json",
                                      headers={**auth, "Content-Type": "application/json"}),
            "not an object": http.post("/v1/audio/speech", content=b"{not json", headers=auth),
            "speed true": http.post("/v1/audio/speech", headers=auth, json={
                "model": "tts-1", "input": "Hi.", "voice": "x", "speed": True}),
            "seed true": http.post("/v1/audio/speech", headers=auth, json={
                "model": "tts-1", "input": "Hi.", "voice": "x", "seed": True}),
            "no token": http.get("/v1/audio/voices"),
            "unknown path": http.get("/nowhere", headers=auth),
            "loading": http.post("/v1/audio/speech", headers=auth, json={
                "model": "tts-1", "input": "Hi.", "voice": "x", "speed": 1}),
            "readyz": http.get("/readyz"),
            "too large": http.post("/v1/audio/speech", headers=auth, content=b"x" * (33 * 1024 * 1024)),
        }
    for what, r in responses.items():
        assert r.headers["content-type"] == "application/json", what
        assert len(r.headers.get("x-request-id", "")) == 32, (what, dict(r.headers))
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, what
    status = {what: r.status_code for what, r in responses.items()}
    assert status == {"garbage body": 400, "not an object": 400, "speed true": 400, "seed true": 400, "no token": 401, "unknown path": 404,
                      "loading": 503, "readyz": 503, "too large": 413}
    garbage = responses["garbage body"].json()["error"]
    assert garbage["param"] is None and garbage["message"].startswith("the request body is not valid JSON ("), garbage
    not_object = responses["not an object"].json()["error"]
    assert not_object["param"] is None and "Content-Type: application/json" in not_object["message"]
    assert responses["speed true"].json()["error"]["param"] == "speed"
    assert responses["seed true"].json()["error"]["param"] == "seed"
    loading = responses["loading"]  # an int speed is still a float: this one got past validation
    assert "loading" in loading.json()["error"]["message"]


def test_uvicorn_level_400s_are_json(plain):
    with socket.create_connection(("127.0.0.1", plain.server.http_port), timeout=10) as s:
        s.sendall(b"NOT AN HTTP REQUEST\x00\x01\r\n\r\n")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert lines[0] == "HTTP/1.1 400 Bad Request"
    assert headers["content-type"] == "application/json" and len(headers["x-request-id"]) == 32
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_request" and "Invalid HTTP request received" in error["message"]


# ---- HTTP over TLS, docs behind the token (issue 26 item 10) -------------------------------------------

def test_http_door_serves_tls_with_the_grpc_certificate_and_docs_need_the_token(tmp_path):
    cert, key = _self_signed(tmp_path / "tls")
    with _server(tmp_path, host="localhost", tls_cert=str(cert), tls_key=str(key)) as st:
        port = st.server.http_port
        tls = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=f"https://localhost:{port}", verify=tls, timeout=30) as https:
            assert https.get("/healthz").json() == {"status": "ok"}
            for path in ("/docs", "/openapi.json"):
                r = https.get(path)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            schema = https.get("/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
            assert schema.status_code == 200 and "/v1/audio/speech" in schema.json()["paths"]
            page = https.get("/docs", params={"api_key": TOKEN})  # a browser: the key in the URL
            assert page.status_code == 200 and f"/openapi.json?api_key={TOKEN}" in page.text
            assert https.get(f"/openapi.json?api_key={TOKEN}").status_code == 200
        # the same port in plaintext: no HTTP answer (the token never crosses in clear)
        with httpx.Client(timeout=10) as http, pytest.raises(httpx.HTTPError):
            http.get(f"http://localhost:{port}/healthz", headers={"Authorization": f"Bearer {TOKEN}"})

        async def grpc_over_tls():  # gRPC keeps its TLS
            async with CosyVoiceClient(st.target.replace("127.0.0.1", "localhost"), tls=cert,
                                       token=TOKEN) as client:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await client.list_speakers(timeout=10)
                return e.value.code()
        assert asyncio.run(grpc_over_tls()) == grpc.StatusCode.UNAVAILABLE


def test_http_door_own_certificate_and_docs_off(tmp_path):
    cert, key = _self_signed(tmp_path / "http-tls")
    with _server(tmp_path, host="localhost", port=None, http_tls_cert=str(cert), http_tls_key=str(key),
                 http_docs=False) as st:
        tls = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=f"https://localhost:{st.server.http_port}", verify=tls, timeout=30) as https:
            assert https.get("/healthz").status_code == 200
            auth = {"Authorization": f"Bearer {TOKEN}"}
            assert https.get("/docs", headers=auth).status_code == 404
            assert https.get("/openapi.json", headers=auth).status_code == 404
    with pytest.raises(ValueError, match="http_tls_cert and server.http_tls_key go together"):
        _server(tmp_path, http_tls_cert=str(cert))


def test_http_door_requires_client_certificates_with_mtls(tmp_path):
    cert, key = _self_signed(tmp_path / "tls")
    with _server(tmp_path, host="localhost", port=None, tls_cert=str(cert), tls_key=str(key),
                 tls_client_ca=str(cert)) as st:
        url = f"https://localhost:{st.server.http_port}/healthz"
        anonymous = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(verify=anonymous, timeout=10) as https, pytest.raises(httpx.HTTPError):
            https.get(url).raise_for_status()
        known = ssl.create_default_context(cafile=str(cert))
        known.load_cert_chain(str(cert), str(key))
        with httpx.Client(verify=known, timeout=10) as https:
            assert https.get(url).json() == {"status": "ok"}

"""Docs that run: every shell and Python example in README.md and docs/*.md, against one fresh
default server on CPU (the tiny demo model), in document order.

- The examples are the fenced blocks tagged `bash`, `sh`, `shell`, `console` or `python`. An
  untagged block must not look like a command (it is a diagram or a listing): tag it.
- A comment on the line before a fence marks it: `<!-- doc-test: skip: REASON -->` (needs a GPU,
  a real model, Docker, ...: reported as a skip with the reason), `<!-- doc-test: needs TOOL -->`
  (runs where TOOL is on PATH, skipped with that reason elsewhere), or
  `<!-- doc-test: without: CMD; CMD -->` (runs the block without those commands: the installer
  and the test suite, which CI runs itself; `CMD && rest` keeps `rest`).
- One server for all examples: `async-cosyvoice serve --http-port H --port G` with the default
  config and no model dir (the demo model), started here once. A background `serve ... &` line
  in an example is that server (not started again); the documented addresses 127.0.0.1:8000
  (HTTP) and 127.0.0.1:50051 (gRPC) are rewritten to H and G, so the test runs beside other
  servers on the same machine.
- Each document starts from a server with no voices and its own working directory holding what a
  user of the examples has at hand: `prompt.wav`, `alice.wav` and `p.wav` (a recording,
  tests/data/prompt.wav) and the checkout's `tests/`, `configs/`, `scripts/` and `.venv` (this
  interpreter's environment). The examples of one document share that directory, like one
  terminal. Shell runs under `bash -e -o pipefail`; Python as a script.
A failing example fails its test with the example's output.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from grpc_async.client import CosyVoiceClient

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"bash": "bash", "sh": "bash", "shell": "bash", "console": "bash", "python": "python"}
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*doc-test:\s*(skip|needs|without)\b:?\s*(.*?)\s*-->\s*$")
LOOKS_LIKE_A_COMMAND = re.compile(r"^\s*(\$ |async-cosyvoice |\.venv/|python |pip |curl |grpcurl |docker |serve )")
BACKGROUND_SERVE = re.compile(r"^\s*(\S*/)?async-cosyvoice serve\b[^\n#]*&[ \t]*(#.*)?$", re.M)
DOC_HTTP, DOC_GRPC = "127.0.0.1:8000", "127.0.0.1:50051"
USER_FILES = ("prompt.wav", "alice.wav", "p.wav")
EXAMPLE_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Example:
    doc: Path
    line: int
    lang: str
    code: str
    marker: tuple[str, str] | None   # ("skip", reason), ("needs", tool) or ("without", "cmd; cmd")

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def fences(doc: Path) -> list[tuple[int, str, str, str]]:
    """(line of the fence, language tag, body, the line before the fence) for each fenced block."""
    text = doc.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        out.append((text.count("\n", 0, m.start()) + 1, m.group(1).lower(), m.group(2), before))
    return out


def examples() -> list[Example]:
    found = []
    for doc in DOCS:
        for line, lang, body, before in fences(doc):
            if lang not in RUN:
                continue
            marker = MARKER.search(before)
            found.append(Example(doc, line, lang, body, (marker.group(1), marker.group(2)) if marker else None))
    return found


EXAMPLES = examples()


def runnable_code(example: Example) -> str:
    """The example's code less the commands a `without` marker names."""
    code = example.code
    if example.marker and example.marker[0] == "without":
        for command in filter(None, (c.strip() for c in example.marker[1].split(";"))):
            assert command in code, f"{example.name}: the marker names {command!r}, which is not in the block"
            code = code.replace(f"{command} && ", "")
            code = "\n".join(line for line in code.split("\n") if not line.strip().startswith(command))
    return code


def test_untagged_blocks_are_no_commands():
    """A command in an untagged block would be skipped silently: every example carries its tag."""
    untagged = [f"{doc.relative_to(ROOT)}:{line}" for doc in DOCS for line, lang, body, _ in fences(doc)
                if not lang and LOOKS_LIKE_A_COMMAND.match(body)]
    assert not untagged, f"tag these blocks (bash/python/console) so the docs test runs or skips them: {untagged}"


def test_every_front_door_and_cli_verb_has_a_running_example():
    running = "\n".join(runnable_code(e) for e in EXAMPLES if e.marker is None or e.marker[0] != "skip")
    for verb in ("synthesize", "speakers add", "speakers list", "speakers show", "speakers rm",
                 "speakers import", "speakers export", "bench", "batch"):
        assert re.search(rf"async-cosyvoice {verb}\b", running), verb
    assert BACKGROUND_SERVE.search(running), "serve"
    assert "--target" in running                                   # the CLI against the server
    assert "/v1/audio/speech" in running and "OpenAI(" in running   # HTTP: curl and the SDK
    assert "/v1/audio/speech/stream" in running                     # the WebSocket
    assert "CosyVoiceClient(" in running                            # gRPC from Python
    assert "Synthesizer.create(" in running                         # the library


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(tmp: Path) -> dict[str, str]:
    """The user's shell: this interpreter's venv first on PATH, the checkout importable, no
    ASYNC_COSYVOICE settings (a default server), data under `tmp`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNC_COSYVOICE")}
    if "ASYNC_COSYVOICE_CACHE" in os.environ:  # where the demo model was generated
        env["ASYNC_COSYVOICE_CACHE"] = os.environ["ASYNC_COSYVOICE_CACHE"]
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env["XDG_DATA_HOME"] = str(tmp / "xdg-data")
    return env


@dataclasses.dataclass
class DocServer:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    env: dict[str, str]
    doc: Path | None = None

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def rewrite(self, code: str) -> str:
        code = BACKGROUND_SERVE.sub("# (the docs test's shared server stands in for this line)", code)
        return code.replace(DOC_HTTP, self.http).replace(DOC_GRPC, self.grpc)

    def forget_voices(self) -> None:
        with httpx.Client(base_url=f"http://{self.http}", timeout=60) as c:
            for voice in c.get("/v1/audio/voices").raise_for_status().json()["data"]:
                c.delete(f"/v1/audio/voices/{voice['id']}").raise_for_status()


@pytest.fixture(scope="module")
def doc_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("doc-server")
    env = _clean_env(tmp)
    http_port, grpc_port = _free_port(), _free_port()
    log = open(tmp / "serve.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "cosyvoice_cli", "serve", "--http-port", str(http_port),
                                "--port", str(grpc_port)], cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = DocServer(process, http_port, grpc_port, env)

    async def ready():
        async with CosyVoiceClient(server.grpc) as client:
            await client.wait_ready(timeout=600)
    try:
        asyncio.run(ready())
    except BaseException:
        process.kill()
        raise AssertionError(f"the docs' server did not start:\n{(tmp / 'serve.log').read_text()[-3000:]}")
    yield server
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()


def _workdir(tmp: Path) -> Path:
    work = tmp / "work"
    work.mkdir()
    for name in USER_FILES:
        shutil.copy(ROOT / "tests" / "data" / "prompt.wav", work / name)
    for name in ("tests", "configs", "scripts"):
        (work / name).symlink_to(ROOT / name)
    (work / ".venv").symlink_to(Path(sys.prefix))
    return work


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    made: dict[Path, Path] = {}

    def of(doc: Path) -> Path:
        if doc not in made:
            made[doc] = _workdir(tmp_path_factory.mktemp(doc.stem))
        return made[doc]
    return of


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_doc_example_runs(example: Example, doc_server: DocServer, workdirs):
    if example.marker and example.marker[0] == "skip":
        pytest.skip(f"{example.name}: {example.marker[1]}")
    if example.marker and example.marker[0] == "needs" and not shutil.which(example.marker[1]):
        pytest.skip(f"{example.name}: needs {example.marker[1]}, which is not installed")
    if doc_server.doc != example.doc:  # each document starts from a server with no voices
        doc_server.forget_voices()
        doc_server.doc = example.doc
    work = workdirs(example.doc)
    code = doc_server.rewrite(runnable_code(example))
    if RUN[example.lang] == "python":
        script = work / f"example_{example.line}.py"
        script.write_text(code)
        argv = [sys.executable, script.name]
    else:
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    env = {**doc_server.env, "XDG_DATA_HOME": str(work / ".xdg-data")}  # the user's data, not the server's
    process = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=EXAMPLE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{example.name} ran over {EXAMPLE_TIMEOUT_S} s:\n{output.decode(errors='replace')[-4000:]}")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # what the example left in the background
        except ProcessLookupError:
            pass
    assert process.returncode == 0, (f"{example.name} exited {process.returncode}:\n{code}\n--- output ---\n"
                                     f"{output.decode(errors='replace')[-4000:]}")

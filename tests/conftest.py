import os
from pathlib import Path

import pytest

FIXTURE_ENV = "COSYVOICE_TINY_FIXTURE"
DEFAULT_FIXTURE = Path(__file__).resolve().parents[1] / ".." / "shared" / "fixtures" / "cosyvoice2-tiny"
FIXTURE3_ENV = "COSYVOICE3_TINY_FIXTURE"
DEFAULT_FIXTURE3 = Path(__file__).resolve().parents[1] / ".." / "shared" / "fixtures" / "cosyvoice3-tiny"


def fixture_dir() -> Path:
    return Path(os.environ.get(FIXTURE_ENV, DEFAULT_FIXTURE)).resolve()


def fixture3_dir() -> Path:
    return Path(os.environ.get(FIXTURE3_ENV, DEFAULT_FIXTURE3)).resolve()


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    d = fixture_dir()
    if not (d / "cosyvoice2.yaml").is_file():
        pytest.fail(
            f"CosyVoice2 tiny fixture not found at {d}. It is not in the repository: it ships beside it as "
            "../shared/fixtures/cosyvoice2-tiny (random weights, goldens recorded from the upstream code; "
            f"README.md, 'The parity fixture'). Copy it there, or set {FIXTURE_ENV} to the directory "
            "holding cosyvoice2.yaml, llm.pt, flow.pt, hift.pt and golden/."
        )
    return d


@pytest.fixture(scope="session")
def tiny3_dir() -> Path:
    """The public CosyVoice3 tiny fixture (cosyvoice3.yaml, upstream goldens)."""
    d = fixture3_dir()
    if not (d / "cosyvoice3.yaml").is_file():
        pytest.fail(f"CosyVoice3 tiny fixture not found at {d}. Set {FIXTURE3_ENV} to the directory "
                    "holding cosyvoice3.yaml, llm.pt, flow.pt, hift.pt and golden/.")
    return d


@pytest.fixture(scope="session")
def golden_dir(tiny_dir) -> Path:
    return tiny_dir / "golden"


@pytest.fixture
def _one_thread():
    """Single-threaded torch: float sums in the order the goldens were made (1 thread)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dir(tiny_dir):
    from async_cosyvoice.model_dir import load_model_dir

    return load_model_dir(tiny_dir)


@pytest.fixture(scope="session")
def hift(model_dir):
    from async_cosyvoice.models.hift import HiFT

    m = HiFT(model_dir.dims.hift).eval()
    m.load_state_dict(model_dir.hift_state_dict(), strict=True)
    return m


@pytest.fixture(scope="module")
def lm(model_dir):
    """The fixture's LM, loaded strictly, float32 CPU, eval mode."""
    from async_cosyvoice.model_dir import load_strict
    from async_cosyvoice.models.llm import CosyVoice2LM

    m = CosyVoice2LM(model_dir.dims.lm).eval()
    load_strict(m, model_dir.llm_state_dict(), "llm.pt")
    return m


def next_job_upto(stream, tokens, llm_done):
    """Plan with the token list as it stands: append what the stream has not seen yet, then plan."""
    import torch

    tokens = torch.as_tensor(tokens).reshape(-1)
    stream.append(tokens[stream.n_tokens:])
    return stream.next_job(llm_done)


# ---- a real redis-server on 127.0.0.1 (speaker store tests, Ray Serve tests) -------------------

class RedisServer:
    """`redis-server` on a free port with its files in `directory`; `appendfsync always` so an
    acknowledged write is on disk before the reply. `kill()` is SIGKILL; `start()` again reuses
    the directory (and port), as a supervisor restarting it would."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self) -> "RedisServer":
        import shutil
        import subprocess
        import threading

        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed: apt-get install -y redis-server (.ci/run does)")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in self.proc.stdout:  # blocks until redis says it is ready (or exits)
            lines.append(line)
            if "Ready to accept connections" in line:
                break
        else:
            pytest.fail("redis-server did not start:\n" + "".join(lines))
        # keep draining its log so a full pipe never blocks it
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        return self

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def make_redis_server(tmp_path):
    """Starts private redis-servers (to kill and restart); all are stopped after the test."""
    servers = []

    def make() -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(servers)}").start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()

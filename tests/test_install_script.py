"""scripts/install.sh is quiet: one line per step, what pip, npm and apt print kept in .venv/install.log
and shown only when a step fails. The real installers need the network and minutes, so the script
runs here in a copy of the repository against stand-ins that print like them (300 lines a call)."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOISY = """#!/bin/bash
echo "$(basename "$0") $*" >> "$CALLS"
for i in $(seq 150); do echo "Collecting something-$i"; echo "  warning box line $i" >&2; done
[ -n "${FAIL_ON:-}" ] && [[ " $* " == *" $FAIL_ON "* ]] && { echo "ERROR: no matching distribution"; exit 1; }
exit 0
"""
TOOLS = ("bash", "dirname", "basename", "tail", "tee", "id", "env", "seq", "cat")


def executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def repo(tmp_path) -> tuple[Path, dict]:
    """A repository copy whose .venv, npm and apt-get are the noisy stand-ins; no redis-server or
    chromium on PATH, so the apt step runs too (we are root here; elsewhere it warns)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("install.sh", "constraints-cpu.txt"):
        shutil.copy2(ROOT / "scripts" / name, repo / "scripts" / name)
    venv = repo / ".venv" / "bin"
    venv.mkdir(parents=True)
    executable(venv / "pip", NOISY)
    executable(venv / "python", "#!/bin/bash\nexit 0\n")  # the torch version check
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("npm", "apt-get"):
        executable(bin_dir / name, NOISY)
    for name in TOOLS:
        os.symlink(shutil.which(name), bin_dir / name)
    env = {"PATH": str(bin_dir), "CALLS": str(tmp_path / "calls"), "HOME": str(tmp_path)}
    return repo, env


def test_a_good_install_prints_a_line_per_step(repo):
    path, env = repo
    r = subprocess.run(["bash", "scripts/install.sh"], cwd=path, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    said = (r.stdout + r.stderr).splitlines()
    assert len(said) <= 8 and all(line.startswith("install: ") for line in said), said
    assert said[-1].startswith("install: done")
    log = (path / ".venv" / "install.log").read_text()
    assert log.count("Collecting something-") == 150 * 6  # pip x3, npm, apt-get update + install
    calls = Path(env["CALLS"]).read_text()
    assert "-q" in calls and "apt-get install -y -qq redis-server chromium" in calls


def test_a_failing_step_shows_why_and_stops(repo):
    path, env = repo
    r = subprocess.run(["bash", "scripts/install.sh"], cwd=path, env={**env, "FAIL_ON": "-e"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "install: FAILED (1):" in r.stderr and "ERROR: no matching distribution" in r.stderr
    assert len(r.stderr.splitlines()) <= 45  # the failure line and the log's last 40 lines
    assert "install: done" not in r.stdout

"""The SDK's own distribution (sdk/pyproject.toml): in a fresh venv it installs with nats-py and msgspec only,
and importing libdsec and its E2B facade loads nothing of the server (placement, edge, chronus, aether, cli)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LONG

pytestmark = [pytest.mark.timeout(600), LONG]   # (a venv and a pip install: 15 s; `make test-long`)
REPO = Path(__file__).resolve().parent.parent


def test_the_sdk_installs_alone_and_loads_no_server_module(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    p = subprocess.run([str(py), "-m", "pip", "install", "-q", str(REPO / "sdk")], capture_output=True, text=True,
                       timeout=400)
    assert p.returncode == 0, p.stderr
    dists = subprocess.run([str(py), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                           check=True).stdout
    names = {line.split("==")[0].lower() for line in dists.split()}
    assert names - {"pip", "setuptools"} == {"dsec-sdk", "nats-py", "msgspec"}, names
    check = ("import sys, libdsec, libdsec.e2b\n"
             "libdsec.e2b.install(); import e2b; from e2b import Sandbox, AsyncSandbox\n"
             "server = sorted(m for m in sys.modules if m.split('.')[0] in "
             "('placement', 'edge', 'chronus', 'aether', 'cli'))\n"
             "print('server:', server, 'libdsec at', libdsec.__file__)\n")
    p = subprocess.run([str(py), "-c", check], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("server: [] libdsec at " + str(venv)), p.stdout

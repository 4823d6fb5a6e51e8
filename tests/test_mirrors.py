"""The node's package mirrors (issue 16, part B): sandboxes' pip installs from the node's proxpi, which
fetches each file from the upstream index once (a pypiserver this module starts in a namespace of its own,
with a wheel built here), whatever number of sandboxes install it; a mirror-only sandbox reaches nothing
else; a killed mirror gives a clear error, then comes back."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

import libdsec

DSEC = os.path.join(os.path.dirname(sys.executable), "dsec")
INSTALLS = 20       # sandboxes installing the same wheel (100 in bench.network)
WHEEL = "dsecdemo-1.0-py3-none-any.whl"


@pytest.fixture(scope="module")
async def pip_image(stack):
    """Debian with pip (debootstrap, cached outside the state dir: the first build downloads it)."""
    r = await asyncio.to_thread(subprocess.run, [DSEC, "image", "build", "--nats", stack.url, "pip", "--debootstrap",
                                                 "bookworm", "--packages", "python3-pip"],
                                capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-2000:]
    return "pip"


def fetched(logs, name: str) -> int:
    """How often the upstream index served the file (its access log's GETs; the mirror also asks HEAD)."""
    path = logs / "pypi.log"
    return path.read_text().count(f'"GET /packages/{name} ') if path.exists() else 0


PIP = "pip install --no-cache-dir --break-system-packages --disable-pip-version-check -q dsecdemo"


async def test_sandboxes_install_through_the_node_mirror_and_upstream_sees_each_file_once(client, upstream,
                                                                                          pip_image):
    sbs = await asyncio.gather(*(client.create(pip_image, network="mirror-only") for _ in range(INSTALLS)))
    try:
        results = await asyncio.gather(*(sb.exec(f"{PIP} && python3 -c 'import dsecdemo; print(dsecdemo.VERSION)'",
                                                 timeout=120) for sb in sbs))
        assert [(r.exit_code, r.stdout) for r in results] == [(0, b"1.0\n")] * INSTALLS, \
            [r.stderr[-500:] for r in results if r.exit_code]
        assert fetched(upstream, WHEEL) == 1
        # mirror-only: the index is the only place it reaches; pip pointed elsewhere gets nowhere
        r = await sbs[0].exec("pip download --no-deps -d /tmp/x --index-url http://allowed.test/simple/ "
                              "--disable-pip-version-check --timeout 3 --retries 0 dsecdemo", timeout=60)
        assert r.exit_code != 0
        r = await sbs[0].exec("rm -f /etc/pip.conf; unset PIP_INDEX_URL; pip download --no-deps -d /tmp/y "
                              "--disable-pip-version-check --timeout 3 --retries 0 dsecdemo", timeout=60)
        assert r.exit_code != 0 and fetched(upstream, WHEEL) == 1
    finally:
        await asyncio.gather(*(sb.destroy() for sb in sbs))


async def test_a_killed_mirror_gives_a_clear_error_then_recovers(client, upstream, pip_image, stack, monkeypatch):
    from aether import mirrors
    monkeypatch.setattr(mirrors, "RESTART_DELAY", 8.0)   # down long enough for an install to meet it
    mirror = stack.edge.network.mirrors[0]
    async with await client.create(pip_image, network=libdsec.Network(allow=["allowed.test"])) as sb:
        old = mirror.proc
        old.kill()
        r = await sb.exec(f"{PIP} --timeout 3 --retries 0", timeout=60)
        assert r.exit_code != 0 and b"dsecdemo" in r.stderr   # pip names what it could not get
        for _ in range(400):
            if mirror.proc is not old and mirror.proc.poll() is None and mirror.restarts:
                break
            await asyncio.sleep(0.05)
        assert mirror.proc is not old
        r = await sb.exec(f"{PIP} --timeout 10", timeout=120)
        assert r.exit_code == 0, r.stderr[-1000:]

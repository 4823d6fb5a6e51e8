"""The node's package mirrors (issue 16, part B), run by the edge as processes of its own, each with its own
config, port and cache dir under the state dir, and started again if one dies:

- pip: proxpi (PyPI's `proxpi`), a caching proxy of a simple index (`--mirror-pypi`, default PyPI's). Its
  download timeout is raised (PROXPI_DOWNLOAD_TIMEOUT): past it proxpi would send a client to the upstream
  file itself, which a sandbox cannot reach.

A sandbox reaches a mirror at a fixed port of its gateway (PIP_PORT): the node's rules bring it to the
proxy like any connection, and the proxy hands it to the mirror's local port (mirror-only and proxied
sandboxes alike). Its pip is pointed there by PIP_INDEX_URL and /etc/pip.conf; changing them gains it
nothing, as every other destination is the proxy's to refuse.
"""
from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

from bus.server import die_with_parent, free_port
from edge.backends.execio import exited

log = logging.getLogger(__name__)

PIP_PORT = 3141                  # the gateway port a sandbox's pip talks to
START_TIMEOUT = 20.0
RESTART_DELAY = 0.5


class MirrorError(Exception):
    """A mirror could not be started (its tool is missing, or it did not answer)."""


class Mirror:
    """One supervised mirror process on 127.0.0.1:port."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, node: str) -> None:
        self.name, self.argv, self.env, self.port, self.node = name, argv, env, port, node
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def start(self) -> None:
        await self._spawn()
        self._task = asyncio.ensure_future(self._supervise())

    async def _spawn(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=die_with_parent)   # a SIGKILLed edge leaves no mirror
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT
        while loop.time() < deadline:
            if self.proc.poll() is not None:
                raise MirrorError(f"the {self.name} mirror exited at start ({self.proc.returncode})")
            try:
                _, w = await asyncio.open_connection("127.0.0.1", self.port)
                w.close()
                return
            except OSError:
                await asyncio.sleep(0.1)
        raise MirrorError(f"the {self.name} mirror did not answer on port {self.port}")

    async def _supervise(self) -> None:
        while True:
            await exited(self.proc)
            if self._stopping:
                return
            log.warning("the %s mirror of node %s died (%s): starting it again", self.name, self.node,
                        self.proc.returncode)
            self.restarts += 1
            await asyncio.sleep(RESTART_DELAY)
            try:
                await self._spawn()
            except MirrorError as exc:
                log.error("%s", exc)

    async def stop(self) -> None:
        self._stopping = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            await exited(self.proc)
        if self._task is not None:
            self._task.cancel()


def pip_mirror(state_dir: Path, node: str, upstream: str) -> Mirror:
    """proxpi over `upstream` (a simple index URL), its cache in state_dir/pip."""
    cache = state_dir / "pip"
    cache.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PROXPI_INDEX_URL": upstream,
           "PROXPI_CACHE_DIR": str(cache), "PROXPI_DOWNLOAD_TIMEOUT": "600", "PROXPI_INDEX_TTL": "300",
           "PROXPI_CONNECT_TIMEOUT": "10", "PROXPI_READ_TIMEOUT": "60", "PROXPI_CACHE_SIZE": str(10 << 30)}
    argv = [sys.executable, "-m", "flask", "--app", "proxpi.server", "run", "--host", "127.0.0.1",
            "--port", str(port), "--with-threads", "--no-reload", "--no-debugger"]
    env["DSEC_MIRROR_NODE"] = node         # names its node to leftover checks
    return Mirror("pip", argv, env, port, node)


def sandbox_etc(gateway: str) -> dict[str, str]:
    """Files of a sandbox's /etc with mirrors: name -> contents."""
    return {"pip.conf": f"[global]\nindex-url = http://{gateway}:{PIP_PORT}/index/\n"
                        f"trusted-host = {gateway}\n"}


def sandbox_env(gateway: str) -> dict[str, str]:
    """Environment of a sandbox with mirrors."""
    return {"PIP_INDEX_URL": f"http://{gateway}:{PIP_PORT}/index/", "PIP_TRUSTED_HOST": gateway}

"""The node's package mirrors (issue 16, part B), run by the edge as processes of its own, each with its own
config, port and cache dir under the state dir, and started again if one dies:

- pip: proxpi (PyPI's `proxpi`), a caching proxy of a simple index (`--mirror-pypi`, default PyPI's), with one
  download per file at a time (aether/pipmirror.py). Its download timeout is raised (PROXPI_DOWNLOAD_TIMEOUT):
  past it proxpi would send a client to the upstream file itself, which a sandbox cannot reach.
- apt: apt-cacher-ng (Debian's), as an HTTP proxy that serves only Debian's archive names (deb.debian.org
  and the like), each fetched from the node's Debian mirror (`--mirror-apt`); ForceManaged refuses every
  other URL and no CONNECT passes, so it relays nothing else.

A sandbox reaches a mirror at a fixed port of its gateway (PIP_PORT, APT_PORT): the node's rules bring it to
the proxy like any connection, and the proxy hands it to the mirror's local port (mirror-only and proxied
sandboxes alike). Its pip is pointed there by PIP_INDEX_URL and /etc/pip.conf, its apt by
/etc/apt/apt.conf.d/00dsec-mirror (when the image has apt); changing them gains it nothing, as every other
destination is the proxy's to refuse.

Bytes fetched from upstream (`upstream_bytes`, shown as dsec_mirror_upstream_bytes): apt-cacher-ng's
transfer log (its "I" lines); for proxpi, which logs none, what its file cache holds.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bus.server import die_with_parent, free_port
from edge.backends.execio import exited

log = logging.getLogger(__name__)

PIP_PORT = 3141                  # the gateway port a sandbox's pip talks to
APT_PORT = 3142                  # ... and its apt (as an HTTP proxy)
APT_NAMES = ("deb.debian.org/debian", "ftp.debian.org/debian", "httpredir.debian.org/debian",
             "http.debian.net/debian", "cdn-fastly.deb.debian.org/debian")   # what images' sources name
START_TIMEOUT = 20.0
RESTART_DELAY = 0.5


class MirrorError(Exception):
    """A mirror could not be started (its tool is missing, or it did not answer)."""


class Mirror:
    """One supervised mirror process on 127.0.0.1:port."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, node: str,
                 gateway_port: int = 0, counted=lambda: 0) -> None:
        self.name, self.argv, self.env, self.port, self.node = name, argv, env, port, node
        self.gateway_port = gateway_port   # where sandboxes reach it
        self._counted = counted            # () -> bytes fetched from upstream so far
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

    def upstream_bytes(self) -> int:
        """Bytes this mirror fetched from its upstream (kept across its restarts)."""
        try:
            return self._counted()
        except OSError:
            return 0

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
           "PROXPI_CONNECT_TIMEOUT": "10", "PROXPI_READ_TIMEOUT": "60", "PROXPI_CACHE_SIZE": str(10 << 30),
           "DSEC_MIRROR_NODE": node}       # names its node to leftover checks
    argv = [sys.executable, "-m", "flask", "--app", "aether.pipmirror", "run", "--host", "127.0.0.1",
            "--port", str(port), "--with-threads", "--no-reload", "--no-debugger"]
    return Mirror("pip", argv, env, port, node, PIP_PORT, lambda: _tree_bytes(cache))


def apt_mirror(state_dir: Path, node: str, upstream: str) -> Mirror:
    """apt-cacher-ng serving Debian's archive names from `upstream` (a Debian mirror's URL), its config,
    cache and logs in state_dir/apt."""
    tool = shutil.which("apt-cacher-ng", path=f"{os.environ.get('PATH', '')}:/usr/sbin")
    if tool is None:
        raise MirrorError("apt-cacher-ng is not installed (make setup installs it)")
    base = state_dir / "apt"
    for d in ("conf", "cache", "log"):
        (base / d).mkdir(parents=True, exist_ok=True)
    port = free_port(below=32768)     # it reads Port as a signed 16-bit number: above, it binds nothing
    upstream = upstream.rstrip("/")
    security = upstream.rsplit("/", 1)[0] + "/debian-security"
    (base / "conf" / "acng.conf").write_text("\n".join([
        f"CacheDir: {base / 'cache'}", f"LogDir: {base / 'log'}", "SupportDir: /usr/lib/apt-cacher-ng",
        f"Port: {port}", "BindAddress: 127.0.0.1", "ForeGround: 1", f"PidFile: {base / 'pid'}",
        f"SocketPath: {base / 'socket'}",
        "ForceManaged: 1",             # only the archives remapped below: no open relay
        "PassThroughPattern: ^$",      # no CONNECT to anything
        "AllowUserPorts: 80", "RedirMax: 0", "ExThreshold: 4", "NetworkTimeout: 60",
        f"Remap-debrep: {' '.join(APT_NAMES)} ; {upstream}",
        f"Remap-secdeb: {' '.join(n.replace('/debian', '/debian-security') for n in APT_NAMES)} "
        f"security.debian.org/debian-security ; {security}", ""]))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "DSEC_MIRROR_NODE": node}
    return Mirror("apt", [tool, "-c", str(base / "conf")], env, port, node, APT_PORT,
                  _LogCount(base / "log" / "apt-cacher.log"))


class _LogCount:
    """Bytes in from upstream by apt-cacher-ng's transfer log (`time|I|bytes|client|path` lines), read on."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.total = path, 0, 0

    def __call__(self) -> int:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        done = data.rfind(b"\n") + 1          # whole lines only: the rest is read next time
        self.offset += done
        for line in data[:done].splitlines():
            parts = line.split(b"|")
            if len(parts) > 2 and parts[1] == b"I" and parts[2].isdigit():
                self.total += int(parts[2])
        return self.total


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def sandbox_etc(gateway: str, ports: set[int]) -> dict[str, str]:
    """Files of a sandbox's /etc for the node's mirrors (on these gateway ports): path -> contents. apt's
    is written only where the image has /etc/apt/apt.conf.d."""
    files = {}
    if PIP_PORT in ports:
        files["pip.conf"] = (f"[global]\nindex-url = http://{gateway}:{PIP_PORT}/index/\n"
                             f"trusted-host = {gateway}\n")
    if APT_PORT in ports:
        files["apt/apt.conf.d/00dsec-mirror"] = f'Acquire::http::Proxy "http://{gateway}:{APT_PORT}/";\n'
    return files


def sandbox_env(gateway: str, ports: set[int]) -> dict[str, str]:
    """Environment of a sandbox for the node's mirrors."""
    if PIP_PORT not in ports:
        return {}
    return {"PIP_INDEX_URL": f"http://{gateway}:{PIP_PORT}/index/", "PIP_TRUSTED_HOST": gateway}

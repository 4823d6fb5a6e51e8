"""Per-sandbox views of /proc/meminfo, cpuinfo, stat, uptime, diskstats and swaps, sized to the sandbox.

Without them a sandbox reads the host's memory, cores, uptime and disks. lxcfs (Debian's, the well-kept
tool for this) computes each file for the process that reads it, from that process's cgroups (memory
limit and usage, cpu quota) and its pid namespace's init (uptime). The edge runs one lxcfs per node,
under its own state dir (`<state>/lxcfs`; never Debian's system service, which `make setup` stops and
disables), and every sandbox bind-mounts these files over its /proc ones when it starts.

If lxcfs dies, a sandbox's views would fail (the FUSE connection is gone), so the edge starts it again
and has the zygote put fresh binds into every running sandbox (detached clones of the new files,
moved into each sandbox's mount namespace): their views recover within about a second.

lxcfs works for whichever sandbox reads, in no sandbox's cgroups: one re-reading /proc/stat in 8 threads
took 144% of the host's CPU from a sandbox of a quarter core, and one holding 160,000 opened views grew it
by 330 MB, never given back (helper A2). It runs in cgroups of its own (`dsec-<node>.views`): at most
VIEWS_CPU cores at a low weight, and VIEWS_MEMORY bytes, past which it is OOM-killed and started again
(every sandbox's views back within a second; the hostile one's opened files gone with it).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Awaitable, Callable

from edge.backends import kernel
from edge.backends.cgroups import own_paths, read, write
from edge.backends.uppers import mounted_at
from edge.backends.zygote import PROC_VIEWS

log = logging.getLogger(__name__)

START_TIMEOUT = 10.0
VIEWS_CPU = 0.5              # cores lxcfs may use (the CFS quota of its group)
VIEWS_SHARES = 256           # its weight beside the edge and NATS (1,024 each)
VIEWS_MEMORY = 256 << 20     # its memory (an idle one holds ~3 MB; each opened view a few KB)


class ProcViews:
    """The node's lxcfs: started, watched, restarted; `proc_dir` is where its /proc files are."""

    def __init__(self, state_dir: Path, on_restart: Callable[[], Awaitable[None]],
                 serving: Callable[[], bool] = lambda: True, node_id: str = "local") -> None:
        self.groups = {c: p / f"dsec-{node_id}.views" for c, p in own_paths().items() if c in ("cpu", "memory")}
        self.mount = state_dir / "lxcfs"
        self.pidfile = state_dir / "lxcfs.pid"
        self.on_restart = on_restart
        self.serving = serving          # False once the backend can serve no sandbox (its zygote died)
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._watch: asyncio.Task | None = None
        self._stopping = False

    @property
    def available(self) -> bool:
        return shutil.which("lxcfs") is not None

    @property
    def proc_dir(self) -> str:
        """The lxcfs /proc directory, or "" when lxcfs is not running (sandboxes then see the host's)."""
        return str(self.mount / "proc") if self.proc is not None and self.proc.poll() is None else ""

    async def start(self) -> None:
        """Start lxcfs (a stale mount of a crashed run is dropped first) and watch it."""
        if not self.available:
            log.warning("lxcfs not found: sandboxes see the host's /proc/meminfo, cpuinfo, stat and uptime "
                        "(make setup installs it)")
            return
        await asyncio.to_thread(self._launch)
        self._watch = asyncio.ensure_future(self._supervise())

    def _launch(self) -> None:
        self.cleanup()
        self.mount.mkdir(mode=0o755, exist_ok=True)
        self._make_groups()
        join = " && ".join(f'echo $$ > "{g}/cgroup.procs"' for g in self.groups.values()) or "true"
        self.proc = subprocess.Popen(["sh", "-c", f'{join} && exec "$@"', "sh",   # in its groups from its start
                                      "lxcfs", "--foreground", "--disable-swap", "--enable-cfs",
                                      f"--pidfile={self.pidfile}", str(self.mount)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while not os.path.exists(self.mount / "proc" / "meminfo"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._kill()
                raise OSError(f"lxcfs did not start (exit {self.proc.returncode})")
            time.sleep(0.01)
        missing = [name for name in PROC_VIEWS if not os.path.exists(self.mount / "proc" / name)]
        if missing:   # checked once here: each sandbox's launch binds them all without looking
            self._kill()
            raise OSError(f"this lxcfs serves no /proc/{', '.join(missing)}")

    async def _supervise(self) -> None:
        while not self._stopping:
            proc = self.proc
            while proc is not None and proc.poll() is None and not self._stopping:
                await asyncio.sleep(0.2)
            if self._stopping or not self.serving():
                return   # stopped, or the backend is dead (a later start of the node cleans up)
            log.error("lxcfs exited (%s): starting it again", proc.returncode if proc else "?")
            try:
                await asyncio.to_thread(self._launch)
            except OSError as exc:
                log.error("%s; retrying", exc)
                await asyncio.sleep(1)
                continue
            self.restarts += 1
            try:
                await self.on_restart()
            except Exception:   # noqa: BLE001 (one sandbox failing to refresh must not stop the watch)
                log.exception("refreshing the sandboxes' /proc views failed")

    async def stop(self) -> None:
        """Stop lxcfs and unmount its directory."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await asyncio.to_thread(self._kill)
        await asyncio.to_thread(self.cleanup)

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _make_groups(self) -> None:
        for g in self.groups.values():
            g.mkdir(exist_ok=True)
        if "cpu" in self.groups:
            write(self.groups["cpu"] / "cpu.shares", str(VIEWS_SHARES))
            period = int(read(self.groups["cpu"] / "cpu.cfs_period_us") or 100000)
            write(self.groups["cpu"] / "cpu.cfs_quota_us", str(int(VIEWS_CPU * period)))
        if "memory" in self.groups:
            write(self.groups["memory"] / "memory.limit_in_bytes", str(VIEWS_MEMORY))

    def cleanup(self) -> None:
        """Unmount a (dead or live) lxcfs mount, kill a leftover daemon of this state dir, and remove its
        groups."""
        pid = _read_pid(self.pidfile)
        if pid and _is_ours(pid, str(self.mount)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for _ in range(4):
            if not mounted_at(self.mount):
                break
            kernel.umount2(str(self.mount), kernel.MNT_DETACH)
        self.pidfile.unlink(missing_ok=True)
        for g in self.groups.values():
            for _ in range(100):   # (a killed daemon leaves its group a moment later)
                try:
                    g.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def _read_pid(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def _is_ours(pid: int, mount: str) -> bool:
    try:
        return mount.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False


def leftover_daemons(mount: str) -> list[int]:
    """Pids of lxcfs processes serving mount (for leak accounting)."""
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"lxcfs") and mount.encode() in cmd:
            out.append(int(proc.name))
    return out

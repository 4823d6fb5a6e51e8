"""Host-side helpers of the gVisor backend: ids, host limits, the user namespace runsc runs in, runsc's
processes, and what a node of it left behind."""
from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

from edge.backends.base import Limits
from edge.backends.cgroups import NodeCgroups

SENTRY_MEMORY = 24 << 20     # host memory of sentry + gofer on top of the sandbox's limit (kinds.OVERHEAD)
# Host tasks allowed: under ptrace each sandbox task costs host tasks too (a stub thread, a sentry
# thread); past this the sentry cannot make a thread and dies (the sandbox with it): a backstop only,
# the sandbox's pids limit itself is enforced inside by the sentry (see dsec-agent.c).
HOST_TASKS_PER_PID, HOST_TASKS_BASE = 16, 256   # ~11 host tasks per sandbox task measured


def valid_id(sandbox_id: str) -> bool:
    """A sandbox id usable as a runsc container id, cgroup and directory name."""
    return re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", sandbox_id) is not None


def host_limits(limits: Limits) -> Limits:
    """The host cgroup limits of a sandbox: its own plus what sentry and gofer take."""
    return Limits(cpu=limits.cpu, memory=limits.memory + SENTRY_MEMORY, cpu_class=limits.cpu_class,
                  pids=HOST_TASKS_BASE + HOST_TASKS_PER_PID * limits.pids,
                  disk=limits.disk)


def _join(tasks: list[str]) -> None:
    """In the forked runsc, before exec: join the sandbox's groups (sentry and gofer inherit them)."""
    pid = str(os.getpid()).encode()
    for path in tasks:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, pid)
        finally:
            os.close(fd)


async def _remove_groups(groups: dict[str, Path], timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (busy := NodeCgroups.remove(groups)) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    return busy


def processes_where(match) -> list[int]:
    """Pids of the host's processes whose command line (its words, bytes) match(words) accepts."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            words = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if match(words):
            found.append(int(proc.name))
    return found


def runsc_processes(state_dir: Path, key: str | None = None) -> list[int]:
    """Pids of runsc processes (sentry, gofer, commands) using our runsc root (of one container)."""
    root = f"--root={state_dir / 'runsc'}".encode()
    return processes_where(lambda words: root in words and (key is None or key.encode() in words))


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()[-400:]
    except OSError:
        return "(no log)"

"""Exclusive locks that keep two dsec processes from managing the same node or state dir at once.

A second edge with the same node id would reconcile (kill) the first one's sandboxes, since the
cgroup tree is named after the node; flock is released by the kernel when the holder dies, so a
crashed run never leaves a stale lock: the file it left is taken over by the next one. A clean exit
removes the file. Whoever holds the lock holds the file the path names now: one that locked a file
removed meanwhile by its holder's release tries again on the new one.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from bus.errors import DsecError

LOCK_DIR = Path("/run/dsec")


class AlreadyRunning(DsecError):
    """Another dsec process holds this node or state dir."""

    code = "already_running"


class Lock:
    """An flock held until release() or process exit."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = Path(path), what
        self._fd: int | None = None

    def acquire(self) -> "Lock":
        """Take the lock or raise AlreadyRunning naming the holder (a dead holder's file is taken over)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise AlreadyRunning(f"{self.what} is in use by another dsec process (pid {holder})") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)   # its holder released (and removed) it between our open and flock: again
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Let go and remove the file (idempotent)."""
        if self._fd is not None:
            try:
                os.unlink(self.path)   # while still holding it: nobody can take a file about to go
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None


def node_lock(node_id: str) -> Lock:
    """The host-wide lock of one node id."""
    return Lock(LOCK_DIR / f"node-{node_id}.lock", f"node id {node_id!r}")


def state_lock(state_dir: Path) -> Lock:
    """The lock of one state dir."""
    return Lock(Path(state_dir) / "dsec.lock", f"state dir {state_dir}")

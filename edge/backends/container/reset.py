"""Wiping a worker sandbox between two stateless calls (fncall): every process but its init killed, the
commands' cgroups removed, /tmp and /dev/shm emptied and given back their modes. Everything else a call
could change is read-only to it (the root, the trusted shell) or per command (its IPC namespace, its
user namespace and so its keyrings, its environment): see edge/backends/fncall/__init__.py."""
from __future__ import annotations

import asyncio
import os
import stat

from edge.backends import cgroups, treeops
from edge.backends.base import BackendError
from edge.backends.container.state import Core

SCRATCH_DIRS = (("tmp", 0o1777), ("dev/shm", 0o1777))   # the writable places of a worker, and their modes


class Resetting(Core):
    """reset(): a used worker made as it was when started."""

    async def reset(self, sandbox_id: str) -> None:
        """Kill what its commands left running, remove their groups, empty its scratch dirs; BackendError
        when something survives (the caller retires the worker then)."""
        sb = self._live(sandbox_id)
        if not sb.spec.scratch:
            raise BackendError(f"{sandbox_id} is not a worker (only a worker's calls can be wiped)")
        group = sb.call_group   # a worker's commands all run in its one exec group (x0); none: no call yet
        try:
            left = group is not None and group.procs()
        except OSError as exc:
            raise BackendError(f"worker {sandbox_id}: its exec group cannot be read: {exc}") from exc
        if left and not await cgroups.kill_tree(group.groups["freezer"], timeout=5.0):
            raise BackendError(f"worker {sandbox_id}: processes survive in {group.groups['freezer']}")
        if sb.scratch_fds is None:   # opened once, in its root: a call cannot move them (read-only root)
            sb.scratch_fds = [(mode, fd) for rel, mode in SCRATCH_DIRS
                              if (fd := _open_scratch(sb.init_pid, rel)) is not None]
        if _reset_scratch(sb.scratch_fds, sb.ids.base):   # something to remove: off the event loop
            await asyncio.to_thread(_empty_scratch, sb.init_pid, sb.ids.base)


def _reset_scratch(dirs: list[tuple[int, int]], owner: int) -> bool:
    """Give each scratch dir (mode, fd) its mode and owner back; whether any holds something to remove."""
    dirty = False
    for mode, fd in dirs:
        try:
            os.fchmod(fd, mode)
            os.fchown(fd, owner, owner)
            # listed through a fresh open of the dir (its magic link), never the fd kept: a btrfs dir read
            # through a file opened earlier lists none of the entries made since (its last index is cached
            # there), so a call that wrote only /dev/shm (a subvolume) left it to the next tenant (helper-44)
            dirty = dirty or bool(os.listdir(f"/proc/self/fd/{fd}"))
        except OSError as exc:
            raise BackendError(f"cannot reset the worker's scratch dir: {exc}") from exc
    return dirty


def _open_scratch(init_pid: int, rel: str) -> int | None:
    try:
        return os.open(f"/proc/{init_pid}/root/{rel}", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BackendError(f"cannot open the worker's /{rel}: {exc}") from exc


def _empty_scratch(init_pid: int, owner: int) -> None:
    """Remove everything under each scratch dir, through fds opened in the sandbox's root (a symlink the
    call left is removed, never followed); the dirs get their mode and owner back."""
    for rel, mode in SCRATCH_DIRS:
        fd = _open_scratch(init_pid, rel)
        if fd is None:
            continue
        try:
            for entry in os.scandir(fd):
                st = os.stat(entry.name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    treeops.remove_tree(fd, entry.name)
                else:
                    os.unlink(entry.name, dir_fd=fd)
            os.fchmod(fd, mode)
            os.fchown(fd, owner, owner)
        except OSError as exc:
            raise BackendError(f"cannot empty the worker's /{rel}: {exc}") from exc
        finally:
            os.close(fd)

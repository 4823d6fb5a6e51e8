"""Files of gVisor sandboxes, from the host: the sandbox's root is an overlay mounted on the host (the
gofer serves it to the sentry, --file-access=shared), so every operation resolves inside that mount as the
container backend's do (openat2 RESOLVE_IN_ROOT, rootfiles.py/treeops.py), and a directory watch is the
host's inotify on it (watcher.py): what the sandbox writes goes through the gofer into the same mount."""
from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

from bus.messages import FileOp
from edge.backends import kernel, rootfiles, treeops, watcher
from edge.backends.base import TRUSTED_DIR, ExecControl, ExecResult, OutputSink, SandboxGone

# The sentry's own mounts (the spec's), over directories of the root it leaves unseen: a file written
# there on the host would be read back by read_file yet never seen by the sandbox's commands, and what
# they see there (its /proc, /dev/shm) the host cannot reach. Refused, as a container's are (EXDEV).
COVERED = ("/proc", "/sys", "/dev", TRUSTED_DIR)


def cover_view(rootfs: Path, view: Path, owner: int) -> None:
    """The root as the file operations see it: a bind of it at view, with an empty read-only tmpfs over each
    COVERED directory. _reachable refuses a path that lands there, but it checks before the operation acts,
    and the sandbox can swap a directory on the way for a link meanwhile: a command doing so as fast as it
    could took 739 of 3,881 writes onto the root's own /proc (helper-45). What lands there now lands on an
    empty, read-only mount, which the sandbox's commands cannot change (the bind is the host's only: private,
    so on a host whose mounts propagate the covers do not reach the root the gofer serves). Each is owned by
    the sandbox's root (owner), 0755, as the directory it covers: a listing of / looks as it did."""
    view.mkdir(mode=0o700)
    kernel.mount(str(rootfs), view, None, kernel.MS_BIND)
    kernel.mount(None, view, None, kernel.MS_PRIVATE)
    for top in COVERED:
        kernel.mount("none", view / top.lstrip("/"), "tmpfs", kernel.MS_RDONLY | kernel.MS_NOSUID | kernel.MS_NODEV
                     | kernel.MS_NOEXEC, f"size=4k,mode=755,uid={owner},gid={owner}")


MAX_LINKS = 40   # symlinks followed on one path, as Linux's


def _reachable(root: int, path: str, creating: bool, follow: bool = True) -> None:
    """EXDEV when path lands (its symlinks followed inside the root, as a command's would be) under one of the
    sentry's own mounts: a link the sandbox made (/tmp/p -> /proc, /tmp/sh -> /.dsec/sh) took a write
    there on the host that no command could see, and read_file returned it (helper-44). follow=False: a
    last component that is a link is the link itself (stat, remove, rename and mkdir act on it, not through
    it: /etc/mtab -> ../proc/self/mounts is statted, a link to /proc removed)."""
    head, last = os.path.split(path.rstrip("/"))
    if follow or last in ("", ".", ".."):
        lands = landing(root, path)
    else:
        lands = os.path.join(landing(root, head), last)
    if any(lands == top or lands.startswith(top + "/") for top in COVERED):
        raise rootfiles.file_error(OSError(errno.EXDEV, "the sentry's own mount"), path, creating)


def landing(root: int, path: str) -> str:
    """Where path lands in the root: each symlink on the way followed inside it (a dangling one too), each
    `..` taken where the links led; ELOOP past MAX_LINKS links."""
    here, links = "/", 0
    todo = [c for c in path.split("/") if c not in ("", ".")]
    while todo:
        name = todo.pop(0)
        if name == "..":
            here = os.path.dirname(here)
            continue
        target = _link(root, here, name)
        if target is None:
            here = os.path.join(here, name)
            continue
        links += 1
        if links > MAX_LINKS:
            raise rootfiles.file_error(OSError(errno.ELOOP, "too many levels of symbolic links"), path, False)
        if target.startswith("/"):
            here = "/"
        todo[:0] = [c for c in target.split("/") if c not in ("", ".")]
    return here


def _link(root: int, here: str, name: str) -> str | None:
    """The target of here/name if it is a symlink (here has none: it was resolved), else None."""
    try:
        fd = kernel.openat2(root, here.lstrip("/") or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0,
                            kernel.RESOLVE_IN_ROOT)
    except OSError:
        return None   # (no such dir: nothing further can be a link)
    try:
        return os.readlink(name, dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)


class RootFiles:
    """write_file / read_file / file_op / watch of a backend whose sandboxes' roots are host mounts, seen through
    self._files_root(key) (cover_view), running ones found by self._live(id) (with .key, .ids.base, .spec.id,
    .frozen_for)."""

    def _root(self, sb) -> int:
        """An O_PATH fd of the sandbox's root, as file operations see it (SandboxGone when it is no more)."""
        try:
            return os.open(self._files_root(sb.key), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise SandboxGone(f"sandbox {sb.spec.id} is not running") from exc

    def _in_root(self, sb, op, paths=(), creating=False, follow=True):
        """op(root fd) on a fresh fd of the sandbox's root, closed after; first, each of paths must land
        outside the sentry's own mounts (_reachable)."""
        root = self._root(sb)
        try:
            for path in paths:
                _reachable(root, path, creating, follow)
            return op(root)
        finally:
            os.close(root)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        """Create or truncate a file in the root (symlinks resolved inside it), owned by the sandbox's root."""
        sb = self._live(sandbox_id)
        await asyncio.to_thread(self._in_root, sb, lambda root: rootfiles.write_in(root, path, path, data, mode,
                                                                                    sb.ids.base), (path,), True)

    async def read_file(self, sandbox_id: str, path: str, limit: int) -> bytes:
        """Read a file of the root (symlinks resolved inside it), at most limit bytes."""
        sb = self._live(sandbox_id)
        return await asyncio.to_thread(self._in_root, sb, lambda root: rootfiles.read_in(root, path, path, limit),
                                       (path,))

    async def file_op(self, sandbox_id: str, op: FileOp, user=None) -> bytes:
        """One file-tree op in the root as user (users.ExecUser: its host ids, every permission checked as
        it; None: the sandbox's root)."""
        sb = self._live(sandbox_id)
        base = sb.ids.base
        who = None if user is None else user.on_host(base)
        return await asyncio.to_thread(self._in_root, sb,
                                       lambda root: rootfiles.tree_op_in(root, op.path, op, base, who=who),
                                       (op.path, *([op.dest] if op.op == "rename" else [])),
                                       op.op in ("mkdir", "write", "rename"), op.op in ("read", "write", "list"))

    async def watch(self, sandbox_id: str, path: str, recursive: bool, *, timeout: float, sink: OutputSink,
                    control: ExecControl | None = None) -> ExecResult:
        """A directory's changes (watcher.py), resolved inside the root each time a directory is added."""
        sb = self._live(sandbox_id)
        return await watcher.watch(lambda p: self._in_root(sb, lambda root: treeops.dir_in_root(root, p), (p,)),
                                   path, recursive, timeout, sink, control, sb.frozen_for, owner=sb.ids.base)

"""Files of gVisor sandboxes, from the host: the sandbox's root is an overlay mounted on the host (the
gofer serves it to the sentry, --file-access=shared), so every operation resolves inside that mount as the
container backend's do (openat2 RESOLVE_IN_ROOT, rootfiles.py/treeops.py), and a directory watch is the
host's inotify on it (watcher.py): what the sandbox writes goes through the gofer into the same mount."""
from __future__ import annotations

import asyncio
import errno
import os

from bus.messages import FileOp
from edge.backends import rootfiles, treeops, watcher
from edge.backends.base import TRUSTED_DIR, ExecControl, ExecResult, OutputSink, SandboxGone

# The sentry's own mounts (the spec's), over directories of the root it leaves unseen: a file written
# there on the host would be read back by read_file yet never seen by the sandbox's commands, and what
# they see there (its /proc, /dev/shm) the host cannot reach. Refused, as a container's are (EXDEV).
COVERED = ("/proc", "/sys", "/dev", TRUSTED_DIR)


def _reachable(path: str, creating: bool) -> None:
    normal = treeops.normal(path)
    if any(normal == top or normal.startswith(top + "/") for top in COVERED):
        raise rootfiles.file_error(OSError(errno.EXDEV, "the sentry's own mount"), path, creating)


class RootFiles:
    """write_file / read_file / file_op / watch of a backend whose sandboxes' roots are host mounts
    (self._rootfs(key)), running ones found by self._live(id) (with .key, .ids.base, .spec.id, .frozen_for)."""

    def _root(self, sb) -> int:
        """An O_PATH fd of the sandbox's root mount (SandboxGone when it is no more)."""
        try:
            return os.open(self._rootfs(sb.key), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise SandboxGone(f"sandbox {sb.spec.id} is not running") from exc

    def _in_root(self, sb, op):
        """op(root fd) on a fresh fd of the sandbox's root, closed after."""
        root = self._root(sb)
        try:
            return op(root)
        finally:
            os.close(root)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        """Create or truncate a file in the root (symlinks resolved inside it), owned by the sandbox's root."""
        sb = self._live(sandbox_id)
        _reachable(path, creating=True)
        await asyncio.to_thread(self._in_root, sb, lambda root: rootfiles.write_in(root, path, path, data, mode,
                                                                                    sb.ids.base))

    async def read_file(self, sandbox_id: str, path: str, limit: int) -> bytes:
        """Read a file of the root (symlinks resolved inside it), at most limit bytes."""
        sb = self._live(sandbox_id)
        _reachable(path, creating=False)
        return await asyncio.to_thread(self._in_root, sb, lambda root: rootfiles.read_in(root, path, path, limit))

    async def file_op(self, sandbox_id: str, op: FileOp, user=None) -> bytes:
        """One file-tree op in the root as user (users.ExecUser: its host ids, every permission checked as
        it; None: the sandbox's root)."""
        sb = self._live(sandbox_id)
        for path in (op.path, *([op.dest] if op.op == "rename" else [])):
            _reachable(path, creating=op.op in ("mkdir", "write", "rename"))
        base = sb.ids.base
        who = None if user is None else user.on_host(base)
        return await asyncio.to_thread(self._in_root, sb,
                                       lambda root: rootfiles.tree_op_in(root, op.path, op, base, who=who))

    async def watch(self, sandbox_id: str, path: str, recursive: bool, *, timeout: float, sink: OutputSink,
                    control: ExecControl | None = None) -> ExecResult:
        """A directory's changes (watcher.py), resolved inside the root each time a directory is added."""
        sb = self._live(sandbox_id)
        _reachable(path, creating=False)
        return await watcher.watch(lambda p: self._in_root(sb, lambda root: treeops.dir_in_root(root, p)),
                                   path, recursive, timeout, sink, control, sb.frozen_for, owner=sb.ids.base)

"""File operations in a sandbox's root filesystem, from the edge (write_file / read_file, and the tree ops).

Paths resolve inside the sandbox root (openat2 RESOLVE_IN_ROOT, see kernel.open_in_root). A file the
edge creates belongs to the sandbox's root (its range base on the host), as if the sandbox had made it:
never to host root.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct

from bus.messages import FileOp, FileOpResult, encode
from edge.backends import enter, fscreds, kernel, treeops
from edge.backends.base import BackendError, SandboxGone


SCRATCH = ("tmp", "dev/shm")   # the writable mounts of a worker with a read-only root (fncall)


def _root_fd(sandbox_id: str, init_pid: int, pidfd: int, sub: str = "") -> int:
    """An O_PATH fd of the sandbox's root as its init sees it, or of the mount `sub` in it (checked
    against, then closing, pidfd)."""
    try:
        fd = os.open(f"/proc/{init_pid}/root/{sub}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
                     | (os.O_NOFOLLOW if sub else 0))
        if not enter.alive(pidfd):   # the pid may have been reused: the fd could be anyone's root
            os.close(fd)
            raise ProcessLookupError(init_pid)
        return fd
    except OSError as exc:
        raise SandboxGone(f"sandbox {sandbox_id} is not running") from exc
    finally:
        os.close(pidfd)


def open_dir(sandbox_id: str, init_pid: int, pidfd: int, path: str) -> int:
    """An O_PATH fd of directory path, resolved inside the sandbox's root (OSError when it is none);
    pidfd is closed either way."""
    root = _root_fd(sandbox_id, init_pid, pidfd)
    try:
        return treeops.dir_in_root(root, path)
    finally:
        os.close(root)


TIOCGPTPEER, TIOCSPTLCK = 0x5441, 0x40045431


def open_pty(sandbox_id: str, init_pid: int, pidfd: int) -> tuple[int, int]:
    """(master, slave) of a new terminal of the sandbox's own devpts: its /dev/pts/ptmx opened inside its root,
    unlocked, the slave opened from the master (TIOCGPTPEER); pidfd is closed either way."""
    root = _root_fd(sandbox_id, init_pid, pidfd)
    try:
        master = kernel.openat2(root, "dev/pts/ptmx", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC, 0,
                                kernel.RESOLVE_IN_ROOT | kernel.RESOLVE_NO_MAGICLINKS)
    finally:
        os.close(root)
    try:
        fcntl.ioctl(master, TIOCSPTLCK, struct.pack("i", 0))
        return master, fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except BaseException:
        os.close(master)
        raise


def _where(path: str, scratch: bool) -> tuple[str, str]:
    """(mount, path inside it): the root for a sandbox, its scratch mount for a worker's /tmp or /dev/shm
    (symlinks there resolve inside that mount)."""
    if not scratch:
        return "", path
    for sub in SCRATCH:
        if path.startswith(f"/{sub}/") and len(path) > len(sub) + 2:
            return sub, path[len(sub) + 2:]
    raise BackendError(f"{path}: a worker's files live under /tmp or /dev/shm (its root is read-only)")


def _opened(sandbox_id: str, init_pid: int, pidfd: int, path: str, scratch: bool) -> tuple[int, str]:
    """(an fd of the root path resolves in, path relative to it); pidfd is closed either way."""
    try:
        sub, rel = _where(path, scratch)
    except BackendError:
        os.close(pidfd)
        raise
    return _root_fd(sandbox_id, init_pid, pidfd, sub), rel


def write(sandbox_id: str, init_pid: int, pidfd: int, path: str, data: bytes, mode: int, owner: int,
          scratch: bool = False) -> None:
    """Create or truncate path with exactly mode; a new file is owned by host uid/gid owner."""
    root, rel = _opened(sandbox_id, init_pid, pidfd, path, scratch)
    try:
        write_in(root, rel, path, data, mode, owner)
    finally:
        os.close(root)


def write_in(root: int, rel: str, path: str, data: bytes, mode: int, owner: int) -> None:
    """write in the root open at fd root (rel: path inside it), which stays open."""
    try:
        if not 0 <= mode <= 0o7777:
            raise OSError(errno.EINVAL, f"mode must be permission bits, 0 to 0o7777, got {mode:#o}")
        kernel.write_in_root(root, rel, data, mode, owner)
    except OSError as exc:
        raise file_error(exc, path, creating=True) from exc


def read(sandbox_id: str, init_pid: int, pidfd: int, path: str, limit: int, scratch: bool = False) -> bytes:
    """The bytes of a regular file (at most limit, else EFBIG)."""
    root, rel = _opened(sandbox_id, init_pid, pidfd, path, scratch)
    try:
        return read_in(root, rel, path, limit)
    finally:
        os.close(root)


def read_in(root: int, rel: str, path: str, limit: int) -> bytes:
    """read in the root open at fd root (rel: path inside it), which stays open."""
    try:
        return kernel.read_in_root(root, rel, limit)
    except OSError as exc:
        raise file_error(exc, path, creating=False) from exc


def tree_op(sandbox_id: str, init_pid: int, pidfd: int, op: FileOp, base: int, scratch: bool = False,
            who: tuple[int, int, tuple[int, ...]] | None = None) -> bytes:
    """One FileOp (treeops.py) in the sandbox's root; its FileOpResult, encoded. who: the host uid, gid and
    groups of the sandbox user it runs as (every permission checked as it, what it makes its own); None: the
    sandbox's root (what it makes is given to the root's host uid, base)."""
    root, rel = _opened(sandbox_id, init_pid, pidfd, op.path, scratch)
    try:
        return tree_op_in(root, rel, op, base, scratch, who)
    finally:
        os.close(root)


def tree_op_in(root: int, rel: str, op: FileOp, base: int, scratch: bool = False,
               who: tuple[int, int, tuple[int, ...]] | None = None) -> bytes:
    """tree_op in the root open at fd root (rel: op.path inside it), which stays open."""
    owner = None if who is not None else base   # (as a user, what it makes is its own already)
    try:
        with fscreds.as_user(*who) if who is not None else contextlib.nullcontext():
            return _tree_op(root, rel, op, base, owner, scratch)
    except OSError as exc:
        if op.op == "rename" and exc.errno == errno.ENOENT:   # which one is missing: the file, or where it goes
            try:
                treeops.stat(root, rel, base)
            except OSError as gone:
                if gone.errno == errno.ENOENT:
                    raise file_error(exc, op.path, creating=False) from exc
            raise file_error(exc, op.dest, creating=True) from exc
        raise file_error(exc, op.path, creating=op.op in ("mkdir", "write")) from exc
    except OverflowError as exc:   # a listing past treeops.MAX_SCAN
        raise BackendError(f"{exc}: {op.path}") from exc


def _tree_op(root: int, rel: str, op: FileOp, base: int, owner: int | None, scratch: bool) -> bytes:
    match op.op:
        case "stat":
            result = FileOpResult(entry=treeops.stat(root, rel, base))
        case "list":
            result = treeops.page(op, *treeops.listing(root, rel, op.depth, base, op.after))
        case "mkdir":
            result = FileOpResult(made=treeops.make_dir(root, rel, owner))
        case "remove":
            treeops.remove(root, rel)
            result = FileOpResult()
        case "rename":
            dest_mount, dest = _where(op.dest, scratch)
            if dest_mount != _where(op.path, scratch)[0]:
                raise OSError(errno.EXDEV, "across mounts")
            result = FileOpResult(entry=treeops.rename(root, rel, dest, base))
        case "read":
            data, size = treeops.read_at(root, rel, op.offset, op.length)
            result = FileOpResult(data=data, size=size)
        case "write":
            if not 0 <= op.mode <= 0o7777:
                raise BackendError(f"mode must be permission bits, 0 to 0o7777, got {op.mode:#o}")
            treeops.write_at(root, rel, op.data, op.offset, op.mode & 0o7777, owner, dict(op.metadata))
            result = FileOpResult()
        case _:
            raise BackendError(f"unknown file op {op.op!r}")
    return encode(result)


class FileError(BackendError):
    """A file operation failed on the file (not there, not a regular file, no room...), not on the sandbox."""


class FileTooLarge(FileError):
    """A file read past the limit it was read with."""


def file_error(exc: OSError, path: str, creating: bool) -> FileError:
    """One clear line for a failed sandbox file operation."""
    if exc.errno == errno.ENOENT:
        return FileError(f"no such directory: {os.path.dirname(path) or '/'}" if creating
                         else f"no such file: {path}")
    if exc.errno == errno.EFBIG:
        return FileTooLarge(f"file too large: {path} exceeds the limit of {exc.strerror} bytes "
                            "(sb.files.read reads a file of any size, a piece per request)")
    messages = {errno.EISDIR: "is a directory", errno.ENOTDIR: "not a directory",
                errno.ELOOP: "too many levels of symbolic links", errno.EACCES: "permission denied",
                errno.EXDEV: "outside the sandbox root filesystem (/proc, /sys and /dev are not accessible)",
                errno.EROFS: "read-only file system", errno.EDQUOT: "disk quota exceeded",
                errno.ENOSPC: "no space left on the writable layer", errno.ENXIO: "not a regular file",
                errno.EBADFD: "not a regular file", errno.EEXIST: "already exists",
                errno.ENOTEMPTY: "directory not empty"}
    return FileError(f"{messages.get(exc.errno, exc.strerror)}: {path}")

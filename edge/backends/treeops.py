"""File-tree operations in a sandbox's root, from the edge: stat, list, mkdir, remove, rename, and
chunked reads and writes at an offset (files of any size, moved a piece per request).

Every path resolves inside the root (kernel.open_in_root: openat2 RESOLVE_IN_ROOT | NO_XDEV |
NO_MAGICLINKS). An operation on a path's last component (stat of a symlink, remove, rename) opens the
parent that way and acts on the name relative to it, so a planted symlink is never followed out of the
root. Removal walks by fds (remove_tree: never following a symlink, at any depth). What the edge
creates belongs to the sandbox's root (its range base on the host), never to host root.
"""
from __future__ import annotations

import contextlib
import errno
import heapq
import os
import stat as st
import tempfile
import time
from typing import Iterator

import msgspec

from bus.messages import FileEntry, FileOpResult, encode
from edge.backends import kernel
from edge.backends.base import BackendError

MAX_ENTRIES = 2_000     # a listing's page at most...
PAGE_BYTES = 512 << 10  # ...and its entries encoded at most (an answer carries them base64'd, in 1 MiB)
MAX_SCAN = 1_000_000    # names one page's walk may read (each page walks the tree again): past it, refused
MAX_DEPTH = 16
MAX_AFTER = 8192       # a listing's cursor (the last path of a page): PATH_MAX and then some
MAX_META_KEY = 250      # "user." + key within XATTR_NAME_MAX (255)
MAX_META_VALUE = 4096   # each value (one filesystem block holds them all on ext4; btrfs allows more)


def normal(path: str) -> str:
    """An absolute sandbox path, normalised (no //, ., .. or trailing /)."""
    return os.path.normpath("/" + path.lstrip("/"))


def _split(path: str) -> tuple[str, str]:
    """(parent, name) of an absolute sandbox path; the root itself has no name."""
    parent, name = os.path.split(normal(path))
    if not name:
        raise BackendError("not on the sandbox root itself: /")
    return parent, name


def dir_in_root(root: int, path: str) -> int:
    """An O_PATH fd of directory path, resolved as kernel.open_in_root does (O_PATH takes no other flags)."""
    return kernel.openat2(root, path, os.O_PATH | os.O_DIRECTORY, 0,
                          kernel.RESOLVE_IN_ROOT | kernel.RESOLVE_NO_MAGICLINKS | kernel.RESOLVE_NO_XDEV)


def _parent(root: int, path: str) -> tuple[int, str]:
    """(an O_PATH fd of path's parent, resolved inside root; the last component's name)."""
    parent, name = _split(path)
    return dir_in_root(root, parent), name


def _kind(mode: int) -> str:
    if st.S_ISDIR(mode):
        return "dir"
    if st.S_ISREG(mode):
        return "file"
    if st.S_ISLNK(mode):
        return "symlink"
    return "other"


def wire_name(text: str) -> str:
    """A name as the wire carries it (UTF-8 text): a byte that is no UTF-8 (a name Python decoded with
    surrogateescape) is written as \\xNN. Encoding the name failed before, and with it the whole listing."""
    return text if text.isascii() else os.fsencode(text).decode("utf-8", "backslashreplace")


def entry(pfd: int, name: str, path: str, base: int) -> FileEntry:
    """The entry `name` in dir pfd (not following a symlink); owners as the sandbox sees them."""
    s = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    target = os.readlink(name, dir_fd=pfd) if st.S_ISLNK(s.st_mode) else ""
    meta = _metadata(pfd, name) if st.S_ISREG(s.st_mode) or st.S_ISDIR(s.st_mode) else {}
    return FileEntry(name=wire_name(name), path=wire_name(path), type=_kind(s.st_mode), size=s.st_size,
                     mode=st.S_IMODE(s.st_mode), permissions=st.filemode(s.st_mode)[1:], uid=_inside(s.st_uid, base),
                     gid=_inside(s.st_gid, base), mtime=s.st_mtime, symlink_target=wire_name(target),
                     metadata={wire_name(k): v for k, v in meta.items()})


def _metadata(pfd: int, name: str) -> dict[str, str]:
    """The user.* xattrs of `name` in dir pfd ("user." taken off; values as UTF-8, bad bytes replaced)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=pfd)
    except OSError:
        return {}
    try:
        return {k[5:]: os.getxattr(fd, k).decode(errors="replace") for k in os.listxattr(fd) if k.startswith("user.")}
    except OSError:   # a filesystem without user xattrs
        return {}
    finally:
        os.close(fd)


def check_metadata(metadata: dict[str, str]) -> None:
    """ValueError for metadata that cannot be user.* xattrs."""
    for key, value in metadata.items():
        if not key or "\0" in key or len(key.encode()) > MAX_META_KEY or "\0" in value \
                or len(value.encode()) > MAX_META_VALUE:
            raise ValueError(f"metadata: keys of 1..{MAX_META_KEY} bytes and values of at most {MAX_META_VALUE} "
                             f"bytes, without NUL (got key {key[:40]!r})")


def _inside(host_id: int, base: int) -> int:
    """A host uid/gid as the sandbox sees it (65534, nobody, for one outside its range)."""
    return host_id - base if base <= host_id < base + 65536 else 65534


def stat(root: int, path: str, base: int) -> FileEntry:
    if normal(path) == "/":
        return msgspec.structs.replace(entry(root, ".", "/", base), name="/")
    pfd, name = _parent(root, path)
    try:
        return entry(pfd, name, normal(path), base)
    finally:
        os.close(pfd)


def listing(root: int, path: str, depth: int, base: int, after: str = "") -> tuple[list[FileEntry], str]:
    """A page of the entries under directory path, down to depth levels (1: its own entries, up to
    MAX_DEPTH: the op lane checks it), sorted by path: the first MAX_ENTRIES whose path sorts after `after`
    (the `next` of the page before; "": from the start), and the page's `next` ("" for the last page): the
    path of its last entry, or of where it was (an entry gone meanwhile is left out). The walk reads names
    only (a subtree wholly before `after` is skipped) and keeps the page's smallest; only the page's entries
    are looked at."""
    top = normal(path)
    fd = kernel.open_in_root(root, top, os.O_RDONLY | os.O_DIRECTORY)
    page = heapq.nsmallest(MAX_ENTRIES + 1, _names(fd, top, depth, after, [0]))
    by_parent: dict[str, list[tuple[str, str]]] = {}
    for _shown, parent, name in page[:MAX_ENTRIES]:
        by_parent.setdefault(parent, []).append((name, f"{parent.rstrip('/')}/{name}"))
    out: list[FileEntry] = []
    for parent, names in by_parent.items():
        try:
            pfd = dir_in_root(root, parent)
        except OSError:      # gone (or replaced) since the walk
            continue
        try:
            for name, full in names:
                with contextlib.suppress(FileNotFoundError):
                    out.append(entry(pfd, name, full, base))
        finally:
            os.close(pfd)
    return fit(sorted(out, key=lambda e: e.path), page[MAX_ENTRIES - 1][0] if len(page) > MAX_ENTRIES else "")


def page(op, entries: list[FileEntry], after: str) -> FileOpResult:
    """A listing's answer: this page and where the next goes on; to a caller that does not page (an SDK from
    before pages), a refusal when more follow, as it got before, never a silently short listing."""
    if after and not op.paged:
        raise BackendError(f"more than {len(entries)} entries: list a smaller tree or a smaller depth, or use an "
                           f"SDK that pages: {op.path}")
    return FileOpResult(entries=entries, next=after)


def fit(entries: list[FileEntry], after: str, cursors: list[str] | None = None) -> tuple[list[FileEntry], str]:
    """A page's entries cut where they pass PAGE_BYTES encoded (entries with large xattrs), the next page
    going on from the last one kept (its path, or its cursor of cursors); else as they are, with `after`."""
    size = 0
    for i, e in enumerate(entries):
        size += len(encode(e)) + 1
        if size > PAGE_BYTES and i:
            return entries[:i], cursors[i - 1] if cursors is not None else entries[i - 1].path
    return entries, after


def _names(fd: int, path: str, depth: int, after: str, scanned: list[int]) -> Iterator[tuple[str, str, str]]:
    """(path as the wire shows it, parent, name) of each entry below dir fd (closed here) that sorts after
    `after`, depth levels down; a directory's entries by fd (O_NOFOLLOW, never into another mount).
    OverflowError past MAX_SCAN names read (scanned[0] counts them)."""
    try:
        dev = os.fstat(fd).st_dev
        subdirs: list[tuple[str, str]] = []
        with os.scandir(fd) as found:
            for de in found:
                scanned[0] += 1
                if scanned[0] > MAX_SCAN:
                    raise OverflowError(f"more than {MAX_SCAN} entries to walk: list a smaller tree or a smaller depth")
                full = f"{path.rstrip('/')}/{de.name}"
                shown = wire_name(full)
                if shown > after:
                    yield shown, path, de.name
                if depth > 1 and de.is_dir(follow_symlinks=False):
                    below = shown + "/"      # every path under it starts so: all before `after`, or not one
                    if after.startswith(below) or after <= below:
                        subdirs.append((de.name, full))
        for name, full in subdirs:
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError:   # unreadable, or gone
                continue
            if os.fstat(sub).st_dev != dev:   # another mount (its entries are not the root's)
                os.close(sub)
                continue
            yield from _names(sub, full, depth - 1, after, scanned)
    finally:
        os.close(fd)


def make_dir(root: int, path: str, owner: int | None) -> bool:
    """Create path and its missing parents (0755), given to host uid/gid owner (None: the creator's, a user's
    fsuid); False when it was there. Each parent is resolved from the root again (a symlink among them means
    what it means inside the sandbox)."""
    parts = [p for p in normal(path).split("/") if p]
    made = False
    for i, part in enumerate(parts):
        pfd = dir_in_root(root, "/" + "/".join(parts[:i]))
        try:
            os.mkdir(part, 0o755, dir_fd=pfd)
            if owner is not None:
                os.chown(part, owner, owner, dir_fd=pfd, follow_symlinks=False)
            made = True
        except FileExistsError:
            made = False
        finally:
            os.close(pfd)
    os.close(dir_in_root(root, "/" + "/".join(parts)))   # ENOTDIR when a file was there
    return made


def remove(root: int, path: str) -> None:
    """Remove a file, a symlink (not what it points to) or a whole directory tree."""
    pfd, name = _parent(root, path)
    try:
        s = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        if st.S_ISDIR(s.st_mode):
            real = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=pfd)   # (fds of no O_PATH)
            try:
                remove_tree(real, name)
            finally:
                os.close(real)
        else:
            os.unlink(name, dir_fd=pfd)
    finally:
        os.close(pfd)


def walk(top) -> Iterator[tuple[str, list[str], list[str]]]:
    """os.walk(top), top-down (dirnames may be sorted or pruned in place), never following a symlink (one to
    a directory is in filenames), without recursion: Python 3.11's os.walk recursed, so a chain of ~1,000
    directories a sandbox made raised RecursionError when its upper was sized for a snapshot. A directory
    that cannot be read raises OSError (os.walk skipped it: a layer or an export would silently miss it)."""
    todo = [os.fspath(top)]
    while todo:
        path = todo.pop()
        dirs, files = [], []
        with os.scandir(path) as it:
            for e in it:
                (dirs if e.is_dir(follow_symlinks=False) else files).append(e.name)
        yield path, dirs, files
        todo.extend(os.path.join(path, d) for d in reversed(dirs))


DEEP = 200   # levels one walk of remove_tree goes down before it moves the rest up


def remove_tree(top: int, name: str) -> None:
    """Remove directory `name` of dir fd top with all it holds, by fds (a symlink is removed, never
    followed), however deep. shutil.rmtree recurses: a chain of ~1,000 directories raised RecursionError,
    which left an fncall worker unwiped and out of its pool for good (helper G). Past DEEP levels a directory
    is moved up into top under a name of its own, and removed from there in turn."""
    todo = [name]
    while todo:
        _remove_walk(top, todo.pop(), top, todo, 0)


def _remove_walk(dfd: int, name: str, top: int, todo: list[str], depth: int) -> None:
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        with os.scandir(fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for child, is_dir in entries:
            if not is_dir:
                os.unlink(child, dir_fd=fd)
            elif depth < DEEP:
                _remove_walk(fd, child, top, todo, depth + 1)
            else:
                moved = f".dsec-rm-{os.getpid()}-{len(todo)}-{time.monotonic_ns()}"
                os.rename(child, moved, src_dir_fd=fd, dst_dir_fd=top)
                todo.append(moved)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dfd)


def remove_path(path) -> None:
    """Remove path: a file, or a directory with all it holds however deep (remove_tree: shutil.rmtree, and so
    TemporaryDirectory's cleanup, recursed and raised RecursionError on an imported tree 1,200 deep). A
    symlink is removed, never followed; a path already gone is fine."""
    parent, name = os.path.split(os.path.abspath(path))
    pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            mode = os.stat(name, dir_fd=pfd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return
        if not st.S_ISDIR(mode):
            os.unlink(name, dir_fd=pfd)
            return
        dfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        try:   # its entries one by one, so what remove_tree moves up stays inside it (never beside it)
            with os.scandir(dfd) as it:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
            for child, is_dir in entries:
                if is_dir:
                    remove_tree(dfd, child)
                else:
                    os.unlink(child, dir_fd=dfd)
        finally:
            os.close(dfd)
        os.rmdir(name, dir_fd=pfd)
    finally:
        os.close(pfd)


@contextlib.contextmanager
def scratch_dir(prefix: str = "tmp", dir: str | os.PathLike | None = None) -> Iterator[str]:
    """tempfile.TemporaryDirectory for trees of any depth: the directory's path, removed by remove_path."""
    path = tempfile.mkdtemp(prefix=prefix, dir=dir)
    try:
        yield path
    finally:
        remove_path(path)


def rename(root: int, src: str, dest: str, base: int) -> FileEntry:
    """Move src to dest (replacing a file there); the entry at dest."""
    sfd, sname = _parent(root, src)
    try:
        dfd, dname = _parent(root, dest)
        try:
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
            return entry(dfd, dname, normal(dest), base)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def read_at(root: int, path: str, offset: int, length: int) -> tuple[bytes, int]:
    """(up to length bytes of regular file path from offset, its whole size)."""
    fd = kernel.open_in_root(root, path, os.O_RDONLY)
    try:
        s = os.fstat(fd)
        if not st.S_ISREG(s.st_mode):
            raise OSError(errno.ENXIO, "not a regular file")
        return os.pread(fd, length, offset), s.st_size
    finally:
        os.close(fd)


def write_at(root: int, path: str, data: bytes, offset: int, mode: int, owner: int | None,
             metadata: dict[str, str] | None = None) -> None:
    """Write data at offset of path: offset 0 creates or truncates it (exactly mode, owned by owner, with
    metadata as its user.* xattrs, checked by the op lane, in place of those it had); a later piece extends
    what the first made."""
    if offset == 0:   # its metadata becomes exactly `metadata` (a rewrite without any clears the old)
        kernel.write_in_root(root, path, data, mode, owner)
        fd = kernel.open_in_root(root, path, os.O_RDONLY)
        try:
            for name in os.listxattr(fd):
                if name.startswith("user.") and name[5:] not in (metadata or {}):
                    os.removexattr(fd, name)
            for key, value in (metadata or {}).items():
                os.setxattr(fd, f"user.{key}", value.encode())
        finally:
            os.close(fd)
        return
    fd = kernel.open_in_root(root, path, os.O_WRONLY)
    try:
        s = os.fstat(fd)
        if not st.S_ISREG(s.st_mode):
            raise OSError(errno.ENXIO, "not a regular file")
        if s.st_size != offset:   # pieces come in order, each once: anything else is a lost piece
            raise OSError(errno.EINVAL, f"the file holds {s.st_size} bytes, not {offset}: a piece was lost")
        view = memoryview(data)
        while view:               # a short write (the disk's quota reached) goes on to the error it meets
            view = view[os.pwrite(fd, view, offset + len(data) - len(view)):]
    finally:
        os.close(fd)

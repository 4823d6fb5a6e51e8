"""OCI and Docker images in: read an OCI layout (a directory, or an OCI archive of one) or a `docker save`
archive, apply its layers in order into one directory tree (what overlayfs would show of them: whiteouts
and opaque directories applied, hard links, symlinks, owners, modes with setuid, xattrs and file
capabilities kept), which erofs.pack_dir makes one EROFS layer of; and the image's config (Env, WorkingDir,
User, Entrypoint, Cmd) as the image's defaults.

Every path is resolved inside the tree (openat2 RESOLVE_IN_ROOT): a member named ../x, /x, or reached
through a symlink a layer planted, never lands outside it. Device nodes are refused (a sandbox gets its
/dev from the platform); so are layers compressed with anything but gzip (zstd has no reader here)."""
from __future__ import annotations

import base64
import contextlib
import errno
import lzma
import os
import posixpath
import stat
import tarfile
import tempfile
import zlib
from pathlib import Path

from edge.backends import kernel
from edge.backends.treeops import remove_tree
from edge.erofs import MAX_NAME, mtime_ns, set_dir_mtimes
from edge.ociread import Budget, Image, OciError, read_docker_archive, read_oci_layout, unpack_archive

__all__ = ["Budget", "Image", "OciError", "apply_layers", "read_docker_archive", "read_oci_layout", "unpack_archive"]

WHITEOUT, OPAQUE = ".wh.", ".wh..wh..opq"
IN_ROOT = kernel.RESOLVE_IN_ROOT | kernel.RESOLVE_NO_MAGICLINKS
XATTRS = ("user.",)                 # xattrs an image may carry (prefixes), and security.capability: never
CAPABILITY = "security.capability"  # trusted.* (trusted.overlay.* would change what overlayfs shows the sandbox)
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
BLOCK = 1 << 20
_ZERO = memoryview(bytes(BLOCK))   # (compared, never copied)


# ------------------------------------------------------------------ applying layers

def apply_layers(layers: list[Path], root: Path, progress=lambda line: None, budget: Budget | None = None) -> None:
    """Apply each layer tar (plain or gzip) onto root, lowest first, as overlayfs would stack them, within
    budget (a default Budget when None)."""
    budget = budget or Budget()
    root.mkdir(mode=0o755, exist_ok=True)
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    dir_mtimes: dict[str, int] = {}
    try:
        for i, layer in enumerate(layers):
            progress(f"layer {i + 1}/{len(layers)}: {layer.name[:19]} ({layer.stat().st_size} bytes)")
            try:
                _apply(fd, layer, dir_mtimes, budget)
            except (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError) as exc:   # (a truncated or
                raise OciError(f"layer {i + 1} ({layer.name[:19]}): {str(exc)[:300]}") from None   # corrupt stream)
        try:   # each directory's mtime as its last layer gave it
            set_dir_mtimes(root, dir_mtimes)
        except OSError as exc:
            raise OciError(f"setting directory times: {exc}") from None
    finally:
        os.close(fd)


def _open(layer: Path) -> tarfile.TarFile:
    with open(layer, "rb") as f:
        if f.read(4) == ZSTD_MAGIC:
            raise OciError("it is zstd-compressed: not supported here; convert it with "
                           "`skopeo copy --dest-compress-format gzip`")
    return tarfile.open(layer, "r:*")


def _members(tar: tarfile.TarFile, budget: Budget):
    """A layer's members one at a time, none kept (a TarFile keeps every member read: 16M empty ones, a 100 MB
    gzip, held ~7 GB), each counted, a stop between two."""
    seen = 0
    while (m := tar.next()) is not None:
        tar.members.clear()
        seen += 1
        budget.look(seen)
        yield m


def _apply(root: int, layer: Path, dir_mtimes: dict[str, int], budget: Budget) -> None:
    # whiteouts first: they hide what the layers below hold, never what this one adds
    with _open(layer) as tar:
        outs = [(_clean(m.name), m) for m in _members(tar, budget)
                if os.path.basename(m.name.rstrip("/")).startswith(WHITEOUT)]
    for rel, _ in outs:
        parent, base = os.path.split(rel)
        if base == OPAQUE:
            _clear(root, parent)
        elif base[len(WHITEOUT):] in ("", ".", ".."):   # (.wh... would remove the directory above its own)
            raise OciError(f"whiteout {rel!r} names no file")
        else:
            _remove(root, os.path.join(parent, base[len(WHITEOUT):]))
    links = []
    with _open(layer) as tar:
        for m in _members(tar, budget):
            rel = _clean(m.name)
            if not rel or os.path.basename(rel).startswith(WHITEOUT):
                continue
            budget.entry(m.size if m.isfile() else 0)
            if m.islnk():
                links.append((rel, m))    # after the files they name (a link may come before its target)
            else:
                _entry(root, rel, m, tar, dir_mtimes, budget)
    for rel, m in links:
        _hardlink(root, rel, m)


def _clean(name: str) -> str:
    """A member's path relative to the root; .. anywhere is a path traversal."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise OciError(f"member {name!r} leaves the image's root (path traversal)")
    if any(len(p.encode("utf-8", "surrogateescape")) > MAX_NAME for p in parts):   # (each directory on its way too)
        raise OciError(f"{name[-80:]!r}: a name of 255 bytes, which this mkfs.erofs cannot pack (at most {MAX_NAME})")
    return "/".join(parts)


def _dir_fd(root: int, rel: str, create: bool = True, depth: int = 0) -> int:
    """An fd of directory rel inside the root, resolved in it as the sandbox would (a symlink, absolute
    or not, stays inside); missing directories are made (0755, root's) when create, the target of a
    symlink to a directory not there yet too (var/run -> /run, then var/run/x: as Docker does)."""
    try:
        return kernel.openat2(root, rel or ".", os.O_PATH | os.O_DIRECTORY, 0, IN_ROOT)
    except FileNotFoundError:
        if not create:
            raise
    parts = [p for p in rel.split("/") if p]
    for i in range(1, len(parts) + 1):
        try:
            os.close(kernel.openat2(root, "/".join(parts[:i]), os.O_PATH | os.O_DIRECTORY, 0, IN_ROOT))
        except FileNotFoundError:
            parent = kernel.openat2(root, "/".join(parts[:i - 1]) or ".", os.O_PATH | os.O_DIRECTORY, 0, IN_ROOT)
            try:
                try:
                    os.mkdir(parts[i - 1], 0o755, dir_fd=parent)
                except FileExistsError:   # a symlink whose target is not there: make its target
                    link = os.readlink(parts[i - 1], dir_fd=parent)
                    if depth > 40:
                        raise OSError(errno.ELOOP, "too many levels of symbolic links", rel) from None
                    target = posixpath.normpath(posixpath.join("/", "/".join(parts[:i - 1]), link))
                    os.close(_dir_fd(root, target.lstrip("/"), True, depth + 1))
            finally:
                os.close(parent)
    return kernel.openat2(root, rel, os.O_PATH | os.O_DIRECTORY, 0, IN_ROOT)


def _split(root: int, rel: str, create: bool = True) -> tuple[int, str]:
    parent, base = os.path.split(rel)
    return _dir_fd(root, parent, create), base


def _lstat(dfd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _rm(dfd: int, name: str) -> None:
    """Remove name (a directory with all it holds, however deep: remove_tree never recurses in Python)."""
    st = _lstat(dfd, name)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        remove_tree(dfd, name)
    else:
        os.unlink(name, dir_fd=dfd)


def _remove(root: int, rel: str) -> None:
    try:
        dfd, base = _split(root, rel, create=False)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        _rm(dfd, base)
    finally:
        os.close(dfd)


def _clear(root: int, rel: str) -> None:
    try:
        dfd = _dir_fd(root, rel, create=False)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        sub = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        for entry in os.listdir(sub):
            _rm(sub, entry)
    finally:
        os.close(sub)


def _entry(root: int, rel: str, m: tarfile.TarInfo, tar: tarfile.TarFile, dir_mtimes: dict[str, int],
           budget: Budget) -> None:
    if m.ischr() or m.isblk():
        raise OciError(f"{rel} is a device node ({'char' if m.ischr() else 'block'} {m.devmajor}:{m.devminor}): "
                           "refused (a sandbox's /dev comes from the platform)")
    if not (m.isfile() or m.isdir() or m.issym() or m.isfifo()):
        raise OciError(f"{rel}: unsupported tar member type {m.type!r}")

    dfd, base = _split(root, rel)
    try:
        old = _lstat(dfd, base)
        if m.isdir():
            if old is not None and not stat.S_ISDIR(old.st_mode):
                _rm(dfd, base)
                old = None
            if old is None:
                os.mkdir(base, 0o700, dir_fd=dfd)
        else:
            if old is not None:
                _rm(dfd, base)
            if m.issym():
                os.symlink(m.linkname, base, dir_fd=dfd)
            elif m.isfifo():
                os.mkfifo(base, 0o600, dir_fd=dfd)
            else:
                fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=dfd)
                with os.fdopen(fd, "wb") as out, tar.extractfile(m) as data:
                    _copy(data, out, m.size, budget)
        _attributes(dfd, base, m)
        if m.isdir():   # (keyed by where it is: a parent named through a symlink of the image resolves)
            real = os.path.join(os.readlink(f"/proc/self/fd/{dfd}"), base)
            dir_mtimes[os.path.relpath(real, os.readlink(f"/proc/self/fd/{root}"))] = mtime_ns(m.mtime)
    finally:
        os.close(dfd)


def _copy(data, out, size: int, budget: Budget) -> None:
    """A member's bytes, blocks of zeros left as holes (a sparse file stays sparse), within the budget."""
    while block := data.read(BLOCK):
        if _ZERO[:len(block)] == block:
            if budget.stop.is_set():
                raise OciError("interrupted")
            out.seek(len(block), os.SEEK_CUR)
        else:
            budget.room(out.fileno(), len(block))
            out.write(block)
    out.truncate(size)


def _attributes(dfd: int, base: str, m: tarfile.TarInfo) -> None:
    """Owner, then mode (chown clears setuid), xattrs (a file capability is security.capability)."""
    os.chown(base, m.uid, m.gid, dir_fd=dfd, follow_symlinks=False)
    if not m.issym():
        os.chmod(base, m.mode & 0o7777, dir_fd=dfd)
    path = f"/proc/self/fd/{dfd}/{base}"
    for key, value in (m.pax_headers or {}).items():
        if key.startswith("SCHILY.xattr."):
            name, raw = key[len("SCHILY.xattr."):], value.encode("utf-8", "surrogateescape")
        elif key.startswith("LIBARCHIVE.xattr."):
            name, raw = key[len("LIBARCHIVE.xattr."):], base64.b64decode(value + "==")
        else:
            continue
        if m.issym() or not (name == CAPABILITY or name.startswith(XATTRS)):
            continue                                 # (user.* xattrs cannot be set on a symlink)
        try:
            os.setxattr(path, name, raw, follow_symlinks=False)
        except OSError as exc:
            if exc.errno == errno.ENOSPC and _room(dfd) > 16 << 20:   # (not a full disk: ext4 keeps one block,
                                                                       # ~4 KiB, of a file's xattrs)
                raise OciError(f"{m.name}: xattr {name}: its xattrs ({_xattr_bytes(m)} bytes in all) do not fit "
                               f"in the import's work directory (under {tempfile.gettempdir()}, on a filesystem "
                               f"that holds about 4 KiB of them a file, as ext4): set TMPDIR to a directory on btrfs "
                               f"or xfs") from None
            raise OciError(f"{m.name}: xattr {name}: {exc.strerror}") from None
    with contextlib.suppress(OSError):
        os.utime(base, ns=(mtime_ns(m.mtime),) * 2, dir_fd=dfd, follow_symlinks=False)


def _room(dfd: int) -> int:
    """Bytes free on the filesystem of directory fd dfd (0 when unknown)."""
    try:
        st = os.statvfs(f"/proc/self/fd/{dfd}")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _xattr_bytes(m: tarfile.TarInfo) -> int:
    """About how many bytes a member's xattrs take (names and values)."""
    return sum(len(k) + len(v) for k, v in (m.pax_headers or {}).items() if k.startswith(("SCHILY.xattr.",
                                                                                        "LIBARCHIVE.xattr.")))


def _hardlink(root: int, rel: str, m: tarfile.TarInfo) -> None:
    target = _clean(m.linkname)
    sfd, sbase = _split(root, target, create=False)
    dfd, base = _split(root, rel)
    try:
        st = _lstat(sfd, sbase)
        if st is None:
            raise OciError(f"{rel} is a hard link to {m.linkname!r}, which no layer holds")
        if _lstat(dfd, base) is not None:
            _rm(dfd, base)
        os.link(sbase, base, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
    finally:
        os.close(sfd)
        os.close(dfd)

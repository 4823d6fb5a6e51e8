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
import hashlib
import json
import lzma
import os
import shutil
import stat
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from edge.backends import kernel
from edge.erofs import mtime_ns, set_dir_mtimes

WHITEOUT, OPAQUE = ".wh.", ".wh..wh..opq"
IN_ROOT = kernel.RESOLVE_IN_ROOT | kernel.RESOLVE_NO_MAGICLINKS
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")


class OciError(Exception):
    """An image could not be imported; the message is one clear line."""


@dataclass
class Image:
    """What an archive holds: its layers (files, lowest first) and its config's defaults."""

    layers: list[Path]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    user: str = ""
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ reading the archive formats

def _json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise OciError(f"cannot read {path.name}: {exc}") from None


def _blob(layout: Path, digest: str) -> Path:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or not all(c in "0123456789abcdef" for c in hexpart):
        raise OciError(f"bad blob digest: {digest!r}")
    path = layout / "blobs" / "sha256" / hexpart
    if not path.is_file():
        raise OciError(f"blob {digest} is missing from the image")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != hexpart:
        raise OciError(f"blob {digest[:19]} does not match its digest (truncated or corrupt)")
    return path


def read_oci_layout(layout: Path, ref: str = "") -> Image:
    """An OCI image layout directory: index.json's manifest (the one named ref, or the only one; an index
    inside it picks linux/amd64)."""
    if not (layout / "oci-layout").is_file() or not (layout / "index.json").is_file():
        raise OciError(f"{layout} is not an OCI image layout (no oci-layout and index.json)")
    manifests = _json(layout / "index.json").get("manifests") or []
    if ref:
        manifests = [m for m in manifests if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == ref]
    if len(manifests) != 1:
        raise OciError(f"{layout}: {len(manifests)} manifests{f' named {ref!r}' if ref else ''}; "
                           "name one with --ref" if manifests else f"{layout}: no manifest"
                           + (f" named {ref!r}" if ref else ""))
    desc = manifests[0]
    for _ in range(4):                               # an index of platforms: this machine's
        if desc.get("mediaType") not in INDEX_TYPES:
            break
        inner = _json(_blob(layout, desc["digest"])).get("manifests") or []
        mine = [m for m in inner if m.get("platform", {}).get("os") == "linux"
                and m.get("platform", {}).get("architecture") == "amd64"]
        if not mine:
            raise OciError("the image index has no linux/amd64 manifest")
        desc = mine[0]
    manifest = _json(_blob(layout, desc["digest"]))
    layers = []
    for layer in manifest.get("layers") or []:
        media = layer.get("mediaType", "")
        if "zstd" in media:
            raise OciError(f"layer {layer.get('digest')} is zstd-compressed ({media}): not supported here; "
                               "convert it with `skopeo copy --dest-compress-format gzip`")
        if "foreign" in media or "nondistributable" in media:
            raise OciError(f"layer {layer.get('digest')} is not distributable ({media}): not in the archive")
        layers.append(_blob(layout, layer["digest"]))
    config = _json(_blob(layout, manifest["config"]["digest"])) if manifest.get("config") else {}
    return _with_config(layers, config)


def read_docker_archive(root: Path) -> Image:
    """An unpacked `docker save` archive: manifest.json's one image (its config file and layer tars)."""
    if not (root / "manifest.json").is_file():
        raise OciError("not a docker save archive (no manifest.json)")
    entries = _json(root / "manifest.json")
    if not isinstance(entries, list) or len(entries) != 1:
        raise OciError(f"the archive holds {len(entries) if isinstance(entries, list) else 0} images; "
                           "import an archive of one")
    entry = entries[0]
    layers = [_member(root, name) for name in entry.get("Layers") or []]
    return _with_config(layers, _json(_member(root, entry["Config"])))


def _member(root: Path, name: str) -> Path:
    path = (root / name).resolve()
    if not path.is_relative_to(root.resolve()) or not path.is_file():
        raise OciError(f"the archive's manifest names {name!r}, which it does not hold")
    return path


def _with_config(layers: list[Path], config: dict) -> Image:
    c = config.get("config") or {}
    env = {}
    for item in c.get("Env") or []:
        key, sep, value = item.partition("=")
        if sep and key and "\0" not in item:   # (a NUL would break every exec)
            env[key] = value
    cwd = c.get("WorkingDir") or ""
    if cwd and not cwd.startswith("/"):
        raise OciError(f"the image's WorkingDir is not absolute: {cwd!r}")
    return Image(layers=layers, env=env, cwd=cwd, user=c.get("User") or "",
                 entrypoint=list(c.get("Entrypoint") or []), cmd=list(c.get("Cmd") or []))


def unpack_archive(archive: Path, into: Path) -> None:
    """An OCI or docker archive (a plain tar of its files) unpacked as it is: regular files and directories
    only, every name inside into."""
    try:
        with tarfile.open(archive) as tar:
            for m in tar:
                if not (m.isfile() or m.isdir()):
                    continue      # (symlinks of old docker saves' layer dirs are not needed: manifest.json names files)
                tar.extract(m, into, filter="data")
    except tarfile.TarError as exc:
        raise OciError(f"cannot read {archive.name}: {exc}") from None
    except OSError as exc:
        raise OciError(f"cannot unpack {archive.name}: {exc}") from None


# ------------------------------------------------------------------ applying layers

def apply_layers(layers: list[Path], root: Path, progress=lambda line: None) -> None:
    """Apply each layer tar (plain or gzip) onto root, lowest first, as overlayfs would stack them."""
    root.mkdir(mode=0o755, exist_ok=True)
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    dir_mtimes: dict[str, int] = {}
    try:
        for i, layer in enumerate(layers):
            progress(f"layer {i + 1}/{len(layers)}: {layer.name[:19]} ({layer.stat().st_size} bytes)")
            try:
                _apply(fd, layer, dir_mtimes)
            except (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError) as exc:   # (a truncated or
                raise OciError(f"layer {i + 1} ({layer.name[:19]}): {exc}") from None           # corrupt stream)
        try:   # each directory's mtime as its last layer gave it
            set_dir_mtimes(root, dir_mtimes)
        except OSError as exc:
            raise OciError(f"setting directory times: {exc}") from None
    finally:
        os.close(fd)


def _open(layer: Path) -> tarfile.TarFile:
    return tarfile.open(layer, "r:*")


def _apply(root: int, layer: Path, dir_mtimes: dict[str, int]) -> None:
    # whiteouts first: they hide what the layers below hold, never what this one adds
    with _open(layer) as tar:
        outs = [(_clean(m.name), m) for m in tar if os.path.basename(m.name.rstrip("/")).startswith(WHITEOUT)]
    for rel, _ in outs:
        parent, base = os.path.split(rel)
        if base == OPAQUE:
            _clear(root, parent)
        else:
            _remove(root, os.path.join(parent, base[len(WHITEOUT):]))
    links = []
    with _open(layer) as tar:
        for m in tar:
            rel = _clean(m.name)
            if not rel or os.path.basename(rel).startswith(WHITEOUT):
                continue
            if m.islnk():
                links.append((rel, m))    # after the files they name (a link may come before its target)
            else:
                _entry(root, rel, m, tar, dir_mtimes)
    for rel, m in links:
        _hardlink(root, rel, m)


def _clean(name: str) -> str:
    """A member's path relative to the root; .. anywhere is a path traversal."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise OciError(f"member {name!r} leaves the image's root (path traversal)")
    return "/".join(parts)


def _dir_fd(root: int, rel: str, create: bool = True) -> int:
    """An fd of directory rel inside the root, resolved in it as the sandbox would (a symlink, absolute
    or not, stays inside); missing directories are made (0755, root's) when create."""
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
                os.mkdir(parts[i - 1], 0o755, dir_fd=parent)
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
    st = _lstat(dfd, name)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            for entry in os.listdir(sub):
                _rm(sub, entry)
        finally:
            os.close(sub)
        os.rmdir(name, dir_fd=dfd)
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


def _entry(root: int, rel: str, m: tarfile.TarInfo, tar: tarfile.TarFile, dir_mtimes: dict[str, int]) -> None:
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
                    shutil.copyfileobj(data, out, 1 << 20)
        _attributes(dfd, base, m)
        if m.isdir():   # (keyed by where it is: a parent named through a symlink of the image resolves)
            real = os.path.join(os.readlink(f"/proc/self/fd/{dfd}"), base)
            dir_mtimes[os.path.relpath(real, os.readlink(f"/proc/self/fd/{root}"))] = mtime_ns(m.mtime)
    finally:
        os.close(dfd)


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
        if m.issym() and not name.startswith("trusted."):
            continue                                 # user.* xattrs cannot be set on a symlink
        try:
            os.setxattr(path, name, raw, follow_symlinks=False)
        except OSError as exc:
            raise OciError(f"{m.name}: xattr {name}: {exc.strerror}") from None
    with contextlib.suppress(OSError):
        os.utime(base, ns=(mtime_ns(m.mtime),) * 2, dir_fd=dfd, follow_symlinks=False)


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

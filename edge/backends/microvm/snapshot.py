"""A microVM's writable layer packed as an EROFS layer on the host, so snapshots, forks and rollbacks of VMs
use the same layers as containers (a fork of a VM snapshot may be a container, and the reverse).

The layer lives on the guest's ext4 disk, which the host never mounts (a disk the guest wrote is the
guest's to shape). Instead:
1. the agent freezes that filesystem (FIFREEZE: the sandbox's writers wait, so the pack is one point in
   time) and lists its opaque dirs (an xattr only the agent may read);
2. the trusted shell streams the raw upper dir as a tar (busybox tar: files, dirs, symlinks, hard links,
   and whiteouts as 0/0 character devices) into a file on the host, bounded by the disk limit;
3. the agent thaws it, and the host unpacks the tar as untrusted input (no path leaves the tree, nothing
   is written through a symlink, no device but a whiteout, hard links only to files of the tree), marks
   the opaque dirs and packs the tree with mkfs.erofs. Owners stay as the guest numbered them, which is
   relative to the sandbox, as a container's packs are.
What busybox tar does not carry is lost: extended attributes other than opacity (file capabilities,
user.* attributes) and sub-second mtimes."""
from __future__ import annotations

import asyncio
import os
import stat
import tarfile
from pathlib import Path

from edge.backends.base import BackendError, SnapshotTooLarge
from edge.erofs import MAX_NAME, mtime_ns, set_dir_mtimes
from edge.backends.gvisor.agent import AgentChannel
from chronus.shell import TRUSTED_BUSYBOX

PACK = "cd /.dsec/upper && exec tar -c -f - ."
SLACK = 16 << 20       # tar headers and padding over the files' own bytes


class UnsafeArchive(ValueError):
    """A guest's tar that would write outside its tree or make what a layer may not hold."""


class TarSink:
    """An exec's stdout into a file, refused past `limit` bytes (SnapshotTooLarge); stderr kept short."""

    def __init__(self, path: Path, limit: int, sandbox_id: str) -> None:
        self.file = open(path, "wb")
        self.limit, self.size, self.sandbox_id = limit, 0, sandbox_id
        self.stderr = bytearray()

    async def __call__(self, stream: str, data: bytes) -> None:
        if stream != "stdout":
            self.stderr += data[:4096 - len(self.stderr)]
            return
        self.size += len(data)
        if self.size > self.limit:
            raise SnapshotTooLarge(f"snapshot of {self.sandbox_id} refused: its writable layer packs to more "
                                   f"than {self.limit} bytes (its disk limit plus tar's headers)")
        self.file.write(data)

    def close(self) -> None:
        self.file.close()


def _inside(name: str) -> str | None:
    """A member's path relative to the tree ('' for the tree itself), or None if it would leave it."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or ".." in parts:
        return None
    return "/".join(parts)


def _safe_parent(root: Path, rel: str) -> Path:
    """root/rel, once no existing ancestor of it inside root is a symlink (so nothing is written through one)."""
    target = root / rel
    parent = os.path.realpath(target.parent)
    if parent != os.path.normpath(target.parent):
        raise UnsafeArchive(f"{rel!r} lies under a symlink")
    return target


def unpack(tar: Path, root: Path, opaque: list[str]) -> None:
    """Extract a guest's tar of its upper dir into root (an empty dir of the host), as untrusted input;
    mark the opaque dirs. UnsafeArchive for anything a layer may not hold."""
    real_root = os.path.realpath(root)
    dir_times: dict[str, int] = {}
    with tarfile.open(tar, "r:") as tf:
        for m in tf:
            rel = _inside(m.name)
            if rel is None:
                raise UnsafeArchive(f"{m.name!r} leaves the tree")
            if rel == "":
                continue
            if any(len(p.encode("utf-8", "surrogateescape")) > MAX_NAME for p in rel.split("/")):
                raise SnapshotTooLarge(f"/{rel[:300]}: a name of 255 bytes (a layer holds names of up to {MAX_NAME})")
            if m.isblk() or (m.ischr() and (m.devmajor, m.devminor) != (0, 0)):
                raise UnsafeArchive(f"{rel!r} is a device node (only whiteouts, 0/0, may be)")
            if not (m.isfile() or m.isdir() or m.issym() or m.islnk() or m.isfifo() or m.ischr()):
                raise UnsafeArchive(f"{rel!r} is of a kind a layer does not hold ({m.type!r})")
            target = _safe_parent(root, rel)
            if m.islnk():
                src = _inside(m.linkname)
                if not src or not (root / src).is_file() or (root / src).is_symlink() \
                        or os.path.realpath(root / src) != os.path.join(real_root, src):
                    raise UnsafeArchive(f"hard link {rel!r} to {m.linkname!r}: not a file of the tree")
                m.linkname = src
            if os.path.lexists(target) and not (target.is_dir() and not target.is_symlink() and m.isdir()):
                if target.is_dir() and not target.is_symlink():
                    raise UnsafeArchive(f"{rel!r} is both a directory and not one")
                target.unlink()                     # a later member of the same name wins, never through it
            m.name = rel
            # a hard link's attributes are its file's, set already
            tf.extract(m, root, set_attrs=not m.islnk(), numeric_owner=True, filter="fully_trusted")
            if m.isdir():
                dir_times[rel] = mtime_ns(m.mtime)
    set_dir_mtimes(root, dir_times)   # (each member extracted after its directory set that one's to now)
    for rel in opaque:
        path = _inside(rel)
        if path:
            target = _safe_parent(root, path)
            if stat.S_ISDIR(os.lstat(target).st_mode):
                os.setxattr(target, "trusted.overlay.opaque", b"y", follow_symlinks=False)


async def pack(chan: AgentChannel, sandbox_id: str, disk: int, env: dict[str, str], work: Path, dst: Path) -> str:
    """Steps 1-3 above for one VM (work: an empty dir of the host); the layer's digest. SnapshotTooLarge past
    the disk limit, BackendError for anything else."""
    from edge.erofs import LayerBuildError, pack_dir
    try:
        opaque = await chan.freeze_upper(True)
        sink = TarSink(work / "upper.tar", disk + SLACK, sandbox_id)
        try:
            res = await chan.exec([TRUSTED_BUSYBOX, "sh", "-c", PACK], env, "/", None, max(60.0, disk / (4 << 20)),
                                  sink, None)
        finally:
            sink.close()
            await chan.freeze_upper(False)
        if res.exit_code or res.timed_out:
            why = sink.stderr.decode(errors="replace").strip()
            raise BackendError(f"tar in the guest exited {res.exit_code}: {why}")
        (work / "root").mkdir(mode=0o755)
        try:
            await asyncio.to_thread(unpack, work / "upper.tar", work / "root", opaque)
        except SnapshotTooLarge as exc:
            raise SnapshotTooLarge(f"snapshot of {sandbox_id} refused: {exc}") from None
        (work / "upper.tar").unlink()
        return await asyncio.to_thread(pack_dir, work / "root", dst)
    except (UnsafeArchive, tarfile.TarError, LayerBuildError, OSError) as exc:
        raise BackendError(f"the guest's writable layer: {exc}") from exc

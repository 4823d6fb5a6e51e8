"""Read-only EROFS layer mounts, one per layer file per node, shared by every sandbox that uses it.

EROFS here mounts a regular file directly (file-backed mounts, no loop device), which costs
~0.3 ms, plus as much again to unmount; a layer is mounted when its first user comes, and when its
last user leaves it stays mounted, idle, for the next sandbox: up to IDLE_KEEP idle mounts are kept
(least recently used unmounted first), and all are unmounted when the backend stops.
A mount is named by a hash of the file's path and identity (device, inode, mtime), so a layer file
replaced in place gets a fresh mount instead of a stale one.
"""
from __future__ import annotations

import collections
import errno
import hashlib
import os
import stat
from pathlib import Path

from edge.backends import kernel
from edge.backends.uppers import mount_points


IDLE_KEEP = 16   # idle layer mounts kept for reuse


class LayerError(Exception):
    """A layer file could not be mounted."""


class LayerMounts:
    """Refcounted read-only mounts of layer files under one directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._refs: dict[Path, int] = {}
        self._idle: collections.OrderedDict[Path, None] = collections.OrderedDict()

    def mountpoint(self, layer: str) -> Path:
        """Where the layer file is (or would be) mounted."""
        try:
            st = os.stat(layer)
        except OSError as exc:
            raise LayerError(f"layer not found: {layer}") from exc
        if not stat.S_ISREG(st.st_mode):
            raise LayerError(f"layer is not a file: {layer}")
        ident = f"{os.path.realpath(layer)}\0{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"
        return self.root / hashlib.sha256(ident.encode()).hexdigest()[:20]

    def acquire(self, layers: list[str]) -> list[Path]:
        """Mount (or share) every layer; return their mountpoints in the same order. All or nothing."""
        done: list[Path] = []
        try:
            for layer in layers:
                target = self.mountpoint(layer)
                if self._refs.get(target, 0) == 0:
                    if target in self._idle:
                        del self._idle[target]      # still mounted from an earlier user: reuse it
                    else:
                        self._mount(layer, target)
                self._refs[target] = self._refs.get(target, 0) + 1
                done.append(target)
        except (OSError, LayerError) as exc:
            self.release(done)
            raise exc if isinstance(exc, LayerError) else LayerError(str(exc)) from exc
        return done

    def _mount(self, layer: str, target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        try:
            kernel.mount(layer, target, "erofs", kernel.MS_RDONLY | kernel.MS_NODEV | kernel.MS_NOSUID)
        except kernel.KernelError as exc:
            target.rmdir()
            if exc.errno == errno.ENOTBLK:   # (a file-backed EROFS mount needs a file of a disk filesystem)
                raise LayerError(f"cannot mount layer {layer}: its filesystem (tmpfs?) cannot back an EROFS mount; "
                                 "put the edge's --state-dir on a disk filesystem (ext4, xfs, btrfs)") from exc
            raise LayerError(f"cannot mount layer {layer}: {exc.strerror} (is it an EROFS image?)") from exc

    def release(self, targets: list[Path]) -> None:
        """Drop one reference per mountpoint; those nobody uses become idle (LRU beyond IDLE_KEEP goes)."""
        for target in targets:
            left = self._refs.get(target, 0) - 1
            if left > 0:
                self._refs[target] = left
                continue
            self._refs.pop(target, None)
            self._idle[target] = None
        while len(self._idle) > IDLE_KEEP:
            oldest, _ = self._idle.popitem(last=False)
            _unmount(oldest)

    def idle(self) -> list[Path]:
        """Mounted layers no sandbox uses now (kept for reuse)."""
        return list(self._idle)

    def in_use(self) -> dict[Path, int]:
        """Mountpoints with their reference counts."""
        return dict(self._refs)

    def unmount_all(self) -> None:
        """Unmount every layer mount under root (ours or a crashed run's) and remove the dirs."""
        self._refs.clear()
        self._idle.clear()
        for point in reversed(mount_points()):
            if Path(point).parent == self.root:
                _unmount(Path(point))
        if self.root.is_dir():
            for leftover in self.root.iterdir():
                _unmount(leftover)


def _unmount(target: Path) -> None:
    """Unmount (lazily if a dying sandbox still holds it) and remove the directory."""
    try:
        kernel.umount2(target)
    except kernel.KernelError as exc:
        if kernel.is_busy(exc):
            kernel.umount2(target, kernel.MNT_DETACH)
    try:
        target.rmdir()
    except OSError:
        pass

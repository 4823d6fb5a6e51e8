"""Writable layers with a size cap: one btrfs subvolume per sandbox, limited by a qgroup.

Why btrfs: a sandbox's writes must be capped on disk and fail with EDQUOT/ENOSPC, not OOM. A tmpfs
upper would charge every written byte to the sandbox's memory cgroup; XFS project quotas are not in
this kernel; ext4 project quotas need a dedicated filesystem anyway. So the node keeps one sparse
image file (state_dir/uppers.btrfs), formatted and mounted once per start (the `mount -o loop` and
`btrfs quota enable` commands run once), and per sandbox does only fast ioctls on it:
BTRFS_IOC_SUBVOL_CREATE (~0.2 ms), BTRFS_IOC_QGROUP_LIMIT (qgroupid 0 = the subvolume of the fd,
max_rfer = max_excl = the cap) and BTRFS_IOC_SNAP_DESTROY (~2 ms). The qgroup of a deleted
subvolume goes away by itself once btrfs has dropped the subvolume in the background.
Each sandbox's subvolume holds upper/ and work/ (the overlay's), merged/ (its mountpoint) and shm/ (its
/dev/shm, made at launch: capped with the layer).

Host disk: the qgroup counts a subvolume's metadata (tree blocks) as well as its data, so 50,000 empty
files hit the cap like data does. What the sparse image itself takes on the host is bounded by formatting
metadata `single` (not DUP: one copy of every tree block) and mounting with `discard`, so blocks btrfs
frees (copy-on-write churn of the trees, a deleted subvolume) are punched out of the image at once:
the image holds about what the sandboxes hold now, never what they once wrote. The pool is mounted
nosuid,nodev: nothing a sandbox plants there is a setuid program or a device node for the host.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

from edge.backends import kernel


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x94 << 8) | nr


BTRFS_IOC_SUBVOL_CREATE = _ioc(1, 14, 4096)     # _IOW(0x94, 14, struct btrfs_ioctl_vol_args)
BTRFS_IOC_SNAP_DESTROY = _ioc(1, 15, 4096)      # _IOW(0x94, 15, struct btrfs_ioctl_vol_args)
BTRFS_IOC_QGROUP_LIMIT = _ioc(2, 43, 48)        # _IOR(0x94, 43, struct btrfs_ioctl_qgroup_limit_args)
BTRFS_QGROUP_LIMIT_MAX_RFER = 1
BTRFS_QGROUP_LIMIT_MAX_EXCL = 2
MOUNT_OPTIONS = "loop,discard,nosuid,nodev"


class UpperError(Exception):
    """The writable-layer pool or one writable layer failed."""


def _vol_args(name: str) -> bytearray:
    # A mutable buffer: fcntl.ioctl copies immutable arguments only up to 1024 bytes.
    return bytearray(struct.pack("q4088s", 0, name.encode()))


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UpperError(f"{' '.join(argv[:3])} failed: {proc.stderr.strip()[-300:]}")


def mounted_at(path: Path) -> bool:
    """True if something is mounted exactly at path (per /proc/self/mountinfo)."""
    return str(path) in mount_points()


mount_points = kernel.mount_points


class UpperPool:
    """The node's btrfs pool of per-sandbox writable layers."""

    def __init__(self, state_dir: Path, size: int) -> None:
        self.image = state_dir / "uppers.btrfs"
        self.root = state_dir / "uppers"
        self.size = size
        self._ioctls = True

    def setup(self) -> None:
        """Format and mount a fresh pool with quotas on (whatever was there is dropped)."""
        self.teardown()
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.image, "wb") as f:
            f.truncate(self.size)
        _run("mkfs.btrfs", "-q", "-f", "-m", "single", str(self.image))
        _run("mount", "-o", MOUNT_OPTIONS, str(self.image), str(self.root))
        _run("btrfs", "quota", "enable", str(self.root))
        self._ioctls = self._probe()

    def device(self) -> str:
        """"major:minor" of the loop device the pool is mounted from ("" when not mounted)."""
        for dev in loop_devices(self.image):
            rdev = os.stat(dev).st_rdev
            return f"{os.major(rdev)}:{os.minor(rdev)}"
        return ""

    def _probe(self) -> bool:
        """Check the ioctls on a throwaway subvolume; fall back to btrfs commands if one fails."""
        try:
            self._create_ioctl(".probe", 1 << 20)
            self._destroy_ioctl(".probe")
            return True
        except OSError:
            shutil.rmtree(self.root / ".probe", ignore_errors=True)
            return False

    def teardown(self) -> None:
        """Unmount the pool (all subvolumes go with it) and delete the image."""
        for _ in range(8):      # stacked mounts, if a crashed run mounted twice
            if not mounted_at(self.root):
                break
            try:
                kernel.umount2(self.root)
            except kernel.KernelError:
                kernel.umount2(self.root, kernel.MNT_DETACH)   # a dying sandbox still holds it
        self.image.unlink(missing_ok=True)

    def create(self, name: str, limit: int) -> Path:
        """Create the capped subvolume of one sandbox with upper/, work/ and merged/ inside."""
        try:
            if self._ioctls:
                self._create_ioctl(name, limit)
            else:
                _run("btrfs", "subvolume", "create", str(self.root / name))
                _run("btrfs", "qgroup", "limit", str(limit), str(self.root / name))
            sub = self.root / name
            for d in ("upper", "work", "merged"):
                (sub / d).mkdir(mode=0o755)
            return sub
        except (OSError, UpperError) as exc:
            if (self.root / name).exists():
                self.remove(name)
            raise UpperError(f"writable layer for {name}: {exc}") from exc

    def _create_ioctl(self, name: str, limit: int) -> None:
        top = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(top, BTRFS_IOC_SUBVOL_CREATE, _vol_args(name))
        finally:
            os.close(top)
        fd = os.open(self.root / name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            flags = BTRFS_QGROUP_LIMIT_MAX_RFER | BTRFS_QGROUP_LIMIT_MAX_EXCL
            fcntl.ioctl(fd, BTRFS_IOC_QGROUP_LIMIT, bytearray(struct.pack("6Q", 0, flags, limit, limit, 0, 0)))
        finally:
            os.close(fd)

    def _destroy_ioctl(self, name: str) -> None:
        top = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(top, BTRFS_IOC_SNAP_DESTROY, _vol_args(name))
        finally:
            os.close(top)

    def remove(self, name: str, timeout: float = 5.0) -> None:
        """Delete one sandbox's subvolume (blocking); retry while its dead mounts are torn down."""
        deadline = time.monotonic() + timeout
        while (self.root / name).exists():
            try:
                if self._ioctls:
                    self._destroy_ioctl(name)
                else:
                    _run("btrfs", "subvolume", "delete", str(self.root / name))
            except OSError as exc:
                if not kernel.is_busy(exc) or time.monotonic() > deadline:
                    raise UpperError(f"cannot delete writable layer {name}: {exc.strerror}") from exc
                time.sleep(0.005)

    def names(self) -> list[str]:
        """Subvolumes present in the pool (one per sandbox)."""
        if not mounted_at(self.root):
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and p.stat().st_ino == 256)


def loop_devices(image: Path) -> list[str]:
    """Loop devices whose backing file is image."""
    found = []
    for dev in Path("/sys/block").glob("loop*"):
        try:
            backing = (dev / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue
        if backing in (str(image), f"{image} (deleted)"):
            found.append(f"/dev/{dev.name}")
    return found

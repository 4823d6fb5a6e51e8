"""Mounts a node makes once and binds into every container sandbox: its /dev and its /sys.

Why shared: every superblock alive on the host costs each memory cgroup a slot in its shrinker map
(16 bytes per memcg per superblock, kmalloc'd in 64-slot units of 1 KiB), and the kernel sizes every
memcg's map by the most superblocks ever alive at once, for as long as it runs. With one memcg per sandbox,
n sandboxes of s superblocks each cost n * n * s * 16 bytes: the one cost here that grows with the count
(and the memcg mkdir of every create allocates n * s / 64 units). A sandbox of its own sysfs and /dev tmpfs
had s = 6 (overlay, proc, sysfs, tmpfs, devpts and the IPC namespace's mqueue); binding these two makes it 4.

- devices/: a small tmpfs (nosuid, noexec, not nodev) holding the character devices every sandbox gets
  and the /dev symlinks, made read-only once filled. A sandbox binds it read-only at /dev, mounts its own
  devpts at /dev/pts and binds a directory of its writable layer at /dev/shm (capped with the layer).
- sysfs/: sysfs mounted from a network namespace of its own with only `lo` (up), so a sandbox's
  /sys/class/net shows `lo` and nothing of the host; the rest of /sys is the host's either way (and its
  leaky parts are masked by the sandbox's own binds, zygote.MASKED_SYS_*). sysfs.net, a bind of that
  namespace's nsfs file, keeps it alive.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from edge.backends import kernel

DEVICES = (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9),
           ("tty", 5, 0))
DEV_LINKS = (("ptmx", "pts/ptmx"), ("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
             ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"))
DEV_DIRS = ("pts", "shm")   # mount points: the sandbox's devpts and its /dev/shm


def _mounted(path: Path) -> bool:
    return os.path.ismount(path)


def prepare_devices(path: Path) -> None:
    """path: the node's /dev for sandboxes (kept if already mounted by this run)."""
    path.mkdir(mode=0o755, exist_ok=True)
    if _mounted(path):
        return
    kernel.mount("tmpfs", path, "tmpfs", kernel.MS_NOSUID | kernel.MS_NOEXEC, "size=64k,mode=755")
    try:
        for name, major, minor in DEVICES:
            os.mknod(path / name, 0o666 | 0o020000, os.makedev(major, minor))
            os.chmod(path / name, 0o666)   # the umask took some
        for name, target in DEV_LINKS:
            os.symlink(target, path / name)
        for name in DEV_DIRS:
            (path / name).mkdir(mode=0o755)
        kernel.mount(None, path, None, kernel.MS_REMOUNT | kernel.MS_RDONLY | kernel.MS_NOSUID | kernel.MS_NOEXEC,
                     "size=64k,mode=755")
    except OSError:
        kernel.umount2(path, kernel.MNT_DETACH)
        raise


def prepare_sysfs(path: Path) -> None:
    """path: sysfs of a network namespace holding only `lo` (kept if already mounted by this run).

    A short child does it (unshare(CLONE_NEWNET) must not touch the edge's own namespace); the mount lands
    in the edge's mount namespace and keeps the network namespace alive until it is unmounted."""
    path.mkdir(mode=0o755, exist_ok=True)
    if _mounted(path):
        return
    proc = subprocess.run([sys.executable, "-m", "edge.backends.nodemounts", "sysfs", str(path)],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise OSError(f"sysfs for sandboxes at {path}: {proc.stderr.strip()[-300:] or proc.returncode}")


def _sysfs_child(path: str) -> None:
    kernel.unshare(kernel.CLONE_NEWNET)
    kernel.loopback_up()
    kernel.mount("sysfs", path, "sysfs", kernel.MS_RDONLY | kernel.MS_NOSUID | kernel.MS_NODEV | kernel.MS_NOEXEC)
    # sysfs holds only a passive reference: the namespace (and its lo) would go with this process. A bind
    # of its nsfs file keeps it (nsfs has one superblock for the whole host: none is added).
    keep = f"{path}.net"
    with open(keep, "w"):
        pass
    kernel.mount("/proc/self/ns/net", keep, None, kernel.MS_BIND)


if __name__ == "__main__":
    if sys.argv[1:2] == ["sysfs"] and len(sys.argv) == 3:
        _sysfs_child(sys.argv[2])
    else:
        sys.exit("usage: python -m edge.backends.nodemounts sysfs PATH")

"""ctypes wrappers for the Linux syscalls the container backend needs (Python 3.11 has no os.unshare/os.setns).

Every wrapper raises KernelError (an OSError carrying errno) whose message names the call and its
arguments, so a failure deep inside a launch reads as one clear line.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import resource
import socket
import stat
import struct

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

# x86_64 syscall numbers that glibc does not wrap (or wraps only in newer versions).
SYS_PIVOT_ROOT = 155
SYS_CAPSET = 126
SYS_OPENAT2 = 437
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_MOUNT_SETATTR = 442

OPEN_TREE_CLONE = 1
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY = 0x00000001
MOUNT_ATTR_NOSUID = 0x00000002
MOUNT_ATTR_IDMAP = 0x00100000

# Per-namespace limits of every sandbox's user namespace (/proc/sys/user/*; see nskeeper.sandbox_userns).
USERNS_PER_SANDBOX = 1024
USERNS_LIMITS = (("max_inotify_instances", "128"), ("max_inotify_watches", "65536"),
                 ("max_user_namespaces", str(USERNS_PER_SANDBOX)), ("max_fanotify_groups", "16"),
                 ("max_fanotify_marks", "8192"))

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2

PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

_LINUX_CAPABILITY_VERSION_3 = 0x20080522

# Docker's default capability set: enough for package managers and chown, nothing that mounts,
# loads modules, traces other processes or escapes the namespaces (no CAP_SYS_ADMIN).
DEFAULT_CAPS = {
    "CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_FSETID": 4, "CAP_KILL": 5,
    "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_NET_BIND_SERVICE": 10,
    "CAP_NET_RAW": 13, "CAP_SYS_CHROOT": 18, "CAP_MKNOD": 27, "CAP_AUDIT_WRITE": 29,
    "CAP_SETFCAP": 31,
}
CAP_SYS_ADMIN = 21


class KernelError(OSError):
    """A syscall failed; errno is kept and the message names the call. Also the errno's own OSError subclass
    (FileNotFoundError, PermissionError...), as os's calls raise them: `except FileNotFoundError` around a
    call here missed ENOENT while this was a plain OSError subclass (OCI import: a layer naming a file before
    its directory failed)."""


_KINDS: dict[type, type] = {OSError: KernelError}


def kernel_error(err: int, text: str) -> KernelError:
    """A KernelError that is also the errno's OSError subclass."""
    kind = type(OSError(err, ""))
    cls = _KINDS.get(kind)
    if cls is None:
        cls = _KINDS[kind] = type(f"Kernel{kind.__name__}", (KernelError, kind), {})
    return cls(err, text)


def _check(ret: int, what: str) -> int:
    """Raise KernelError for a -1 return, with the errno text."""
    if ret == -1:
        err = ctypes.get_errno()
        raise kernel_error(err, f"{what}: {os.strerror(err)}")
    return ret


def _b(s: str | os.PathLike | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def unshare(flags: int) -> None:
    """unshare(2): move this process into new namespaces."""
    _check(_libc.unshare(flags), f"unshare({flags:#x})")


def setns(fd: int, nstype: int = 0) -> None:
    """setns(2): join the namespace fd refers to."""
    _check(_libc.setns(fd, nstype), f"setns({nstype:#x})")


def mount(source: str | None, target: str | os.PathLike, fstype: str | None,
          flags: int = 0, data: str | None = None) -> None:
    """mount(2)."""
    _check(_libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)),
           f"mount({source}, {target}, {fstype})")


def umount2(target: str | os.PathLike, flags: int = 0) -> None:
    """umount2(2)."""
    _check(_libc.umount2(_b(target), flags), f"umount({target})")


def mount_points() -> list[str]:
    """Mount points of this mount namespace, in mount order (a mount's children after it)."""
    with open("/proc/self/mountinfo") as f:
        return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in f]


def own_mounts(keep: list[str]) -> None:
    """Give this process a mount namespace of its own (nothing propagates either way) holding only the
    mounts the paths keep lie on (and "/", and the mounts those lie under), every other mount of the
    host's detached: each topmost one with everything under it, one call each. A long-lived process with a
    copy of all of them (a VM's QEMU, the keeper's maker) kept each one's filesystem alive after the host
    unmounted it: another node's upper pool stayed mounted, its loop device attached to a deleted image,
    for as long as a VM started while that node ran (helper S)."""
    unshare(CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    points = mount_points()
    kept = {p for p in points for k in ("/", *keep) if k == p or k.startswith(p.rstrip("/") + "/")}
    gone: list[str] = []
    for point in points:   # (parents before their children)
        if point in kept or any(point.startswith(g.rstrip("/") + "/") for g in gone):
            continue
        with contextlib.suppress(OSError):
            umount2(point, MNT_DETACH)
        gone.append(point)


def pivot_root(new_root: str, put_old: str) -> None:
    """pivot_root(2)."""
    _check(_libc.syscall(SYS_PIVOT_ROOT, _b(new_root), _b(put_old)), f"pivot_root({new_root})")


def sethostname(name: str) -> None:
    """sethostname(2) in the current UTS namespace."""
    raw = name.encode()
    _check(_libc.sethostname(raw, len(raw)), f"sethostname({name})")


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> int:
    """prctl(2) with integer arguments."""
    return _check(_libc.prctl(option, arg2, arg3, 0, 0), f"prctl({option})")


def set_child_subreaper() -> None:
    """Become the reaper of orphaned descendants."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def last_cap() -> int:
    """Highest capability number this kernel knows."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        return int(f.read())


class Lockdown:
    """no_new_privs plus a capability set shrunk to `keep` (bounding, ambient, eff/perm/inh).

    Built once in the parent so a fork child only makes the syscalls: after fork every page Python
    touches is copied, and preparing this in the child cost ~1 ms.
    """

    def __init__(self, keep: set[int]) -> None:
        self.drops = [cap for cap in range(last_cap() + 1) if cap not in keep]
        mask = sum(1 << c for c in keep)
        lo, hi = mask & 0xFFFFFFFF, mask >> 32
        self.header = ctypes.create_string_buffer(struct.pack("Ii", _LINUX_CAPABILITY_VERSION_3, 0), 8)
        self.data = ctypes.create_string_buffer(struct.pack("6I", lo, lo, lo, hi, hi, hi), 24)

    def apply(self) -> None:
        """Lock down the calling thread; irreversible."""
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        for cap in self.drops:
            prctl(PR_CAPBSET_DROP, cap)
        prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
        _check(_libc.syscall(SYS_CAPSET, self.header, self.data), "capset")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def open_tree_clone(path: str) -> int:
    """A detached copy of the mount (or file) at path, as an fd (open_tree OPEN_TREE_CLONE)."""
    return _check(_libc.syscall(SYS_OPEN_TREE, -100, _b(path), OPEN_TREE_CLONE | os.O_CLOEXEC),
                  f"open_tree({path})")


def move_mount(fd: int, target: str) -> None:
    """Attach the detached mount fd at target (in the caller's mount namespace)."""
    _check(_libc.syscall(SYS_MOVE_MOUNT, fd, b"", -100, _b(target), MOVE_MOUNT_F_EMPTY_PATH),
           f"move_mount({target})")


def idmapped_clone(path: str, userns_fd: int, suid: bool = False, readonly: bool = False) -> int:
    """A detached copy of the mount at path whose file owners are seen through userns_fd's maps
    (on-disk id n shows as the host id that n maps to); returns its fd (open_tree + mount_setattr).
    suid: the copy honours setuid bits (the host's mount stays nosuid: the copy's owners are the
    sandbox's range, so a setuid-root file there is setuid to the sandbox's root only). readonly: the
    copy is read-only."""
    fd = open_tree_clone(path)
    attr = _MountAttr(MOUNT_ATTR_IDMAP | (0 if suid else MOUNT_ATTR_NOSUID) | (MOUNT_ATTR_RDONLY if readonly else 0),
                      MOUNT_ATTR_NOSUID if suid else 0, 0, userns_fd)
    try:
        _check(_libc.syscall(SYS_MOUNT_SETATTR, fd, b"", AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)),
               f"mount_setattr({path}, idmap)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def idmap_over(path: str, userns_fd: int, at: str | None = None, suid: bool = False, readonly: bool = False) -> None:
    """Mount an idmapped copy of path over `at` (default: over path itself, stacked)."""
    fd = idmapped_clone(path, userns_fd, suid, readonly)
    try:
        move_mount(fd, at or path)
    finally:
        os.close(fd)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """openat2(2): open path relative to dirfd with RESOLVE_* rules; returns the fd."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    return _check(_libc.syscall(SYS_OPENAT2, dirfd, _b(path), ctypes.byref(how), ctypes.sizeof(how)),
                  f"open({path})")


def open_in_root(root_fd: int, path: str, flags: int, mode: int = 0) -> int:
    """Open path as if root_fd were '/', never leaving that filesystem.

    '..' and symlinks (absolute ones too) resolve inside the root; magic links (/proc/*/root...)
    and crossing into another mount (/proc, /sys, /dev of a sandbox) fail. O_NONBLOCK keeps a
    planted FIFO from hanging the caller.
    """
    resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
    return openat2(root_fd, path, flags | os.O_NONBLOCK | os.O_NOCTTY, mode, resolve)


def _regular(fd: int, path: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise KernelError(errno.EBADFD, f"not a regular file: {path}")
    os.set_blocking(fd, True)
    return st


def write_in_root(root_fd: int, path: str, data: bytes, mode: int, owner: int | None = None) -> None:
    """Create or truncate a regular file under root_fd (see open_in_root) with exactly mode; a file this
    call created (owned by us, host root) is given to host uid/gid owner."""
    fd = open_in_root(root_fd, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)   # (a FIFO or device: no
    try:                                                                              # truncation, refused below)
        st = _regular(fd, path)
        if owner is not None and st.st_uid == os.geteuid():
            os.fchown(fd, owner, owner)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, mode)     # O_CREAT's mode went through the umask
    finally:
        os.close(fd)


def read_in_root(root_fd: int, path: str, limit: int) -> bytes:
    """Read a regular file under root_fd (see open_in_root); EFBIG if it holds more than limit bytes."""
    fd = open_in_root(root_fd, path, os.O_RDONLY)
    try:
        if _regular(fd, path).st_size > limit:
            raise KernelError(errno.EFBIG, str(limit))
        chunks, size = [], 0
        while chunk := os.read(fd, min(1 << 16, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:        # grew, or a /proc-like file with no size
                raise KernelError(errno.EFBIG, str(limit))
        return b"".join(chunks)
    finally:
        os.close(fd)


def loopback_up() -> None:
    """Bring `lo` of the current network namespace up (SIOCSIFFLAGS on a throwaway socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def close_fds_except(keep: set[int]) -> None:
    """Close every fd >= 0 not in keep (close_range under the hood)."""
    lo = 0
    for fd in sorted(keep):
        if fd > lo:
            os.closerange(lo, fd)
        lo = fd + 1
    os.closerange(lo, os.sysconf("SC_OPEN_MAX"))


def is_busy(exc: OSError) -> bool:
    """True for the errors a retry may clear (mount or subvolume still in use)."""
    return exc.errno in (errno.EBUSY, errno.EAGAIN)


def enter_class(cpu_class: str) -> None:
    """In a sandbox's first host process (a forked child, before exec): its CPU class, which every process
    it makes inherits and none may leave (cgroups.BATCH_SHARES). Here, not in cgroups.py: the zygote imports
    this module, and cgroups.py brings asyncio, subprocess and threading, which made every fork of the
    zygote ~0.6 ms slower (its docstring)."""
    resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
    if cpu_class == "batch":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


@contextlib.contextmanager
def on_this_cpu():
    """Bind the calling thread to the CPU it runs on while a process is spawned under it, so the child starts
    here: posix_spawn's parent sleeps until the child execs, so this CPU is free for it at once. Left free,
    the kernel often put the child on the other CPU, busy with a sandbox's work (SCHED_IDLE work counts as
    idle there), where it waited its turn, up to a tick (~4 ms here), while this CPU idled: the exec round
    trip beside one busy sandbox went +47% (bench.cpuclass, classes off; +20-30% with this). The child
    inherits the binding; dsec-enter drops it (dsec-enter.c, pin_here). A failure to bind only costs the
    hint."""
    try:
        free = os.sched_getaffinity(0)
        cpu = _libc.sched_getcpu()
        if cpu >= 0:
            os.sched_setaffinity(0, {cpu})
    except OSError:
        cpu = -1
    if cpu < 0:
        yield
        return
    try:
        yield
    finally:
        try:
            os.sched_setaffinity(0, free)
        except OSError:   # (a CPU of it went offline meanwhile)
            os.sched_setaffinity(0, range(os.cpu_count() or 1))

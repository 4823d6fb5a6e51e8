"""The launcher ("zygote"): one single-threaded helper process that forks every sandbox init. Commands
are started by the dsec-enter helper, straight from the edge (see enter.py and dsec-enter.c).

Why: the edge is a multithreaded asyncio process; running Python in a forked child of it is unsafe
(locks held by other threads at fork time). The zygote has one thread, so its fork children may
run Python freely until they exec. It talks to the edge over a SOCK_SEQPACKET socketpair: one
msgspec-encoded message per packet, fds passed with SCM_RIGHTS.

PID namespaces: unshare(CLONE_NEWPID) changes only pid_for_children, so the zygote unshares, forks
(the child is PID 1 of a new namespace and a direct child of the zygote) and setns()es back to its
own namespace (verified to work here; no double fork needed).

Identity: before that fork the zygote makes the sandbox's user namespace S, owned by the sandbox's
host uid range (idmap.py) and mapping its 0..65535 onto that range, with per-namespace limits on
inotify, fanotify and user namespaces that the sandbox cannot raise. S is kept per range and used
again by the range's next sandbox (a range is reused only once nothing of the last one is left;
commands live in namespaces of their own nested in S, so nothing of a tenant stays in S itself). The init builds the root as host
root (the mount namespace stays the host user namespace's: the sandbox cannot unmount what masks
/proc), with every image layer mounted idmapped through S (files show the image's owners inside;
the layers stay shared and read-only), then joins S as its root and becomes catatonit.

The zygote process imports only what it runs (no asyncio, subprocess, pathlib): fork time and the
pages each child copies grow with its memory. The edge side (Launcher) lives in launcher.py.
"""
from __future__ import annotations

import gc
import os
import select
import signal
import socket
import sys
from typing import NoReturn

import msgspec

from edge.backends import hostsfile, kernel, nskeeper
from edge.backends.kernel import enter_class

MAX_MESSAGE = 200_000       # below the default socket buffer, so one packet always fits
DEVPTS_MAX = 256            # terminals a sandbox holds at once (its devpts's max=; the host's: hosttables.HOST_TABLES)
KEEP_CAPS = set(kernel.DEFAULT_CAPS.values())
KEEP_MASK = sum(1 << c for c in KEEP_CAPS)
MASKED_PROC = ("kcore", "keys", "key-users", "latency_stats", "timer_list", "sched_debug", "sysrq-trigger",
               "kpageflags", "kpagecount", "kpagecgroup", "slabinfo", "vmallocinfo", "program_cpu", "cmdline",
               "partitions")
# What /sys would tell of the host: its block devices (every loop backing file), every sandbox's live disk
# use (btrfs qgroups), the kernel's memory layout. Empty read-only directories (or /dev/null) instead.
TRUSTED_EMPTY = "empty"   # an empty dir in the trusted tmpfs: the source of masked dirs
MASKED_SYS_DIRS = ("block", "class/block", "dev/block", "devices/virtual/block", "fs/btrfs")
MASKED_SYS_FILES = ("kernel/vmcoreinfo",)
# Files lxcfs computes for the reading sandbox (its memory, cpu quota, uptime): bound over /proc's.
PROC_VIEWS = ("meminfo", "cpuinfo", "stat", "uptime", "diskstats", "swaps")
READONLY_PROC = ("sys", "irq", "bus", "fs")



class Launch(msgspec.Struct, tag="launch", tag_field="kind", frozen=True):
    """Start a sandbox init. fds: [ready pipe write end] (+ [network namespace] with netns)."""

    hostname: str
    cgroups: list[str]          # group directories to join, one per controller
    lowers: list[str]           # overlay lowerdirs, TOP layer first
    upper: str
    work: str
    merged: str
    rid: int = 0
    trusted: str = ""           # host dir holding the trusted shell, bind-mounted read-only at /.dsec
    uid_base: int = 0           # first host uid (and gid) of the sandbox's range: its root
    empty: str = ""             # the lowerdir of a sandbox without layers (a plain dir: not idmapped)
    base: str = "/"             # the node's state dir: overlay paths are given relative to it
    views: str = ""             # lxcfs's /proc dir: its files are bound over the sandbox's (procviews.py)
    devices: str = ""           # the node's read-only /dev tmpfs and its sysfs of a bare network namespace,
    sysfs: str = ""             # bound at /dev and /sys (nodemounts.py)
    shm: str = ""               # a directory of its writable layer, made and bound at /dev/shm
    scratch: int = 0            # > 0: a read-only root with a tmpfs of this many bytes at /tmp (fncall workers)
    netns: bool = False         # join the network namespace of the 2nd fd (Aether's, made by the host)
                                # instead of a new one with only lo
    etc: dict[str, str] = {}    # files written in its /etc (a sandbox with a network: resolv.conf, pip.conf)
    idle: bool = False          # its CPU class is batch: its init (and so what it reaps) at SCHED_IDLE


class Refresh(msgspec.Struct, tag="refresh", tag_field="kind", frozen=True):
    """Put fresh /proc views (lxcfs restarted) into a running sandbox; the child exits 0 when done."""

    init: int
    views: str
    rid: int = 0


class Hello(msgspec.Struct, tag="hello", tag_field="kind", frozen=True):
    """The zygote is ready."""

    pid: int


class Spawned(msgspec.Struct, tag="spawned", tag_field="kind", frozen=True):
    """A request forked a child with this host pid."""

    rid: int
    pid: int


class Refused(msgspec.Struct, tag="refused", tag_field="kind", frozen=True):
    """A request could not be forked."""

    rid: int
    error: str


class Exited(msgspec.Struct, tag="exited", tag_field="kind", frozen=True):
    """A child of the zygote was reaped; status is the raw waitpid status."""

    pid: int
    status: int


Request = Launch | Refresh
Reply = Hello | Spawned | Refused | Exited


class LauncherError(Exception):
    """The zygote refused a request, or is not running; the message is one line."""


# ---------------------------------------------------------------- zygote process side


class Zygote:
    """The serving loop of the launcher process."""

    def __init__(self, sock: socket.socket, init_binary: str) -> None:
        self.sock = sock
        self.init_fd = os.open(init_binary, os.O_PATH | os.O_CLOEXEC)
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.inits: set[int] = set()
        self.userns = nskeeper.Keeper()   # uid range base -> its user namespace (kept: made once per range)
        self.lockdown = kernel.Lockdown(KEEP_CAPS)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(Request)

    def serve(self) -> None:
        """Handle requests and reap children until the edge closes the socket."""
        kernel.set_child_subreaper()
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_w)
        gc.freeze()     # fork children then copy fewer pages: the collector leaves old objects alone
        self.userns.start()
        self._send(Hello(os.getpid()))
        while True:
            ready, _, _ = select.select([self.sock, wake_r], [], [])
            if wake_r in ready:
                _drain(wake_r)
                self._reap()
            if self.sock in ready and not self._serve_one():
                return

    def _send(self, msg: Reply) -> None:
        self.sock.send(self.encoder.encode(msg))

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.userns.pid:
                raise SystemExit(f"zygote: the user namespace keeper exited (status {status})")
            self.inits.discard(pid)
            self._send(Exited(pid, status))

    def _serve_one(self) -> bool:
        data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 8)
        if not data:
            return False
        rid = 0
        try:
            req = self.decoder.decode(data)
            rid = req.rid
            pid = self._launch(req, fds) if isinstance(req, Launch) else self._refresh(req)
            self._send(Spawned(rid, pid))
        except (OSError, msgspec.DecodeError, ValueError) as exc:
            self._send(Refused(rid, str(exc)))
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def _launch(self, req: Launch, fds: list[int]) -> int:
        if len(fds) != 1 + req.netns:
            raise ValueError("launch needs the ready pipe's fd (and, with netns, the namespace's)")
        if req.uid_base <= 0:
            raise ValueError("launch needs the sandbox's uid range")
        userns = self.userns.get(req.uid_base)
        kernel.unshare(kernel.CLONE_NEWPID)
        try:
            pid = os.fork()
            if pid == 0:
                _launch_child(req, fds, self.init_fd, self.lockdown, userns)
        finally:
            kernel.setns(self.own_pidns, kernel.CLONE_NEWPID)
            os.close(userns)
        self.inits.add(pid)
        return pid

    def _refresh(self, req: Refresh) -> int:
        if req.init not in self.inits:
            raise ValueError("sandbox is not running")
        clones: list[int] = []          # procviews checked that lxcfs serves every one of PROC_VIEWS
        mntns = -1
        try:
            for name in PROC_VIEWS:
                clones.append(kernel.open_tree_clone(f"{req.views}/{name}"))
            mntns = os.open(f"/proc/{req.init}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    kernel.setns(mntns, kernel.CLONE_NEWNS)
                    for name, fd in zip(PROC_VIEWS, clones):
                        try:
                            kernel.umount2(f"/proc/{name}", kernel.MNT_DETACH)   # the dead lxcfs's
                        except OSError:
                            pass
                        kernel.move_mount(fd, f"/proc/{name}")
                    code = 0
                finally:
                    os._exit(code)
            return pid
        finally:
            for fd in [mntns, *clones]:
                if fd >= 0:
                    os.close(fd)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _join(groups: list[str]) -> None:
    """Move the calling process into each cgroup ("0" = the writer, whatever its pid namespace).

    Writes the v1 `tasks` file, not cgroup.procs: moving only the current thread skips the global
    threadgroup rwsem, whose RCU grace period costs ~15 ms per launch here. The caller is a
    single-threaded fork child, so its thread is the whole process.
    """
    for group in groups:
        fd = os.open(f"{group}/tasks", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


def _launch_child(req: Launch, fds: list[int], init_fd: int, lockdown: kernel.Lockdown, userns: int) -> NoReturn:
    """PID 1 of a new sandbox: build its root, join its user namespace, lock down, become catatonit."""
    ready = fds[0]
    try:
        gc.disable()
        os.setsid()        # own session, no controlling tty: kill(0) and /dev/tty never reach the edge's
        os.set_inheritable(ready, False)        # EOF on the ready pipe = catatonit is running
        _join(req.cgroups)
        kernel.unshare(kernel.CLONE_NEWNS | (0 if req.netns else kernel.CLONE_NEWNET) | kernel.CLONE_NEWUTS
                       | kernel.CLONE_NEWIPC | kernel.CLONE_NEWCGROUP)   # after joining: its cgroups read as "/"
        if req.netns:                            # Aether's: owned by the host's user namespace, so the
            kernel.setns(fds[1], kernel.CLONE_NEWNET)   # sandbox's root has no CAP_NET_ADMIN over it; its
            os.close(fds[1])                            # sysctls set when it was made (aether/links.py)
        kernel.mount(None, "/", None, kernel.MS_REC | kernel.MS_PRIVATE)
        _mount_root(req, userns)
        os.chdir(req.merged)
        kernel.pivot_root(".", ".")              # old root ends up stacked on /; detach it
        kernel.umount2(".", kernel.MNT_DETACH)
        os.chdir("/")
        for name, text in req.etc.items():       # inside the new root: an image's symlink resolves in it
            _write_etc(name, text, req.uid_base)
        hostsfile.name_host("/", req.hostname, req.uid_base)
        kernel.sethostname(req.hostname)
        if not req.netns:                        # Aether's has lo up (an ioctl here would wait for the
            kernel.loopback_up()                 # rtnl lock, which every namespace's teardown holds)
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        kernel.close_fds_except({0, 1, 2, ready, init_fd, userns})
        enter_class("batch" if req.idle else "latency")
        kernel.setns(userns, kernel.CLONE_NEWUSER)   # last: host root is needed for everything above
        os.close(userns)
        os.setgroups([])
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        lockdown.apply()
        os.execve(init_fd, ["catatonit", "-P"], {})
    except BaseException as exc:
        os.write(ready, str(exc).encode()[:2000] or type(exc).__name__.encode())
    finally:
        os._exit(1)


# Commands run in user namespaces of their own (see dsec-enter.c), where CAP_NET_BIND_SERVICE and
# CAP_NET_RAW do not count for the sandbox's network namespace; as Docker does, low ports and ICMP
# echo sockets are opened to every uid in it instead.
NET_SYSCTLS = (("net/ipv4/ip_unprivileged_port_start", "0"), ("net/ipv4/ping_group_range", "0 2147483647"))


def _open_net_privileges(proc: str) -> None:
    """Let every uid of the (new) network namespace bind ports below 1024 and ping. Written through the
    sandbox's own proc mount: through the host's, every namespace's /proc/sys/net dentries pile up under one
    parent, and each lookup there compares them all (proc_sys_compare: O(sandboxes) per create)."""
    for name, value in NET_SYSCTLS:
        with open(f"{proc}/sys/{name}", "w") as f:
            f.write(value)


def _write_etc(name: str, text: str, owner: int) -> None:
    """/etc/<name> of the sandbox, e.g. resolv.conf (its upper layer: the sandbox's root may change it, which
    gains it nothing, as its every DNS query goes to Aether's resolver whatever server it names). A name in a
    subdirectory (apt/apt.conf.d/...) is written only where the image has that directory (apt's config in an
    image with apt)."""
    parts = name.split("/")
    if not name or any(not part or part.startswith(".") for part in parts):
        raise ValueError(f"not a file name under /etc: {name!r}")
    path = f"/etc/{name}"
    if len(parts) > 1 and not os.path.isdir(os.path.dirname(path)):
        return
    if os.path.islink(path):
        os.unlink(path)
    os.makedirs("/etc", 0o755, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o644)
    os.chown(path, owner, owner)   # the sandbox's root's, like the rest of its root


def _mount_root(req: Launch, userns: int) -> None:
    """Overlay root over idmapped layers, then its /proc, /dev and /sys, all mounted before pivot_root."""
    root = req.merged
    for lower in req.lowers:        # in this (private) mount namespace only: the host sees none of it
        if lower != req.empty:
            kernel.idmap_over(lower, userns, suid=True)   # the image's setuid programs work inside
    os.chown(req.upper, req.uid_base, req.uid_base)   # the root directory: the sandbox root's
    # Paths relative to the node's state dir: the overlay's options, shown in the sandbox's mountinfo,
    # then name no host directory.
    os.chdir(req.base)
    rel = [os.path.relpath(p, req.base) for p in (*req.lowers, req.upper, req.work)]
    opts = f"lowerdir={':'.join(rel[:-2])},upperdir={rel[-2]},workdir={rel[-1]},volatile"
    kernel.mount("overlay", root, "overlay", kernel.MS_NODEV, opts)
    for name, mode in (("proc", 0o555), ("dev", 0o755), ("sys", 0o555), ("tmp", 0o1777)):
        if not os.path.isdir(f"{root}/{name}"):
            os.mkdir(f"{root}/{name}")
            os.chmod(f"{root}/{name}", mode)
    nosuid = kernel.MS_NOSUID | kernel.MS_NODEV | kernel.MS_NOEXEC
    kernel.mount("proc", f"{root}/proc", "proc", nosuid)
    if not req.netns:                # (Aether's namespace had its sysctls set when it was made)
        _open_net_privileges(f"{root}/proc")
    for name in READONLY_PROC:
        _bind(f"{root}/proc/{name}", f"{root}/proc/{name}", readonly=True)
    for name in MASKED_PROC:
        _bind("/dev/null", f"{root}/proc/{name}", readonly=False)
    _bind(req.sysfs, f"{root}/sys", readonly=True)
    # Masked dirs: read-only binds of the trusted tmpfs's empty dir (shared by the node's sandboxes).
    # Every superblock a sandbox adds costs each memory cgroup on the host a slot in its shrinker map,
    # for as long as the host runs (nodemounts.py).
    empty_dir = f"{req.trusted}/{TRUSTED_EMPTY}"
    for name in MASKED_SYS_DIRS:
        if os.path.isdir(f"{root}/sys/{name}"):
            _bind(empty_dir, f"{root}/sys/{name}", readonly=True)
    for name in MASKED_SYS_FILES:
        _bind("/dev/null", f"{root}/sys/{name}", readonly=False)
    if req.views:                   # every one is there (procviews checked when lxcfs started)
        for name in PROC_VIEWS:
            _bind(f"{req.views}/{name}", f"{root}/proc/{name}", readonly=False)
    _mount_dev(req, f"{root}/dev")
    _mount_trusted(req.trusted, f"{root}/.dsec")
    if req.scratch:   # the image's files stay as they are; what a command writes goes to /tmp (or /dev/shm)
        kernel.mount("tmpfs", f"{root}/tmp", "tmpfs", kernel.MS_NOSUID | kernel.MS_NODEV,
                     f"size={req.scratch},mode=1777,uid={req.uid_base},gid={req.uid_base}")
        kernel.mount(None, root, None, kernel.MS_BIND | kernel.MS_REMOUNT | kernel.MS_RDONLY | kernel.MS_NODEV)


def _mount_trusted(src: str, target: str) -> None:
    """The trusted shell's directory, read-only (executable) over a mount point the sandbox can't move."""
    if os.path.islink(target) or (os.path.lexists(target) and not os.path.isdir(target)):
        os.unlink(target)   # an image that put something else there loses it
    if not os.path.isdir(target):
        os.mkdir(target, 0o555)
    kernel.mount(src, target, None, kernel.MS_BIND)
    kernel.mount(None, target, None, kernel.MS_BIND | kernel.MS_REMOUNT | kernel.MS_RDONLY
                 | kernel.MS_NOSUID | kernel.MS_NODEV)


def _bind(src: str, target: str, readonly: bool) -> None:
    """Bind src over target (skipped when target is absent on this kernel)."""
    if not os.path.lexists(target):
        return
    kernel.mount(src, target, None, kernel.MS_BIND | kernel.MS_REC)
    if readonly:
        kernel.mount(None, target, None, kernel.MS_BIND | kernel.MS_REMOUNT | kernel.MS_RDONLY
                     | kernel.MS_NOSUID | kernel.MS_NODEV | kernel.MS_NOEXEC)


def _mount_dev(req: Launch, dev: str) -> None:
    """/dev: the node's device tmpfs, read-only (the same nodes for every sandbox), with a devpts of the
    sandbox's own at /dev/pts and a directory of its writable layer (its root's) at /dev/shm."""
    kernel.mount(req.devices, dev, None, kernel.MS_BIND)
    kernel.mount(None, dev, None, kernel.MS_BIND | kernel.MS_REMOUNT | kernel.MS_RDONLY | kernel.MS_NOSUID
                 | kernel.MS_NOEXEC)
    kernel.mount("devpts", f"{dev}/pts", "devpts", kernel.MS_NOSUID | kernel.MS_NOEXEC,   # tty: gid 5 inside
                 f"newinstance,ptmxmode=0666,mode=0620,gid={req.uid_base + 5},max={DEVPTS_MAX}")
    if not os.path.isdir(req.shm):   # (a restored writable layer may have it already)
        os.mkdir(req.shm)
    os.chmod(req.shm, 0o1777)
    os.chown(req.shm, req.uid_base, req.uid_base)
    kernel.mount(req.shm, f"{dev}/shm", None, kernel.MS_BIND)
    kernel.mount(None, f"{dev}/shm", None, kernel.MS_BIND | kernel.MS_REMOUNT | kernel.MS_NOSUID | kernel.MS_NODEV
                 | kernel.MS_NOEXEC)


def main(argv: list[str]) -> None:
    """Entry point: `python -m edge.backends.zygote <socket fd> <init binary> [label]`."""
    # Children inherit these and exec without resetting them (cheaper than a reset per fork):
    # ignored signals would stay ignored in every command, so Python's SIG_IGN for SIGPIPE and
    # SIGXFSZ goes. The zygote runs in its own session, so no terminal ^C reaches it. SIGCHLD's
    # handler is reset by execve itself.
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    os.umask(0o022)
    sock = socket.socket(fileno=int(argv[0]))
    sock.setblocking(True)
    Zygote(sock, argv[1]).serve()


if __name__ == "__main__":
    main(sys.argv[1:])

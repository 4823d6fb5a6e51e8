"""The launcher ("zygote"): one single-threaded helper process that forks every sandbox init (and
every exec when the dsec-enter helper is not built; see enter.py for the usual exec path).

Why: the edge is a multithreaded asyncio process; running Python in a forked child of it is unsafe
(locks held by other threads at fork time). The zygote has one thread, so its fork children may
run Python freely until they exec. It talks to the edge over a SOCK_SEQPACKET socketpair: one
msgspec-encoded message per packet, stdio pipe fds passed with SCM_RIGHTS.

PID namespaces: unshare(CLONE_NEWPID) changes only pid_for_children, so the zygote unshares, forks
(the child is PID 1 of a new namespace and a direct child of the zygote) and setns()es back to its
own namespace (verified to work here; no double fork needed). Execs do the same with setns into
the sandbox's namespace, so every command lives inside the sandbox's PID namespace while the
zygote remains its parent and reports its wait status.

The zygote process imports only what it runs (no asyncio, subprocess, pathlib): fork time and the
pages each child copies grow with its memory. The edge side (Launcher) lives in launcher.py.
"""
from __future__ import annotations

import gc
import os
import resource
import select
import signal
import socket
import sys
from typing import NoReturn

import msgspec

from edge.backends import kernel

MAX_MESSAGE = 200_000       # below the default socket buffer, so one packet always fits
KEEP_CAPS = set(kernel.DEFAULT_CAPS.values())
KEEP_MASK = sum(1 << c for c in KEEP_CAPS)
MASKED_PROC = ("kcore", "keys", "latency_stats", "timer_list", "sched_debug", "sysrq-trigger")
READONLY_PROC = ("sys", "irq", "bus", "fs")
DEVICES = (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9),
           ("tty", 5, 0))
DEV_LINKS = (("ptmx", "pts/ptmx"), ("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
             ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"))


class Launch(msgspec.Struct, tag="launch", tag_field="kind", frozen=True):
    """Start a sandbox init. fds: [ready pipe write end]."""

    hostname: str
    cgroups: list[str]          # group directories to join, one per controller
    lowers: list[str]           # overlay lowerdirs, TOP layer first
    upper: str
    work: str
    merged: str
    rid: int = 0
    trusted: str = ""           # host dir holding the trusted shell, bind-mounted read-only at /.dsec


class Exec(msgspec.Struct, tag="exec", tag_field="kind", frozen=True):
    """Start a command in a sandbox. fds: [stdin read, stdout write, stderr write, error pipe write]."""

    init: int                   # host pid of the sandbox init (a child of the zygote)
    cgroups: list[str]
    argv: list[str]
    env: dict[str, str]
    cwd: str
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


Request = Launch | Exec
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
            pid = self._launch(req, fds) if isinstance(req, Launch) else self._exec(req, fds)
            self._send(Spawned(rid, pid))
        except (OSError, msgspec.DecodeError, ValueError) as exc:
            self._send(Refused(rid, str(exc)))
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def _launch(self, req: Launch, fds: list[int]) -> int:
        if len(fds) != 1:
            raise ValueError("launch needs exactly one fd (the ready pipe)")
        kernel.unshare(kernel.CLONE_NEWPID)
        try:
            pid = os.fork()
            if pid == 0:
                _launch_child(req, fds[0], self.init_fd, self.lockdown)
        finally:
            kernel.setns(self.own_pidns, kernel.CLONE_NEWPID)
        self.inits.add(pid)
        return pid

    def _exec(self, req: Exec, fds: list[int]) -> int:
        if req.init not in self.inits or len(fds) != 4:
            raise ValueError("sandbox is not running")
        opened: list[int] = []
        try:
            for ns in ("pid", "ipc", "uts", "net", "mnt"):
                opened.append(os.open(f"/proc/{req.init}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC))
            opened.append(os.open(f"/proc/{req.init}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
            kernel.setns(opened[0], kernel.CLONE_NEWPID)
            try:
                pid = os.fork()
                if pid == 0:
                    _exec_child(req, fds, opened[1:5], opened[5], self.lockdown)
            finally:
                kernel.setns(self.own_pidns, kernel.CLONE_NEWPID)
            return pid
        finally:
            for fd in opened:
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


def _launch_child(req: Launch, ready: int, init_fd: int, lockdown: kernel.Lockdown) -> NoReturn:
    """PID 1 of a new sandbox: build its root, lock it down, become catatonit. Never returns."""
    try:
        gc.disable()
        os.setsid()        # own session, no controlling tty: kill(0) and /dev/tty never reach the edge's
        os.set_inheritable(ready, False)        # EOF on the ready pipe = catatonit is running
        _join(req.cgroups)
        kernel.unshare(kernel.CLONE_NEWNS | kernel.CLONE_NEWNET | kernel.CLONE_NEWUTS | kernel.CLONE_NEWIPC)
        _open_net_privileges()                   # the host's /proc/sys/net: now the new namespace's
        kernel.mount(None, "/", None, kernel.MS_REC | kernel.MS_PRIVATE)
        _mount_root(req)
        os.chdir(req.merged)
        kernel.pivot_root(".", ".")              # old root ends up stacked on /; detach it
        kernel.umount2(".", kernel.MNT_DETACH)
        os.chdir("/")
        kernel.sethostname(req.hostname)
        kernel.loopback_up()
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        kernel.close_fds_except({0, 1, 2, ready, init_fd})
        lockdown.apply()
        os.execve(init_fd, ["catatonit", "-P"], {})
    except BaseException as exc:
        os.write(ready, str(exc).encode()[:2000] or type(exc).__name__.encode())
    finally:
        os._exit(1)


# Commands run in user namespaces of their own (see _own_userns), where CAP_NET_BIND_SERVICE and
# CAP_NET_RAW do not count for the sandbox's network namespace; as Docker does, low ports and ICMP
# echo sockets are opened to every uid in it instead.
NET_SYSCTLS = (("net/ipv4/ip_unprivileged_port_start", "0"), ("net/ipv4/ping_group_range", "0 2147483647"))


def _open_net_privileges() -> None:
    """Let every uid of the (new) network namespace bind ports below 1024 and ping."""
    for name, value in NET_SYSCTLS:
        with open(f"/proc/sys/{name}", "w") as f:
            f.write(value)


def _mount_root(req: Launch) -> None:
    """Overlay root, then its /proc, /dev and /sys, all mounted before pivot_root."""
    root = req.merged
    opts = f"lowerdir={':'.join(req.lowers)},upperdir={req.upper},workdir={req.work},volatile"
    kernel.mount("overlay", root, "overlay", kernel.MS_NODEV, opts)
    for name, mode in (("proc", 0o555), ("dev", 0o755), ("sys", 0o555), ("tmp", 0o1777)):
        if not os.path.isdir(f"{root}/{name}"):
            os.mkdir(f"{root}/{name}")
            os.chmod(f"{root}/{name}", mode)
    nosuid = kernel.MS_NOSUID | kernel.MS_NODEV | kernel.MS_NOEXEC
    kernel.mount("proc", f"{root}/proc", "proc", nosuid)
    for name in READONLY_PROC:
        _bind(f"{root}/proc/{name}", f"{root}/proc/{name}", readonly=True)
    for name in MASKED_PROC:
        _bind("/dev/null", f"{root}/proc/{name}", readonly=False)
    kernel.mount("sysfs", f"{root}/sys", "sysfs", nosuid | kernel.MS_RDONLY)
    _mount_dev(f"{root}/dev")
    if req.trusted:
        _mount_trusted(req.trusted, f"{root}/.dsec")


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


def _mount_dev(dev: str) -> None:
    """A minimal /dev on tmpfs: a few char devices, a private devpts, /dev/shm."""
    kernel.mount("tmpfs", dev, "tmpfs", kernel.MS_NOSUID | kernel.MS_NOEXEC, "mode=755,size=64k")
    for name, major, minor in DEVICES:
        os.mknod(f"{dev}/{name}", 0o666 | 0o020000, os.makedev(major, minor))
        os.chmod(f"{dev}/{name}", 0o666)
    for name, target in DEV_LINKS:
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/pts")
    kernel.mount("devpts", f"{dev}/pts", "devpts", kernel.MS_NOSUID | kernel.MS_NOEXEC,
                 "newinstance,ptmxmode=0666,mode=0620")
    os.mkdir(f"{dev}/shm")
    kernel.mount("tmpfs", f"{dev}/shm", "tmpfs", kernel.MS_NOSUID | kernel.MS_NODEV | kernel.MS_NOEXEC,
                 "mode=1777,size=64m")


def _exec_child(req: Exec, fds: list[int], nsfds: list[int], root_fd: int,
                lockdown: kernel.Lockdown) -> NoReturn:
    """A command entering a sandbox: cgroup, namespaces, root, caps, stdio, execvpe. Never returns."""
    err = fds[3]
    stage = "setup"
    try:
        gc.disable()
        os.setsid()        # own session, no controlling tty: kill(0) and /dev/tty never reach the edge's
        _join(req.cgroups)
        for fd in nsfds:
            kernel.setns(fd, 0)
        _own_userns()
        os.fchdir(root_fd)
        os.chroot(".")
        stage = "cwd"
        os.chdir(req.cwd)
        stage = "setup"
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # as dsec-enter's clean_slate (see there)
        lockdown.apply()
        kernel.deny_user_namespaces()
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        if err != 3:                            # fds arrive at >= 3, after 0-2 are taken
            os.dup2(err, 3, inheritable=False)
            err = 3
        os.set_inheritable(err, False)          # EOF on the error pipe = execve succeeded
        kernel.close_fds_except({0, 1, 2, 3})
        stage = "exec"
        os.execvpe(req.argv[0], req.argv, req.env)
    except BaseException as exc:
        code = getattr(exc, "errno", None) or 0
        os.write(err, f"{stage}\0{code}\0{exc}".encode()[:2000])
    finally:
        os._exit(127)


def _own_userns() -> None:
    """Move into a user namespace of this exec's own, identity-mapped (as dsec-enter does; see there).

    The maps can only be written from the parent namespace, so a child forked before the unshare
    writes them (through the sandbox's /proc: both already live in its mount and pid namespaces)."""
    r, w = os.pipe2(os.O_CLOEXEC)
    helper = os.fork()
    if helper == 0:
        code = 1
        try:
            os.close(w)
            if os.read(r, 1):
                parent = os.getppid()
                for name in ("uid_map", "gid_map"):
                    with open(f"/proc/{parent}/{name}", "w") as f:
                        f.write("0 0 4294967295")
                code = 0
        finally:
            os._exit(code)
    os.close(r)
    try:
        kernel.unshare(kernel.CLONE_NEWUSER)
        os.write(w, b"u")
    finally:
        os.close(w)
        _, status = os.waitpid(helper, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise PermissionError(1, "user namespace map not written")


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

"""The user namespaces of sandboxes: how one is made per uid range (sandbox_userns), and the keeper that
holds them, one fd per range, in a process that never forks.

The zygote forks for every sandbox, and fork copies its whole fd table (dup_fd) which the child then closes
(close_range): with a namespace fd per range kept in the zygote, each launch cost O(ranges) in the kernel
(~0.1 ms per 1,000 fds here). The keeper, forked from the zygote before any namespace exists, holds them
instead and lends one per launch over a socketpair (SCM_RIGHTS): the zygote's table stays a few fds long.

A namespace is made by a stub process that exits once it is open. Its parent is the maker, the keeper's
child forked before the keeper holds anything, never the zygote: every SIGCHLD the zygote gets makes it
wait for any child (waitpid(-1)), which walks all its children, the inits of every sandbox held.
"""
from __future__ import annotations

import errno
import os
import signal
import socket
import struct

from edge.backends import kernel

_REQ = struct.Struct("!q")   # uid range base
_MAX_ERROR = 600
PROC_FRESH_EVERY = 64   # user namespaces made through one proc mount of the maker's (see _make)


class Keeper:
    """Zygote side; start() forks the keeper process (which forks the maker)."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.pid = 0

    def start(self) -> None:
        self.sock, self.pid = _fork_server(_keep)

    def get(self, base: int) -> int:
        """A new fd of range base's user namespace (the caller closes it), made if none is kept yet.
        OSError says why it could not be made (USERNS_EXHAUSTED in its text when the host has no more)."""
        assert self.sock is not None
        self.sock.send(_REQ.pack(base))
        data, fds, _, _ = socket.recv_fds(self.sock, _MAX_ERROR, 1)
        if not data:
            raise OSError("the user namespace keeper is gone")
        if fds:
            return fds[0]
        raise OSError(errno.EPERM, f"sandbox user namespace: {data[1:].decode(errors='replace')}")


def _fork_server(serve) -> tuple[socket.socket, int]:
    """Fork a child that keeps only its end of a new socketpair and runs serve(it) until it returns (the
    parent closed its end); return the parent's end and the child's pid."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ours.close()
            kernel.close_fds_except({0, 1, 2, theirs.fileno()})
            serve(theirs)
            code = 0
        finally:
            os._exit(code)
    theirs.close()
    ours.set_inheritable(False)
    return ours, pid


def _keep(sock: socket.socket) -> None:
    """Keeper process: fork the maker while it holds no namespace fd, then serve."""
    signal.set_wakeup_fd(-1)   # the zygote's (closed here); the maker reaps its stubs by pid
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _serve(sock, _fork_server(_make)[0])


def _make(sock: socket.socket) -> None:
    """Maker process: make a user namespace per request and send its fd (or b"e" and why) back.

    Its stubs write their namespace's limits through a proc of the maker's own, a fresh one every
    PROC_FRESH_EVERY namespaces: through one proc, every namespace's /proc/sys/user dentries pile up under
    one parent and each lookup compares them all (proc_sys_compare: O(sandboxes) per create). A proc per
    stub, in a mount namespace of its own, freed that namespace at the stub's exit, and each free waits
    for an expedited RCU grace period, which every mount and unmount of the node's creates queue on."""
    kernel.own_mounts(["/proc"])   # (a copy of every host mount would keep them alive as long as the node)
    made = 0
    while True:
        data = sock.recv(64)
        if not data:
            return
        try:
            if made % PROC_FRESH_EVERY == 0:
                if made:
                    kernel.umount2("/proc", kernel.MNT_DETACH)   # back to the copy of the host's below it
                kernel.mount("proc", "/proc", "proc", kernel.MS_NOSUID | kernel.MS_NODEV | kernel.MS_NOEXEC)
            made += 1
            fd = sandbox_userns(*_REQ.unpack(data))
        except OSError as exc:
            sock.send(b"e" + (exc.strerror or str(exc)).encode()[:_MAX_ERROR - 1])
            continue
        try:
            socket.send_fds(sock, [b"y"], [fd])
        finally:
            os.close(fd)


def _serve(sock: socket.socket, maker: socket.socket) -> None:
    """Keeper process: answer until the zygote closes its end."""
    kept: dict[int, int] = {}
    while True:
        data = sock.recv(64)
        if not data:
            return
        (base,) = _REQ.unpack(data)
        if base not in kept:
            maker.send(data)
            reply, fds, _, _ = socket.recv_fds(maker, _MAX_ERROR, 1)
            if not reply:
                raise SystemExit("the user namespace maker is gone")
            if not fds:
                sock.send(reply)
                continue
            kept[base] = fds[0]
        socket.send_fds(sock, [b"y"], [kept[base]])


# Per-namespace limits of every sandbox's user namespace S (/proc/sys/user/*, written from inside S
# before anything of the sandbox runs; commands live in namespaces nested in S and cannot change
# them). They bound what the sandbox as a whole may hold; the host's per-uid sysctls (charged to the
# sandbox's own uid) bound it too. Each exec uses one user namespace while any of its processes lives.
USERNS_LIMITS = kernel.USERNS_LIMITS
USERNS_EXHAUSTED = "the host's user namespaces are exhausted"   # (user.max_user_namespaces)


def sandbox_userns(base: int) -> int:
    """An fd of a new user namespace owned by host uid `base`, mapping 0..65535 onto base.., limited.

    A stub child drops to the range's root uid and unshares (so the namespace is charged to that uid,
    not to host root), writes the limits from inside, and waits; the zygote writes the maps (a
    privileged writer may map any range), opens the namespace and lets the stub exit."""
    go_r, go_w = os.pipe2(os.O_CLOEXEC)
    rep_r, rep_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(go_w)
            os.close(rep_r)
            os.setgroups([])   # (its /proc: the maker's, see _make)
            os.setresgid(base, base, base)
            os.setresuid(base, base, base)
            kernel.unshare(kernel.CLONE_NEWUSER)
            for name, value in USERNS_LIMITS:
                try:
                    with open(f"/proc/sys/user/{name}", "w") as f:
                        f.write(value)
                except FileNotFoundError:   # an older kernel without this count
                    pass
            os.write(rep_w, b"u")
            os.read(go_r, 1)
        except BaseException as exc:
            text = USERNS_EXHAUSTED if getattr(exc, "errno", None) == errno.ENOSPC else str(exc)
            os.write(rep_w, f"{text} ({exc})".encode()[:500])
        finally:
            os._exit(0)
    os.close(go_r)
    os.close(rep_w)
    try:
        report = os.read(rep_r, 600)
        if report != b"u":
            raise OSError(errno.EPERM, report.decode(errors='replace') or 'stub died')
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(f"0 {base} 65536")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(rep_r)
        os.close(go_w)
        os.waitpid(pid, 0)

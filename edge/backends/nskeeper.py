"""The user namespaces of sandboxes: how the zygote makes one per uid range (sandbox_userns), and the keeper
that holds them, one fd per range, in a process that never forks.

The zygote forks for every sandbox, and fork copies its whole fd table (dup_fd) which the child then closes
(close_range): with a namespace fd per range kept in the zygote, each launch cost O(ranges) in the kernel
(~0.1 ms per 1,000 fds here). The keeper, forked from the zygote before any namespace exists, holds them
instead and lends one per launch over a socketpair (SCM_RIGHTS): the zygote's table stays a few fds long.
"""
from __future__ import annotations

import errno
import os
import socket
import struct

from edge.backends import kernel

_REQ = struct.Struct("!cq")   # op (P put, G get), uid range base


class Keeper:
    """Zygote side; start() forks the keeper process."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.pid = 0

    def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ours.close()
                kernel.close_fds_except({0, 1, 2, theirs.fileno()})
                _serve(theirs)
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        ours.set_inheritable(False)
        self.sock, self.pid = ours, pid

    def get(self, base: int) -> int | None:
        """A new fd of range base's user namespace (the caller closes it), or None if none is kept."""
        assert self.sock is not None
        self.sock.send(_REQ.pack(b"G", base))
        data, fds, _, _ = socket.recv_fds(self.sock, 16, 1)
        if not data:
            raise OSError("the user namespace keeper is gone")
        return fds[0] if fds else None

    def put(self, base: int, fd: int) -> None:
        """Keep (a copy of) fd as range base's user namespace."""
        assert self.sock is not None
        socket.send_fds(self.sock, [_REQ.pack(b"P", base)], [fd])
        if self.sock.recv(16) != b"k":
            raise OSError("the user namespace keeper is gone")


def _serve(sock: socket.socket) -> None:
    """Keeper process: answer until the zygote closes its end."""
    kept: dict[int, int] = {}
    while True:
        data, fds, _, _ = socket.recv_fds(sock, 64, 1)
        if not data:
            return
        op, base = _REQ.unpack(data)
        if op == b"P" and fds:
            old = kept.pop(base, None)
            if old is not None:
                os.close(old)
            kept[base] = fds[0]
            sock.send(b"k")
        elif base in kept:
            socket.send_fds(sock, [b"y"], [kept[base]])
        else:
            sock.send(b"n")


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
            # A proc of its own: through the host's, every user namespace's /proc/sys/user dentries pile up
            # under one parent and each lookup compares them all (proc_sys_compare: O(sandboxes) per create).
            kernel.unshare(kernel.CLONE_NEWNS)
            kernel.mount(None, "/", None, kernel.MS_REC | kernel.MS_PRIVATE)
            kernel.mount("proc", "/proc", "proc", kernel.MS_NOSUID | kernel.MS_NODEV | kernel.MS_NOEXEC)
            os.setgroups([])
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
            raise OSError(errno.EPERM, f"sandbox user namespace: {report.decode(errors='replace') or 'stub died'}")
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(f"0 {base} 65536")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(rep_r)
        os.close(go_w)
        os.waitpid(pid, 0)

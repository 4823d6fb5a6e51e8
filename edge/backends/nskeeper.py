"""The zygote's keeper of user namespaces: one fd per uid range, held by a process that never forks.

The zygote forks for every sandbox, and fork copies its whole fd table (dup_fd) which the child then closes
(close_range): with a namespace fd per range kept in the zygote, each launch cost O(ranges) in the kernel
(~0.1 ms per 1,000 fds here). The keeper, forked from the zygote before any namespace exists, holds them
instead and lends one per launch over a socketpair (SCM_RIGHTS): the zygote's table stays a few fds long.
"""
from __future__ import annotations

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

"""Moving bytes between two sockets on the proxy's event loop: splice(2) through a pipe (the bytes never
enter Python), non-blocking, one pump per direction. Also the small awaitables the proxy reads its first
bytes with."""
from __future__ import annotations

import fcntl
import os
import socket

from edge.backends.execio import wait_fd

CHUNK = 1 << 20
PIPE_SIZE = 1 << 20
F_SETPIPE_SZ = 1031
FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK


async def recv(sock: socket.socket, size: int = 65536) -> bytes:
    """Some bytes from a non-blocking socket (b'' at EOF)."""
    while True:
        try:
            return sock.recv(size)
        except (BlockingIOError, InterruptedError):
            await wait_fd(sock.fileno(), False)


async def sendall(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except (BlockingIOError, InterruptedError):
            await wait_fd(sock.fileno(), True)


async def pump(src: socket.socket, dst: socket.socket, counted: list[int], index: int) -> None:
    """src -> dst until src's EOF (then dst's write side is shut) or an error; counted[index] += bytes."""
    r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        try:
            fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass
        while True:
            try:
                n = os.splice(src.fileno(), w, CHUNK, flags=FLAGS)
            except (BlockingIOError, InterruptedError):
                await wait_fd(src.fileno(), False)
                continue
            if n == 0:
                break
            while n:
                try:
                    m = os.splice(r, dst.fileno(), n, flags=FLAGS)
                except (BlockingIOError, InterruptedError):
                    await wait_fd(dst.fileno(), True)
                    continue
                n -= m
                counted[index] += m
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    except OSError:           # a reset on either side ends both directions
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    finally:
        os.close(r)
        os.close(w)

"""The edge side of the zygote (see zygote.py): spawn it, send it requests, learn pids and exit
statuses, and notice its death. Kept apart so the zygote process never imports asyncio."""
from __future__ import annotations

import asyncio
import itertools
import os
import socket
import subprocess
import sys

import msgspec

from edge.backends.zygote import (MAX_MESSAGE, Exited, Hello, LauncherError, Refused, Reply, Request, Spawned)


class Launcher:
    """Edge-side handle of the zygote: send requests, learn pids and exit statuses, notice its death.

    Runs on the edge's event loop.
    """

    def __init__(self, init_binary: str = "/usr/bin/catatonit", label: str = "") -> None:
        self.init_binary = init_binary
        self.label = label          # on the zygote's command line, so leftover checks can find it
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.death: str | None = "launcher not started"
        self._rids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._exits: dict[int, asyncio.Future] = {}
        self._hello: asyncio.Future | None = None
        self._send_lock = asyncio.Lock()   # one sender waits for room at a time: the loop has one writer per fd
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Reply)

    @property
    def alive(self) -> bool:
        """True while the zygote runs and answers."""
        return self.death is None

    async def start(self, timeout: float = 10.0) -> None:
        """Spawn the zygote and wait for its hello."""
        if not os.access(self.init_binary, os.X_OK):
            raise LauncherError(f"init binary not found: {self.init_binary} (install catatonit)")
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "PYTHONPATH": repo}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edge.backends.zygote", str(theirs.fileno()), self.init_binary,
             self.label],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            env=env, cwd=repo, start_new_session=True)   # own session: a terminal ^C must not kill it
        theirs.close()
        ours.setblocking(False)
        self.sock, self.death = ours, None
        self._hello = loop.create_future()
        loop.add_reader(ours.fileno(), self._on_readable)
        try:
            await asyncio.wait_for(asyncio.shield(self._hello), timeout)
        except (asyncio.TimeoutError, LauncherError) as exc:
            await self.close()
            raise LauncherError(f"launcher did not start: {exc or 'timeout'}") from exc

    async def request(self, msg: Request, fds: list[int]) -> tuple[int, asyncio.Future]:
        """Send a request with fds; return the host pid of the child it forked and its exit future.

        The exit future resolves to the raw wait status when the zygote reaps the child, or fails
        with LauncherError if the zygote dies first.
        """
        if self.death is not None:
            raise LauncherError(self.death)
        rid = next(self._rids)
        data = self._encoder.encode(msgspec.structs.replace(msg, rid=rid))
        if len(data) > MAX_MESSAGE:
            raise LauncherError(f"request too large ({len(data)} bytes; argv and env must stay below {MAX_MESSAGE})")
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await self._send(data, fds)
            return await fut
        finally:
            self._pending.pop(rid, None)

    async def _send(self, data: bytes, fds: list[int]) -> None:
        async with self._send_lock:   # (a second add_writer on the fd would replace the first's callback,
            await self._send_now(data, fds)   # whose create then waited forever)

    async def _send_now(self, data: bytes, fds: list[int]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.sock is None:
                raise LauncherError(self.death or "launcher closed")
            try:
                socket.send_fds(self.sock, [data], fds)
                return
            except BlockingIOError:
                writable = loop.create_future()
                loop.add_writer(self.sock.fileno(), lambda: writable.done() or writable.set_result(None))
                try:
                    await writable
                finally:
                    if self.sock is not None:
                        loop.remove_writer(self.sock.fileno())
            except OSError as exc:
                self._die(f"launcher connection failed: {exc.strerror}")

    def _on_readable(self) -> None:
        while self.sock is not None:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except BlockingIOError:
                return
            except OSError as exc:
                self._die(f"launcher connection failed: {exc.strerror}")
                return
            if not data:
                self._die("launcher exited")
                return
            self._dispatch(self._decoder.decode(data))

    def _dispatch(self, msg: Reply) -> None:
        match msg:
            case Hello():
                if self._hello and not self._hello.done():
                    self._hello.set_result(msg.pid)
            case Spawned(rid=rid, pid=pid):
                # Bound now, before any Exited for this pid can be read (pids are reused after reaping).
                exited = self._exits[pid] = asyncio.get_running_loop().create_future()
                fut = self._pending.get(rid)
                if fut is not None and not fut.done():
                    fut.set_result((pid, exited))
            case Refused(rid=rid, error=error):
                fut = self._pending.get(rid)
                if fut is not None and not fut.done():
                    fut.set_exception(LauncherError(error))
            case Exited(pid=pid, status=status):
                fut = self._exits.pop(pid, None)
                if fut is not None and not fut.done():
                    fut.set_result(status)

    def _die(self, reason: str) -> None:
        """Mark the zygote dead and fail everything waiting on it."""
        if self.death is not None:
            return
        rc = self.proc.poll() if self.proc else None
        self.death = f"{reason} (exit status {rc})" if rc is not None else reason
        if self.sock is not None:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        waiting = [self._hello] + list(self._pending.values()) + list(self._exits.values())
        self._exits.clear()
        for fut in waiting:
            if fut is not None and not fut.done():
                fut.set_exception(LauncherError(self.death))
                fut.exception()     # mark retrieved: nobody may be waiting on it any more

    async def close(self, timeout: float = 5.0) -> None:
        """Close the socket (the zygote exits on EOF) and reap it; kill it if it lingers."""
        self._die("launcher stopped")
        if self.proc is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.proc.poll() is None:
            if loop.time() > deadline:
                self.proc.kill()
                deadline = float("inf")
            await asyncio.sleep(0.005)



"""Pty: the synchronous sandbox.pty (see AsyncPty)."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from libdsec.e2b.sandbox.commands.command_handle import PtySize
from libdsec.e2b.sandbox_async.commands.pty import AsyncPty
from libdsec.e2b.sandbox_sync.commands.command_handle import CommandHandle


class Pty:
    """create() gives a CommandHandle whose wait(on_pty=...) hands out the terminal's bytes."""

    def __init__(self, run: Callable[[Any], Any], inner: AsyncPty) -> None:
        self._run, self._inner = run, inner

    def create(self, size: PtySize, user: Optional[str] = None, cwd: Optional[str] = None,
               envs: Optional[Dict[str, str]] = None, timeout: Optional[float] = 60,
               request_timeout: Optional[float] = None) -> CommandHandle:
        return CommandHandle(self._run, self._run(self._inner.create(size, None, user=user, cwd=cwd, envs=envs,
                                                                     timeout=timeout)))

    def connect(self, pid: int, timeout: Optional[float] = 60, request_timeout: Optional[float] = None) -> CommandHandle:
        return CommandHandle(self._run, self._run(self._inner.connect(pid, None, timeout=timeout)))

    def send_stdin(self, pid: int, data: bytes, request_timeout: Optional[float] = None) -> None:
        self._run(self._inner.send_stdin(pid, data))

    def resize(self, pid: int, size: PtySize, request_timeout: Optional[float] = None) -> None:
        self._run(self._inner.resize(pid, size))

    def kill(self, pid: int, request_timeout: Optional[float] = None) -> bool:
        return self._run(self._inner.kill(pid))

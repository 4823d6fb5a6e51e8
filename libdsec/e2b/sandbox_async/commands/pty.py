"""AsyncPty: sandbox.pty, E2B's terminals on DSec's (sb.terminal: a terminal of the sandbox's own devpts)."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from bus.errors import DsecError
from libdsec.e2b.exceptions import mapped
from libdsec.e2b.sandbox.commands.command_handle import PtySize
from libdsec.e2b.sandbox_async.commands.command import not_found
from libdsec.e2b.sandbox_async.commands.command_handle import AsyncCommandHandle, killed_here, started_or_closed
from libdsec.sandbox import AsyncSandbox as NativeSandbox

NO_LIMIT = 24 * 3600.0   # a timeout of 0 (E2B: no limit)
PtyHandler = Callable[[bytes], Any]


class AsyncPty:
    """create() a terminal (an interactive login bash where the image has one, else the trusted sh), then
    send_stdin/resize/kill by its pid, or connect() to it from another client."""

    def __init__(self, sb: NativeSandbox) -> None:
        self._sb = sb

    async def create(self, size: PtySize, on_data: PtyHandler, user: Optional[str] = None, cwd: Optional[str] = None,
                     envs: Optional[Dict[str, str]] = None, timeout: Optional[float] = 60,
                     request_timeout: Optional[float] = None) -> AsyncCommandHandle:
        """A terminal of size rows x cols; its output, bytes, to on_data as it comes. TERM, LANG and LC_ALL
        default as E2B's (xterm-256color, C.UTF-8)."""
        envs = {"TERM": "xterm-256color", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", **(envs or {})}
        try:
            handle = await self._sb.terminal(rows=size.rows, cols=size.cols, cwd=cwd, env=envs, user=user,
                                             timeout=NO_LIMIT if not timeout else float(timeout))
            await started_or_closed(handle)
        except DsecError as err:
            raise mapped(err) from err
        return AsyncCommandHandle(handle, on_pty=on_data, pty=True)

    async def connect(self, pid: int, on_data: PtyHandler, timeout: Optional[float] = 60,
                      request_timeout: Optional[float] = None) -> AsyncCommandHandle:
        """The running terminal with that pid, from any client: its output from the first byte."""
        try:
            handle = await self._sb.attach(pid=pid)
            await started_or_closed(handle)
        except DsecError as err:
            raise not_found(err, pid) from err
        return AsyncCommandHandle(handle, on_pty=on_data, pty=True)

    async def send_stdin(self, pid: int, data: bytes, request_timeout: Optional[float] = None) -> None:
        """Type data into the terminal with that pid."""
        try:
            await self._sb.send_stdin(pid, data)
        except DsecError as err:
            raise not_found(err, pid) from err

    async def resize(self, pid: int, size: PtySize, request_timeout: Optional[float] = None) -> None:
        """Resize the terminal with that pid (its programs get SIGWINCH)."""
        try:
            await self._sb.resize_terminal(pid, size.rows, size.cols)
        except DsecError as err:
            raise not_found(err, pid) from err

    async def kill(self, pid: int, request_timeout: Optional[float] = None) -> bool:
        """Kill the terminal's whole process tree; False when no running command has the pid."""
        try:
            if not isinstance(pid, int) or isinstance(pid, bool):
                return await self._sb.kill_process(pid)   # (its error says what a pid is)
            return await killed_here(self._sb.id, pid, lambda: self._sb.kill_process(pid))
        except DsecError as err:
            raise mapped(err) from err

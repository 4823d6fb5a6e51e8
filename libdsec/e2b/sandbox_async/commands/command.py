"""AsyncCommands: sandbox.commands of E2B's async sandbox (E2B's module: e2b.sandbox_async.commands.command).

A command line runs as E2B's does, under `/bin/bash -l -c` where the image has bash (the trusted sh starts it:
the relay depends on no binary of the sandbox; an image without bash runs it in the trusted sh itself), as the
image's default user (`user` in the base image) in its working directory (/home/user there)."""
from __future__ import annotations

import asyncio
import contextlib
import shlex
from typing import Any, Dict, List, Optional

from bus.errors import DsecError, InvalidRequest, SandboxNotFound
from bus.execwire import ProcessEntry
from libdsec.e2b.exceptions import NotFoundException, SandboxException, mapped
from libdsec.e2b.sandbox.commands.main import ProcessInfo
from libdsec.e2b.sandbox_async.commands.command_handle import (MAX_OUTPUT, AsyncCommandHandle, OutputHandler,
                                                               killed_here, started_or_closed)
from libdsec.e2b.sandbox_async.filesystem.filesystem import absolute
from libdsec.sandbox import AsyncSandbox as NativeSandbox

NO_LIMIT = 24 * 3600.0   # a command timeout of 0 (E2B: no limit)
KILL_WAIT = 5.0          # seconds a foreground run left early waits for its command to be killed


# The command line is in the script once (as a variable: the script is one argument, which Linux takes up to
# 128 KiB, so a line of up to about that runs, as in E2B); the eval unsets it before the line runs.
LOGIN = '; if [ -x /bin/bash ]; then exec /bin/bash -l -c "$__dsec_line"; fi; eval "unset __dsec_line; $__dsec_line"'


def login_shell(cmd: str) -> str:
    """The trusted sh's script for a command line: bash -l -c it where the image has bash, else run it here."""
    return f"__dsec_line={shlex.quote(cmd)}{LOGIN}"


def command_line(script: str) -> str | None:
    """The command line of a login_shell script (None: the script is not one)."""
    if not (script.startswith("__dsec_line=") and script.endswith(LOGIN)):
        return None
    quoted = script[len("__dsec_line="):-len(LOGIN)]
    try:
        words = shlex.split(quoted)
    except ValueError:
        return None
    return words[0] if len(words) == 1 and shlex.quote(words[0]) == quoted else None


class AsyncCommands:
    """sandbox.commands: run a command in the foreground or the background."""

    def __init__(self, sb: NativeSandbox) -> None:
        self._sb = sb

    async def run(self, cmd: str, background: Optional[bool] = None, envs: Optional[Dict[str, str]] = None,
                  user: Optional[str] = None, cwd: Optional[str] = None, on_stdout: Optional[OutputHandler] = None,
                  on_stderr: Optional[OutputHandler] = None, stdin: Optional[bool] = None,
                  timeout: Optional[float] = 60, request_timeout: Optional[float] = None) -> Any:
        """Run cmd (a shell line, run by the sandbox's trusted sh). Foreground: the CommandResult, or
        CommandExitException for a non-zero exit; background=True: an AsyncCommandHandle at once.
        user: "root", "user" or any account of the image (None: the image's default user)."""
        try:
            if not isinstance(cmd, str) or not cmd or "\0" in cmd:
                raise InvalidRequest("cmd must be a non-empty string without NUL bytes")
            handle = await self._sb.exec(login_shell(cmd), background=True, env=envs, max_output=MAX_OUTPUT,
                                         end_on_exit=True,   # as E2B's: `server &` does not hold the command
                                         cwd=absolute(cwd, user) if cwd else None, user=user,
                                         timeout=NO_LIMIT if not timeout else float(timeout),
                                         stdin=True if stdin else None)
            await started_or_closed(handle)   # as E2B's: the handle comes with its pid
        except DsecError as err:
            raise mapped(err) from err
        h = AsyncCommandHandle(handle, on_stdout, on_stderr)
        if background:
            return h
        try:
            return await h.wait()
        except BaseException as exc:   # a handler that raised, a cancel: the command is this call's, killed
            await self.end_left(h, exc)
            raise

    async def end_left(self, h: AsyncCommandHandle, exc: BaseException) -> None:
        """A foreground command its caller left (a handler raised, a cancel, Ctrl-C) is killed, within KILL_WAIT."""
        gone = isinstance(exc.__cause__, SandboxNotFound)   # nothing left to kill
        if h.exit_code is None and h.pid and not gone:   # (by pid: the handle stopped listening with the error)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._sb.kill_process(h.pid), KILL_WAIT)

    async def list(self, request_timeout: Optional[float] = None) -> List[ProcessInfo]:
        """The sandbox's running commands (tag: DSec's exec id; a shell line shows as sh -c LINE)."""
        try:
            return [process_info(p) for p in await self._sb.processes()]
        except DsecError as err:
            raise mapped(err) from err

    async def kill(self, pid: int, request_timeout: Optional[float] = None) -> bool:
        """Kill the command with that pid and its whole process tree; False when no running command has it."""
        try:
            if not isinstance(pid, int) or isinstance(pid, bool):
                return await self._sb.kill_process(pid)   # (its error says what a pid is)
            return await killed_here(self._sb.id, pid, lambda: self._sb.kill_process(pid))
        except DsecError as err:
            raise mapped(err) from err

    async def send_stdin(self, pid: int, data: str, request_timeout: Optional[float] = None) -> None:
        """Write data to the stdin of the command with that pid (started with stdin=True)."""
        try:
            if not await self._sb.send_stdin(pid, data):
                raise SandboxException(f"the command with pid {pid} ended or closed its stdin")
        except DsecError as err:
            raise not_found(err, pid) from err

    async def close_stdin(self, pid: int, request_timeout: Optional[float] = None) -> None:
        """End the stdin of the command with that pid (it reads EOF)."""
        try:
            await self._sb.send_stdin(pid, b"", eof=True)
        except DsecError as err:
            raise not_found(err, pid) from err

    async def connect(self, pid: int, timeout: Optional[float] = 60, request_timeout: Optional[float] = None,
                      on_stdout: Optional[OutputHandler] = None,
                      on_stderr: Optional[OutputHandler] = None) -> AsyncCommandHandle:
        """A handle on the running command with that pid (from another client, or after a restart): its output
        from its first byte on, then wait() and kill() as run()'s handle."""
        try:
            handle = await self._sb.attach(pid=pid)
            await started_or_closed(handle)
        except DsecError as err:
            raise not_found(err, pid) from err
        return AsyncCommandHandle(handle, on_stdout, on_stderr)


def not_found(err: DsecError, pid: int) -> Exception:
    """No running command has the pid: E2B's NotFoundException; else the mapped error."""
    if isinstance(err, InvalidRequest) and "has pid" in str(err):
        return NotFoundException(f"no running command has pid {pid}")
    return mapped(err)


def process_info(p: ProcessEntry) -> ProcessInfo:
    """A running exec as E2B's ProcessInfo: a command run() started shows as E2B's do (/bin/bash -l -c CMD)."""
    line = command_line(p.shell) if p.shell else None
    if line is not None:
        cmd, args = "/bin/bash", ["-l", "-c", line]
    else:
        cmd, args = ("sh", ["-c", p.shell]) if p.shell else (p.argv[0], list(p.argv[1:]))
    return ProcessInfo(pid=p.pid, tag=p.exec_id, cmd=cmd, args=args, envs=dict(p.env), cwd=p.cwd or None)
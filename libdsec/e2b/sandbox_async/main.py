"""AsyncSandbox: E2B's async sandbox on DSec (docs/e2b.md maps every call)."""
from __future__ import annotations

import asyncio
import functools
import os
import time
from typing import IO, Any, Callable, Dict, List, Optional, Union

from bus.apiwire import MAX_PAGE, ListSandboxes, SandboxPage
from bus.errors import DsecError, InvalidRequest, SandboxNotFound
from bus.execwire import ProcessEntry
from libdsec.client import AsyncClient
from libdsec.e2b.exceptions import (InvalidArgumentException, NotFoundException, SandboxException,
                                   SandboxNotFoundException, mapped)
from libdsec.e2b.sandbox.commands.main import ProcessInfo
from libdsec.e2b.sandbox.commands.command_handle import CommandResult
from libdsec.e2b.sandbox.filesystem.filesystem import EntryInfo, FileType, WriteEntry, WriteInfo, entry_info
from libdsec.e2b.sandbox.sandbox_api import SandboxInfo, SandboxQuery, SandboxState, info_of
from libdsec.e2b.sandbox.filesystem.watch_handle import FilesystemEvent
from libdsec.e2b.sandbox_async.commands.command_handle import AsyncCommandHandle, OutputHandler
from libdsec.e2b.sandbox_async.commands.pty import AsyncPty
from libdsec.e2b.sandbox_async.filesystem.watch_handle import AsyncWatchHandle
from libdsec.sandbox import AsyncSandbox as NativeSandbox

DEFAULT_TEMPLATE = "base"     # E2B's default template: DSec's `base` image (docs/e2b.md builds it)
DEFAULT_TIMEOUT = 300         # seconds a sandbox lives, as E2B's default
NO_LIMIT = 24 * 3600.0        # a command timeout of 0 (E2B: no limit)
IGNORED = ("api_key", "domain", "debug", "secure", "request_timeout", "proxy", "headers", "access_token",
           "api_url", "sandbox_url", "allow_internet_access", "mcp", "network", "auto_pause")
_clients: Dict[asyncio.AbstractEventLoop, AsyncClient] = {}


class by_id:
    """A method of a sandbox by id: sb.kill() on an instance, AsyncSandbox.kill(id) on the class."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj, cls):
        if obj is None:
            return functools.partial(self.fn, cls)
        return functools.partial(self.fn, cls, obj.sandbox_id)


async def client() -> AsyncClient:
    """The connection of this event loop, made on first use: DSEC_URL (default nats://127.0.0.1:4222) and
    DSEC_CREDS (default: the SDK's own lookup); the tenant is the credential's."""
    loop = asyncio.get_running_loop()
    c = _clients.get(loop)
    if c is None:
        c = AsyncClient(os.environ.get("DSEC_URL", "nats://127.0.0.1:4222"), creds=os.environ.get("DSEC_CREDS"))
        await c.connect()
        _clients[loop] = c
    return c


def _refuse_unknown(kwargs: Dict[str, Any]) -> None:
    unknown = sorted(set(kwargs) - set(IGNORED))
    if unknown:
        raise InvalidArgumentException(f"not an argument of E2B's API (or not one DSec maps): {', '.join(unknown)}")


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
            handle = await self._sb.exec(cmd, background=True, env=envs, cwd=cwd, user=user,
                                         timeout=NO_LIMIT if not timeout else float(timeout),
                                         stdin=True if stdin else None)
            await handle.started()   # as E2B's: the handle comes with its pid
        except DsecError as err:
            raise mapped(err) from err
        h = AsyncCommandHandle(handle, on_stdout, on_stderr)
        return h if background else await h.wait()

    async def list(self, request_timeout: Optional[float] = None) -> List[ProcessInfo]:
        """The sandbox's running commands (tag: DSec's exec id; a shell line shows as sh -c LINE)."""
        try:
            return [process_info(p) for p in await self._sb.processes()]
        except DsecError as err:
            raise mapped(err) from err

    async def kill(self, pid: int, request_timeout: Optional[float] = None) -> bool:
        """Kill the command with that pid and its whole process tree; False when no running command has it."""
        try:
            return await self._sb.kill_process(pid)
        except DsecError as err:
            raise mapped(err) from err

    async def send_stdin(self, pid: int, data: str, request_timeout: Optional[float] = None) -> None:
        """Write data to the stdin of the command with that pid (started with stdin=True)."""
        try:
            if not await self._sb.send_stdin(pid, data):
                raise SandboxException(f"the command with pid {pid} ended or closed its stdin")
        except DsecError as err:
            raise _not_found(err, pid) from err

    async def close_stdin(self, pid: int, request_timeout: Optional[float] = None) -> None:
        """End the stdin of the command with that pid (it reads EOF)."""
        try:
            await self._sb.send_stdin(pid, b"", eof=True)
        except DsecError as err:
            raise _not_found(err, pid) from err

    async def connect(self, pid: int, timeout: Optional[float] = 60, request_timeout: Optional[float] = None,
                      on_stdout: Optional[OutputHandler] = None,
                      on_stderr: Optional[OutputHandler] = None) -> AsyncCommandHandle:
        """A handle on the running command with that pid (from another client, or after a restart): its output
        from its first byte on, then wait() and kill() as run()'s handle."""
        try:
            handle = await self._sb.attach(pid=pid)
            await handle.started()
        except DsecError as err:
            raise _not_found(err, pid) from err
        return AsyncCommandHandle(handle, on_stdout, on_stderr)


def _not_found(err: DsecError, pid: int) -> Exception:
    """No running command has the pid: E2B's NotFoundException; else the mapped error."""
    if isinstance(err, InvalidRequest) and "has pid" in str(err):
        return NotFoundException(f"no running command has pid {pid}")
    return mapped(err)


def process_info(p: ProcessEntry) -> ProcessInfo:
    """A running exec as E2B's ProcessInfo."""
    cmd, args = ("sh", ["-c", p.shell]) if p.shell else (p.argv[0], list(p.argv[1:]))
    return ProcessInfo(pid=p.pid, tag=p.exec_id, cmd=cmd, args=args, envs=dict(p.env), cwd=p.cwd or None)


class AsyncFilesystem:
    """sandbox.files: the sandbox's file tree; paths resolve inside its root."""

    def __init__(self, sb: NativeSandbox) -> None:
        self._files = sb.files

    async def _do(self, work):
        try:
            return await work
        except DsecError as err:
            raise mapped(err) from err

    async def read(self, path: str, format: str = "text", user: Optional[str] = None,
                   request_timeout: Optional[float] = None) -> Any:
        """The file as text (UTF-8), bytes (a bytearray) or a stream (an async iterator of one piece)."""
        if format not in ("text", "bytes", "stream"):
            raise InvalidArgumentException(f"format must be text, bytes or stream, got {format!r}")
        data = await self._do(self._files.read(path))
        if format == "text":
            return data.decode(errors="replace")
        if format == "bytes":
            return bytearray(data)

        async def pieces():
            yield data
        return pieces()

    async def write(self, path: str, data: Union[str, bytes, IO], user: Optional[str] = None,
                    request_timeout: Optional[float] = None, metadata: Optional[Dict[str, str]] = None) -> WriteInfo:
        """Create or overwrite path (its missing parent directories are made); metadata: its user.* xattrs."""
        if hasattr(data, "read"):
            data = data.read()
        parent = os.path.dirname(path.rstrip("/"))
        if parent not in ("", "/"):
            await self._do(self._files.make_dir(parent))
        await self._do(self._files.write(path, data, metadata=metadata))
        return WriteInfo(name=os.path.basename(path), type=FileType.FILE, path=path)

    async def write_files(self, files: List[WriteEntry], user: Optional[str] = None,
                          request_timeout: Optional[float] = None) -> List[WriteInfo]:
        """Write several files, in order."""
        return [await self.write(f.path, f.data) for f in files]

    async def list(self, path: str, depth: Optional[int] = 1, user: Optional[str] = None,
                   request_timeout: Optional[float] = None) -> List[EntryInfo]:
        """The entries under path, depth levels down."""
        return [entry_info(e) for e in await self._do(self._files.list(path, depth=depth or 1))]

    async def exists(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> bool:
        return await self._do(self._files.exists(path))

    async def get_info(self, path: str, user: Optional[str] = None,
                       request_timeout: Optional[float] = None) -> EntryInfo:
        return entry_info(await self._do(self._files.get_info(path)))

    async def remove(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> None:
        await self._do(self._files.remove(path))

    async def rename(self, old_path: str, new_path: str, user: Optional[str] = None,
                     request_timeout: Optional[float] = None) -> EntryInfo:
        return entry_info(await self._do(self._files.rename(old_path, new_path)))

    async def make_dir(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> bool:
        return await self._do(self._files.make_dir(path))

    async def watch_dir(self, path: str, on_event: Callable[[FilesystemEvent], Any],
                        on_exit: Optional[Callable[[Optional[Exception]], Any]] = None, user: Optional[str] = None,
                        request_timeout: Optional[float] = None, timeout: Optional[float] = 60,
                        recursive: bool = False) -> AsyncWatchHandle:
        """Call on_event for each change under path (recursive: in every directory below it too) for `timeout`
        seconds (0: no limit); returns once the watch is in place. FileNotFoundException when path is no
        directory."""
        watch = await self._do(self._files.watch(path, recursive=recursive,
                                                 timeout=NO_LIMIT if not timeout else float(timeout)))
        return AsyncWatchHandle(watch, on_event, on_exit)


class AsyncSandboxPaginator:
    """Pages of list(): has_next, next_token, await next_items()."""

    def __init__(self, query: Optional[SandboxQuery], limit: Optional[int], next_token: Optional[str]) -> None:
        self._query = query or SandboxQuery()
        self._limit = limit
        self.next_token = next_token or ""
        self.has_next = True

    async def next_items(self) -> List[SandboxInfo]:
        """The next page (filtered on the server by metadata; states: running and paused)."""
        if not self.has_next:
            raise SandboxException("no more items")
        c = await client()
        req = ListSandboxes(states=["ready"], labels=dict(self._query.metadata or {}), next_token=self.next_token,
                            limit=self._limit or MAX_PAGE)
        try:
            page = await c._ask(req, SandboxPage)
        except DsecError as err:
            raise mapped(err) from err
        self.next_token = page.next_token
        self.has_next = bool(page.next_token)
        wanted = set(self._query.state or [SandboxState.RUNNING, SandboxState.PAUSED])
        return [i for i in map(info_of, page.records) if i.state in wanted]


class AsyncSandbox:
    """E2B's AsyncSandbox: `await AsyncSandbox.create(...)`, then .commands, .files, kill()."""

    def __init__(self, native: NativeSandbox) -> None:
        self._native = native
        self.sandbox_id = native.id
        self.commands = AsyncCommands(native)
        self.files = AsyncFilesystem(native)
        self.pty = AsyncPty(native, _not_found)

    def __repr__(self) -> str:
        return f"AsyncSandbox(sandbox_id={self.sandbox_id!r})"

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.kill()

    @classmethod
    async def create(cls, template: Optional[str] = None, timeout: Optional[int] = None,
                     metadata: Optional[Dict[str, str]] = None, envs: Optional[Dict[str, str]] = None,
                     lifecycle: Optional[Dict[str, Any]] = None, **kwargs: Any) -> "AsyncSandbox":
        """A new sandbox of image `template` (default: base) living `timeout` seconds (default 300), with
        metadata as its labels and envs in every command. E2B-only arguments (api_key, domain, ...) are
        accepted and ignored; others are refused."""
        _refuse_unknown(kwargs)
        on_timeout = (lifecycle or {}).get("on_timeout", "kill")
        if on_timeout not in ("kill", "pause") or set(lifecycle or {}) - {"on_timeout"}:
            raise InvalidArgumentException(f"lifecycle: only on_timeout 'kill' or 'pause' is offered, got {lifecycle!r}")
        c = await client()
        try:
            native = await c.create(template or os.environ.get("DSEC_E2B_TEMPLATE", DEFAULT_TEMPLATE),
                                    ttl=float(timeout or DEFAULT_TIMEOUT), labels=dict(metadata or {}), env=envs,
                                    on_timeout="suspend" if on_timeout == "pause" else "destroy")
        except DsecError as err:
            raise mapped(err) from err
        return cls(native)

    @classmethod
    async def connect(cls, sandbox_id: str, timeout: Optional[int] = None, **kwargs: Any) -> "AsyncSandbox":
        """Attach to a running sandbox; a paused one is resumed. Its timeout becomes `timeout` seconds from
        now when that is later than it was (never earlier; a paused one without `timeout` gets 300 s)."""
        _refuse_unknown(kwargs)
        c = await client()
        try:
            native = await c.get(sandbox_id)
            rec = await c._record(sandbox_id)
            if rec is not None:
                left = rec.expires_at - (rec.suspended_at if rec.suspended else time.time())
                want = timeout if timeout is not None else (DEFAULT_TIMEOUT if rec.suspended else None)
                if want is not None and want > left:
                    await native.set_timeout(want)   # before resume: a paused one's count starts then
                if rec.suspended:
                    await native.resume()
        except DsecError as err:
            raise mapped(err) from err
        return cls(native)

    @by_id
    async def kill(cls, sandbox_id: str, **kwargs: Any) -> bool:
        """Destroy it (sb.kill() or AsyncSandbox.kill(id)): True, or False when it was not found; a missing
        sandbox never raises."""
        try:
            native = await (await client()).get(sandbox_id)
            await native.destroy()
            return True
        except SandboxNotFound:
            return False
        except DsecError as err:
            raise mapped(err) from err

    @staticmethod
    def list(query: Optional[SandboxQuery] = None, limit: Optional[int] = None, next_token: Optional[str] = None,
             **kwargs: Any) -> AsyncSandboxPaginator:
        """A paginator over this tenant's running and paused sandboxes."""
        _refuse_unknown(kwargs)
        return AsyncSandboxPaginator(query, limit, next_token)

    @by_id
    async def get_info(cls, sandbox_id: str, **kwargs: Any) -> SandboxInfo:
        """Its SandboxInfo (sb.get_info() or AsyncSandbox.get_info(id))."""
        rec = await (await client())._record(sandbox_id)
        if rec is None or rec.state != "ready":
            raise SandboxNotFoundException(f"sandbox {sandbox_id} not found ({rec.state if rec else 'never existed'})")
        return info_of(rec)

    async def is_running(self, **kwargs: Any) -> bool:
        c = await client()
        rec = await c._record(self.sandbox_id)
        return rec is not None and rec.state == "ready" and not rec.suspended

    @by_id
    async def pause(cls, sandbox_id: str, **kwargs: Any) -> str:
        """Suspend it (processes stop, memory stays); connect() resumes it. Returns its id."""
        try:
            await (await (await client()).get(sandbox_id)).suspend()
        except DsecError as err:
            raise mapped(err) from err
        return sandbox_id

    @by_id
    async def set_timeout(cls, sandbox_id: str, timeout: int, **kwargs: Any) -> None:
        """It now ends `timeout` seconds from now, earlier or later than before (0: now)."""
        try:
            await (await (await client()).get(sandbox_id)).set_timeout(timeout)
        except DsecError as err:
            raise mapped(err) from err

__all__ = ["AsyncSandbox", "AsyncSandboxPaginator", "AsyncCommands", "AsyncFilesystem", "CommandResult"]

"""AsyncSandbox: E2B's async sandbox on DSec (docs/e2b.md maps every call)."""
from __future__ import annotations

import asyncio
import functools
import os
import time
from typing import Any, Dict, List, Optional

from bus.apiwire import MAX_PAGE, ListSandboxes, SandboxPage
from bus.errors import DsecError, ImageNotFound, SandboxNotFound
from libdsec.client import AsyncClient
from libdsec.e2b.exceptions import (NOT_OFFERED, InvalidArgumentException, SandboxException, SandboxNotFoundException,
                                   TemplateException, mapped, not_offered)
from libdsec.e2b.sandbox.commands.command_handle import CommandResult
from libdsec.e2b.sandbox.sandbox_api import SandboxInfo, SandboxQuery, SandboxState, SnapshotInfo, info_of
from libdsec.e2b.sandbox_async import snapshots
from libdsec.e2b.sandbox_async.commands.command import AsyncCommands
from libdsec.e2b.sandbox_async.commands.pty import AsyncPty
from libdsec.e2b.sandbox_async.filesystem.filesystem import AsyncFilesystem
from libdsec.sandbox import AsyncSandbox as NativeSandbox

DEFAULT_TEMPLATE = "base"     # E2B's default template: DSec's `base` image (docs/e2b.md builds it)
DEFAULT_TIMEOUT = 300         # seconds a sandbox lives, as E2B's default
IGNORED = ("api_key", "domain", "debug", "secure", "request_timeout", "proxy", "headers", "access_token",
           "api_url", "sandbox_url", "allow_internet_access", "mcp", "network", "auto_pause")
_clients: Dict[asyncio.AbstractEventLoop, "asyncio.Task[AsyncClient]"] = {}   # one connection per event loop


class by_id:
    """A method of a sandbox by id: sb.kill() on an instance, AsyncSandbox.kill(id) on the class. with_native:
    on an instance it also gets the native sandbox (_native=), saving a lookup of its record."""

    def __init__(self, fn, with_native: bool = False) -> None:
        self.fn = fn
        self.with_native = with_native
        self.__doc__ = fn.__doc__

    def __get__(self, obj, cls):
        if obj is None:
            return functools.partial(self.fn, cls)
        if self.with_native:
            return functools.partial(self.fn, cls, obj.sandbox_id, _native=obj._native)
        return functools.partial(self.fn, cls, obj.sandbox_id)


async def client() -> AsyncClient:
    """The connection of this event loop, made on first use: DSEC_URL (default nats://127.0.0.1:4222) and
    DSEC_CREDS (default: the SDK's own lookup); the tenant is the credential's."""
    loop = asyncio.get_running_loop()
    for other in [k for k in _clients if k.is_closed()]:   # (closed without asyncio.run's shutdown: dropped)
        _clients.pop(other)
    task = _clients.get(loop)   # (first uses at once share one connection: each closing the other's, two
    if task is None:            # closed both while in use: review)
        task = _clients[loop] = loop.create_task(_connect(loop))
    return await asyncio.shield(task)


async def _connect(loop: asyncio.AbstractEventLoop) -> AsyncClient:
    c = AsyncClient(os.environ.get("DSEC_URL", "nats://127.0.0.1:4222"), creds=os.environ.get("DSEC_CREDS"))
    try:
        await c.connect()
    except BaseException as err:
        _clients.pop(loop, None)   # (the next use tries again)
        if isinstance(err, DsecError):   # (a bad credential, no server: E2B's classes, as every other call's)
            raise mapped(err) from err
        raise
    c.closer = _closed_with_loop(loop, c)   # asyncio.run() (and pytest's loops) close it as the loop ends: they
    await c.closer.__anext__()              # aclose() every async generator the loop started (held by c)
    return c


async def _closed_with_loop(loop: asyncio.AbstractEventLoop, c: AsyncClient):
    try:
        yield
    finally:
        _clients.pop(loop, None)
        await c.close()


BUILD_BASE_WAIT = 900.0   # seconds a first use may take to build `base` (a cold debootstrap, packing, upload)


async def build_base() -> None:
    """Build DSec's `base` image with `dsec image build base --e2b-base` against DSEC_URL (the CLI of the
    server package, with the admin credential it finds: a local `dsec up`'s under DSEC_STATE_DIR);
    TemplateException with the command to run when it cannot."""
    import shutil
    import sys
    cli = os.path.join(os.path.dirname(sys.executable), "dsec")
    cli = cli if os.access(cli, os.X_OK) else shutil.which("dsec")
    how = "dsec image build base --e2b-base (docs/e2b.md)"
    if cli is None:
        raise TemplateException(f"the `base` image is not built here and no `dsec` CLI is at hand: run {how}")
    env = dict(os.environ)
    if env.get("DSEC_STATE_DIR"):   # its admin's credential, not the tenant's this process connects with
        env.pop("DSEC_CREDS", None)
    proc = await asyncio.create_subprocess_exec(
        cli, "image", "build", "--nats", os.environ.get("DSEC_URL", "nats://127.0.0.1:4222"), "base", "--e2b-base",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), BUILD_BASE_WAIT)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise TemplateException(f"building the `base` image took over {BUILD_BASE_WAIT:.0f} s: run {how}") from None
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
        raise TemplateException(f"the `base` image could not be built ({tail[0]}): run {how}")


def _on_timeout(lifecycle: Optional[Dict[str, Any]]) -> str:
    """DSec's on_timeout for E2B's lifecycle: {"on_timeout": "kill" | "pause" | {"action": ..., "keep_memory": ...}}
    (None or missing: kill). keep_memory=False (a filesystem-only pause, cold boot on resume) is refused: a
    container keeps its memory while suspended; auto_resume=True too (nothing resumes a sandbox by itself)."""
    lc = dict(lifecycle or {})
    if set(lc) - {"on_timeout", "auto_resume"}:
        raise InvalidArgumentException(f"lifecycle: on_timeout and auto_resume only, got {sorted(lc)}")
    if lc.get("auto_resume"):
        raise InvalidArgumentException("lifecycle: auto_resume is not offered (resume with connect())")
    action = lc.get("on_timeout")
    if isinstance(action, dict):
        if action.get("keep_memory") is False:
            raise InvalidArgumentException("lifecycle: keep_memory=False (a filesystem-only pause) is not offered: "
                                           "a paused sandbox keeps its memory")
        action = action.get("action")
    if action in (None, "kill"):
        return "destroy"
    if action == "pause":
        return "suspend"
    raise InvalidArgumentException(f"lifecycle: on_timeout 'kill' or 'pause', got {action!r}")


def _refuse_unknown(kwargs: Dict[str, Any]) -> None:
    unknown = sorted(set(kwargs) - set(IGNORED))
    if unknown:
        raise InvalidArgumentException(f"not an argument of E2B's API (or not one DSec maps): {', '.join(unknown)}")


class AsyncSandboxPaginator:
    """Pages of list(): has_next, next_token (None at the end), await next_items(). The server filters by
    metadata and state; the facade orders by start time (order="desc", newest first, as E2B; or "asc") and
    filters by template and started_after, then pages."""

    def __init__(self, query: Optional[SandboxQuery], limit: Optional[int], next_token: Optional[str],
                 order: str = "desc") -> None:
        if order not in ("asc", "desc"):
            raise InvalidArgumentException(f"order must be 'asc' or 'desc', got {order!r}")
        self._query = query or SandboxQuery()
        self._limit = limit or MAX_PAGE
        self._order = order
        self.next_token: Optional[str] = next_token
        self.has_next = True
        self._all: Optional[List[SandboxInfo]] = None

    async def _everything(self) -> List[SandboxInfo]:
        c = await client()
        q, out, token = self._query, [], ""
        while True:
            req = ListSandboxes(states=["ready"], labels=dict(q.metadata or {}), next_token=token, limit=MAX_PAGE)
            try:
                page = await c._ask(req, SandboxPage)
            except DsecError as err:
                raise mapped(err) from err
            out += page.records
            token = page.next_token
            if not token:
                break
        wanted = set(q.state or [SandboxState.RUNNING, SandboxState.PAUSED])
        infos = [i for i in map(info_of, sorted(out, key=lambda r: (r.created_at, r.sandbox_id)))
                 if i.state in wanted and (not q.template or i.template_id == q.template)
                 and (q.started_after is None or i.started_at >= q.started_after)]
        return infos[::-1] if self._order == "desc" else infos

    async def next_items(self) -> List[SandboxInfo]:
        """The next page."""
        if not self.has_next:
            raise SandboxException("no more items")
        if self._all is None:
            self._all = await self._everything()
        start = int(self.next_token) if self.next_token and self.next_token.isdigit() else 0
        page = self._all[start:start + self._limit]
        self.has_next = start + self._limit < len(self._all)
        self.next_token = str(start + self._limit) if self.has_next else None
        return page


class AsyncSandbox:
    """E2B's AsyncSandbox: `await AsyncSandbox.create(...)`, then .commands, .files, kill()."""

    def __init__(self, native: NativeSandbox) -> None:
        self._native = native
        self.sandbox_id = native.id
        self.commands = AsyncCommands(native)
        self.files = AsyncFilesystem(native)
        self.pty = AsyncPty(native)
        self._envd_version = "dsec"   # (E2B's sandboxes name their in-sandbox daemon's version; DSec has none)

    def __repr__(self) -> str:
        return f"AsyncSandbox(sandbox_id={self.sandbox_id!r})"

    def __getattr__(self, name: str) -> Any:
        if name in NOT_OFFERED:
            raise not_offered(name)
        raise AttributeError(name)

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
        on_timeout = _on_timeout(lifecycle)
        c = await client()
        default = template is None and "DSEC_E2B_TEMPLATE" not in os.environ
        template = template or os.environ.get("DSEC_E2B_TEMPLATE", DEFAULT_TEMPLATE)
        source = {"from_snapshot": template} if snapshots.is_snapshot(template) else {"image": template}
        for first in (True, False):
            try:
                native = await c.create(**source, ttl=float(timeout or DEFAULT_TIMEOUT),
                                        labels=dict(metadata or {}), env=envs, on_timeout=on_timeout)
                return cls(native)
            except ImageNotFound as err:
                if not (default and first):
                    raise mapped(err) from err
                await build_base()   # E2B's default template on first use, then once more
            except DsecError as err:
                raise mapped(err) from err
        raise AssertionError("unreachable")

    @by_id
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

    async def _kill(cls, sandbox_id: str, _native: Optional[NativeSandbox] = None, **kwargs: Any) -> bool:
        """Destroy it (sb.kill() or AsyncSandbox.kill(id)): True, or False when it was not found; a missing
        sandbox never raises."""
        try:
            native = _native or await (await client()).get(sandbox_id)
            await native.destroy()
            await snapshots.forked_sandbox_gone(await client(), sandbox_id)
            return True
        except SandboxNotFound:
            return False
        except DsecError as err:
            raise mapped(err) from err

    kill = by_id(_kill, with_native=True)

    @staticmethod
    def list(query: Optional[SandboxQuery] = None, limit: Optional[int] = None, next_token: Optional[str] = None,
             order: str = "desc", **kwargs: Any) -> AsyncSandboxPaginator:
        """A paginator over this tenant's running and paused sandboxes (newest first)."""
        _refuse_unknown(kwargs)
        return AsyncSandboxPaginator(query, limit, next_token, order)

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
    async def pause(cls, sandbox_id: str, keep_memory: bool = True, **kwargs: Any) -> bool:
        """Suspend it (processes stop, memory stays: a container keeps its memory whatever keep_memory says);
        connect() resumes it. True, or False when it was paused already."""
        c = await client()
        try:
            rec = await c._record(sandbox_id)
            if rec is not None and rec.state == "ready" and rec.suspended:
                return False
            await (await c.get(sandbox_id)).suspend()
        except DsecError as err:
            raise mapped(err) from err
        return True

    beta_pause = pause   # E2B's older name

    @by_id
    async def create_snapshot(cls, sandbox_id: str, name: Optional[str] = None, **kwargs: Any) -> SnapshotInfo:
        """Snapshot its filesystem (it is frozen for the moment that takes); create(snapshot_id) starts
        sandboxes from it. A container's snapshot holds no memory: its processes start afresh."""
        return await snapshots.create_snapshot(await client(), sandbox_id, name)

    @by_id
    def list_snapshots(cls, sandbox_id: Optional[str] = None, limit: Optional[int] = None,
                       next_token: Optional[str] = None, name: Optional[str] = None,
                       **kwargs: Any) -> snapshots.AsyncSnapshotPaginator:
        """A paginator over this tenant's snapshots (of one sandbox: sb.list_snapshots(); name: id or tag)."""
        return snapshots.AsyncSnapshotPaginator(client, sandbox_id, limit, next_token, name)

    @classmethod
    async def delete_snapshot(cls, snapshot_id: str, **kwargs: Any) -> bool:
        """True, or False when there is no such snapshot."""
        return await snapshots.delete_snapshot(await client(), snapshot_id)

    @by_id
    async def fork(cls, sandbox_id: str, count: Optional[int] = None, timeout: Optional[int] = None,
                   **kwargs: Any) -> List[Any]:
        """count new sandboxes (default 1) from one snapshot of this one, living timeout seconds (default 300):
        a list with a sandbox or the exception of each. They hold its files, not its running processes.
        (`sbx.fork(2)` is two forks: count came second, so it made one fork living 2 s.)"""
        return await snapshots.fork(await client(), sandbox_id, cls, timeout, count)

    @by_id
    async def set_timeout(cls, sandbox_id: str, timeout: int, **kwargs: Any) -> None:
        """It now ends `timeout` seconds from now, earlier or later than before (0: now)."""
        try:
            await (await (await client()).get(sandbox_id)).set_timeout(timeout)
        except DsecError as err:
            raise mapped(err) from err

__all__ = ["AsyncSandbox", "AsyncSandboxPaginator", "AsyncCommands", "AsyncFilesystem", "CommandResult"]

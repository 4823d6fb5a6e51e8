"""The synchronous twin of the SDK: the same API, run on a private event loop in a background thread."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from typing import Any, Iterator

from libdsec.client import AsyncClient
from libdsec.exechandle import ExecHandle as AsyncExecHandle
from libdsec.files import AsyncFiles
from bus.errors import InvalidRequest, SandboxError
from libdsec.results import ExecResult, Exit, Output
from libdsec.sandbox import AsyncSandbox

_DONE = object()
LEFT_WAIT = 10.0   # seconds a sync iterator left early waits for its async side to clean up


class _Loop:
    """An event loop in a daemon thread; run() blocks the caller until the coroutine ends."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="libdsec", daemon=True)
        self.stopped = False
        self.thread.start()

    def run(self, coro) -> Any:
        """The coroutine's result. Interrupted here (Ctrl-C), the call is cancelled on the loop and its cleanup
        waited for (a foreground exec's command is killed), then the interrupt goes on."""
        began, ended = threading.Event(), threading.Event()

        async def tracked() -> Any:
            began.set()
            try:
                return await coro
            finally:
                ended.set()
        fut = self.submit(tracked(), coro)
        try:
            return fut.result()
        except BaseException:
            if not fut.done():
                fut.cancel()
                if began.is_set():   # (cancelled before its first step, it has nothing to clean up)
                    ended.wait(LEFT_WAIT)
            raise

    def submit(self, coro, inner=None) -> concurrent.futures.Future:
        if self.stopped:
            for c in (coro, inner):
                if c is not None:
                    c.close()
            raise SandboxError("client is closed: make a new libdsec.Client")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        """Cancel what still runs on the loop (waiting for it a moment), then stop and close it."""
        if self.stopped:
            return
        self.stopped = True
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(LEFT_WAIT)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


async def _cancel_all() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _iterate(loop: _Loop, make) -> Iterator:
    """Run an async iterator on the private loop, handing its items to this thread as they come."""
    q: queue.Queue = queue.Queue()

    async def pump() -> None:
        try:
            async for ev in make():
                q.put(ev)
        except BaseException as exc:
            q.put(exc)
        finally:
            q.put(_DONE)

    running = loop.submit(pump())
    item = None
    try:
        while (item := q.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        if item is not _DONE:   # left early: stop reading (a handle keeps what it read; the rest is still there)...
            running.cancel()
            with contextlib.suppress(queue.Empty):   # ...once its cleanup is done (sb.stream kills its command)
                while q.get(timeout=LEFT_WAIT) is not _DONE:
                    pass


def _iterate_exact(loop: _Loop, agen) -> Iterator:
    """One item at a time, nothing read ahead: what is not taken here stays for the next reader."""
    try:
        while True:
            try:
                item = loop.run(agen.__anext__())
            except StopAsyncIteration:
                return
            yield item
    finally:
        loop.run(agen.aclose())


class ExecHandle:
    """Synchronous twin of libdsec.ExecHandle: a background exec to stream, wait for or kill."""

    def __init__(self, loop: _Loop, inner: AsyncExecHandle) -> None:
        self._loop = loop
        self._inner = inner
        self.id = inner.id

    def __repr__(self) -> str:
        return repr(self._inner)

    @property
    def done(self) -> bool:
        """Its exit record has been read."""
        return self._inner.done

    def stream(self, lines: bool = True) -> Iterator[Output | Exit]:
        """Lines as they are produced (lines=False: chunks as they come), then the Exit; leave it any time,
        stream() again goes on from there."""
        return _iterate_exact(self._loop, self._inner.stream(lines))

    def wait(self) -> ExecResult:
        """Wait for the end (ExecTimeout past its timeout)."""
        return self._loop.run(self._inner.wait())

    def kill(self, signal: int = 9) -> bool:
        """Signal its processes (SIGKILL by default); False when it had already ended."""
        return self._loop.run(self._inner.kill(signal))

    @property
    def pid(self) -> int:
        """Its pid in the sandbox once its start record was read (started() waits for it)."""
        return self._inner.pid

    def started(self) -> int:
        """Wait until it started; its pid in the sandbox (0: its kind does not say)."""
        return self._loop.run(self._inner.started())

    def send_stdin(self, data: bytes | str, *, eof: bool = False) -> bool:
        """Write to its live stdin (started with stdin=True); False when it ended or closed its stdin."""
        return self._loop.run(self._inner.send_stdin(data, eof=eof))

    def close_stdin(self) -> bool:
        """End its live stdin."""
        return self._loop.run(self._inner.close_stdin())

    def resize(self, rows: int, cols: int) -> bool:
        """Resize its terminal (one started by Sandbox.terminal); False when it had ended."""
        return self._loop.run(self._inner.resize(rows, cols))

    def close(self) -> None:
        """Stop listening."""
        self._loop.run(self._inner.close())


class Files:
    """Synchronous sb.files (see libdsec.files.AsyncFiles for each method)."""

    def __init__(self, loop: _Loop, inner: AsyncFiles) -> None:
        self._loop = loop
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)   # get_info, exists, list, make_dir, remove, rename, read, write
        if name.startswith("_") or not callable(method):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._loop.run(method(*args, **kwargs))

    def read_pieces(self, path: str, **kwargs: Any) -> Iterator[bytes]:
        """The file's bytes a piece at a time, each read as the one before is taken."""
        return _iterate_exact(self._loop, self._inner.read_pieces(path, **kwargs))


class Sandbox:
    """Synchronous handle on one sandbox (see AsyncSandbox for each method)."""

    def __init__(self, client: "Client", inner: AsyncSandbox) -> None:
        self._client = client
        self._inner = inner
        self.id = inner.id
        self.node = inner.node
        self.files = Files(client._loop, inner.files)

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, node={self.node!r})"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._client._loop.run(self._inner.__aexit__(*exc))

    def exec(self, cmd, **kwargs: Any) -> Any:
        """Run a command to the end and return its ExecResult; background=True returns an ExecHandle
        (stream(), wait(), kill()) at once. Live stdin (an async iterable) needs the AsyncClient."""
        if kwargs.get("stdin") is not None and hasattr(kwargs["stdin"], "__aiter__"):   # (stdin=True is fine)
            raise InvalidRequest("a streamed (async iterable) stdin needs the AsyncClient; give bytes or str here")
        result = self._client._loop.run(self._inner.exec(cmd, **kwargs))
        return ExecHandle(self._client._loop, result) if kwargs.get("background") else result

    def stream(self, cmd, **kwargs: Any) -> Iterator[Output | Exit]:
        """Yield Output per line as produced, then Exit."""
        return _iterate(self._client._loop, lambda: self._inner.stream(cmd, **kwargs))

    def write_file(self, path: str, data: bytes | str, **kwargs: Any) -> None:
        """Write a file inside the sandbox."""
        self._client._loop.run(self._inner.write_file(path, data, **kwargs))

    def read_file(self, path: str, **kwargs: Any) -> bytes:
        """Read a file inside the sandbox."""
        return self._client._loop.run(self._inner.read_file(path, **kwargs))

    def destroy(self, **kwargs: Any) -> None:
        """Destroy it."""
        self._client._loop.run(self._inner.destroy(**kwargs))

    def snapshot(self, **kwargs: Any):
        """Snapshot it (tag=, memory=); the SnapshotRecord."""
        return self._client._loop.run(self._inner.snapshot(**kwargs))

    def rollback(self, snapshot, **kwargs: Any) -> None:
        """Put it back to a snapshot of its own."""
        self._client._loop.run(self._inner.rollback(snapshot, **kwargs))

    def suspend(self, **kwargs: Any) -> None:
        """Stop its processes; its memory stays."""
        self._client._loop.run(self._inner.suspend(**kwargs))

    def resume(self, **kwargs: Any) -> None:
        """Run it again after suspend."""
        self._client._loop.run(self._inner.resume(**kwargs))

    def set_timeout(self, seconds: float, **kwargs: Any) -> None:
        """It now expires `seconds` from now (0: at once)."""
        self._client._loop.run(self._inner.set_timeout(seconds, **kwargs))

    def processes(self, **kwargs: Any) -> list:
        """Its running execs (ProcessEntry: exec_id, pid, argv/shell, env, cwd, ...)."""
        return self._client._loop.run(self._inner.processes(**kwargs))

    def attach(self, exec_id: str | None = None, *, pid: int | None = None) -> ExecHandle:
        """A handle on an exec started before, by exec id or pid (its output from the first byte on)."""
        return ExecHandle(self._client._loop, self._client._loop.run(self._inner.attach(exec_id, pid=pid)))

    def kill_process(self, pid: int, signal: int = 9) -> bool:
        """Signal the running exec with that pid; False when none has it."""
        return self._client._loop.run(self._inner.kill_process(pid, signal))

    def send_stdin(self, pid: int, data: bytes | str, *, eof: bool = False) -> bool:
        """Write to the live stdin of the running exec with that pid."""
        return self._client._loop.run(self._inner.send_stdin(pid, data, eof=eof))

    def terminal(self, cmd=None, **kwargs: Any) -> ExecHandle:
        """A command on a terminal of its own (default: a login shell); send_stdin() what is typed, resize()."""
        return ExecHandle(self._client._loop, self._client._loop.run(self._inner.terminal(cmd, **kwargs)))

    def resize_terminal(self, pid: int, rows: int, cols: int) -> bool:
        """Resize the terminal of the running exec with that pid; False when it ended meanwhile."""
        return self._client._loop.run(self._inner.resize_terminal(pid, rows, cols))

    def set_network(self, network: Any, **kwargs: Any) -> None:
        """Change its network policy ("mirror-only" or libdsec.Network(allow=[...]))."""
        self._client._loop.run(self._inner.set_network(network, **kwargs))


class Client:
    """Synchronous SDK entry point; use as `with Client(url) as client`."""

    def __init__(self, url: str = "nats://127.0.0.1:4222", *, tenant: str | None = None, creds: str | None = None,
                 connect_timeout: float = 5.0) -> None:
        """creds and tenant as AsyncClient's."""
        self._loop = _Loop()
        self._async = AsyncClient(url, tenant=tenant, creds=creds, connect_timeout=connect_timeout)
        try:
            self._loop.run(self._async.connect())
        except BaseException:
            self._loop.stop()
            raise

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection and the private loop (then every call raises SandboxError; closing again
        does nothing)."""
        if self._loop.stopped:
            return
        try:
            self._loop.run(self._async.close())
        finally:
            self._loop.stop()

    def create(self, image: str = "busybox", **kwargs: Any) -> Sandbox:
        """Create one sandbox and wait until it runs."""
        return Sandbox(self, self._loop.run(self._async.create(image, **kwargs)))

    def call(self, cmd, **kwargs: Any):
        """One stateless call (see AsyncClient.call)."""
        return self._loop.run(self._async.call(cmd, **kwargs))

    def call_many(self, calls: list[dict[str, Any]]) -> list:
        """Many calls, results in input order (see AsyncClient.call_many)."""
        return self._loop.run(self._async.call_many(calls))

    def create_many(self, n: int, image: str = "busybox", **kwargs: Any) -> list[Sandbox]:
        """Create n sandboxes in one round (all or none)."""
        return [Sandbox(self, s) for s in self._loop.run(self._async.create_many(n, image, **kwargs))]

    def fork(self, snapshot, n: int = 1, **kwargs: Any) -> list[Sandbox]:
        """n new sandboxes from a snapshot (create's keyword arguments apply)."""
        return [Sandbox(self, s) for s in self._loop.run(self._async.fork(snapshot, n, **kwargs))]

    def snapshot(self, ref):
        """A snapshot's record by id (or the record itself, looked up again)."""
        return self._loop.run(self._async.snapshot(ref))

    def quota(self):
        """This tenant's quota and what its live sandboxes hold now."""
        return self._loop.run(self._async.quota())

    def snapshots(self, tag: str | None = None) -> list:
        """This tenant's snapshots (with tag, only those)."""
        return self._loop.run(self._async.snapshots(tag))

    def delete_snapshot(self, ref) -> None:
        """Delete a snapshot (its record and layers)."""
        self._loop.run(self._async.delete_snapshot(ref))

    def get(self, sandbox_id: str, **kwargs: Any) -> Sandbox:
        """Attach to a sandbox by id (one still starting is waited for: see AsyncClient.get)."""
        return Sandbox(self, self._loop.run(self._async.get(sandbox_id, **kwargs)))

    def suspend(self, **kwargs: Any) -> list[str]:
        """Freeze sandboxes by labels= or ids= (see AsyncClient.suspend)."""
        return self._loop.run(self._async.suspend(**kwargs))

    def resume(self, **kwargs: Any) -> list[str]:
        """Thaw them (see AsyncClient.resume)."""
        return self._loop.run(self._async.resume(**kwargs))

    def list(self, all_states: bool = False) -> list:
        """Sandbox records of this tenant."""
        return self._loop.run(self._async.list(all_states))

    def set_warm_pool(self, name: str, image: str = "busybox", **kwargs: Any):
        """Create or change a warm pool (see AsyncClient.set_warm_pool)."""
        return self._loop.run(self._async.set_warm_pool(name, image, **kwargs))

    def warm_pools(self) -> list:
        """Every warm pool with its ready sandboxes per node."""
        return self._loop.run(self._async.warm_pools())

    def delete_warm_pool(self, name: str) -> None:
        """Remove a warm pool."""
        self._loop.run(self._async.delete_warm_pool(name))

    def drop_trajectory_reader(self, durable: str) -> None:
        """Forget a durable trajectory reader (AsyncClient.drop_trajectory_reader)."""
        self._loop.run(self._async.drop_trajectory_reader(durable))

    def trajectories(self, **kwargs: Any) -> Iterator["Trajectory"]:
        """This tenant's trajectory records in order, one at a time (nothing read ahead); each a Trajectory
        (`.record`, `.seq`, `.ack()`). Arguments as AsyncClient.trajectories (job, sandbox, since, durable,
        follow, ack_wait)."""
        for item in _iterate_exact(self._loop, self._async.trajectories(**kwargs)):
            yield Trajectory(self._loop, item)


class Trajectory:
    """Synchronous twin of libdsec.Trajectory: one record of an episode; ack() it once it is processed."""

    def __init__(self, loop: _Loop, inner: Any) -> None:
        self._loop, self._inner = loop, inner
        self.record, self.seq = inner.record, inner.seq

    def __repr__(self) -> str:
        return f"Trajectory(seq={self.seq}, record={self.record!r})"

    def ack(self) -> None:
        """Processed: a durable consumer restarted later does not receive it again."""
        self._loop.run(self._inner.ack())

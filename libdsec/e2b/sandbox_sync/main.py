"""Sandbox: E2B's synchronous sandbox on DSec, the AsyncSandbox run on a private event loop thread."""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Iterator, List, Optional

from libdsec.e2b.exceptions import NOT_OFFERED, not_offered
from libdsec.e2b.sandbox.filesystem.watch_handle import FilesystemEvent
from libdsec.e2b.sandbox.sandbox_api import SandboxQuery
from libdsec.e2b.sandbox_async import main as aio
from libdsec.e2b.sandbox_async.filesystem.filesystem import AsyncFileStreamReader
from libdsec.e2b.sandbox_sync.commands.command_handle import CommandHandle, HandlerThread
from libdsec.e2b.sandbox_sync.commands.pty import Pty
from libdsec.e2b.sandbox_sync.filesystem.watch_handle import WatchHandle
from libdsec.sync import _Loop

_loop: Optional[_Loop] = None
_lock = threading.Lock()


def run(coro) -> Any:
    """Run a coroutine on the facade's loop thread (started on first use) and return its result."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = _Loop()
    return _loop.run(coro)


class Commands:
    """sandbox.commands (see AsyncCommands.run)."""

    def __init__(self, inner: aio.AsyncCommands) -> None:
        self._inner = inner

    def run(self, cmd: str, background: Optional[bool] = None, on_stdout: Optional[Callable[[str], None]] = None,
            on_stderr: Optional[Callable[[str], None]] = None, **kwargs: Any) -> Any:
        """Run cmd: a CommandResult (CommandExitException on a non-zero exit), or with background=True a
        CommandHandle at once. A foreground run's handlers run in this thread, as E2B's; a background one's
        given here in a thread of their own as its output comes, those given to wait() in the waiting thread."""
        if background and (on_stdout or on_stderr):   # (DSec's: E2B's sync run takes none with background)
            calls = HandlerThread(on_stdout, on_stderr)
            return CommandHandle(run, run(calls.started(self._inner.run(cmd, background=True, on_stdout=calls.stdout,
                                                                        on_stderr=calls.stderr, **kwargs))), calls=calls)
        h = CommandHandle(run, run(self._inner.run(cmd, background=True, **kwargs)), on_stdout, on_stderr)
        if background:
            return h
        try:
            return h.wait()
        except BaseException as exc:   # a handler that raised, Ctrl-C: the command is this call's, killed
            run(self._inner.end_left(h._inner, exc))
            raise

    def connect(self, pid: int, on_stdout: Optional[Callable[[str], None]] = None,
                on_stderr: Optional[Callable[[str], None]] = None, **kwargs: Any) -> CommandHandle:
        """A handle on the running command with that pid (see AsyncCommands.connect); its handlers run in
        this thread, in wait()."""
        return CommandHandle(run, run(self._inner.connect(pid, **kwargs)), on_stdout, on_stderr)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)   # list, kill, send_stdin, close_stdin
        if name.startswith("_") or not callable(method):
            raise AttributeError(name)
        return lambda *args, **kwargs: run(method(*args, **kwargs))


class Filesystem:
    """sandbox.files (see AsyncFilesystem); read(format="stream") gives an iterator."""

    def __init__(self, inner: aio.AsyncFilesystem) -> None:
        self._inner = inner

    def watch_dir(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None,
                  recursive: bool = False, timeout: Optional[float] = 0, include_entry: bool = False,
                  allow_network_mounts: bool = False) -> WatchHandle:
        """Watch path (recursive: every directory below it too) until stop(); get_new_events() gives what
        happened since the last call, up to the call. FileNotFoundException when path is no directory."""
        events: List[FilesystemEvent] = []
        inner = run(self._inner.watch_dir(path, events.append, user=user, recursive=recursive, timeout=timeout,
                                          include_entry=include_entry))
        return WatchHandle(run, inner, events)

    def read(self, path: str, format: str = "text", **kwargs: Any) -> Any:
        if format == "stream":
            return FileStreamReader(run(self._inner.read(path, "stream", **kwargs)))
        return run(self._inner.read(path, format, **kwargs))

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)   # write, write_files, list, exists, get_info, remove, rename, make_dir
        if name.startswith("_") or not callable(method):
            raise AttributeError(name)
        return lambda *args, **kwargs: run(method(*args, **kwargs))


class FileStreamReader:
    """read(format="stream"): an iterator of the file's bytes as they are read, a piece at a time, usable as a
    context manager; close() ends it."""

    def __init__(self, inner: AsyncFileStreamReader) -> None:
        self._inner = inner

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        try:
            return run(self._inner.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        run(self._inner.aclose())

    def __enter__(self) -> "FileStreamReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class by_id:
    """sb.kill() on an instance, Sandbox.kill(id) on the class (the async one's, run here); wrap(result) makes
    what the caller gets; run=False for a method that returns at once (a paginator)."""

    def __init__(self, name: str, wrap: Callable[[Any], Any] = lambda r: r, run: bool = True) -> None:
        self.name, self.wrap, self.run = name, wrap, run

    def __get__(self, obj, cls):
        fn = getattr(aio.AsyncSandbox, self.name)

        def call(*args: Any, **kwargs: Any) -> Any:
            result = fn(obj.sandbox_id, *args, **kwargs) if obj is not None else fn(*args, **kwargs)
            return self.wrap(run(result) if self.run else result)
        return functools.wraps(fn)(call)


class SandboxPaginator:
    """Pages of list() (SandboxInfo) or list_snapshots() (SnapshotInfo): has_next, next_token, next_items()."""

    def __init__(self, inner) -> None:
        self._inner = inner

    @property
    def has_next(self) -> bool:
        return self._inner.has_next

    @property
    def next_token(self) -> Optional[str]:
        return self._inner.next_token

    def next_items(self) -> List[Any]:
        return run(self._inner.next_items())


SnapshotPaginator = SandboxPaginator


def _forks(made: List[Any]) -> List[Any]:
    return [Sandbox(m) if isinstance(m, aio.AsyncSandbox) else m for m in made]


class Sandbox:
    """E2B's Sandbox: `Sandbox.create(...)` (or `with Sandbox.create() as sb:`), .commands, .files, kill()."""

    kill = by_id("kill")
    get_info = by_id("get_info")
    pause = by_id("pause")
    set_timeout = by_id("set_timeout")
    create_snapshot = by_id("create_snapshot")
    list_snapshots = by_id("list_snapshots", wrap=lambda p: SnapshotPaginator(p), run=False)
    fork = by_id("fork", wrap=lambda made: _forks(made))
    connect = by_id("connect", wrap=lambda inner: Sandbox(inner))
    beta_pause = by_id("beta_pause")

    @classmethod
    def delete_snapshot(cls, snapshot_id: str, **kwargs: Any) -> bool:
        return run(aio.AsyncSandbox.delete_snapshot(snapshot_id, **kwargs))

    def __init__(self, inner: aio.AsyncSandbox) -> None:
        self._inner = inner
        self.sandbox_id = inner.sandbox_id
        self.commands = Commands(inner.commands)
        self.files = Filesystem(inner.files)
        self.pty = Pty(run, inner.pty)
        self._envd_version = inner._envd_version

    def __repr__(self) -> str:
        return f"Sandbox(sandbox_id={self.sandbox_id!r})"

    def __getattr__(self, name: str) -> Any:
        if name in NOT_OFFERED:
            raise not_offered(name)
        raise AttributeError(name)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()

    @classmethod
    def create(cls, template: Optional[str] = None, timeout: Optional[int] = None, **kwargs: Any) -> "Sandbox":
        """See AsyncSandbox.create."""
        return cls(run(aio.AsyncSandbox.create(template, timeout, **kwargs)))

    @staticmethod
    def list(query: Optional[SandboxQuery] = None, limit: Optional[int] = None, next_token: Optional[str] = None,
             **kwargs: Any) -> SandboxPaginator:
        return SandboxPaginator(aio.AsyncSandbox.list(query, limit, next_token, **kwargs))

    def is_running(self, **kwargs: Any) -> bool:
        return run(self._inner.is_running(**kwargs))

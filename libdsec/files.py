"""sb.files: the file tree of a sandbox (stat, list, mkdir, remove, rename) and files of any size, moved
in pieces of bus.messages.FILE_PIECE bytes, one op each, in order (edge/backends/treeops.py)."""
from __future__ import annotations

import asyncio
import contextlib
import posixpath
from typing import TYPE_CHECKING, AsyncIterator

from bus import kinds, validate
from bus.errors import ExecFailed, FileOpError, InvalidRequest
from bus.messages import (FILE_PIECE, FileEntry, FileEvent, FileOp, FileOpResult, file_event_decoder,
                          file_result_decoder)
from libdsec.exechandle import ExecHandle
from libdsec.ids import new_id
from libdsec.results import Exit, Output

if TYPE_CHECKING:
    from libdsec.sandbox import AsyncSandbox

DEFAULT_TIMEOUT = 30.0   # per piece or op
DEFAULT_WATCH = 3600.0   # seconds a watch lasts unless stopped
FLUSH_WAIT = 10.0        # seconds a watch's flush() waits for its mark


class AsyncFiles:
    """File operations of one sandbox; every path resolves inside its root (a planted symlink never
    leads out of it). Errors are FileOpError with one clear line ("no such file: /x", ...). Each runs as
    `user` (a name or uid[:gid] of the image; default: the sandbox's default user, its image's User, else
    root): permissions are checked as that user and what it creates is that user's."""

    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self._sb = sandbox

    async def _op(self, op: str, path: str, timeout: float = DEFAULT_TIMEOUT, user: str | None = None,
                  **fields) -> FileOpResult:
        self._sb._needs("file_tree", f"files.{op}")
        validate.file_path(path)
        if user is not None and not isinstance(user, str):
            raise InvalidRequest(f"user must be a name or uid[:gid] string, got {user!r}")
        kinds.require_user(self._sb.backend, user, f"files.{op}")
        sb = self._sb
        data = await sb.client._op(sb.node, sb.id, lambda rid, to, dl: FileOp(
            request_id=rid, sandbox_id=sb.id, op=op, path=path, reply_to=to, deadline=dl, user=user or "",
            **fields), timeout)
        return file_result_decoder.decode(data)

    async def get_info(self, path: str, *, timeout: float = DEFAULT_TIMEOUT, user: str | None = None) -> FileEntry:
        """The entry at path (a symlink itself, not what it points to)."""
        entry = (await self._op("stat", path, timeout, user)).entry
        assert entry is not None
        return entry

    async def exists(self, path: str, *, timeout: float = DEFAULT_TIMEOUT, user: str | None = None) -> bool:
        """Whether anything (a dangling symlink too) is at path."""
        try:
            await self._op("stat", path, timeout, user)
            return True
        except FileOpError as err:
            if str(err).startswith(("no such file", "no such directory", "not a directory")):
                return False
            raise

    async def list(self, path: str, *, depth: int = 1, timeout: float = DEFAULT_TIMEOUT,
                   user: str | None = None) -> list[FileEntry]:
        """The entries under directory path, depth levels down (1: its own), sorted by path. A large tree
        comes a page (2,000 entries) per request, each page within timeout; an entry made or removed
        while the pages come may be missed, never listed twice."""
        found: list[FileEntry] = []
        after = ""
        while True:
            page = await self._op("list", path, timeout, user, depth=depth, after=after, paged=True)
            found += page.entries
            if not page.next:
                return found
            if page.next == after:
                raise FileOpError(f"listing {path} made no progress past {after!r}")
            after = page.next

    async def make_dir(self, path: str, *, timeout: float = DEFAULT_TIMEOUT, user: str | None = None) -> bool:
        """Make directory path and its missing parents; False when it was already there."""
        return (await self._op("mkdir", path, timeout, user)).made

    async def remove(self, path: str, *, timeout: float = DEFAULT_TIMEOUT, user: str | None = None) -> None:
        """Remove a file, a symlink or a whole directory tree."""
        await self._op("remove", path, timeout, user)

    async def rename(self, old_path: str, new_path: str, *, timeout: float = DEFAULT_TIMEOUT,
                     user: str | None = None) -> FileEntry:
        """Move old_path to new_path; the entry now at new_path."""
        validate.file_path(new_path)
        entry = (await self._op("rename", old_path, timeout, user, dest=new_path)).entry
        assert entry is not None
        return entry

    async def read(self, path: str, *, timeout: float = DEFAULT_TIMEOUT, user: str | None = None) -> bytes:
        """The whole file, any size, a piece per request. A file that changes while it is read gives
        FileOpError rather than a mix of its old and new bytes."""
        return b"".join([piece async for piece in self.read_pieces(path, timeout=timeout, user=user)])

    async def read_pieces(self, path: str, *, timeout: float = DEFAULT_TIMEOUT,
                          user: str | None = None) -> AsyncIterator[bytes]:
        """The file's bytes a piece (up to 512 KiB) at a time, each read when the one before was taken: a file of
        any size in bounded memory. FileOpError, at the piece where it shows, when the file changes meanwhile."""
        first = await self._op("read", path, timeout, user, offset=0, length=FILE_PIECE)
        got = len(first.data)
        if first.data:
            yield first.data
        while got < first.size:
            piece = await self._op("read", path, timeout, user, offset=got, length=FILE_PIECE)
            if piece.size != first.size or not piece.data:
                raise FileOpError(f"changed while read: {path} ({first.size} bytes, then {piece.size})")
            got += len(piece.data)
            yield piece.data
        if got != first.size:
            raise FileOpError(f"changed while read: {path} ({first.size} bytes, then {got})")

    async def write(self, path: str, data: bytes | str, *, mode: int = 0o644, metadata: dict[str, str] | None = None,
                    timeout: float = DEFAULT_TIMEOUT, user: str | None = None) -> None:
        """Create or truncate path with data (any size). metadata: kept as the file's user.<key> extended
        attributes (get_info(...).metadata gives them back), in place of any it had (a write without metadata
        clears them). Whole or not at all: data of more than one piece (512 KiB) is written, a piece per
        request, to a hidden file beside path (beside a symlink's target), then renamed over it, so a reader or
        another writer never sees a part of it, and a write that fails (FileOpError, e.g. the disk's quota)
        leaves path as it was. The file is then a new one: its owner is the writer (as root, the sandbox's
        root), and hard links to the old one keep the old bytes; a mount point (/etc/hosts) is written in
        place."""
        if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise InvalidRequest("metadata must map str to str")
        check_mode(mode)
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidRequest(f"data must be bytes or str, got {type(data).__name__}")
        if len(data) <= FILE_PIECE:
            await self._op("write", path, timeout, user, offset=0, data=bytes(data), mode=mode,
                           metadata=dict(metadata or {}))
            return
        if not posixpath.basename(path):
            raise InvalidRequest(f"path names no file: {path!r}")
        path = await self._through_links(path, timeout, user)   # a link's target is written, as in place
        head, name = posixpath.split(path)
        short = name.encode()[:150].decode(errors="ignore")          # (a name's bytes: the temp's fit in 255)
        partial = f"{head.rstrip('/')}/.{short}.dsec-{new_id('w')}"
        view = memoryview(data)

        async def pieces_to(target: str) -> None:
            for offset in range(0, len(data), FILE_PIECE):
                await self._op("write", target, timeout, user, offset=offset, data=bytes(view[offset:offset + FILE_PIECE]),
                               mode=mode, metadata=dict(metadata or {}) if offset == 0 else {})
        try:
            await pieces_to(partial)
            await self._op("rename", partial, timeout, user, dest=path)
        except BaseException as err:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._op("remove", partial, timeout, user))
            if not isinstance(err, FileOpError):
                raise
            if "busy" not in str(err).lower():   # (named by the path written, not the hidden file's name)
                raise FileOpError(str(err).replace(partial, path), **err.details) from None
            await pieces_to(path)   # a mount point (/etc/hosts): only in place

    async def _through_links(self, path: str, timeout: float, user: str | None) -> str:
        """Where path leads: its symlinks followed (at most 8), resolved inside the sandbox by every op after."""
        for _ in range(8):
            try:
                entry = (await self._op("stat", path, timeout, user)).entry
            except FileOpError:
                return path              # not there (yet): made by the write
            if entry is None or entry.type != "symlink" or not entry.symlink_target:
                return path
            target = entry.symlink_target
            path = posixpath.normpath(target if target.startswith("/") else
                                      posixpath.join(posixpath.dirname(path), target))
        return path

    async def watch(self, path: str, *, recursive: bool = False, timeout: float = DEFAULT_WATCH) -> "DirWatch":
        """Watch directory path (and, recursive, every directory below it, new ones too) for `timeout`
        seconds: events() yields a FileEvent per change as it happens (create, write, remove, rename, chmod;
        name relative to path; `overflow` when the node's queue overflowed and events were lost) until
        stop(), the timeout or the directory's removal. Returns once the watch is in place: every change made
        after it is reported. FileOpError when path is no directory of the sandbox."""
        self._sb._needs("watch", "files.watch")
        validate.file_path(path)
        handle = await self._sb._start("", timeout, None, None, True, 16 << 20, background=True, keep_output=False,
                                       what={"watch": path, "recursive": bool(recursive)})
        try:
            try:
                await handle.started()   # in place: every change from now on is reported
                if not handle.start_seen:   # it ended without starting: why
                    await handle.wait()
                    raise FileOpError(f"the watch of {path} ended before it started")
            except ExecFailed as err:
                raise FileOpError(str(err)) from None
        except BaseException:
            await handle.close()
            raise
        return DirWatch(handle, path)




def check_mode(mode: int) -> None:
    """A file's permission bits (setuid, setgid and sticky included); -1 was taken as 0o7777."""
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise InvalidRequest(f"mode must be permission bits, 0 to 0o7777, got {mode!r}")


class DirWatch:
    """A running watch: `async for ev in w.events()`, then stop() (or leave it to its timeout)."""

    def __init__(self, handle: ExecHandle, path: str) -> None:
        self._handle = handle
        self.path = path
        self.id = handle.id
        self.ended: Exit | None = None   # how it ended, once events() came to its end (.timed_out: its timeout)
        self._marks: dict[str, asyncio.Future] = {}

    async def events(self) -> AsyncIterator[FileEvent]:
        """Each event as it happens, until the watch ends (then .ended says how); SandboxNotFound when its
        sandbox ended under it."""
        try:
            async for ev in self._handle.stream():
                if not isinstance(ev, Output):
                    self.ended = ev
                    return
                if not ev.data.endswith(b"\n"):
                    continue
                event = file_event_decoder.decode(ev.data)
                if event.type == "mark":   # a flush() came back: what came before it is all here
                    waiter = self._marks.pop(event.name, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(None)
                    continue
                yield event
        finally:
            for waiter in self._marks.values():
                if not waiter.done():
                    waiter.set_result(None)

    async def flush(self, timeout: float = FLUSH_WAIT) -> None:
        """Return once every change made before this call has come out of events() (which must be being
        read meanwhile): the edge reads what its inotify queue holds, then sends a mark back."""
        name = new_id("m")
        waiter = self._marks[name] = asyncio.get_running_loop().create_future()
        try:
            if await self._handle.send_stdin(name):
                await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except asyncio.TimeoutError:
            raise FileOpError(f"the watch of {self.path} did not answer within {timeout:.0f}s") from None
        finally:
            self._marks.pop(name, None)

    async def stop(self) -> None:
        """End the watch (events already produced can still be read from events())."""
        await self._handle.kill(15)

    async def close(self) -> None:
        """Stop listening here (the watch ends at stop() or its timeout)."""
        await self._handle.close()

"""AsyncFilesystem: sandbox.files of E2B's async sandbox, on DSec's sb.files (libdsec/files.py).

A relative path resolves against the user's home (/home/user, /root for root), as E2B's does. Each call runs
as `user` (default: the image's default user, `user` in the base image): permissions are checked as that
user and what a write makes is its own (0644 files, 0755 directories). Metadata is kept in the file's
user.e2b.* xattrs, as E2B keeps it."""
from __future__ import annotations

import posixpath
from typing import IO, Any, AsyncIterator, Callable, Dict, List, Optional, Union

from bus.errors import DsecError, FileOpError
from libdsec.e2b.exceptions import FileNotFoundException, InvalidArgumentException, mapped
from libdsec.e2b.sandbox.filesystem.filesystem import (EntryInfo, FileType, WriteEntry, WriteInfo, entry_info,
                                                       metadata_xattrs)
from libdsec.e2b.sandbox.filesystem.watch_handle import FilesystemEvent
from libdsec.e2b.sandbox_async.filesystem.watch_handle import AsyncWatchHandle
from libdsec.sandbox import AsyncSandbox as NativeSandbox

NO_LIMIT = 24 * 3600.0   # a watch timeout of 0 (E2B: no limit)
PIECE = 1 << 20          # bytes a stream read hands out at once


KERNEL_VIEWS = ("/proc/", "/sys/", "/dev/")   # mounts of the sandbox's own, read from inside it


def absolute(path: str, user: Optional[str]) -> str:
    """path as the sandbox sees it: a relative one under the user's home, and ~ (~/...) that home, as E2B's."""
    if not isinstance(path, str) or not path:
        raise InvalidArgumentException(f"path must be a non-empty string, got {path!r}")
    if path.startswith("/"):
        return path
    home = "/root" if user in ("root", "0") else "/home/user"
    if path == "~" or path.startswith("~/"):
        return posixpath.normpath(home + path[1:])
    return posixpath.join(home, path)


def _ids(text: str) -> Dict[int, str]:
    """id -> name from /etc/passwd or /etc/group text."""
    out: Dict[int, str] = {}
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) > 2 and parts[2].isdigit():
            out.setdefault(int(parts[2]), parts[0])
    return out


class AsyncFileStreamReader:
    """read(format="stream"): an async iterator of the file's bytes as they are read, a piece at a time (a file of
    any size in bounded memory: it was read whole first, 609 MiB held for 200 MB), usable as an async context
    manager; aclose() ends it."""

    def __init__(self, pieces: AsyncIterator[bytes]) -> None:
        self._pieces = pieces

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._pieces.__anext__()
        except DsecError as err:
            raise mapped(err) from err

    async def aclose(self) -> None:
        await self._pieces.aclose()

    async def __aenter__(self) -> "AsyncFileStreamReader":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


async def _then(first: bytes, rest) -> AsyncIterator[bytes]:
    try:
        if first:
            yield first
        async for piece in rest:
            yield piece
    finally:
        await rest.aclose()


async def _once(data: bytes) -> AsyncIterator[bytes]:
    """A file read whole (a kernel view's, by cat) as stream pieces."""
    for at in range(0, len(data), PIECE):
        yield data[at:at + PIECE]


class AsyncFilesystem:
    """sandbox.files: the sandbox's file tree; paths resolve inside its root."""

    def __init__(self, sb: NativeSandbox) -> None:
        self._sb = sb
        self._files = sb.files
        self._names: Optional[Dict[str, Dict[int, str]]] = None

    async def _do(self, work):
        try:
            return await work
        except DsecError as err:
            raise mapped(err) from err

    async def _entry(self, e) -> EntryInfo:
        """EntryInfo with owner and group named as the sandbox's /etc/passwd and /etc/group name them."""
        if self._names is None:
            names: Dict[str, Dict[int, str]] = {}
            for key, path in (("uid", "/etc/passwd"), ("gid", "/etc/group")):
                try:
                    names[key] = _ids((await self._files.read(path, user="root")).decode(errors="replace"))
                except DsecError:
                    names[key] = {}
            self._names = names
        return entry_info(e, self._names)

    async def read(self, path: str, format: str = "text", user: Optional[str] = None,
                   request_timeout: Optional[float] = None, gzip: bool = False,
                   stream_idle_timeout: Optional[float] = None) -> Any:
        """The file as text (UTF-8), bytes (a bytearray) or a stream (AsyncFileStreamReader). gzip: E2B's
        transfer encoding, nothing to do here (the bus moves the bytes)."""
        if format not in ("text", "bytes", "stream"):
            raise InvalidArgumentException(f"format must be text, bytes or stream, got {format!r}")
        path = absolute(path, user)
        if format == "stream" and not path.startswith(KERNEL_VIEWS):   # its first piece read now: errors said here
            pieces = self._files.read_pieces(path, user=user)
            try:
                first = await pieces.__anext__()
            except StopAsyncIteration:
                first = b""
            except DsecError as err:
                raise mapped(err) from err
            return AsyncFileStreamReader(_then(first, pieces))
        if path.startswith(KERNEL_VIEWS):
            data = await self._kernel_view(path, user)
        else:
            data = await self._do(self._files.read(path, user=user))
        if format == "text":
            return data.decode(errors="replace")
        if format == "bytes":
            return bytearray(data)
        return AsyncFileStreamReader(_once(data))

    async def _kernel_view(self, path: str, user: Optional[str]) -> bytes:
        """A file of the sandbox's /proc, /sys or /dev (its own kernel views, which the edge's file operations do
        not enter), read by `cat` inside the sandbox as user: what a program of the sandbox reads there."""
        res = await self._do(self._sb.exec(["cat", "--", path], user=user))
        if res.exit_code:
            why = res.stderr.decode(errors="replace").strip()
            raise mapped(FileOpError(f"no such file: {path}" if "No such file" in why
                                     else f"cannot read {path}: {why or f'cat exited {res.exit_code}'}"))
        return res.stdout

    async def write(self, path: str, data: Union[str, bytes, IO], user: Optional[str] = None,
                    request_timeout: Optional[float] = None, gzip: bool = False,
                    use_octet_stream: Optional[bool] = None, metadata: Optional[Dict[str, str]] = None) -> WriteInfo:
        """Create or overwrite path (its missing parent directories are made); metadata: its user.e2b.* xattrs
        (a rewrite without metadata clears them)."""
        xattrs = metadata_xattrs(metadata)
        path = absolute(path, user)
        if hasattr(data, "read"):
            data = data.read()
        parent = posixpath.dirname(path.rstrip("/"))
        if parent not in ("", "/"):
            await self._do(self._files.make_dir(parent, user=user))
        await self._do(self._files.write(path, data, metadata=xattrs, user=user))
        return WriteInfo(name=posixpath.basename(path), type=FileType.FILE, path=path,
                         metadata=dict(metadata) if metadata else None)

    async def write_files(self, files: List[WriteEntry], user: Optional[str] = None,
                          request_timeout: Optional[float] = None, gzip: bool = False,
                          use_octet_stream: Optional[bool] = None,
                          metadata: Optional[Dict[str, str]] = None) -> List[WriteInfo]:
        """Write several files ({"path", "data"} each), in order."""
        out = []
        for f in files:
            path, data = (f["path"], f["data"]) if isinstance(f, dict) else (f.path, f.data)
            out.append(await self.write(path, data, user=user, metadata=metadata))
        return out

    async def list(self, path: str, depth: Optional[int] = 1, user: Optional[str] = None,
                   request_timeout: Optional[float] = None) -> List[EntryInfo]:
        """The entries under path, depth levels down."""
        if depth is not None and depth < 1:
            raise InvalidArgumentException("depth should be at least 1")
        entries = await self._do(self._files.list(absolute(path, user), depth=depth or 1, user=user))
        return [await self._entry(e) for e in entries]

    async def exists(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> bool:
        return await self._do(self._files.exists(absolute(path, user), user=user))

    async def get_info(self, path: str, user: Optional[str] = None,
                       request_timeout: Optional[float] = None) -> EntryInfo:
        return await self._entry(await self._do(self._files.get_info(absolute(path, user), user=user)))

    async def remove(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> None:
        """Remove a file or a directory tree; nothing there is no error, as in E2B."""
        try:
            await self._do(self._files.remove(absolute(path, user), user=user))
        except FileNotFoundException:
            pass

    async def rename(self, old_path: str, new_path: str, user: Optional[str] = None,
                     request_timeout: Optional[float] = None) -> EntryInfo:
        return await self._entry(await self._do(self._files.rename(absolute(old_path, user),
                                                                   absolute(new_path, user), user=user)))

    async def make_dir(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> bool:
        return await self._do(self._files.make_dir(absolute(path, user), user=user))

    async def watch_dir(self, path: str, on_event: Callable[[FilesystemEvent], Any],
                        on_exit: Optional[Callable[[Optional[Exception]], Any]] = None, user: Optional[str] = None,
                        request_timeout: Optional[float] = None, timeout: Optional[float] = 60,
                        recursive: bool = False, include_entry: bool = False,
                        allow_network_mounts: bool = False) -> AsyncWatchHandle:
        """Call on_event for each change under path (recursive: in every directory below it too) for `timeout`
        seconds (0: no limit); returns once the watch is in place. include_entry: each event with the entry's
        EntryInfo where it still exists. FileNotFoundException when path is no directory."""
        where = absolute(path, user)
        watch = await self._do(self._files.watch(where, recursive=recursive,
                                                 timeout=NO_LIMIT if not timeout else float(timeout)))
        entry = (lambda name: self._entry_or_none(posixpath.join(where, name))) if include_entry else None
        return AsyncWatchHandle(watch, on_event, on_exit, entry)

    async def _entry_or_none(self, path: str) -> Optional[EntryInfo]:
        try:
            return await self._entry(await self._files.get_info(path, user="root"))
        except DsecError:
            return None

"""AsyncFilesystem: sandbox.files of E2B's async sandbox, on DSec's sb.files (libdsec/files.py).

A relative path resolves against the user's home (/home/user, /root for root), as E2B's does. Each call runs
as `user` (default: the image's default user, `user` in the base image): permissions are checked as that
user and what a write makes is its own (0644 files, 0755 directories)."""
from __future__ import annotations

import posixpath
from typing import IO, Any, Callable, Dict, List, Optional, Union

from bus.errors import DsecError
from libdsec.e2b.exceptions import InvalidArgumentException, mapped
from libdsec.e2b.sandbox.filesystem.filesystem import EntryInfo, FileType, WriteEntry, WriteInfo, entry_info
from libdsec.e2b.sandbox.filesystem.watch_handle import FilesystemEvent
from libdsec.e2b.sandbox_async.filesystem.watch_handle import AsyncWatchHandle
from libdsec.sandbox import AsyncSandbox as NativeSandbox

NO_LIMIT = 24 * 3600.0   # a watch timeout of 0 (E2B: no limit)


def absolute(path: str, user: Optional[str]) -> str:
    """path as the sandbox sees it: a relative one under the user's home."""
    if not isinstance(path, str) or not path:
        raise InvalidArgumentException(f"path must be a non-empty string, got {path!r}")
    if path.startswith("/"):
        return path
    return posixpath.join("/root" if user in ("root", "0") else "/home/user", path)


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
                   request_timeout: Optional[float] = None, gzip: bool = False,
                   stream_idle_timeout: Optional[float] = None) -> Any:
        """The file as text (UTF-8), bytes (a bytearray) or a stream (an async iterator of one piece).
        gzip: E2B's transfer encoding, nothing to do here (the bus moves the bytes)."""
        if format not in ("text", "bytes", "stream"):
            raise InvalidArgumentException(f"format must be text, bytes or stream, got {format!r}")
        data = await self._do(self._files.read(absolute(path, user), user=user))
        if format == "text":
            return data.decode(errors="replace")
        if format == "bytes":
            return bytearray(data)

        async def pieces():
            yield data
        return pieces()

    async def write(self, path: str, data: Union[str, bytes, IO], user: Optional[str] = None,
                    request_timeout: Optional[float] = None, gzip: bool = False,
                    use_octet_stream: Optional[bool] = None, metadata: Optional[Dict[str, str]] = None) -> WriteInfo:
        """Create or overwrite path (its missing parent directories are made); metadata: its user.* xattrs."""
        path = absolute(path, user)
        if hasattr(data, "read"):
            data = data.read()
        parent = posixpath.dirname(path.rstrip("/"))
        if parent not in ("", "/"):
            await self._do(self._files.make_dir(parent, user=user))
        await self._do(self._files.write(path, data, metadata=metadata, user=user))
        return WriteInfo(name=posixpath.basename(path), type=FileType.FILE, path=path)

    async def write_files(self, files: List[WriteEntry], user: Optional[str] = None,
                          request_timeout: Optional[float] = None, gzip: bool = False,
                          use_octet_stream: Optional[bool] = None,
                          metadata: Optional[Dict[str, str]] = None) -> List[WriteInfo]:
        """Write several files, in order."""
        return [await self.write(f.path, f.data, user=user, metadata=metadata) for f in files]

    async def list(self, path: str, depth: Optional[int] = 1, user: Optional[str] = None,
                   request_timeout: Optional[float] = None) -> List[EntryInfo]:
        """The entries under path, depth levels down."""
        if depth is not None and depth < 1:
            raise InvalidArgumentException("depth should be at least one")
        return [entry_info(e) for e in await self._do(self._files.list(absolute(path, user), depth=depth or 1,
                                                                         user=user))]

    async def exists(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> bool:
        return await self._do(self._files.exists(absolute(path, user), user=user))

    async def get_info(self, path: str, user: Optional[str] = None,
                       request_timeout: Optional[float] = None) -> EntryInfo:
        return entry_info(await self._do(self._files.get_info(absolute(path, user), user=user)))

    async def remove(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> None:
        await self._do(self._files.remove(absolute(path, user), user=user))

    async def rename(self, old_path: str, new_path: str, user: Optional[str] = None,
                     request_timeout: Optional[float] = None) -> EntryInfo:
        return entry_info(await self._do(self._files.rename(absolute(old_path, user), absolute(new_path, user),
                                                            user=user)))

    async def make_dir(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> bool:
        return await self._do(self._files.make_dir(absolute(path, user), user=user))

    async def watch_dir(self, path: str, on_event: Callable[[FilesystemEvent], Any],
                        on_exit: Optional[Callable[[Optional[Exception]], Any]] = None, user: Optional[str] = None,
                        request_timeout: Optional[float] = None, timeout: Optional[float] = 60,
                        recursive: bool = False, include_entry: bool = False,
                        allow_network_mounts: bool = False) -> AsyncWatchHandle:
        """Call on_event for each change under path (recursive: in every directory below it too) for `timeout`
        seconds (0: no limit); returns once the watch is in place. FileNotFoundException when path is no
        directory."""
        watch = await self._do(self._files.watch(absolute(path, user), recursive=recursive,
                                                 timeout=NO_LIMIT if not timeout else float(timeout)))
        return AsyncWatchHandle(watch, on_event, on_exit)

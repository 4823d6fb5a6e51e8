"""AsyncWatchHandle: a running watch_dir, its events handed to on_event as they happen."""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Optional

from bus.errors import DsecError
from libdsec.e2b.exceptions import TimeoutException, mapped
from libdsec.e2b.sandbox.filesystem.watch_handle import FilesystemEvent, event_of
from libdsec.e2b.sandbox_async.commands.command_handle import call_handler
from libdsec.files import DirWatch


class AsyncWatchHandle:
    """stop() ends the watch; on_exit(None | exception) is called once when it ends, however it ends."""

    def __init__(self, watch: DirWatch, on_event: Callable[[FilesystemEvent], Any],
                 on_exit: Optional[Callable[[Optional[Exception]], Any]] = None,
                 entry: Optional[Callable[[str], Awaitable[Any]]] = None) -> None:
        self._watch = watch
        self._on_event, self._on_exit, self._entry = on_event, on_exit, entry
        self._pump = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        error: Optional[Exception] = None
        try:
            async for ev in self._watch.events():
                mine = event_of(ev)
                if mine is not None:
                    if self._entry is not None:
                        mine.entry = await self._entry(mine.name)
                    await call_handler(self._on_event, mine)
        except DsecError as err:
            error = mapped(err)
        except Exception as exc:   # the caller's on_event failed: the watch ends, on_exit says why
            error = exc
        finally:
            await self._watch.close()
        if error is None and self._watch.ended is not None and self._watch.ended.timed_out:
            # as E2B's (its stream's deadline): on_exit(None) said the watch was stopped (helper-41)
            error = TimeoutException(f"the watch of {self._watch.path} ended at its timeout")
        await call_handler(self._on_exit, error)

    async def flush(self) -> None:
        """Return once every change made before this call was handed to on_event."""
        try:
            await self._watch.flush()
        except DsecError as err:
            raise mapped(err) from err

    async def stop(self) -> None:
        """Stop watching (events already produced are still handed out)."""
        try:
            await self._watch.stop()
        except DsecError as err:
            raise mapped(err) from err
        await asyncio.shield(self._pump)

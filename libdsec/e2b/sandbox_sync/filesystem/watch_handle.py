"""WatchHandle: a running watch_dir, polled with get_new_events()."""
from __future__ import annotations

from typing import Any, Callable, List, Optional

from libdsec.e2b.exceptions import SandboxException
from libdsec.e2b.sandbox.filesystem.watch_handle import FilesystemEvent


class WatchHandle:
    """get_new_events() returns what happened since the last call; stop() ends the watch."""

    def __init__(self, run: Callable[[Any], Any], inner: Any, events: List[FilesystemEvent]) -> None:
        self._run, self._inner, self._events = run, inner, events
        self._closed = False

    def get_new_events(self, request_timeout: Optional[float] = None) -> List[FilesystemEvent]:
        """The events since the last call (or since the watch started)."""
        if self._closed:
            raise SandboxException("The watcher is already stopped")
        self._run(self._inner.flush())   # every change made before now is in
        new, self._events[:] = list(self._events), []
        return new

    def stop(self, request_timeout: Optional[float] = None) -> None:
        """Stop watching."""
        self._run(self._inner.stop())
        self._closed = True

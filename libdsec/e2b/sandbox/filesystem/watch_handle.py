"""Filesystem events, as in E2B."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional


class FilesystemEventType(enum.Enum):
    """What happened to an entry of a watched directory."""

    CHMOD = "chmod"
    CREATE = "create"
    REMOVE = "remove"
    RENAME = "rename"
    WRITE = "write"


@dataclass
class FilesystemEvent:
    """One change: name relative to the watched directory; entry (watch_dir(include_entry=True)): what is at it
    now, None when nothing is."""

    name: str
    type: FilesystemEventType
    entry: Optional[Any] = None


def event_of(ev) -> Optional[FilesystemEvent]:
    """DSec's FileEvent as E2B's (None for DSec's `overflow`, which E2B has no type for)."""
    try:
        return FilesystemEvent(name=ev.name, type=FilesystemEventType(ev.type))
    except ValueError:
        return None

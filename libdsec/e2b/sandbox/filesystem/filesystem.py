"""Entries of a sandbox's file tree, as in E2B."""
from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass, field
from typing import IO, Dict, Optional, Union

from bus.messages import FileEntry


class FileType(enum.Enum):
    """What an entry is (E2B has only files and directories: a symlink is what it points to, other kinds
    show as files)."""

    FILE = "file"
    DIR = "dir"


@dataclass
class EntryInfo:
    """One entry: E2B's fields (owner and group are numeric ids as the sandbox sees them)."""

    name: str
    type: Optional[FileType]
    path: str
    size: int
    mode: int
    permissions: str
    owner: str
    group: str
    modified_time: datetime.datetime
    symlink_target: Optional[str] = None
    metadata: Dict[str, str] = field(default_factory=dict)   # its user.* xattrs


@dataclass
class WriteInfo:
    """Where a write went."""

    name: str
    type: Optional[FileType]
    path: str


@dataclass
class WriteEntry:
    """One file of write_files."""

    path: str
    data: Union[str, bytes, IO]


def entry_info(e: FileEntry) -> EntryInfo:
    """An EntryInfo from DSec's FileEntry."""
    return EntryInfo(name=e.name, type=FileType.DIR if e.type == "dir" else FileType.FILE, path=e.path, size=e.size,
                     mode=e.mode, permissions=e.permissions, owner=str(e.uid), group=str(e.gid),
                     modified_time=datetime.datetime.fromtimestamp(e.mtime, datetime.timezone.utc),
                     symlink_target=e.symlink_target or None, metadata=dict(e.metadata))

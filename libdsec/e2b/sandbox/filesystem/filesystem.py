"""Entries of a sandbox's file tree, as in E2B."""
from __future__ import annotations

import datetime
import enum
import posixpath
import re
import stat
from dataclasses import dataclass, field
from typing import IO, Dict, Optional, TypedDict, Union

from bus.messages import FileEntry
from libdsec.e2b.exceptions import InvalidArgumentException


class FileType(enum.Enum):
    """What an entry is; a symlink shows as what it points to (a file, or a directory), as E2B's do."""

    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"


METADATA_PREFIX = "e2b."   # E2B's metadata lives in the user.e2b.* namespace of a file's xattrs
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")   # an HTTP header token, as E2B's keys must be
_VALUE = re.compile(r"[\x20-\x7e\t]*")                 # an HTTP header value's characters


def metadata_xattrs(metadata: Optional[Dict[str, str]]) -> Optional[Dict[str, str]]:
    """E2B metadata as DSec's (keys under e2b.); InvalidArgumentException for a key E2B refuses."""
    if metadata is None:
        return None
    for key, value in metadata.items():
        if not isinstance(key, str) or not _TOKEN.fullmatch(key):
            raise InvalidArgumentException(f"metadata key {key!r}: a non-empty HTTP header token")
        if not isinstance(value, str) or not _VALUE.fullmatch(value):
            raise InvalidArgumentException(f"metadata value of {key!r}: printable ASCII only")
    return {METADATA_PREFIX + k: v for k, v in metadata.items()}


def metadata_of(xattrs: Dict[str, str]) -> Optional[Dict[str, str]]:
    """A file's user.e2b.* xattrs as E2B metadata (None when it has none)."""
    mine = {k[len(METADATA_PREFIX):]: v for k, v in xattrs.items() if k.startswith(METADATA_PREFIX)}
    return mine or None


@dataclass
class WriteInfo:
    """Where a write went (metadata: what it stored, None when none)."""

    name: str
    type: Optional[FileType]
    path: str
    metadata: Optional[Dict[str, str]] = field(default=None, kw_only=True)


@dataclass
class EntryInfo(WriteInfo):
    """One entry: E2B's fields (owner and group by name where the sandbox's passwd and group name them)."""

    size: int
    mode: int
    permissions: str
    owner: str
    group: str
    modified_time: datetime.datetime
    symlink_target: Optional[str] = None


class WriteEntry(TypedDict):
    """One file of write_files: {"path": ..., "data": ...}."""

    path: str
    data: Union[str, bytes, IO]


def entry_info(e: FileEntry, names: Optional[Dict[str, Dict[int, str]]] = None) -> EntryInfo:
    """An EntryInfo from DSec's FileEntry (names: uid and gid names of the sandbox, when read)."""
    names = names or {}
    target = None
    kind = FileType.DIR if e.type == "dir" else FileType.FILE
    if e.symlink_target:   # E2B: the absolute path it points to; the entry's type, a file's
        target = posixpath.normpath(posixpath.join(posixpath.dirname(e.path), e.symlink_target))
    return EntryInfo(name=e.name, type=kind, path=e.path, size=e.size, mode=e.mode & 0o7777,
                     permissions=_filemode(e.type, e.mode),
                     owner=names.get("uid", {}).get(e.uid, str(e.uid)),
                     group=names.get("gid", {}).get(e.gid, str(e.gid)),
                     modified_time=datetime.datetime.fromtimestamp(e.mtime, datetime.timezone.utc),
                     symlink_target=target, metadata=metadata_of(e.metadata))


def _filemode(kind: str, mode: int) -> str:
    """ls -l's mode string of an entry whose mode holds only its permission bits."""
    bits = {"dir": stat.S_IFDIR, "symlink": stat.S_IFLNK}.get(kind, stat.S_IFREG)
    return stat.filemode(bits | mode)

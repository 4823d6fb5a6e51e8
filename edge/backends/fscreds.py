"""File operations as a user of the sandbox (files.*(user=...)): the calling thread's filesystem ids and
groups become the user's host ids for the operation, so the kernel checks every permission as that user and
what it creates is that user's; then they are host root's again.

setfsuid, setfsgid and a raw setgroups change the calling thread only (glibc's setgroups would change every
thread of the edge), and a non-zero fsuid drops the filesystem capabilities (DAC override, chown, fowner)
from the thread's effective set until it is 0 again (capabilities(7)). Run it in a worker thread (the file
ops do: asyncio.to_thread), never on the event loop's.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from typing import Iterator

SYS_SETGROUPS, SYS_SETFSUID, SYS_SETFSGID, SYS_SETRESUID = 116, 122, 123, 117   # x86_64
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _setgroups(groups: list[int]) -> None:
    array = (ctypes.c_uint * max(1, len(groups)))(*groups)
    if _libc.syscall(SYS_SETGROUPS, len(groups), array) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"setgroups: {os.strerror(e)}")


def _setfs(call: int, value: int) -> None:
    _libc.syscall(call, value)
    if _libc.syscall(call, -1) != value:   # (returns the previous id, never an error: asked again)
        raise OSError(1, f"cannot take filesystem id {value}")


@contextlib.contextmanager
def as_user(uid: int, gid: int, groups: tuple[int, ...]) -> Iterator[None]:
    """This thread's file accesses as host uid/gid with these supplementary groups, inside the block."""
    saved = os.getgroups()
    _setgroups(list(groups))
    try:
        _setfs(SYS_SETFSGID, gid)
        try:
            _setfs(SYS_SETFSUID, uid)
            try:
                yield
            finally:
                _setfs(SYS_SETFSUID, 0)
        finally:
            _setfs(SYS_SETFSGID, 0)
    finally:
        _setgroups(saved)


@contextlib.contextmanager
def as_euid(uid: int) -> Iterator[None]:
    """This thread's effective uid host uid `uid` inside the block (what the kernel charges per-user counts
    to: an inotify instance); its real and saved uids stay root's, so it takes root's back after, and its
    capabilities with it. Never on the event loop's thread."""
    if _libc.syscall(SYS_SETRESUID, -1, uid, -1) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"seteuid: {os.strerror(e)}")
    try:
        yield
    finally:
        if _libc.syscall(SYS_SETRESUID, -1, 0, -1) != 0:   # cannot fail with root's real uid: never go on as another
            os._exit(70)

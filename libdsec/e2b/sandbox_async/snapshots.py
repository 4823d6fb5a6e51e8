"""create_snapshot, list_snapshots, delete_snapshot and fork of the E2B facade, on DSec's snapshots (a
sandbox's filesystem as layers; for container sandboxes not its memory: a fork starts its processes afresh)."""
from __future__ import annotations

import asyncio
import contextlib
import re
import time
from typing import Any, List, Optional

from bus.errors import DsecError, ImageNotFound, InvalidRequest
from libdsec.e2b.exceptions import SandboxException, mapped
from libdsec.e2b.sandbox.sandbox_api import SnapshotInfo, snapshot_info

SNAPSHOT_ID = re.compile(r"snap[0-9a-f]{16}")   # edge/sandboxes.py names them so; create(template=) tells by it
FORK_TAG = "e2b-fork"


def is_snapshot(template: str) -> bool:
    """Whether create()'s template names a snapshot (else an image)."""
    return bool(SNAPSHOT_ID.fullmatch(template))


async def create_snapshot(client, sandbox_id: str, name: Optional[str] = None) -> SnapshotInfo:
    """Snapshot the sandbox (frozen for the moment it takes); name is its tag."""
    try:
        native = await client.get(sandbox_id)
        return snapshot_info(await native.snapshot(tag=name or ""))
    except DsecError as err:
        raise mapped(err) from err


class AsyncSnapshotPaginator:
    """Pages of list_snapshots(): has_next, next_token, await next_items() (newest last, as DSec keeps them)."""

    def __init__(self, client_of, sandbox_id: Optional[str], limit: Optional[int], next_token: Optional[str],
                 name: Optional[str]) -> None:
        self._client_of = client_of
        self.sandbox_id, self.name = sandbox_id, name
        self.limit = limit or 100
        self.next_token = next_token or ""
        self.has_next = True

    async def next_items(self) -> List[SnapshotInfo]:
        if not self.has_next:
            raise SandboxException("no more items")
        try:
            snaps = await (await self._client_of()).snapshots()
        except DsecError as err:
            raise mapped(err) from err
        wanted = [s for s in snaps if (not self.sandbox_id or s.sandbox_id == self.sandbox_id)
                  and (not self.name or self.name in (s.id, s.tag))]
        start = int(self.next_token) if self.next_token.isdigit() else 0
        page = wanted[start:start + self.limit]
        self.has_next = start + self.limit < len(wanted)
        self.next_token = str(start + self.limit) if self.has_next else ""
        return [snapshot_info(s) for s in page]


async def delete_snapshot(client, snapshot_id: str) -> bool:
    """True, or False when there is no such snapshot; refused (InvalidArgumentException) while a running
    sandbox or another snapshot uses it."""
    try:
        await client.delete_snapshot(snapshot_id)
        return True
    except ImageNotFound:
        return False
    except DsecError as err:
        raise mapped(err) from err


MAX_FORKS = 100   # sandboxes one fork() call makes (a timeout given where count goes would be hundreds)


async def fork(client, sandbox_id: str, make, timeout: Optional[int], count: Optional[int]) -> List[Any]:
    """One snapshot of the sandbox, then `count` sandboxes from it, each its own success or failure: a list of
    make(native) or the exception (mapped) per fork."""
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_FORKS):
        raise mapped(InvalidRequest(f"count must be an int from 1 to {MAX_FORKS}, got {count!r}"))
    try:
        native = await client.get(sandbox_id)
        await sweep_forks(client)
        snap = await native.snapshot(tag=FORK_TAG)
    except DsecError as err:
        raise mapped(err) from err
    results = await asyncio.gather(*(client.create(from_snapshot=snap, ttl=float(timeout or 300))
                                     for _ in range(count or 1)), return_exceptions=True)
    for r in results:
        if not isinstance(r, BaseException):
            _FORKED[r.id] = snap.id
    if all(isinstance(r, BaseException) for r in results):
        await _delete_quietly(client, snap.id)
    return [mapped(r) if isinstance(r, DsecError) else r if isinstance(r, BaseException) else make(r)
            for r in results]


_FORKED: dict[str, str] = {}   # fork sandbox id -> the snapshot it was made from (this process's forks)


SWEEP_AFTER = 600.0   # seconds: an e2b-fork snapshot of another process this old has its forks made


async def sweep_forks(client) -> None:
    """Delete the snapshots fork() made whose forks have all ended (one still in use is refused and kept):
    this process's, and any other's older than SWEEP_AFTER (a process that ended left them, and they held
    their image for good: helper U2). Only those whose forks were all made: another fork() may be between
    its snapshot and its creates."""
    for snap_id in set(_FORKED.values()):
        await _delete_quietly(client, snap_id)
    mine = set(_FORKED.values())
    old = time.time() - SWEEP_AFTER
    for snap in await client.snapshots(tag=FORK_TAG):
        if snap.id not in mine and snap.created_at < old:
            await _delete_quietly(client, snap.id)


async def forked_sandbox_gone(client, sandbox_id: str) -> None:
    """A fork this process made was killed: its snapshot goes too once its last fork is gone."""
    snap_id = _FORKED.pop(sandbox_id, None)
    if snap_id is not None and snap_id not in _FORKED.values():
        await _delete_quietly(client, snap_id)


async def _delete_quietly(client, snap_id: str) -> None:
    with contextlib.suppress(DsecError):   # in use by a fork or gone: kept, or nothing to do
        await client.delete_snapshot(snap_id)
        for fork_id in [k for k, v in _FORKED.items() if v == snap_id]:   # (forks ended by their timeout)
            del _FORKED[fork_id]

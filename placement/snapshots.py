"""The control API's snapshot handlers: a tenant's snapshots by id or tag, listed, deleted (KV
dsec-snapshots, bytes in object store dsec-layers). Only the server touches either."""
from __future__ import annotations

import contextlib
from typing import Awaitable, Callable

import msgspec

from bus import streams, subjects
from bus.apiwire import DeleteSnapshot, Done, GetSnapshot, ListSnapshots, SnapshotList
from bus.conn import Bus
from bus.errors import DsecError, ImageNotFound, InvalidRequest
from bus.records import SnapshotRecord, snapshot_decoder


class Snapshots:
    def __init__(self, bus: Bus, records: Callable[[str], Awaitable[list]]) -> None:
        self.bus = bus
        self.records = records   # tenant -> its sandbox records

    def handlers(self) -> dict:
        return {GetSnapshot: self._get, ListSnapshots: self._list, DeleteSnapshot: self._delete}

    async def all_of(self, tenant: str) -> list[SnapshotRecord]:
        recs = await self.bus.kv_values(streams.SNAPSHOTS_KV, snapshot_decoder, prefix=subjects.record_prefix(tenant))
        return sorted((r for r in recs if r.tenant == tenant), key=lambda r: (r.created_at, r.id))

    async def find(self, tenant: str, ref: str) -> SnapshotRecord:
        """By id, else the newest with that tag; ImageNotFound (another tenant's is one that does not exist)."""
        if not isinstance(ref, str) or not ref:
            raise InvalidRequest(f"snapshot: give an id or a tag, got {ref!r}")
        if subjects.is_token(ref):
            raw = await self.bus.kv_get(streams.SNAPSHOTS_KV, subjects.record_key(tenant, ref))
            try:
                rec = snapshot_decoder.decode(raw) if raw is not None else None
            except (msgspec.DecodeError, msgspec.ValidationError):
                rec = None
            if rec is not None and rec.tenant == tenant:
                return rec
        tagged = [s for s in await self.all_of(tenant) if s.tag == ref]
        if not tagged:
            raise ImageNotFound(f"snapshot {ref!r} not found")
        return tagged[-1]

    async def _get(self, tenant: str, req: GetSnapshot) -> SnapshotRecord:
        return await self.find(tenant, req.ref)

    async def _list(self, tenant: str, req: ListSnapshots) -> SnapshotList:
        return SnapshotList(snapshots=[s for s in await self.all_of(tenant) if not req.tag or s.tag == req.tag])

    async def _delete(self, tenant: str, req: DeleteSnapshot) -> Done:
        """Refused while another snapshot is built on it or a live sandbox uses its layer; its bytes go
        when no other snapshot holds them."""
        snap = await self.find(tenant, req.ref)
        own = snap.layers[-1].digest
        others = [s for s in await self.all_of(tenant) if s.id != snap.id and any(la.digest == own for la in s.layers)]
        children = [s.id for s in others if s.layers[-1].digest != own]   # the rest: twins (same bytes)
        if children:
            raise InvalidRequest(f"snapshot {snap.id} has snapshots built on it ({', '.join(children)}): delete them first")
        users = [r.sandbox_id for r in await self.records(tenant) if r.state in ("starting", "ready") and own in r.layers]
        if users:
            raise InvalidRequest(f"snapshot {snap.id} is in use by running sandboxes ({', '.join(users)})")
        await self.bus.kv_remove(streams.SNAPSHOTS_KV, subjects.record_key(snap.tenant, snap.id))
        if not others and not await self._held_elsewhere(own, tenant):
            await self.bus.obj_delete(streams.LAYERS_OBJ, own)
            with contextlib.suppress(DsecError):   # (an edge that misses it drops the file as its cache fills)
                await self.bus.send(subjects.layer_dropped(), own.encode())
        return Done()

    async def _held_elsewhere(self, digest: str, tenant: str) -> bool:
        """Whether another tenant's snapshot holds the same bytes (content-addressed: the same object)."""
        return any(rec.tenant != tenant and any(la.digest == digest for la in rec.layers)
                   for rec in await self.bus.kv_values(streams.SNAPSHOTS_KV, snapshot_decoder))

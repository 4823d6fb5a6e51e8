"""A watched, in-memory view of KV dsec-sandboxes by tenant, for the control API's lists: a list costs the
tenant's own records, not a pass over every tenant's. Before answering, the view waits until it has seen
the bucket's revision of that moment, so a list never misses a record stored before it was asked."""
from __future__ import annotations

import asyncio
import time

import msgspec

from bus import streams
from bus.conn import kv_watch
from bus.errors import BusError
from bus.messages import SandboxRecord, sandbox_decoder

CATCH_UP = 3.0     # seconds a list waits for the watch to reach the bucket's revision


class SandboxView:
    def __init__(self, bus) -> None:
        self.bus = bus
        self.by_tenant: dict[str, dict[str, SandboxRecord]] = {}
        self._tenant_of: dict[str, str] = {}    # key -> tenant (a delete names only the key)
        self._revision: dict[str, int] = {}     # key -> last revision applied (a resync repeats some)
        self.seen = 0                           # highest revision applied
        self._moved = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = await kv_watch(self.bus, streams.SANDBOXES_KV, self.on_change)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def on_change(self, key: str, raw: bytes | None, revision: int) -> None:
        if revision < self._revision.get(key, 0):
            return
        self._revision[key] = revision
        old = self._tenant_of.pop(key, None)
        if old is not None:
            self.by_tenant.get(old, {}).pop(key, None)
        rec = None
        if raw is not None:
            try:
                rec = sandbox_decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                rec = None
        if rec is not None:
            self.by_tenant.setdefault(rec.tenant, {})[key] = rec
            self._tenant_of[key] = rec.tenant
        if revision > self.seen:
            self.seen = revision
            self._moved.set()

    async def records(self, tenant: str) -> list[SandboxRecord]:
        """Every record of the tenant (any state) as of now, oldest first; BusError when the view cannot
        catch up with the bucket in time."""
        want = await self.bus.kv_last_revision(streams.SANDBOXES_KV)
        give_up = time.monotonic() + CATCH_UP
        while self.seen < want:
            left = give_up - time.monotonic()
            if left <= 0:
                raise BusError(f"the sandbox view is behind its bucket ({self.seen} < {want}): try again")
            self._moved.clear()
            try:
                await asyncio.wait_for(self._moved.wait(), left)
            except asyncio.TimeoutError:
                pass
        return sorted(self.by_tenant.get(tenant, {}).values(), key=lambda r: (r.created_at, r.sandbox_id))

"""Per-tenant quotas, configured in one place (KV dsec-quotas, `dsec quota set`), checked at admission.
A project's sandboxes count against its own quota and its tenant's.

A tenant with a quota has a usage record in KV dsec-tenants: the sandboxes it holds (sandbox id ->
resources, request deadline). Admission adds a hold by compare-and-set, so two engines admitting at
once can never together pass the limit; over the limit the request fails at once with QuotaExceeded,
it is never queued. Holds are released lazily, by the admission that needs the room: a hold whose
sandbox has a final state in KV dsec-sandboxes, or whose request deadline passed without a record,
counts no more. Nothing has to remember to release, so crashes leak no quota. A waiting request holds
its share (it is admitted), so a tenant cannot queue more than its quota either.
"""
from __future__ import annotations

import asyncio
import time

import msgspec

from bus import streams, subjects
from bus.conn import Bus
from bus.errors import QuotaExceeded
from bus.messages import CreateRequest, encode
from bus.records import Hold, Quota, TenantUsage, quota_decoder, sandbox_decoder, usage_decoder

GRACE = 5.0    # seconds after its request's deadline a hold with no sandbox record still counts
PRUNE_ABOVE = 512   # holds beyond which ended ones are released (keeps the record small)...
PRUNE_EVERY = 5.0   # ...at most this often per tenant and engine (a refusal always prunes first)


class Quotas:
    """The quota table (watched) and the admission check."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.table: dict[str, Quota] = {}
        self._pruned: dict[str, float] = {}   # tenant -> when its many holds were last pruned here

    def on_change(self, key: str, raw: bytes | None, _revision: int) -> None:
        """KV watch callback of dsec-quotas."""
        quota = None
        if raw is not None:
            try:
                quota = quota_decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                quota = None
        if quota is None or quota.tenant != key:
            self.table.pop(key, None)
        else:
            self.table[key] = quota

    def _limits(self, account: str) -> list[tuple[str, Quota]]:
        """The quotas a create of this account must fit: its own, and its tenant's for a project."""
        out = []
        for a in dict.fromkeys((account, subjects.tenant_root(account))):
            q = self.table.get(a)
            if q is not None and (q.max_sandboxes or q.max_cpu or q.max_memory):
                out.append((a, q))
        return out

    async def admit(self, req: CreateRequest) -> None:
        """Hold the request's share of its tenant's quota (and its project's), or raise QuotaExceeded.
        Idempotent. A tenant's usage record holds its projects' sandboxes too, so one compare-and-set
        checks both limits at once."""
        limits = self._limits(req.tenant)
        if not limits:
            return
        root = subjects.tenant_root(req.tenant)
        hold = Hold(request_id=req.request_id, resources=req.resources, deadline=req.deadline,
                    account="" if req.tenant == root else req.tenant)
        refused: list[str] = []

        def mutate(raw: bytes | None, dead: frozenset[str] = frozenset()) -> bytes | None:
            refused.clear()
            usage = _decode(raw, root)
            holds = {k: v for k, v in usage.holds.items() if k not in dead}   # holds added meanwhile stay
            if req.sandbox_id in holds:
                return None if len(holds) == len(usage.holds) else encode(msgspec.structs.replace(usage, holds=holds))
            for account, quota in limits:
                counted = holds.values() if account == root else [h for h in holds.values() if h.account == account]
                why = over(quota, counted, req.resources)
                if why:
                    refused.append(f"{subjects.describe(account)}: {why}")
                    return None if len(holds) == len(usage.holds) else encode(msgspec.structs.replace(usage, holds=holds))
            return encode(msgspec.structs.replace(usage, holds={**holds, req.sandbox_id: hold}))

        result = await self.bus.kv_update(streams.TENANTS_KV, root, mutate)
        usage = _decode(result.value, root)
        if not refused and (len(usage.holds) < PRUNE_ABOVE
                            or time.monotonic() - self._pruned.get(root, 0.0) < PRUNE_EVERY):
            return
        self._pruned[root] = time.monotonic()
        # at the limit (or holding many): release what has ended, then decide again
        dead = frozenset(usage.holds) - await self._live(usage)
        await self.bus.kv_update(streams.TENANTS_KV, root, lambda raw: mutate(raw, dead))
        if refused:
            raise QuotaExceeded(refused[0])

    async def _live(self, usage: TenantUsage) -> set[str]:
        """The held sandbox ids that still count: running, or not yet recorded and within their deadline."""
        ids = list(usage.holds)
        raws = await asyncio.gather(*(self.bus.kv_get(streams.SANDBOXES_KV,
                                                      subjects.record_key(usage.holds[i].account or usage.tenant, i))
                                      for i in ids))
        now = time.time()
        live = set()
        for sid, raw in zip(ids, raws):
            if raw is None:
                if now < usage.holds[sid].deadline + GRACE:
                    live.add(sid)
                continue
            try:
                rec = sandbox_decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if rec.state in ("starting", "ready") and rec.request_id == usage.holds[sid].request_id:
                live.add(sid)
        return live


def over(quota: Quota, holds, r) -> str:
    """Why one more sandbox of resources r would pass the quota ('' when it fits)."""
    holds = list(holds)
    if quota.max_sandboxes and len(holds) + 1 > quota.max_sandboxes:
        return f"at most {quota.max_sandboxes} concurrent sandboxes"
    if quota.max_cpu and sum(h.resources.cpu for h in holds) + r.cpu > quota.max_cpu + 1e-9:
        return f"at most {quota.max_cpu:g} cpu in total"
    if quota.max_memory and sum(h.resources.memory for h in holds) + r.memory > quota.max_memory:
        return f"at most {quota.max_memory >> 20} MiB of memory in total"
    return ""


def _decode(raw: bytes | None, tenant: str) -> TenantUsage:
    if raw is not None:
        try:
            usage = usage_decoder.decode(raw)
            if usage.tenant == tenant:
                return usage
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
    return TenantUsage(tenant=tenant)


async def set_quota(bus: Bus, quota: Quota) -> None:
    """Configure a tenant's quota (all zero: no limit)."""
    await bus.kv_put(streams.QUOTAS_KV, quota.tenant, quota)


async def change_quota(bus: Bus, tenant: str, **changes) -> Quota:
    """Change the given limits of a tenant's quota (max_sandboxes, max_cpu, max_memory, rate), keeping the
    others as they are (`dsec quota set --cpu 4` once also wiped its sandboxes, memory and rate: helper Q)."""
    def merged(raw: bytes | None) -> bytes:
        try:
            q = quota_decoder.decode(raw) if raw is not None else Quota(tenant=tenant)
        except (msgspec.DecodeError, msgspec.ValidationError):
            q = Quota(tenant=tenant)
        return encode(msgspec.structs.replace(q, tenant=tenant, **changes))
    quota = quota_decoder.decode((await bus.kv_update(streams.QUOTAS_KV, tenant, merged)).value)
    await hold_running(bus, subjects.tenant_root(tenant))
    return quota


async def hold_running(bus: Bus, root: str) -> None:
    """Holds for the sandboxes a tenant (and its projects) runs that hold none: those admitted while it had
    no quota. Admission counted only its own holds, so they were never counted (helper Q: 4 running, a
    quota of 3 set, 3 more admitted)."""
    running = []
    for _, raw in await bus.kv_items(streams.SANDBOXES_KV, prefix=subjects.record_prefix(root)):
        try:
            rec = sandbox_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if rec.state in ("starting", "ready") and subjects.tenant_root(rec.tenant) == root:
            running.append(rec)
    if not running:
        return

    def mutate(raw: bytes | None) -> bytes | None:
        usage = _decode(raw, root)
        new = {r.sandbox_id: Hold(request_id=r.request_id, resources=r.resources, deadline=r.expires_at or time.time(),
                                  account="" if r.tenant == root else r.tenant)
               for r in running if r.sandbox_id not in usage.holds}
        return encode(msgspec.structs.replace(usage, holds={**usage.holds, **new})) if new else None
    await bus.kv_update(streams.TENANTS_KV, root, mutate)


async def usage(bus: Bus, tenant: str) -> TenantUsage:
    """A tenant's recorded holds (some may have ended and not been released yet)."""
    return _decode(await bus.kv_get(streams.TENANTS_KV, tenant), tenant)

"""The control API's warm pool handlers: set, list and remove the settings in KV dsec-warm-pools (every
edge of the node pool watches them) and count the ready sandboxes the edges report in their node records.
A pool belongs to the tenant that set it, under a key of its own (`<tenant>.<name>`): another tenant can
neither see, change nor remove it, and names its own pools as it likes."""
from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from bus import streams, subjects
from bus.apiwire import DeleteWarmPool, Done, ListWarmPools, SetWarmPool, WarmPoolList, WarmPoolState
from bus.conn import Bus
from bus.errors import DsecError, InvalidRequest, QuotaExceeded
from bus.messages import encode
from bus.records import WarmPool, node_decoder, pool_key, quota_decoder, warm_pool_decoder, warm_pool_key
from bus.validate import check_warm_pool

log = logging.getLogger(__name__)

DEFAULT_OWNER = "default"   # the owner of a pool written before pools had owners
MAX_POOLS = 32              # warm pools one account (a tenant, or a project) may have: each costs every edge work
MARKER_AGE = 600.0          # seconds a deleted pool's marker is kept (an edge away longer learns it on its resync)
SWEEP_EVERY = 60.0          # seconds between sweeps of older markers (every listing reads each one)


def owner_of(spec: WarmPool) -> str:
    return spec.owner or DEFAULT_OWNER


class WarmPools:
    def __init__(self, bus: Bus, images) -> None:
        self.bus = bus
        self.images = images
        self._purged_at = 0.0   # (monotonic) when deleted pools' markers were last swept
        self._sweeping: asyncio.Task | None = None

    async def migrate(self) -> None:
        """Move pools an earlier version stored under their bare name to `<owner>.<name>` (the edges keep only
        those, and a delete or `dsec iam tenant rm` finds only those: review R5). Each engine tries at start,
        best effort; a pool set since under the new key is kept."""
        try:
            items = await self.bus.kv_items(streams.WARM_POOLS_KV)
        except DsecError as exc:
            log.warning("warm pools not migrated: %s", exc)
            return
        for key, raw in items:
            try:
                spec = warm_pool_decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if spec.name != key:   # (stored under <owner>.<name> already: a name has no dot)
                continue
            new = warm_pool_key(owner_of(spec), spec.name)
            try:
                value, revision = await self.bus.kv_entry(streams.WARM_POOLS_KV, new)
                if value is None:
                    await self.bus.kv_cas(streams.WARM_POOLS_KV, new, raw, revision)
                await self.bus.kv_delete(streams.WARM_POOLS_KV, key)
                log.info("warm pool %s moved to %s", key, new)
            except DsecError as exc:
                log.warning("warm pool %s not migrated: %s", key, exc)

    def handlers(self) -> dict:
        return {SetWarmPool: self._set, ListWarmPools: self._list, DeleteWarmPool: self._delete}

    async def _spec(self, tenant: str, name: str) -> WarmPool | None:
        raw = await self.bus.kv_get(streams.WARM_POOLS_KV, warm_pool_key(tenant, name))
        try:
            return warm_pool_decoder.decode(raw) if raw is not None else None
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    async def _set(self, tenant: str, req: SetWarmPool) -> WarmPool:
        """Create or change a pool; its layers must resolve now (ImageNotFound), its kind must keep warm
        sandboxes (Unsupported)."""
        spec = msgspec.structs.replace(req.pool, owner=tenant, updated_at=time.time())
        check_warm_pool(spec)
        await self.images.compose(spec.image, spec.workspace, spec.toolkit)
        pools = await self.bus.kv_values(streams.WARM_POOLS_KV, warm_pool_decoder)   # (read once for both checks)
        await self._within_quota(tenant, spec, pools)
        self._within_count(tenant, spec, pools)
        key = warm_pool_key(tenant, spec.name)
        for _ in range(3):
            _, revision = await self.bus.kv_entry(streams.WARM_POOLS_KV, key)
            if await self.bus.kv_cas(streams.WARM_POOLS_KV, key, encode(spec), revision) is not None:
                return spec   # (over exactly what was checked: two sets of one new pool, one wins)
        raise InvalidRequest(f"warm pool {spec.name!r} is being changed by someone else: try again")

    async def _within_quota(self, tenant: str, spec: WarmPool, pools: list[WarmPool]) -> None:
        """QuotaExceeded when the tenant's pools could keep more ready (their `max`, on each node of their
        pool) than its quota lets it run: warm stock is not charged to the quota until claimed, so a tenant
        with a quota of 3 kept 32, the whole node's warm budget, and another tenant's pool never filled
        (helper Q)."""
        for account in dict.fromkeys((tenant, subjects.tenant_root(tenant))):
            raw = await self.bus.kv_get(streams.QUOTAS_KV, account)
            try:
                q = quota_decoder.decode(raw) if raw is not None else None
            except (msgspec.DecodeError, msgspec.ValidationError):
                q = None
            if q is None:
                continue
            held = [p for p in pools if (owner_of(p), p.name) != (tenant, spec.name)
                    and subjects.tenant_root(owner_of(p)) == subjects.tenant_root(account)
                    and (account == subjects.tenant_root(account) or owner_of(p) == account)] + [spec]
            kept = sum(p.max for p in held)
            cpu = sum(p.max * p.resources.cpu for p in held)
            memory = sum(p.max * p.resources.memory for p in held)
            if ((q.max_sandboxes and kept > q.max_sandboxes) or (q.max_cpu and cpu > q.max_cpu + 1e-9)
                    or (q.max_memory and memory > q.max_memory)):
                raise QuotaExceeded(f"{subjects.describe(account)}: its warm pools could keep {kept} sandboxes "
                                    f"ready on a node (their max: {cpu:g} cpu, {memory >> 20} MiB), more than its "
                                    "quota lets it run")

    @staticmethod
    def _within_count(tenant: str, spec: WarmPool, pools: list[WarmPool]) -> None:
        """QuotaExceeded past MAX_POOLS pools of one tenant: pools of max=0 cost its quota nothing, and 20,000
        of them made every edge re-check each pool's image every 2 s, another tenant's create take 0.7 s and
        its pool listing time out (helper T2)."""
        mine = [p.name for p in pools if owner_of(p) == tenant]
        if spec.name not in mine and len(mine) >= MAX_POOLS:   # (one it has may always change; two sets racing
                                                               # may pass it by one each: not a flood)
            raise QuotaExceeded(f"{subjects.describe(tenant)} has {len(mine)} warm pools, the most one tenant may "
                                f"have: remove one (delete_warm_pool) first")

    async def _delete(self, tenant: str, req: DeleteWarmPool) -> Done:
        """Every edge then destroys the pool's ready sandboxes (claimed ones live on)."""
        named = isinstance(req.name, str) and subjects.is_token(req.name)   # (a bad key was a BusError)
        prior = await self._spec(tenant, req.name) if named else None
        if prior is None or owner_of(prior) != tenant:
            raise InvalidRequest(f"no warm pool named {req.name!r}")
        await self.bus.kv_delete(streams.WARM_POOLS_KV, warm_pool_key(tenant, req.name))
        self._sweep_soon()
        return Done()

    def _sweep_soon(self) -> None:
        """Drop, behind the delete, deleted pools' markers older than MARKER_AGE, at most every SWEEP_EVERY: a
        bucket keeps one for each name ever deleted, and every listing read them all (30,003 entries for 3
        pools: another tenant's listing took 6 s, for good; helper T2)."""
        now = time.monotonic()
        if (self._sweeping is not None and not self._sweeping.done()) or now - self._purged_at < SWEEP_EVERY:
            return
        self._purged_at = now
        self._sweeping = asyncio.ensure_future(self._sweep())

    async def _sweep(self) -> None:
        try:
            swept = await self.bus.kv_purge_deletes(streams.WARM_POOLS_KV, older_than=MARKER_AGE)
            if swept:
                log.info("swept %d deleted warm pools' markers", swept)
        except DsecError as exc:   # (the next delete sweeps again)
            log.warning("could not sweep deleted warm pools' markers: %s", exc)

    async def _list(self, tenant: str, _req: ListWarmPools) -> WarmPoolList:
        nodes = await self.bus.kv_values(streams.NODES_KV, node_decoder)
        out = []
        for spec in await self.bus.kv_values(streams.WARM_POOLS_KV, warm_pool_decoder):
            if owner_of(spec) != tenant:
                continue
            try:
                layers = await self.images.compose(spec.image, spec.workspace, spec.toolkit)
                key, error = pool_key(layers, spec.resources, spec.backend, owner_of(spec)), ""
            except DsecError as exc:
                key, error = "", str(exc)
            ready = {n.node: n.warm.get(key, 0) for n in nodes if n.pool == spec.node_pool and not n.lost}
            out.append(WarmPoolState(spec=spec, ready=ready, error=error))
        return WarmPoolList(pools=sorted(out, key=lambda s: s.spec.name))

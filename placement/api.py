"""The control API: `dsec.api.<tenant>.<verb>`, answered by every placement engine (one queue group, so one
engine answers each request). Everything the SDK reads or sets besides creates and sandbox ops goes
through here: a tenant's sandbox records, snapshots and warm pools, filtered on the server. No client
reads a KV bucket or an object store itself.

One chain of steps runs around every handler (`self.steps`): the tenant from the subject (never from the
payload), the tenant's rate, decoding into the verb's one request type, the answer's outcome counted, and
every error turned into one typed ErrorReply. A handler only does its own work.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import msgspec

from bus import lanes, streams, subjects
from bus.apiwire import (MAX_PAGE, VERBS, Backends, GetBackends, GetQuota, GetSandbox, ListSandboxes, QuotaState,
                         api_request_decoder)
from bus.conn import Bus
from bus.errors import DsecError, InvalidRequest, RateLimited, SandboxNotFound
from bus.messages import ErrorReply, Wire
from bus.records import Quota, engine_decoder, sandbox_decoder
from placement.listing import Listings
from placement.snapshots import Snapshots
from placement.streamapi import StreamReadsApi
from placement.warmpools import WarmPools

log = logging.getLogger(__name__)

QUEUE = "dsec-api"
DEFAULT_RATE = 200.0       # control requests per second per tenant (over all engines); a burst of twice that passes
MAX_BUCKETS = 10_000       # tenants' rate buckets kept before the full ones are dropped
ENGINE_ALIVE = 5.0         # seconds an engine's figures count it as answering (it puts them every second)
STATES = ("starting", "ready", "destroyed", "expired", "failed", "node_lost")


@dataclass
class Call:
    """One control request as it goes down the chain."""

    subject: str
    data: bytes
    tenant: str = ""
    verb: str = ""
    request: Wire | None = None


Next = Callable[[Call], Awaitable[Wire]]
Step = Callable[[Call, Next], Awaitable[Wire]]


@dataclass
class Bucket:
    """A tenant's token bucket."""

    tokens: float
    at: float = field(default_factory=time.monotonic)


class ControlApi:
    """The service: the chain, then one handler per request type."""

    def __init__(self, bus: Bus, images, quotas=None, rate: float = DEFAULT_RATE, nodes=lambda: []) -> None:
        self.bus = bus
        self.nodes = nodes   # the node records placement knows (its ledger)...
        self.nodes_known = False   # ...once its watch delivered them all
        self.quotas = quotas
        self.rate = rate
        self.listings = Listings(bus)
        self.snapshots = Snapshots(bus, self.listings.live)
        self.pools = WarmPools(bus, images)
        self.reads = StreamReadsApi(bus)
        self.outcomes: collections.Counter = collections.Counter()   # (verb, code) -> answers
        self._buckets: dict[str, Bucket] = {}
        self._engines: dict[str, float] = {}   # engine -> when its figures were last heard (KV dsec-engines)
        self._sub = None
        self._index: asyncio.Task | None = None
        self._handlers: dict[type, Callable[[str, Wire], Awaitable[Wire]]] = {
            GetSandbox: self._get, ListSandboxes: self._list, GetQuota: self._quota, GetBackends: self._backends,
            **self.snapshots.handlers(),
            **self.pools.handlers(), **self.reads.handlers()}
        self.steps: list[Step] = [self._count, self._answer_errors, self._authorise, self._limit, self._decode]
        self._run = lanes.chain(self._dispatch, self.steps)

    async def start(self) -> None:
        await self.pools.migrate()
        self._index = await self.listings.start()
        self._sub = await self.bus.serve(subjects.api_all(), self.handle, queue=QUEUE)

    async def stop(self) -> None:
        if self._index is not None:
            self._index.cancel()
            await asyncio.gather(self._index, return_exceptions=True)
            self._index = None
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:   # the connection is going anyway
                pass
            self._sub = None
        await self.reads.close()

    async def handle(self, data: bytes, subject: str) -> Wire:
        """Run one request down the chain to its handler."""
        return await self._run(Call(subject=subject, data=data))

    async def _dispatch(self, call: Call) -> Wire:
        assert call.request is not None
        return await self._handlers[type(call.request)](call.tenant, call.request)

    # ---- the chain ------------------------------------------------------------------------------

    async def _answer_errors(self, call: Call, nxt: Next) -> Wire:
        try:
            return await nxt(call)
        except DsecError as exc:
            return ErrorReply(code=exc.code, message=str(exc), reason=str(exc.details.get("reason", "")))

    async def _count(self, call: Call, nxt: Next) -> Wire:
        reply = await nxt(call)
        self.outcomes[(call.verb or "?", reply.code if isinstance(reply, ErrorReply) else "ok")] += 1
        return reply

    async def _authorise(self, call: Call, nxt: Next) -> Wire:
        """The tenant is the subject's token: dsec.api.<tenant>.<verb>."""
        parts = call.subject.split(".")
        if len(parts) != 4 or not subjects.is_token(parts[2]):
            raise InvalidRequest(f"not a control API subject: {call.subject!r}")
        call.tenant, call.verb = parts[2], parts[3]
        return await nxt(call)

    async def _limit(self, call: Call, nxt: Next) -> Wire:
        """A token bucket per account; a project's requests take from its tenant's bucket too."""
        now = time.monotonic()
        root = subjects.tenant_root(call.tenant)
        buckets = [(a, self._bucket(a, now)) for a in dict.fromkeys((call.tenant, root))]
        for account, b in buckets:
            if b.tokens < 1:
                raise RateLimited(f"{subjects.describe(account)} passed its rate of "
                                  f"{self._rate_of(account):g} control requests/s: try again shortly")
        for _, b in buckets:
            b.tokens -= 1
        return await nxt(call)

    def _bucket(self, account: str, now: float) -> Bucket:
        """One account's bucket, refilled to now (a burst of twice the rate; at least one request)."""
        rate = self._rate_of(account)
        cap = max(1.0, 2 * rate)
        b = self._buckets.get(account)
        if b is None:
            if len(self._buckets) >= MAX_BUCKETS:   # drop the full ones: a full bucket is a new one
                self._buckets = {t: x for t, x in self._buckets.items()
                                 if x.tokens + (now - x.at) * self._rate_of(t) < max(1.0, 2 * self._rate_of(t))}
            b = self._buckets[account] = Bucket(tokens=cap, at=now)
        b.tokens = min(cap, b.tokens + (now - b.at) * rate)
        b.at = now
        return b

    def _rate_of(self, tenant: str) -> float:
        """This engine's share of a tenant's rate: the engines answer in one queue group, which spreads
        requests evenly, so each admits rate / (engines alive) and all together the tenant's rate."""
        quota = self.quotas.table.get(tenant) if self.quotas is not None else None
        rate = quota.rate if quota is not None and quota.rate > 0 else self.rate
        return rate / self.engines()

    def engines(self) -> int:
        """Engines heard from in the last ENGINE_ALIVE seconds (at least this one)."""
        cutoff = time.time() - ENGINE_ALIVE
        return max(1, sum(1 for at in self._engines.values() if at >= cutoff))

    def on_engine(self, key: str, raw: bytes | None, _revision: int) -> None:
        """KV watch callback of dsec-engines (every engine puts its figures there every second)."""
        try:
            stats = engine_decoder.decode(raw) if raw is not None else None
        except (msgspec.DecodeError, msgspec.ValidationError):
            stats = None
        if stats is None:
            self._engines.pop(key, None)
        else:
            self._engines[key] = stats.at

    async def _decode(self, call: Call, nxt: Next) -> Wire:
        want = VERBS.get(call.verb)
        if want is None:
            raise InvalidRequest(f"unknown control verb {call.verb!r} (one of {', '.join(VERBS)})")
        try:
            req = api_request_decoder.decode(call.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InvalidRequest(f"{call.verb}: undecodable request: {exc}") from None
        if not isinstance(req, want):
            raise InvalidRequest(f"{call.verb} takes a {want.__name__} request, got {type(req).__name__}")
        call.request = req
        return await nxt(call)

    # ---- sandboxes ------------------------------------------------------------------------------

    async def _get(self, tenant: str, req: GetSandbox) -> Wire:
        if not subjects.is_token(req.sandbox_id):
            raise InvalidRequest(f"sandbox_id must be 1-128 characters of [A-Za-z0-9_-], got {req.sandbox_id!r}")
        raw = await self.bus.kv_get(streams.SANDBOXES_KV, subjects.record_key(tenant, req.sandbox_id))
        try:
            rec = sandbox_decoder.decode(raw) if raw is not None else None
        except (msgspec.DecodeError, msgspec.ValidationError):
            rec = None
        if rec is None and subjects.PROJECT_SEP not in tenant:   # a tenant sees its projects' sandboxes
            found = await self.bus.kv_values(streams.SANDBOXES_KV, sandbox_decoder,
                                             keys=f"{tenant}.*.{req.sandbox_id}")
            rec = next((r for r in found if r.sandbox_id == req.sandbox_id), None)
        if rec is None or not subjects.sees(tenant, rec.tenant):   # another tenant's is one that does not exist
            raise SandboxNotFound(f"sandbox {req.sandbox_id} not found (never_existed)", reason="never_existed")
        return rec

    async def _list(self, tenant: str, req: ListSandboxes) -> Wire:
        bad = [s for s in req.states if s not in STATES]
        if bad:
            raise InvalidRequest(f"states: unknown {', '.join(map(repr, bad))} (one of {', '.join(STATES)})")
        if not 1 <= req.limit <= MAX_PAGE:
            raise InvalidRequest(f"limit must be 1..{MAX_PAGE}, got {req.limit}")
        if req.next_token and not subjects.is_token(req.next_token):
            raise InvalidRequest(f"next_token {req.next_token!r} is not one this API gave")
        return await self.listings.page(tenant, req)

    async def _backends(self, _tenant: str, _req: GetBackends) -> Wire:
        return Backends(kinds=sorted({k for n in self.nodes() if not n.lost and not n.draining for k in n.backends}),
                        known=self.nodes_known)

    async def _quota(self, tenant: str, _req: GetQuota) -> Wire:
        quota = self.quotas.table.get(tenant) if self.quotas is not None else None
        live = await self.listings.live(tenant)
        return QuotaState(quota=quota or Quota(tenant=tenant), sandboxes=len(live),
                          cpu=sum(r.resources.cpu for r in live), memory=sum(r.resources.memory for r in live))

"""A tenant's sandbox records as the control API reads them (lists, a quota's usage, a snapshot's users).

Live records (starting, ready) come from an index every engine keeps in memory, fed by a watch of KV
dsec-sandboxes: a list of running sandboxes costs what the tenant runs, not every record the bucket keeps
for two days (helper S2's soak: at about 80,000 records such a list would pass a request's timeout). A read
of the index first waits until it holds every write the bucket stored before the read began, so a sandbox a
create just returned is listed. An index still loading (its watch delivering) is waited for up to RELOAD;
one whose watch went silent short of the bucket is started afresh (at most once per RELOAD: a restart on
every read would never let a large load end); a read that cannot wait for either goes to the bucket.

Lists of other states read the bucket in stream order, a page at a time, each page going on after the last
sequence the one before it read, so a whole list reads each record once (paging by id read all the tenant's
records for every page). A record written while a list pages through comes again on a later page; the SDK
keeps the later one.
"""
from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time

from bus import streams, subjects
from bus.apiwire import ListSandboxes, SandboxPage
from bus.conn import Bus, kv_watch
from bus.errors import InvalidRequest
from bus.messages import encode
from bus.records import SandboxRecord, sandbox_decoder
from edge.records import decode_record, key_of

log = logging.getLogger(__name__)

LIVE = ("starting", "ready")
CATCH_UP = 1.0      # seconds of silence from a watch short of the bucket before it is started afresh...
RELOAD = 5.0        # ...at most once in this long; and the longest a read waits for the index
RESYNC = 600.0      # seconds of silence after which the watch loads afresh (a reader that finds it behind does sooner)
SCAN_MAX = 5000     # records one page of a stream-order list reads at most (a page with few matches comes back short)
MAX_REPLY = 768 << 10   # bytes of records per page (a reply stays under the server's 1 MiB max payload)


class LiveIndex:
    """The starting and ready records of every tenant, as a watch of the bucket delivers them.

    A watch delivers each key's latest entry in stream order, so once it delivered sequence N the index
    holds every key's state as of N: one whose latest entry came before N was delivered, and one that ended
    (a final state, a delete marker) left the index with it. A fresh watch (a reconnect, a reader that
    found it behind) starts counting again from 0, and a watch on a replica still catching up may deliver
    an older entry than the index holds: that one is ignored."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._live: dict[str, dict[str, tuple[int, SandboxRecord]]] = {}   # tenant root -> key -> (revision, record)
        self.seen = 0                     # the highest stream sequence the current watch delivered
        self._waiters: list[tuple[int, int, asyncio.Future]] = []   # (target, n, future): a heap by target
        self._n = 0
        self._heard = time.monotonic()    # when the watch last delivered (or began)
        self._restarted = 0.0             # when a reader last started it afresh
        self._restart = asyncio.Event()
        self.fallbacks = 0                # reads that went to the bucket: the index stayed behind

    async def start(self) -> asyncio.Task:
        return await kv_watch(self.bus, streams.SANDBOXES_KV, self._on_change, resync_every=RESYNC,
                              on_synced=self._on_synced, on_start=self._on_start, restart=self._restart)

    def _on_start(self) -> None:
        self.seen = 0
        self._heard = time.monotonic()

    def _on_synced(self, present: set[str]) -> None:
        """The watch delivered every current value: keys it did not deliver are gone (expired: no marker)."""
        for root in list(self._live):
            live = self._live[root]
            for key in [k for k in live if k not in present]:
                del live[key]
            if not live:
                del self._live[root]

    def _on_change(self, key: str, raw: bytes | None, revision: int) -> None:
        self.seen = max(self.seen, revision)
        root = key.split(".", 1)[0]
        live = self._live.get(root, {})
        held = live.get(key)
        rec = decode_record(raw)
        if held is not None and held[0] > revision:
            pass   # an older entry (a replica catching up): the index holds a newer one
        elif rec is not None and rec.state in LIVE and key_of(rec) == key:
            self._live[root] = live
            live[key] = (revision, rec)
        elif held is not None:
            del live[key]
            if not live:
                self._live.pop(root, None)
        self._heard = time.monotonic()
        while self._waiters and self._waiters[0][0] <= self.seen:   # (each reader woken once, when it may go on)
            fut = heapq.heappop(self._waiters)[2]
            if not fut.done():
                fut.set_result(None)

    async def _caught_up(self, target: int, wait: float) -> bool:
        """Wait until the watch delivered the bucket's writes up to sequence target (at most `wait` s)."""
        if self.seen >= target:
            return True
        fut = asyncio.get_running_loop().create_future()
        self._n += 1
        heapq.heappush(self._waiters, (target, self._n, fut))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(fut, wait)
        if not fut.done():
            fut.cancel()
            self._waiters = [w for w in self._waiters if not w[2].done()]
            heapq.heapify(self._waiters)
        return self.seen >= target

    async def _nothing_after(self, seq: int) -> bool:
        """Whether the bucket stores nothing after sequence seq (its last sequence may be one expired since)."""
        return await self.bus.stored_after(f"KV_{streams.SANDBOXES_KV}", f"$KV.{streams.SANDBOXES_KV}.>", seq) is None

    async def records(self, tenant: str) -> list[SandboxRecord] | None:
        """The account's live records by id (a tenant's take its projects'), holding every write stored
        before the call; None when the index stayed behind (the caller reads the bucket)."""
        target = await self.bus.kv_last_seq(streams.SANDBOXES_KV)
        give_up = time.monotonic() + RELOAD
        while not await self._caught_up(target, min(CATCH_UP, give_up - time.monotonic())):
            if await self._nothing_after(self.seen):   # (the bucket's last entries expired since)
                break
            now = time.monotonic()
            if now - self._heard >= CATCH_UP and now - self._restarted >= RELOAD:   # silent, not loading
                log.info("live index behind the bucket (%d < %d) and its watch silent: loading it afresh",
                         self.seen, target)
                self._restarted = now
                self._restart.set()
            if now >= give_up:
                self.fallbacks += 1
                return None
        live = self._live.get(subjects.tenant_root(tenant), {})
        return sorted((rec for _, rec in live.values() if subjects.sees(tenant, rec.tenant)),
                      key=lambda r: r.sandbox_id)


class Listings:
    """The control API's reads of sandbox records."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.index = LiveIndex(bus)

    async def start(self) -> asyncio.Task:
        return await self.index.start()

    async def live(self, tenant: str) -> list[SandboxRecord]:
        """The account's starting and ready records, by id."""
        recs = await self.index.records(tenant)
        if recs is None:
            recs = [r for r in await self._read_all(tenant) if r.state in LIVE]
        return recs

    async def _read_all(self, tenant: str) -> list[SandboxRecord]:
        """Every record the account sees (any state), by id: a read of its keys alone (<tenant>.>)."""
        recs = await self.bus.kv_values(streams.SANDBOXES_KV, sandbox_decoder, prefix=subjects.record_prefix(tenant))
        return sorted((r for r in recs if subjects.sees(tenant, r.tenant)), key=lambda r: r.sandbox_id)

    async def page(self, tenant: str, req: ListSandboxes) -> SandboxPage:
        """One page of a list: live states from the index by id, others from the bucket in stream order."""
        if req.states and all(s in LIVE for s in req.states):
            chosen = [r for r in await self.live(tenant)
                      if r.state in req.states and r.sandbox_id > req.next_token and _labelled(r, req.labels)]
            page, size = [], 0
            for r in chosen[:req.limit]:
                size += len(encode(r))
                if page and size > MAX_REPLY:
                    break
                page.append(r)
            return SandboxPage(records=page, next_token=page[-1].sandbox_id if len(page) < len(chosen) else "")
        return await self._scan(tenant, req)

    async def _scan(self, tenant: str, req: ListSandboxes) -> SandboxPage:
        if req.next_token and not (req.next_token.isdigit() and len(req.next_token) <= 20):
            raise InvalidRequest(f"next_token {req.next_token!r} is not one this API gave")
        last = int(req.next_token or 0)
        page: list[SandboxRecord] = []
        size = read = 0
        more = False
        scan = self.bus.kv_scan(streams.SANDBOXES_KV, f"{subjects.record_prefix(tenant)}.>", last,
                                want=lambda: min(req.limit - len(page), SCAN_MAX - read))
        async with contextlib.aclosing(scan) as entries:
            async for key, raw, seq, pending in entries:
                rec = decode_record(raw)
                if (rec is not None and key_of(rec) == key and subjects.sees(tenant, rec.tenant)
                        and (not req.states or rec.state in req.states) and _labelled(rec, req.labels)):
                    n = len(encode(rec))
                    if page and size + n > MAX_REPLY:
                        more = True   # this one starts the next page
                        break
                    page.append(rec)
                    size += n
                last, more, read = seq, pending > 0, read + 1
                if len(page) >= req.limit or read >= SCAN_MAX:
                    break
        return SandboxPage(records=page, next_token=str(last) if more else "")


def _labelled(rec: SandboxRecord, labels: dict[str, str]) -> bool:
    return all(rec.labels.get(k) == v for k, v in labels.items())

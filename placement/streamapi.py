"""The control API's stream reads: what DSEC_OUT and DSEC_TRAJ keep for one tenant, read for it by the
server (a tenant account has no JetStream rights in DSEC). The subjects read are built here from the
tenant the request's subject names, so no request can reach another tenant's records.

Trajectory readers are pull consumers kept on the server, one per (tenant, reader name), named by a
digest of both; the acks a batch carries are the consumer's own ack subjects, taken back only from the
tenant that owns the consumer. An engine keeps its binding to a reader's consumer between fetches (the
consumer is created or updated only when a fetch asks for another configuration, or its binding went
stale), and lets go of bindings unused for half of IDLE_READER (before the server drops an idle reader's
consumer)."""
from __future__ import annotations

import asyncio
import collections
import datetime
import hashlib
import time

from nats.js import api

from bus import streams, subjects
from bus.apiwire import (AckTrajectories, CloseTrajectories, Done, FetchTrajectories, PulledRecord, ReadOutput,
                         StoredOutput, StoredPiece, TrajectoryBatch)
from bus.conn import Bus
from bus.errors import BusError, InvalidRequest, RateLimited
from bus.messages import Wire

MAX_BATCH = 1000
MAX_OUTPUT_BATCH = 64           # stored output records one ReadOutput answers at most
OUTPUT_BATCH_BYTES = 256 << 10  # ... and no more once this many bytes are in (a reply stays under max_payload)
OUTPUT_BATCH_TIME = 0.25        # ... or once this many seconds went on reading them (a slow server)
MAX_WAIT = 5.0
IDLE_READER = 60.0     # seconds after its last read a reader that is not durable is dropped
MAX_READERS = 64       # trajectory readers one tenant (with its projects) has on the server at once
MAX_REPLY = 768 << 10


def _token(value: str, what: str) -> str:
    try:
        return subjects.token(value, what)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def reader_consumer(tenant: str, reader: str) -> str:
    """The consumer on DSEC_TRAJ of one tenant's reader (a digest: no name of one tenant's can be another's)."""
    return "traj-" + hashlib.sha256(f"{tenant}/{reader}".encode()).hexdigest()[:24]


class _Bound:
    """An engine's binding to one reader's consumer: its configuration, the reader, one fetch at a time."""

    def __init__(self, config: api.ConsumerConfig, reader) -> None:
        self.config, self.reader = config, reader
        self.lock = asyncio.Lock()
        self.used = time.monotonic()


class StreamReadsApi:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._bound: dict[str, _Bound] = {}   # consumer name -> this engine's binding to it
        self.consumer_creates = 0             # consumers created or updated for fetches (not one per fetch)
        self._making: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)

    def handlers(self) -> dict:
        return {ReadOutput: self._output, FetchTrajectories: self._fetch, AckTrajectories: self._ack,
                CloseTrajectories: self._close}

    async def _output(self, tenant: str, req: ReadOutput) -> Wire:
        subject = subjects.output(tenant, _token(req.node, "node"), _token(req.sandbox_id, "sandbox_id"),
                                  _token(req.exec_id, "exec_id"))
        if req.last:
            last = await self.bus.last_on_subject(streams.OUT_STREAM, subject, with_headers=True)
            if last is None:
                return StoredOutput()
            return StoredOutput(found=True, data=last[0] or b"", headers=dict(last[1] or {}))
        m = await self.bus.stored_after(streams.OUT_STREAM, subject, max(0, req.after))
        if m is None:
            return StoredOutput()
        out = StoredOutput(found=True, seq=m.seq, data=m.data, headers=dict(m.headers or {}))
        size = len(m.data)   # read here, not a request each: 400 records read back one per request met the
        until = time.monotonic() + OUTPUT_BATCH_TIME   # tenant's rate limit (helper F3)
        for _ in range(min(max(1, req.batch), MAX_OUTPUT_BATCH) - 1):
            if size >= OUTPUT_BATCH_BYTES or time.monotonic() > until or (
                    m := await self.bus.stored_after(streams.OUT_STREAM, subject, m.seq)) is None:
                break
            out.more.append(StoredPiece(seq=m.seq, data=m.data, headers=dict(m.headers or {})))
            size += len(m.data)
        return out

    def _config(self, tenant: str, req: FetchTrajectories) -> api.ConsumerConfig:
        name = reader_consumer(tenant, _token(req.reader, "reader"))
        subject = subjects.trajectory(tenant, _token(req.job, "job") if req.job else "*",
                                      _token(req.sandbox_id, "sandbox_id") if req.sandbox_id else "*")
        start: dict = {"deliver_policy": api.DeliverPolicy.ALL}
        if req.since_seq > 0:
            start = {"deliver_policy": api.DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": req.since_seq}
        elif req.since_time > 0:
            at = datetime.datetime.fromtimestamp(req.since_time, datetime.timezone.utc)
            start = {"deliver_policy": api.DeliverPolicy.BY_START_TIME, "opt_start_time": at.isoformat()}
        if not 0 < req.ack_wait <= 3600:
            raise InvalidRequest(f"ack_wait must be 0-3600 s, got {req.ack_wait}")
        return api.ConsumerConfig(name=name, durable_name=name, filter_subject=subject,
                                  ack_policy=api.AckPolicy.EXPLICIT, ack_wait=req.ack_wait, max_ack_pending=10_000,
                                  inactive_threshold=None if req.durable else IDLE_READER,
                                  description=f"trajectory reader {req.reader} of tenant {tenant}", **start)

    async def _fetch(self, tenant: str, req: FetchTrajectories) -> Wire:
        if not 1 <= req.batch <= MAX_BATCH or not 0 <= req.wait <= MAX_WAIT:
            raise InvalidRequest(f"batch must be 1..{MAX_BATCH} and wait 0..{MAX_WAIT:g} s")
        config = self._config(tenant, req)
        for again in (True, False):
            bound = await self._binding(config, tenant)
            async with bound.lock:
                try:
                    pulled = await bound.reader.fetch(req.batch, max(0.05, req.wait))
                    break
                except BusError:   # the consumer went (idle, deleted): bind afresh once
                    await self._unbind(config.durable_name, bound)
                    if not again:
                        raise
                finally:
                    bound.used = time.monotonic()
        out, size = [], 0
        for p in pulled:
            size += len(p.data) + 200
            if out and size > MAX_REPLY:
                break
            out.append(PulledRecord(seq=p.seq, at=p.at, data=p.data, ack=p.reply))
        # What does not fit the answer goes back at once, to come first in the next fetch. Left to the ack
        # wait, it came 30 s later, after newer records (a sandbox's `destroyed` before its last exec), and a
        # reader that was told nothing was pending stopped without it (helper T: 9 of 14 records, no error).
        for p in pulled[len(out):]:
            await p.nak()
        pending = (pulled[-1].pending if pulled else 0) + len(pulled) - len(out)
        ack_pending = 0
        if len(pulled) < req.batch or pending == 0:
            ack_pending = await self.bus.consumer_ack_pending(streams.TRAJ_STREAM, config.durable_name)
        return TrajectoryBatch(records=out, pending=pending, ack_pending=ack_pending)

    async def _binding(self, config: api.ConsumerConfig, tenant: str) -> _Bound:
        """This engine's binding to the consumer of config: the one kept when its configuration is the
        same, else the consumer created (or updated) and bound; bindings idle too long are let go."""
        now = time.monotonic()
        for name in [n for n, b in self._bound.items() if now - b.used > IDLE_READER / 2 and not b.lock.locked()]:
            await self._unbind(name)
        bound = self._bound.get(config.durable_name)
        if bound is not None and bound.config == config:
            return bound
        if bound is not None:
            await self._unbind(config.durable_name)
        async with self._making[subjects.tenant_root(tenant)]:   # a tenant's count and make, one at a time (here)
            await self._same_reader(config, tenant)
            try:
                reader = await self.bus.durable_reader(streams.TRAJ_STREAM, config)
            except BusError as exc:   # (a follow reader retried this for ever: helper T)
                if "can not be updated" in str(exc):
                    raise InvalidRequest(f"{config.description} was made with other settings (since): read it "
                                         "with the ones it was made with, or under a new name") from None
                raise
        self.consumer_creates += 1
        bound = self._bound[config.durable_name] = _Bound(config, reader)
        return bound

    async def _same_reader(self, config: api.ConsumerConfig, tenant: str) -> None:
        """InvalidRequest when the durable reader exists for another job: binding it rewrote its filter, kept
        its position past that job's records, and read nothing, silently (helper T). A new one: RateLimited
        when the tenant has MAX_READERS already (one tenant's 1,000 durable readers filled the stream's
        consumers, and no other tenant, nor the operator's replay, read a trajectory: helper A3)."""
        if not config.durable_name:
            return
        have = await self.bus.consumer_config(streams.TRAJ_STREAM, config.durable_name)
        if have is not None and have.filter_subject and have.filter_subject != config.filter_subject:
            raise InvalidRequest(f"{config.description} reads another job "
                                 f"({have.filter_subject}): use a new name for this one")
        if have is None:
            root = subjects.tenant_root(tenant)
            held = sum(1 for d in await self.bus.consumer_descriptions(streams.TRAJ_STREAM)
                       if subjects.tenant_root(d.rpartition(" of tenant ")[2]) == root and d.startswith("trajectory reader"))
            if held >= MAX_READERS:
                raise RateLimited(f"{subjects.describe(root)} has {held} trajectory readers, the most one tenant may "
                                  f"({MAX_READERS}): drop a durable one (client.drop_trajectory_reader) or read "
                                  "under a name it has")

    async def close(self) -> None:
        """Let go of every binding (the consumers stay on the server)."""
        for name in list(self._bound):
            await self._unbind(name)

    async def _unbind(self, name: str, only: _Bound | None = None) -> None:
        """Let go of name's binding (only: if it is still that one; that one's reader is closed anyway)."""
        if only is not None and self._bound.get(name) is not only:
            await only.reader.close()
            return
        bound = self._bound.pop(name, None)
        if bound is not None:
            await bound.reader.close()

    async def _ack(self, tenant: str, req: AckTrajectories) -> Wire:
        prefix = f"$JS.ACK.{streams.TRAJ_STREAM}.{reader_consumer(tenant, _token(req.reader, 'reader'))}."
        bad = [a for a in (*req.acks, *req.naks) if not a.startswith(prefix) or " " in a or len(a) > 300]
        if bad:
            raise InvalidRequest(f"traj-ack: {len(bad)} ack(s) are not this reader's (first: {bad[0][:80]!r})")
        for a in req.acks:
            await self.bus.send(a, b"+ACK")
        for a in req.naks:
            await self.bus.send(a, b"-NAK")
        return Done()

    async def _close(self, tenant: str, req: CloseTrajectories) -> Wire:
        name = reader_consumer(tenant, _token(req.reader, "reader"))
        await self._unbind(name)
        await self.bus.delete_consumer(streams.TRAJ_STREAM, name)
        return Done()

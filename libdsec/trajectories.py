"""Trajectory readers for reward models: `client.trajectories(job=..., since=..., durable=...)`.

The reader is a pull consumer the server keeps for this tenant (placement/streamapi.py), fetched and
acked through the control API: a tenant has no JetStream rights of its own."""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from dataclasses import dataclass
from typing import AsyncIterator

import msgspec

from bus import subjects
from bus.apiwire import AckTrajectories, CloseTrajectories, Done, FetchTrajectories, TrajectoryBatch
from bus.errors import BusError, InvalidRequest
from bus.records import TrajRecord, traj_decoder
from libdsec import control
from libdsec.ids import new_id

BATCH = 64
WAIT = 1.0   # seconds a fetch waits for new records before asking again


@dataclass
class Trajectory:
    """One record of an episode; ack() it (or a batch with Trajectory.ack_all) once it is processed."""

    record: TrajRecord
    seq: int                   # the record's sequence in DSEC_TRAJ (increasing, unique)
    _pulled: object | None     # what acks it: .ack(), and for a batch .ack_many (the reader's)
    _unacked: set[int] | None = None   # the reader's records not acked yet

    async def ack(self) -> None:
        """Processed: a durable consumer restarted later does not receive it again."""
        if self._pulled is not None:
            await self._pulled.ack()
            if self._unacked is not None:
                self._unacked.discard(self.seq)

    @staticmethod
    async def ack_all(batch: "list[Trajectory]") -> None:
        """Ack a batch at once (one request per reader, not one round trip each)."""
        by_reader: dict[int, list[Trajectory]] = {}
        for t in batch:
            if isinstance(t._pulled, _Ack):
                by_reader.setdefault(id(t._pulled.reader), []).append(t)
            else:
                await t.ack()
        for group in by_reader.values():
            await group[0]._pulled.reader.ack([t._pulled.token for t in group])
            for t in group:
                if t._unacked is not None:
                    t._unacked.discard(t.seq)


@dataclass
class _Ack:
    reader: "_Reader"
    token: str

    async def ack(self) -> None:
        await self.reader.ack([self.token])


class _Reader:
    """One reader on the server, asked through the control API."""

    def __init__(self, bus, tenant: str, request: FetchTrajectories) -> None:
        self.bus, self.tenant, self.request = bus, tenant, request

    async def fetch(self) -> TrajectoryBatch:
        return await control.ask(self.bus, self.tenant, self.request, TrajectoryBatch,
                                 timeout=self.request.wait + control.TRY_FOR + 3)

    async def ack(self, tokens: list[str]) -> None:
        await control.ask(self.bus, self.tenant, AckTrajectories(reader=self.request.reader, acks=tokens), Done)

    async def give_back(self, tokens: list[str]) -> None:
        """Records fetched and never handed to the caller: due again at once, not after the ack wait."""
        with contextlib.suppress(Exception):   # (best effort: they come again after the ack wait anyway)
            await control.ask(self.bus, self.tenant, AckTrajectories(reader=self.request.reader, naks=tokens), Done,
                              timeout=2.0)

    async def close(self) -> None:
        if not self.request.durable:
            try:
                await control.ask(self.bus, self.tenant, CloseTrajectories(reader=self.request.reader), Done,
                                  timeout=2.0)
            except Exception:   # dropped by the server a minute after its last read anyway
                pass


def fetch_request(job: str | None, sandbox: str | None, since, durable: str | None,
                  ack_wait: float) -> FetchTrajectories:
    """What the server's reader takes: one job (or sandbox), from a point in time or a seq."""
    try:
        if job is not None and not isinstance(job, str):
            raise ValueError(f"job must be a string, got {job!r}")
        job = subjects.job_token(job) if job else ""   # (a sandbox's job label of any text: the same token)
        sandbox = subjects.token(sandbox, "sandbox") if sandbox else ""
        name = subjects.token(durable, "durable") if durable else new_id("rd")
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    since_seq, since_time = 0, 0.0
    if isinstance(since, datetime.datetime):
        since_time = since.timestamp()
    elif isinstance(since, int) and not isinstance(since, bool) and since > 0:
        since_seq = since
    elif since is not None:
        raise InvalidRequest(f"since must be a datetime or a positive stream sequence, got {since!r}")
    if not isinstance(ack_wait, (int, float)) or not 0 < ack_wait <= 3600:
        raise InvalidRequest(f"ack_wait must be 0-3600 seconds, got {ack_wait!r}")
    return FetchTrajectories(reader=name, durable=bool(durable), job=job, sandbox_id=sandbox, since_seq=since_seq,
                             since_time=since_time, ack_wait=float(ack_wait), batch=BATCH, wait=WAIT)


async def read(bus, tenant: str, request: FetchTrajectories, follow: bool) -> AsyncIterator[Trajectory]:
    """Records in stream order; with follow, waits for new ones forever, else stops when caught up. A
    durable reader is caught up only once records an earlier reader took and never acked (it died)
    have come again, after the ack wait."""
    reader = _Reader(bus, tenant, request)
    unacked: set[int] = set()
    give_up: float | None = None
    batch, handed = None, 0   # the batch being handed out, and how many of it were
    try:
        while True:
            try:
                batch, handed = await reader.fetch(), 0
            except BusError:
                if not follow:
                    raise
                await asyncio.sleep(WAIT)   # the API moving to another engine: ask again
                continue
            for handed, pulled in enumerate(batch.records, 1):
                try:
                    rec = traj_decoder.decode(pulled.data)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    await reader.ack([pulled.ack])   # junk on the stream: skip it for good
                    continue
                unacked.add(pulled.seq)
                yield Trajectory(rec, pulled.seq, _Ack(reader, pulled.ack), unacked)
            if follow or (batch.records and batch.pending > 0):
                continue
            if not request.durable:
                return   # caught up
            if batch.ack_pending - len(unacked) <= 0:
                return   # caught up, and nothing of an earlier reader is due again
            give_up = give_up or time.monotonic() + request.ack_wait + 2 * WAIT
            if time.monotonic() > give_up:
                return
    finally:
        unseen = [p.ack for p in batch.records[handed:]] if batch is not None else []
        if unseen and request.durable:   # a caller that stopped mid-batch (helper U2: the next reader on the
            await reader.give_back(unseen)   # durable got them only after the ack wait, 30 s)
        await reader.close()

"""Reading DSEC_TRAJ directly, with a pull consumer of one's own: the platform's and ops' tools (`dsec
replay`), whose credential may read the streams. Tenants read theirs through the control API
(libdsec/trajectories.py), which runs the same kind of consumer for them on the server."""
from __future__ import annotations

import datetime
import time
from typing import AsyncIterator

import msgspec
from nats.js import api

from bus import streams, subjects
from bus.conn import Bus, DurableReader
from bus.errors import InvalidRequest
from bus.records import traj_decoder
from libdsec.trajectories import BATCH, WAIT, Trajectory


def consumer_config(tenant: str, job: str | None, sandbox: str | None, since, durable: str | None,
                    ack_wait: float) -> api.ConsumerConfig:
    """The pull consumer on DSEC_TRAJ for one tenant's job (or sandbox), from a point in time or a seq."""
    try:
        subject = subjects.trajectory(tenant, subjects.job_token(job) if job else "*",
                                      subjects.token(sandbox, "sandbox") if sandbox else "*")
        name = subjects.token(durable, "durable") if durable else None
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    start: dict = {"deliver_policy": api.DeliverPolicy.ALL}
    if isinstance(since, datetime.datetime):
        start = {"deliver_policy": api.DeliverPolicy.BY_START_TIME,
                 "opt_start_time": since.astimezone(datetime.timezone.utc).isoformat()}
    elif isinstance(since, int) and not isinstance(since, bool) and since > 0:
        start = {"deliver_policy": api.DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": since}
    elif since is not None:
        raise InvalidRequest(f"since must be a datetime or a positive stream sequence, got {since!r}")
    return api.ConsumerConfig(durable_name=name, filter_subject=subject, ack_policy=api.AckPolicy.EXPLICIT,
                              ack_wait=ack_wait, max_ack_pending=10_000, **start)


async def read(bus: Bus, config: api.ConsumerConfig, follow: bool) -> AsyncIterator[Trajectory]:
    """Records in stream order; with follow, waits for new ones forever, else stops when caught up. A
    durable consumer is caught up only once records an earlier reader took and never acked (it died)
    have come again, after the ack wait."""
    reader: DurableReader = await bus.durable_reader(streams.TRAJ_STREAM, config)
    unacked: set[int] = set()
    give_up: float | None = None
    try:
        while True:
            batch = await reader.fetch(BATCH, WAIT)
            for pulled in batch:
                try:
                    rec = traj_decoder.decode(pulled.data)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    await pulled.ack()   # junk on the stream: skip it for good
                    continue
                unacked.add(pulled.seq)
                yield Trajectory(rec, pulled.seq, pulled, unacked)
            if follow or (batch and batch[-1].pending > 0):
                continue
            if not config.durable_name:
                return   # caught up
            others = await bus.consumer_ack_pending(streams.TRAJ_STREAM, config.durable_name) - len(unacked)
            if others <= 0:
                return   # caught up, and nothing of an earlier reader is due again
            give_up = give_up or time.monotonic() + (config.ack_wait or 30.0) + 2 * WAIT
            if time.monotonic() > give_up:
                return
    finally:
        await reader.close()

"""What a chaos run left on the streams and in the records, read after it settled.

Checked on the streams, not through the SDK: every sandbox that ran has exactly one `created` and one
terminal event; DSEC_OUT holds exactly one exit record per exec subject; no exit record says
not_on_this_node; no sandbox record is still ready or starting once every sandbox was destroyed.
"""
from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

import msgspec

from bus import streams
from bus.conn import Bus
from bus.errors import BusError
from bus.records import event_decoder, sandbox_decoder
from bus.execwire import ExitRecord, decode_output

TERMINAL_EVENTS = {"destroyed", "expired", "failed", "node_lost"}


@dataclass
class Streams:
    """Counts read back from DSEC_EVT, DSEC_OUT and KV dsec-sandboxes."""

    created_missing: list[str] = field(default_factory=list)
    created_twice: list[str] = field(default_factory=list)
    terminal_missing: list[str] = field(default_factory=list)
    terminal_twice: list[str] = field(default_factory=list)
    exits_not_one: list[str] = field(default_factory=list)   # exec subjects with 0 or 2+ exit records
    not_on_this_node: int = 0
    stale: list[str] = field(default_factory=list)            # recorded ready/starting after everything ended
    wrong_state: list[str] = field(default_factory=list)      # recorded otherwise than the client was told
    events: int = 0
    exits: int = 0
    seen: dict = field(default_factory=dict)    # sandbox -> [(event type, node)] (for the details)
    records: dict = field(default_factory=dict)  # sandbox -> its record

    def bad(self) -> int:
        """How many things are wrong."""
        return (len(self.created_missing) + len(self.created_twice) + len(self.terminal_missing)
                + len(self.terminal_twice) + len(self.exits_not_one) + self.not_on_this_node + len(self.stale)
                + len(self.wrong_state))

    def line(self) -> str:
        """The verdict's part about the streams."""
        return (f"events_missing={len(self.created_missing) + len(self.terminal_missing)} "
                f"events_duplicated={len(self.created_twice) + len(self.terminal_twice)} "
                f"exit_records_not_one={len(self.exits_not_one)} not_on_this_node={self.not_on_this_node} "
                f"stale_records={len(self.stale)} wrong_records={len(self.wrong_state)}")

    def details(self) -> list[str]:
        """The first few of each problem (for stderr)."""
        out = []
        for name in ("created_missing", "created_twice", "terminal_missing", "terminal_twice", "exits_not_one",
                     "stale", "wrong_state"):
            items = getattr(self, name)
            if items:
                out.append(f"{name}: {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}")
        for sid in (self.created_missing + self.terminal_missing + self.created_twice + self.terminal_twice)[:5]:
            rec = self.records.get(sid)
            out.append(f"  {sid}: events {self.seen.get(sid, [])}; record "
                       f"{(rec.state, rec.node, rec.version, rec.reason) if rec else None}")
        return out


async def _read(bus: Bus, stream: str, subject: str) -> list:
    """Every message stored on subject (wildcards allowed), read from the stream's leader one by one: a
    consumer may sit on a replica still catching up after a server came back, and read it short."""
    for attempt in range(5):   # a read that fails midway is done again, never taken for the end
        try:
            out, seq = [], 0
            while (m := await bus.stored_after(stream, subject, seq)) is not None:
                seq = m.seq
                out.append(m)
            return out
        except BusError:
            if attempt == 4:
                raise
            await asyncio.sleep(1.0)
    return []


async def records(bus: Bus) -> list:
    """Every sandbox record, as the KV stream's leader has it."""
    last: dict[str, object] = {}
    for m in await _read(bus, f"KV_{streams.SANDBOXES_KV}", f"$KV.{streams.SANDBOXES_KV}.>"):
        op = (m.headers or {}).get("KV-Operation", "PUT")
        try:
            rec = sandbox_decoder.decode(m.data) if op == "PUT" and m.data else None
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if rec is not None:
            last[rec.sandbox_id] = rec
    return list(last.values())


EVENTS_SETTLE = 20.0   # seconds events may trail their records (the outbox's backoff, with margin)


async def settle(bus: Bus, ids: set[str], limit: float = 30.0) -> list:
    """Wait (up to limit) until no record of these sandboxes is ready or starting; the records then."""
    deadline = time.monotonic() + limit
    while True:
        try:
            recs = await records(bus)
        except BusError:
            recs = []
        live = [r for r in recs if r.sandbox_id in ids and r.state in ("ready", "starting")]
        if recs and (not live or time.monotonic() > deadline):
            return recs
        await asyncio.sleep(0.5)


async def check(bus: Bus, ran: set[str], told: dict[str, str]) -> Streams:
    """ran: sandboxes that were ready at some point; told: sandbox -> the final state the client learnt
    (destroyed by its destroy, or node_lost / expired from a SandboxNotFound)."""
    out = Streams()
    recs = {r.sandbox_id: r for r in await settle(bus, ran)}
    out.records = recs
    for sid in sorted(ran):
        rec = recs.get(sid)
        if rec is None or rec.state in ("ready", "starting"):
            out.stale.append(f"{sid}={rec.state if rec else 'no record'}")
        elif sid in told and rec.state != told[sid]:
            out.wrong_state.append(f"{sid}: told {told[sid]}, recorded {rec.state}")
    # An edge publishes a change's events after its record is stored, retrying while the bus is away (its
    # outbox backs off up to 5 s): a terminal record may precede its event by that much. Read the events
    # again until each sandbox that ran has both, or EVENTS_SETTLE has passed.
    deadline = time.monotonic() + EVENTS_SETTLE
    while True:
        created: collections.Counter = collections.Counter()
        ended: collections.Counter = collections.Counter()
        out.events, out.seen = 0, {}
        for m in await _read(bus, streams.EVT_STREAM, "dsec.evt.>"):
            try:
                ev = event_decoder.decode(m.data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            out.events += 1
            out.seen.setdefault(ev.sandbox_id, []).append((ev.type, ev.node))
            if ev.type == "created":
                created[ev.sandbox_id] += 1
            elif ev.type in TERMINAL_EVENTS:
                ended[ev.sandbox_id] += 1
        missing = [sid for sid in ran if created[sid] == 0 or ended[sid] == 0]
        if not missing or time.monotonic() > deadline:
            break
        await asyncio.sleep(1.0)
    for sid in sorted(ran):
        if created[sid] == 0:
            out.created_missing.append(sid)
        if ended[sid] == 0:
            out.terminal_missing.append(sid)
    out.created_twice = [s for s, n in created.items() if n > 1]
    out.terminal_twice = [s for s, n in ended.items() if n > 1]
    exits: collections.Counter = collections.Counter()
    subjects_seen: set[str] = set()
    for m in await _read(bus, streams.OUT_STREAM, "dsec.out.>"):
        try:
            rec = decode_output(m.data, m.headers)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        subject = f"{rec.exec_id}"
        subjects_seen.add(subject)
        if isinstance(rec, ExitRecord):
            exits[subject] += 1
            out.exits += 1
            if rec.reason == "not_on_this_node":
                out.not_on_this_node += 1
    out.exits_not_one = [s for s in sorted(subjects_seen) if exits[s] != 1]
    return out

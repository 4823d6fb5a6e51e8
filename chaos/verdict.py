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
from bus.messages import ExitRecord, decode_output, event_decoder, sandbox_decoder

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
        return out


async def _read(bus: Bus, stream: str, subject: str, headers: bool = False) -> list:
    for attempt in range(5):   # a read that stalls is retried, never taken for the end
        try:
            return [m async for m in bus.read_subject(stream, subject, with_headers=headers, timeout=5)]
        except BusError:
            if attempt == 4:
                raise
            await asyncio.sleep(1.0)
    return []


async def settle(bus: Bus, ids: set[str], limit: float = 30.0) -> list:
    """Wait (up to limit) until no record of these sandboxes is ready or starting; the records then."""
    deadline = time.monotonic() + limit
    while True:
        try:
            recs = [sandbox_decoder.decode(raw) for _, raw in await bus.kv_items(streams.SANDBOXES_KV)]
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
    for sid in sorted(ran):
        rec = recs.get(sid)
        if rec is None or rec.state in ("ready", "starting"):
            out.stale.append(f"{sid}={rec.state if rec else 'no record'}")
        elif sid in told and rec.state != told[sid]:
            out.wrong_state.append(f"{sid}: told {told[sid]}, recorded {rec.state}")
    created: collections.Counter = collections.Counter()
    ended: collections.Counter = collections.Counter()
    for data in await _read(bus, streams.EVT_STREAM, "dsec.evt.>"):
        try:
            ev = event_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        out.events += 1
        if ev.type == "created":
            created[ev.sandbox_id] += 1
        elif ev.type in TERMINAL_EVENTS:
            ended[ev.sandbox_id] += 1
    for sid in sorted(ran):
        if created[sid] == 0:
            out.created_missing.append(sid)
        if ended[sid] == 0:
            out.terminal_missing.append(sid)
    out.created_twice = [s for s, n in created.items() if n > 1]
    out.terminal_twice = [s for s, n in ended.items() if n > 1]
    exits: collections.Counter = collections.Counter()
    subjects_seen: set[str] = set()
    for data, headers in await _read(bus, streams.OUT_STREAM, "dsec.out.>", headers=True):
        try:
            rec = decode_output(data, headers)
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

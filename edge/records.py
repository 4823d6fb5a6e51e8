"""Sandbox records: the one writer of a sandbox's state (KV dsec-sandboxes), of its lifecycle events
(DSEC_EVT) and of its trajectory timeline's lifecycle records (DSEC_TRAJ).

States: starting -> ready -> destroyed | expired | failed | node_lost; a create that fails before it
is ready ends failed or expired from starting or from no record. A final state is never left, and
exactly one writer records it: every write is compare-and-set on the record's revision, and a record
carries a version (its writes so far), so a change applied again (after a crash, a lost ack) never
overwrites a newer one. The terminal event goes out only with the write that made the record final,
so a sandbox has exactly one terminal event, whoever ended it.

The edge writes through its outbox (edge/outbox.py): durable, in order per sandbox, retried until the
bus has it. Placement's reaper writes node_lost directly (mark_lost) under the same rules.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass

import msgspec

from bus import streams, subjects
from bus.conn import Bus
from bus.errors import BusError
from bus.messages import Event, SandboxRecord, TrajRecord, encode, sandbox_decoder
from edge.outbox import Change, Outbox, Publish

log = logging.getLogger(__name__)

TERMINAL = frozenset({"destroyed", "expired", "failed", "node_lost"})
CONFLICTS = 8   # compare-and-set conflicts one change meets before it reads and decides again


class Outcome(enum.Enum):
    """What applying a change did."""

    WRITTEN = "written"      # the record now holds it
    ALREADY = "already"      # it was there already (applied before)
    STALE = "stale"          # a newer state of ours is there: nothing written
    FINAL = "final"          # the record reached a final state first (someone else ended it)
    NOT_OURS = "not_ours"    # the id belongs to another node or request (our claim was taken)


def decode_record(raw: bytes | None) -> SandboxRecord | None:
    """A sandbox record, or None for none or junk."""
    if raw is None:
        return None
    try:
        return sandbox_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def ours(prior: SandboxRecord, rec: SandboxRecord) -> bool:
    """Whether two records are of the same sandbox run: same node and create request."""
    return prior.node == rec.node and prior.request_id == rec.request_id


def decide(prior: SandboxRecord | None, rec: SandboxRecord, over_claim: bool) -> Outcome | None:
    """Whether rec may be written over prior (None: write it), else why not."""
    if prior is None:
        return Outcome.NOT_OURS if over_claim else None   # a claim that was freed: the request went elsewhere
    if prior == rec:
        return Outcome.ALREADY
    if not ours(prior, rec):
        return Outcome.NOT_OURS
    if prior.state in TERMINAL:
        return Outcome.FINAL
    if prior.version >= rec.version:
        return Outcome.STALE
    return None


def lifecycle(rec: SandboxRecord, type_: str, *, node: str, request_id: str = "", detail: str = "",
              nth: int = 0, failure_class: str = "") -> list[Publish]:
    """The event and the trajectory record of one lifecycle step (nth: which one of a step that may
    happen again, e.g. the 2nd suspend). Their msg ids make publishing them twice store them once."""
    now = time.time()
    name = f"{type_}.{nth}" if nth else type_
    job = subjects.job_of(rec.labels)
    ev = Event(type=type_, sandbox_id=rec.sandbox_id, tenant=rec.tenant, node=node, request_id=request_id, at=now,
               detail=detail, failure_class=failure_class)
    traj = TrajRecord(id=f"{rec.sandbox_id}.{name}", type=type_, sandbox_id=rec.sandbox_id, tenant=rec.tenant,
                      job=job, node=node, at=now, detail=detail, failure_class=failure_class)
    return [Publish(subjects.event(rec.tenant, rec.sandbox_id), encode(ev), f"{rec.sandbox_id}.{name}.{node}"),
            Publish(subjects.trajectory(rec.tenant, job, rec.sandbox_id), encode(traj),
                    f"{rec.sandbox_id}.{name}.{node}.traj")]


@dataclass
class Pending:
    """A change recorded durably: `record` resolves once its record is stored (what reply paths wait
    for), `done` once its publishes are out too; both to its Outcome."""

    record: asyncio.Future
    done: asyncio.Future


class SandboxRecords:
    """Writes the records of the sandboxes of one node (or, for the reaper, of a lost one)."""

    def __init__(self, bus: Bus, node: str, outbox: Outbox | None = None) -> None:
        self.bus = bus
        self.node = node
        self.outbox = outbox
        self.revisions: dict[str, int] = {}   # last revision this writer stored per sandbox (a CAS hint)
        self._written: dict[tuple[str, int], asyncio.Future] = {}   # (id, version) -> its `record` future

    # ---- claims: the create path's own compare-and-set (exactly one sandbox per request) ----------

    async def claim(self, rec: SandboxRecord, revision: int = 0) -> tuple[int | None, SandboxRecord | None, int]:
        """Write a `starting` claim over `revision` (0: the id has no record). Returns (new revision or
        None, the record found instead, its revision)."""
        claimed = await self.bus.kv_cas(streams.SANDBOXES_KV, rec.sandbox_id, encode(rec), revision)
        if claimed is not None:
            self.revisions[rec.sandbox_id] = claimed
            return claimed, None, 0
        raw, latest = await self.bus.kv_entry(streams.SANDBOXES_KV, rec.sandbox_id)
        return None, decode_record(raw), latest

    async def get(self, sandbox_id: str) -> tuple[SandboxRecord | None, int]:
        """A sandbox's record and its revision (None, revision of its tombstone or 0)."""
        raw, revision = await self.bus.kv_entry(streams.SANDBOXES_KV, sandbox_id)
        return decode_record(raw), revision

    async def free_claim(self, sandbox_id: str, node: str | None = None) -> bool:
        """Delete a `starting` claim of this node (never someone else's, never a later state)."""
        rec, revision = await self.get(sandbox_id)
        if rec is not None and rec.node == (node or self.node) and rec.state == "starting":
            return await self.bus.kv_cas_delete(streams.SANDBOXES_KV, sandbox_id, revision)
        return False

    # ---- changes through the outbox -----------------------------------------------------------------

    async def change(self, rec: SandboxRecord | None, sandbox_id: str = "", *, publishes: list[Publish] = (),
                     revision: int = -1, over_claim: bool = False, terminal_event: bool = False) -> Pending:
        """Record a change durably (fsynced before this returns) and have it applied, however long the bus
        takes. rec None: only publishes (an exec's trajectory record, an event)."""
        sid = rec.sandbox_id if rec is not None else sandbox_id
        if revision < 0 and rec is not None:
            revision = self.revisions.get(sid, -1)
        c = Change(sandbox_id=sid, record=rec, revision=revision, over_claim=over_claim,
                   terminal_event=terminal_event, publishes=list(publishes), at=time.time())
        assert self.outbox is not None, "changes go through an outbox"
        written = asyncio.get_running_loop().create_future()
        if rec is not None:
            self._written[(sid, rec.version)] = written
        try:
            done = await self.outbox.put(c)
        except BaseException:
            self._written.pop((sid, rec.version if rec is not None else -1), None)
            raise
        if rec is None:
            written.set_result(Outcome.WRITTEN)
        done.add_done_callback(lambda f: _settle(written, f))
        return Pending(written, done)

    async def apply(self, c: Change, replayed: bool = False) -> Outcome:
        """Apply one change (the outbox's apply): the record by compare-and-set, then its publishes.
        BusError when the bus fails (the outbox tries again)."""
        outcome = Outcome.WRITTEN
        if c.record is not None:
            outcome = await self._write(c.record, c.revision, c.over_claim)
            waiter = self._written.pop((c.sandbox_id, c.record.version), None)
            if waiter is not None and not waiter.done():
                waiter.set_result(outcome)
        if outcome is Outcome.NOT_OURS or (c.terminal_event and outcome not in (Outcome.WRITTEN, Outcome.ALREADY)):
            return outcome
        if replayed:   # published before the crash maybe, beyond the duplicate window: never twice
            for p in c.publishes:
                if not await self._stored(p):
                    await self.bus.publish(p.subject, p.data, msg_id=p.msg_id)
        else:
            await asyncio.gather(*(self.bus.publish(p.subject, p.data, msg_id=p.msg_id) for p in c.publishes))
        return outcome

    async def _write(self, rec: SandboxRecord, revision: int, over_claim: bool) -> Outcome:
        data = encode(rec)
        for _ in range(CONFLICTS):
            if revision >= 0:
                written = await self.bus.kv_cas(streams.SANDBOXES_KV, rec.sandbox_id, data, revision)
                if written is not None:
                    self._stored_revision(rec, written)
                    return Outcome.WRITTEN
            prior, revision = await self.get(rec.sandbox_id)
            why = decide(prior, rec, over_claim)
            if why is not None:
                if why is Outcome.ALREADY:
                    self._stored_revision(rec, revision)
                return why
        raise BusError(f"record of {rec.sandbox_id}: still conflicting after {CONFLICTS} writes")

    def _stored_revision(self, rec: SandboxRecord, revision: int) -> None:
        if rec.state in TERMINAL:
            self.revisions.pop(rec.sandbox_id, None)
        else:
            self.revisions[rec.sandbox_id] = revision

    async def _stored(self, p: Publish) -> bool:
        """Whether a message with this msg id is stored on its subject already (a replayed change)."""
        stream = streams.EVT_STREAM if p.subject.startswith("dsec.evt.") else streams.TRAJ_STREAM
        seq = 0
        while (m := await self.bus.stored_after(stream, p.subject, seq)) is not None:
            seq = m.seq
            if (m.headers or {}).get("Nats-Msg-Id") == p.msg_id:
                return True
        return False

    # ---- placement's writes (no outbox) ------------------------------------------------------------

    async def reject(self, rec: SandboxRecord, publishes: list[Publish]) -> bool:
        """A request that ended before any node took it (placement: no room before its deadline): its final
        record, only if the id has none (a node's claim is then the truth), and its event."""
        prior, revision = await self.get(rec.sandbox_id)
        if prior is not None or await self.bus.kv_cas(streams.SANDBOXES_KV, rec.sandbox_id, encode(rec),
                                                       revision) is None:
            return False
        for p in publishes:
            await self.bus.publish(p.subject, p.data, msg_id=p.msg_id, retries=3, retry_for=5.0)
        return True

    async def mark_lost(self, rec: SandboxRecord, revision: int, why: str) -> Outcome:
        """A ready sandbox of a lost node: node_lost by compare-and-set, then its event and trajectory
        record (published again by whoever finishes a lost node's job, so a crash midway loses none)."""
        gone = msgspec.structs.replace(rec, state="node_lost", reason=why, updated_at=time.time(),
                                       version=rec.version + 1, suspended=False)
        written = await self.bus.kv_cas(streams.SANDBOXES_KV, rec.sandbox_id, encode(gone), revision)
        if written is None:
            return Outcome.FINAL
        await self.announce_lost(gone)
        return Outcome.WRITTEN

    async def announce_lost(self, rec: SandboxRecord) -> None:
        """The node_lost event and trajectory record of a record marked node_lost (idempotent)."""
        for p in lifecycle(rec, "node_lost", node=rec.node, detail=rec.reason):
            await self.bus.publish(p.subject, p.data, msg_id=p.msg_id, retries=3, retry_for=5.0)


def _settle(written: asyncio.Future, done: asyncio.Future) -> None:
    """A change that ended without its record part resolving (cancelled at a stop) resolves it too."""
    if not written.done():
        if done.cancelled():
            written.cancel()
        elif done.exception() is not None:
            written.set_exception(done.exception())
        else:
            written.set_result(done.result())

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
import collections
import enum
import logging
import time
from dataclasses import dataclass

import msgspec

from bus import streams, subjects
from bus.conn import Bus
from bus.errors import BusError, InvalidRequest
from bus.messages import encode
from bus.records import Event, SandboxRecord, TrajRecord, sandbox_decoder
from bus.execwire import ExitRecord, decode_output
from edge.outbox import Change, Outbox, Publish

log = logging.getLogger(__name__)

TERMINAL = frozenset({"destroyed", "expired", "failed", "node_lost"})
CONFLICTS = 8   # compare-and-set conflicts one change meets before it reads and decides again



def key_of(rec: SandboxRecord) -> str:
    """The record's key in dsec-sandboxes: <tenant>.<sandbox>."""
    return subjects.record_key(rec.tenant, rec.sandbox_id)

class Outcome(enum.Enum):
    """What applying a change did."""

    WRITTEN = "written"      # the record now holds it
    ALREADY = "already"      # it was there already (applied before)
    STALE = "stale"          # stored before, and newer states followed: nothing written (it did happen)
    FINAL = "final"          # another writer got there first (ended it): this change never happened
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
    """Whether two records are of the same sandbox run: same node, create request and edge run (a change
    an earlier run left in its outbox never lands on a later run's claim)."""
    return prior.node == rec.node and prior.request_id == rec.request_id and prior.epoch == rec.epoch


def decide(prior: SandboxRecord | None, rec: SandboxRecord, over_claim: bool) -> Outcome | None:
    """Whether rec may be written over prior (None: write it), else why not. Versions grow by one per
    write of one run's record, so a prior of a higher version means this change was stored before and
    later ones followed it (STALE: it did happen); one of the same version, or a final state below it,
    means another writer got there first (FINAL)."""
    if prior is None:
        return Outcome.NOT_OURS if over_claim else None   # a claim that was freed: the request went elsewhere
    if prior == rec:
        return Outcome.ALREADY
    if not ours(prior, rec):
        return Outcome.NOT_OURS
    if prior.version > rec.version:
        return Outcome.STALE
    if prior.state in TERMINAL or prior.version == rec.version:
        return Outcome.FINAL
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
    """A change recorded durably: `record` resolves to its Outcome once its record is stored (what reply
    paths wait for); `done` once its publishes are out too."""

    record: asyncio.Future
    done: asyncio.Future


OLD_CHANGE = 100.0   # seconds after which a change's publishes are looked for before being sent again (past
                     # the streams' 120 s duplicate window a msg id no longer dedupes)
EXITS_KEPT = 100_000  # exec ids whose exit records this node stored, remembered
EXIT_WAIT = 2.0      # seconds an exec's trajectory change waits to hear its exit record is stored


class SandboxRecords:
    """Writes the records of the sandboxes of one node (or, for the reaper, of a lost one)."""

    def __init__(self, bus: Bus, node: str, outbox: Outbox | None = None) -> None:
        self.bus = bus
        self.node = node
        self.outbox = outbox
        self.revisions: dict[str, int] = {}   # last revision this writer stored per sandbox (a CAS hint)
        self._exits: collections.OrderedDict[str, None] = collections.OrderedDict()   # exit records stored
        self._exit_waiters: dict[str, asyncio.Event] = {}
        self.dropped = 0                      # messages the server could never take (see _send)

    def exit_stored(self, exec_id: str) -> None:
        """Chronus stored an exec's exit record: the exec's trajectory record may follow it now."""
        self._exits[exec_id] = None
        while len(self._exits) > EXITS_KEPT:
            self._exits.popitem(last=False)
        waiter = self._exit_waiters.pop(exec_id, None)
        if waiter is not None:
            waiter.set()

    async def _exit_done(self, c: Change, replayed: bool) -> bool:
        """Whether the exit record an exec's trajectory change waits for is stored: told by Chronus (waited
        for a moment: it is usually a millisecond away), else asked of the stream."""
        if c.after_exit in self._exits:
            return True
        if not replayed:
            waiter = self._exit_waiters.setdefault(c.after_exit, asyncio.Event())
            try:
                await asyncio.wait_for(waiter.wait(), EXIT_WAIT)
                return True
            except asyncio.TimeoutError:
                self._exit_waiters.pop(c.after_exit, None)
        return await self._exit_stored(c)

    # ---- claims: the create path's own compare-and-set (exactly one sandbox per request) ----------

    async def claim(self, rec: SandboxRecord, revision: int = 0) -> tuple[int | None, SandboxRecord | None, int]:
        """Write a `starting` claim over `revision` (0: the id has no record). Returns (new revision or
        None, the record found instead, its revision)."""
        claimed = await self.bus.kv_cas(streams.SANDBOXES_KV, key_of(rec), encode(rec), revision)
        if claimed is not None:
            self.revisions[rec.sandbox_id] = claimed
            return claimed, None, 0
        raw, latest = await self.bus.kv_entry(streams.SANDBOXES_KV, key_of(rec))
        return None, decode_record(raw), latest

    async def get(self, tenant: str, sandbox_id: str) -> tuple[SandboxRecord | None, int]:
        """A sandbox's record and its revision (None, revision of its tombstone or 0)."""
        raw, revision = await self.bus.kv_entry(streams.SANDBOXES_KV, subjects.record_key(tenant, sandbox_id))
        return decode_record(raw), revision

    async def free_claim(self, tenant: str, sandbox_id: str, node: str | None = None, revision: int = 0) -> bool:
        """Delete a `starting` claim of this node (never someone else's, never a later state); with a
        revision, only the claim at that revision (the one the caller checked)."""
        key = subjects.record_key(tenant, sandbox_id)
        if revision:
            return await self.bus.kv_cas_delete(streams.SANDBOXES_KV, key, revision)
        rec, revision = await self.get(tenant, sandbox_id)
        if rec is not None and rec.node == (node or self.node) and rec.state == "starting":
            return await self.bus.kv_cas_delete(streams.SANDBOXES_KV, key, revision)
        return False

    # ---- changes through the outbox -----------------------------------------------------------------

    async def change(self, rec: SandboxRecord | None, sandbox_id: str = "", *, publishes: list[Publish] = (),
                     revision: int = -1, over_claim: bool = False, terminal_event: bool = False,
                     after_exit: str = "", exit_subject: str = "") -> Pending:
        """Record a change durably (fsynced before this returns; OSError if the disk fails) and have it
        applied, however long the bus takes. rec None: only publishes (an exec's trajectory record, an
        event); after_exit: an exec id whose exit record must be stored before they go out."""
        sid = rec.sandbox_id if rec is not None else sandbox_id
        if revision < 0 and rec is not None:
            revision = self.revisions.get(sid, -1)
        c = Change(sandbox_id=sid, record=rec, revision=revision, over_claim=over_claim,
                   terminal_event=terminal_event, publishes=list(publishes), at=time.time(), after_exit=after_exit,
                   exit_subject=exit_subject)
        assert self.outbox is not None, "changes go through an outbox"
        early = asyncio.get_running_loop().create_future()
        done = await self.outbox.put(c, early)
        return Pending(early, done)

    async def apply(self, c: Change, replayed: bool = False, early: asyncio.Future | None = None) -> Outcome:
        """Apply one change (the outbox's apply): the record by compare-and-set, then its publishes, only
        if the record is ours and (for the terminal event) this change ended it. BusError when the bus
        fails (the outbox tries again)."""
        outcome = Outcome.WRITTEN
        if c.record is not None:
            outcome = await self._write(c.record, c.revision, c.over_claim)
            if early is not None and not early.done():
                early.set_result(outcome)
            if outcome not in (Outcome.WRITTEN, Outcome.ALREADY) and (c.terminal_event or outcome is not Outcome.STALE):
                log.warning("change of %s to %s not recorded: %s", c.sandbox_id, c.record.state, outcome.value)
                return outcome   # never an event of a change that did not happen (after the end, or not ours)
        if c.after_exit:
            if not await self._exit_done(c, replayed):
                if replayed:
                    return outcome   # a crashed run never stored this exec's end: the node's loss tells it
                raise BusError(f"exit record of {c.after_exit} not stored yet")
        if replayed or time.time() - c.at > OLD_CHANGE:   # published before maybe, past the duplicate window
            for p in c.publishes:
                if not await self._stored(p):
                    await self._send(p)
        else:
            await asyncio.gather(*(self._send(p) for p in c.publishes))
        return outcome

    async def _send(self, p: Publish) -> None:
        """Publish one message of a change. One the server can never take (InvalidRequest: larger than its
        max_payload) is dropped with an error logged, not tried forever: the sandbox's later changes, its
        final state among them, wait behind it in the outbox (chronus/trajfit.py keeps records small)."""
        try:
            await self.bus.publish(p.subject, p.data, msg_id=p.msg_id)
        except InvalidRequest as exc:
            self.dropped += 1
            log.error("message %s (%d bytes on %s) dropped: %s", p.msg_id, len(p.data), p.subject, exc)

    async def _exit_stored(self, c: Change) -> bool:
        subject = c.exit_subject or f"dsec.out.{c.sandbox_id}.{c.after_exit}"
        last = await self.bus.last_on_subject(streams.OUT_STREAM, subject, with_headers=True)
        try:
            return last is not None and isinstance(decode_output(*last), ExitRecord)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False

    async def _write(self, rec: SandboxRecord, revision: int, over_claim: bool) -> Outcome:
        data = encode(rec)
        for _ in range(CONFLICTS):
            if revision >= 0:
                written = await self.bus.kv_cas(streams.SANDBOXES_KV, key_of(rec), data, revision)
                if written is not None:
                    self._stored_revision(rec, written)
                    return Outcome.WRITTEN
            prior, revision = await self.get(rec.tenant, rec.sandbox_id)
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

    async def note(self, tenant: str, sandbox_id: str, type_: str, request_id: str, detail: str) -> None:
        """An event of a request that has no record and no state hanging on it (queued: waiting for room;
        rejected at admission): sent once, best effort, so a busy placement never waits on it."""
        try:
            subjects.token(sandbox_id, "sandbox_id"), subjects.token(tenant, "tenant")
        except ValueError:
            return   # no valid subject to file it under
        try:
            await self.bus.send(subjects.event(tenant, sandbox_id), Event(
                type=type_, sandbox_id=sandbox_id, tenant=tenant, request_id=request_id, at=time.time(),
                detail=detail))
        except BusError:
            pass   # the reply to the requester said it already

    async def reject(self, rec: SandboxRecord, publishes: list[Publish]) -> bool:
        """A request that ended before any node took it (placement: no room before its deadline): its final
        record, only if the id has none (a node's claim is then the truth), and its event."""
        prior, revision = await self.get(rec.tenant, rec.sandbox_id)
        if prior is not None and not (prior.request_id == rec.request_id and not prior.node):
            return False   # a node's record: the truth
        if prior is None and await self.bus.kv_cas(streams.SANDBOXES_KV, key_of(rec), encode(rec),
                                                   revision) is None:
            return False
        for p in publishes:   # (again, for a rejection recorded before: the msg ids keep one of each)
            await self.bus.publish(p.subject, p.data, msg_id=p.msg_id, retries=3, retry_for=5.0)
        return True

    async def mark_lost(self, rec: SandboxRecord, revision: int, why: str) -> Outcome:
        """A ready sandbox of a lost node: node_lost by compare-and-set, then its event and trajectory
        record (published again by whoever finishes a lost node's job, so a crash midway loses none)."""
        gone = msgspec.structs.replace(rec, state="node_lost", reason=why, updated_at=time.time(),
                                       version=rec.version + 1, suspended=False)
        written = await self.bus.kv_cas(streams.SANDBOXES_KV, key_of(rec), encode(gone), revision)
        if written is None:
            return Outcome.FINAL
        await self.announce_lost(gone)
        return Outcome.WRITTEN

    async def announce_lost(self, rec: SandboxRecord) -> None:
        """The node_lost event and trajectory record of a record marked node_lost (idempotent)."""
        for p in lifecycle(rec, "node_lost", node=rec.node, detail=rec.reason):
            await self.bus.publish(p.subject, p.data, msg_id=p.msg_id, retries=3, retry_for=5.0)


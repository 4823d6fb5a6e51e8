"""The edge's outbox (edge/outbox.py) and the record rules (edge/records.py), as units: durable before it
answers, applied in order per sandbox however long the bus fails, replayed after a crash, bounded, and
a torn or corrupt log read up to the damage."""
from __future__ import annotations

import asyncio
import time

import pytest

from bus.errors import BusError
from bus.records import SandboxRecord
from edge.outbox import Change, Outbox, Publish, frame, read_log, _Frame
from edge.records import Outcome, decide


def _change(sid: str, n: int) -> Change:
    return Change(sandbox_id=sid, publishes=[Publish(f"dsec.evt.default.{sid}", b"%d" % n, f"{sid}.{n}")])


class Applier:
    """apply(): fails `failures` times first (the bus away), records what it applied, in order."""

    def __init__(self, failures: int = 0, gate: asyncio.Event | None = None) -> None:
        self.failures = failures
        self.applied: list[tuple[str, bytes]] = []
        self.gate = gate

    async def __call__(self, c: Change, replayed: bool, early=None) -> Outcome:
        if self.gate is not None:
            await self.gate.wait()
        if self.failures:
            self.failures -= 1
            raise BusError("no leader")
        self.applied.append((c.sandbox_id, c.publishes[0].data))
        return Outcome.WRITTEN


async def test_changes_are_applied_in_order_per_sandbox_through_bus_failures(tmp_path, monkeypatch):
    from edge import outbox as mod
    monkeypatch.setattr(mod, "BACKOFF_MAX", 0.02)
    apply = Applier(failures=5)
    box = Outbox(tmp_path / "outbox.log", apply)
    await box.open()
    futures = [await box.put(_change(sid, n)) for n in range(3) for sid in ("a", "b")]
    assert (tmp_path / "outbox.log").stat().st_size > 0, "on disk before put() returns"
    outcomes = await asyncio.wait_for(asyncio.gather(*futures), 10)
    assert outcomes == [Outcome.WRITTEN] * 6 and box.pending == 0
    for sid in ("a", "b"):
        assert [d for s, d in apply.applied if s == sid] == [b"0", b"1", b"2"]
    await box.close()
    assert read_log(tmp_path / "outbox.log") == ({}, "")


async def test_what_a_crashed_run_did_not_apply_is_applied_at_the_next_start(tmp_path):
    gate = asyncio.Event()      # the bus never answers this run
    box = Outbox(tmp_path / "outbox.log", Applier(gate=gate))
    await box.open()
    for n in range(3):
        await box.put(_change("a", n))
    await box.close()           # a stop (or a crash): nothing was applied
    again = Applier()
    box2 = Outbox(tmp_path / "outbox.log", again)
    replayed = await box2.open()
    assert [c.publishes[0].data for c in replayed] == [b"0", b"1", b"2"]
    for _ in range(100):
        if box2.pending == 0:
            break
        await asyncio.sleep(0.02)
    assert again.applied == [("a", b"0"), ("a", b"1"), ("a", b"2")]
    await box2.close()


async def test_a_torn_or_corrupt_log_is_reported_and_read_up_to_the_damage(tmp_path):
    path = tmp_path / "outbox.log"
    good = frame(_Frame(1, _change("a", 1))) + frame(_Frame(2, _change("a", 2))) + frame(_Frame(1))
    for damage, what in ((frame(_Frame(3, _change("a", 3)))[:-4], "torn frame"),
                         (b"\x05\x00\x00\x00\x00\x00\x00\x00xxxxx", "corrupt frame")):
        path.write_bytes(good + damage)
        pending, problem = read_log(path)
        assert sorted(pending) == [2] and what in problem
        apply = Applier()
        box = Outbox(path, apply)
        replayed = await box.open()
        assert box.problem and [c.publishes[0].data for c in replayed] == [b"2"]   # reported, never a crash
        await asyncio.sleep(0.1)
        await box.close()
        assert read_log(path)[1] == "", "the log is rewritten whole at start"


async def test_a_full_outbox_says_so_and_drains(tmp_path):
    gate = asyncio.Event()
    box = Outbox(tmp_path / "outbox.log", Applier(gate=gate), max_pending=3)
    await box.open()
    futures = [await box.put(_change(f"s{n}", n)) for n in range(3)]
    assert box.full(), "past the bound the edge takes no new creates"
    gate.set()
    await asyncio.wait_for(asyncio.gather(*futures), 5)
    assert not box.full()
    await box.close()


@pytest.mark.parametrize("prior,rec,over_claim,want", [
    (None, dict(state="ready", version=2), True, Outcome.NOT_OURS),             # a freed claim: gone elsewhere
    (None, dict(state="ready", version=2), False, None),                        # a warm claim: write it
    (dict(state="starting", version=1), dict(state="ready", version=2), True, None),
    (dict(state="node_lost", version=3), dict(state="destroyed", version=3), False, Outcome.FINAL),  # the reaper
    (dict(state="node_lost", version=3), dict(state="ready", version=2), False, Outcome.STALE),  # ready happened
    (dict(state="expired", version=4), dict(state="ready", version=5, suspended=True), False, Outcome.FINAL),
    (dict(state="ready", version=4), dict(state="ready", version=3), False, Outcome.STALE),
    (dict(state="ready", version=2, node="n2"), dict(state="ready", version=2), False, Outcome.NOT_OURS),
])
def test_record_rules(prior, rec, over_claim, want):
    def make(**kw):
        return SandboxRecord(sandbox_id="s", node=kw.pop("node", "n1"), request_id="r", **kw)
    assert decide(make(**prior) if prior else None, make(**rec), over_claim) is want
    same = make(**rec)
    assert decide(same, make(**rec), over_claim) is Outcome.ALREADY


async def test_a_message_the_server_can_never_take_is_dropped_not_tried_forever():
    """A change's publish refused as InvalidRequest (larger than the server's max_payload) used to fail the
    change, which the outbox then tried forever, holding back every later change of that sandbox (its
    `destroyed` record among them). Now that one message is dropped (logged, counted) and the change applies."""
    from bus.errors import InvalidRequest
    from edge.records import SandboxRecords

    class Bus:
        def __init__(self):
            self.sent = []

        async def publish(self, subject, data, msg_id=None):
            if len(data) > 1 << 20:
                raise InvalidRequest("publish: the message is larger than the NATS server takes")
            self.sent.append(msg_id)

    bus = Bus()
    records = SandboxRecords(bus, "n1")
    change = Change(sandbox_id="sb1", at=time.time(), publishes=[Publish("dsec.traj.default.default.sb1", b"x" * (2 << 20), "x1-traj"),
                                                  Publish("dsec.evt.default.sb1", b"{}", "sb1.destroyed")])
    assert await records.apply(change) is Outcome.WRITTEN
    assert bus.sent == ["sb1.destroyed"] and records.dropped == 1


@pytest.mark.parametrize("truncate_fails", [False, True])
async def test_a_write_the_disk_cut_short_leaves_no_torn_frame_before_later_ones(tmp_path, monkeypatch, truncate_fails):
    """The disk fills mid-write: the put fails (OSError), and what it wrote of its frame is taken back
    (truncated; when even that fails, the log is rewritten whole at the next write), so the changes put
    after it, once the disk has room, are read at the next start (before: they followed a torn frame, and
    the next start read the log only up to the tear: their lifecycle events were lost)."""
    import errno
    import os
    from edge import outbox as mod
    gate = asyncio.Event()      # nothing is applied this run: everything stays pending in the log
    box = Outbox(tmp_path / "outbox.log", Applier(gate=gate))
    await box.open()
    await box.put(_change("a", 0))
    real, full = mod._write_all, [True]

    def half_then_full(fd, data):
        if full[0]:
            full[0] = False
            os.write(fd, data[:len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)
    monkeypatch.setattr(mod, "_write_all", half_then_full)
    if truncate_fails:
        def no_truncate(fd, length):
            raise OSError(errno.EIO, "Input/output error")
        monkeypatch.setattr(mod, "_truncate", no_truncate)
    with pytest.raises(OSError):
        await box.put(_change("a", 1))
    await box.put(_change("b", 2))
    await box.put(_change("a", 3))
    await box.close()
    pending, problem = read_log(tmp_path / "outbox.log")
    assert problem == "" and sorted(c.publishes[0].data for c in pending.values()) == [b"0", b"2", b"3"]

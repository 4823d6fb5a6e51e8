"""Suspend and resume by group (client.suspend / client.resume): every sandbox of a job, on any node,
freezes where it is and later runs on from there."""
from __future__ import annotations

import asyncio

import pytest

import libdsec
from bus import streams
from bus.records import sandbox_decoder

# the count is written aside and renamed over: a reader never sees it half written
COUNTER = "i=0; while :; do echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; i=$((i+1)); usleep 20000; done"


async def counts(sandboxes) -> list[int]:
    return [int((await sb.read_file("/tmp/count")).strip()) for sb in sandboxes]


async def test_a_group_of_20_on_2_edges_freezes_and_goes_on_where_it_was(stack, client, second_edge):
    boxes = await asyncio.gather(*(client.create(labels={"job": "js"}) for _ in range(20)))
    other = await client.create(labels={"job": "other"})
    try:
        assert {sb.node for sb in boxes} == {"t1", "t2"}
        counters = [await sb.exec(COUNTER, background=True) for sb in boxes + [other]]
        await asyncio.sleep(0.5)
        suspended = await client.suspend(labels={"job": "js"})
        assert sorted(suspended) == sorted(sb.id for sb in boxes)
        frozen = await counts(boxes)
        await asyncio.sleep(0.6)
        assert await counts(boxes) == frozen, "a suspended sandbox's processes do not run"
        other_before = (await counts([other]))[0]
        await asyncio.sleep(0.2)
        assert (await counts([other]))[0] > other_before, "only the job's sandboxes are suspended"
        with pytest.raises(libdsec.SandboxSuspended):
            await boxes[0].exec("echo hi")
        rec = sandbox_decoder.decode(await stack.bus.kv_get(streams.SANDBOXES_KV, f"{client.tenant}.{boxes[0].id}"))
        assert rec.state == "ready" and rec.suspended
        assert await client.suspend(labels={"job": "js"}) == []        # already suspended: nothing to do
        assert sorted(await client.resume(labels={"job": "js"})) == sorted(suspended)
        await asyncio.sleep(0.3)
        after = await counts(boxes)
        for before, now in zip(frozen, after):   # on from where it stopped, not started again
            assert before < now < before + 40, (before, now)
        assert (await boxes[0].exec("echo hi")).stdout == b"hi\n"
        for h in counters:
            assert await h.kill() is True
    finally:
        await asyncio.gather(*(sb.destroy() for sb in boxes + [other]), return_exceptions=True)


async def test_suspended_time_counts_against_neither_ttl_nor_exec_timeout(client):
    sb = await client.create(ttl=2)
    try:
        running = asyncio.ensure_future(sb.exec("sleep 1; echo done", timeout=2))
        await asyncio.sleep(0.5)
        await sb.suspend()
        await asyncio.sleep(3)                       # past the TTL and past the exec's timeout, frozen
        assert (await client.get(sb.id)).id == sb.id
        await sb.resume()
        r = await running
        assert (r.stdout, r.exit_code, r.timed_out) == (b"done\n", 0, False)
        await asyncio.sleep(2.5)                     # now the TTL runs on: 1.5 s were left of it
        with pytest.raises(libdsec.SandboxNotFound):
            await client.get(sb.id)
    finally:
        try:
            await sb.destroy()
        except libdsec.SandboxNotFound:
            pass


async def test_a_suspended_sandbox_can_be_destroyed_and_suspend_needs_a_selection(client):
    sb = await client.create(labels={"job": "jd"})
    h = await sb.exec("sleep 60", background=True)
    assert await client.suspend(labels={"job": "jd"}) == [sb.id]
    await sb.destroy()              # frozen processes die too (the kill thaws them)
    try:
        assert (await asyncio.wait_for(h.wait(), 10)).exit_code == 137
    except libdsec.SandboxNotFound:
        pass
    with pytest.raises(libdsec.InvalidRequest):
        await client.suspend()


async def test_a_suspend_during_a_snapshot_stays_suspended(client):
    """The snapshot's pack froze the sandbox and thawed it when done, whatever a suspend did meanwhile: it ran
    on, recorded suspended, its TTL stopped (helper Q: a ttl=8 sandbox still ran 20 s on)."""
    sb = await client.create(ttl=60)
    try:
        await sb.exec("head -c 100000000 /dev/urandom > /tmp/big")   # (a pack that takes a while)
        counter = await sb.exec(COUNTER, background=True)
        await asyncio.sleep(0.3)
        snap = asyncio.ensure_future(sb.snapshot())
        await asyncio.sleep(0.15)
        await sb.suspend()
        await snap
        frozen = await counts([sb])
        await asyncio.sleep(0.6)
        assert await counts([sb]) == frozen, "recorded suspended, it must not run"
        assert (await client._record(sb.id)).suspended
        await sb.resume()
        await asyncio.sleep(0.3)
        assert (await counts([sb]))[0] > frozen[0]
        assert await counter.kill() is True
    finally:
        await sb.destroy()


async def test_a_rollback_of_a_suspended_sandbox_keeps_the_ttl_it_had_left(client):
    """Rollback dropped the suspension without moving the expiry on: it expired at once (helper Q)."""
    sb = await client.create(ttl=4)
    try:
        snap = await sb.snapshot()
        await sb.suspend()
        await asyncio.sleep(4.5)                       # past the TTL, frozen: it does not count
        await sb.rollback(snap.id)
        await asyncio.sleep(1)
        assert (await sb.exec("echo on")).stdout == b"on\n"
    finally:
        try:
            await sb.destroy()
        except libdsec.SandboxNotFound:
            pass

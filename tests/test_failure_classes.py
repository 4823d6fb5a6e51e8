"""Failure classes: an environment failure (here a cached layer that does not mount) is retried on another
node with a fresh environment, once; a task failure (the command's own exit) never is. Both are events
with their class."""
from __future__ import annotations

import asyncio

from bus import streams, subjects
from bus.records import event_decoder, traj_decoder
from tests.conftest import extra_edge


async def events_of(stack, sandbox_id: str, until: set[str] = frozenset()) -> list:
    """The sandbox's events; with until, once those types are all there (events follow replies: a few ms)."""
    for _ in range(100):
        evs = [event_decoder.decode(d) async for d in stack.bus.read_subject(
            streams.EVT_STREAM, subjects.event("default", sandbox_id))]
        if until <= {e.type for e in evs}:
            break
        await asyncio.sleep(0.05)
    return evs


async def test_an_environment_failure_is_retried_elsewhere_and_a_task_failure_is_not(stack, client, tmp_path):
    async with extra_edge(stack, tmp_path / "t3", "t3", 2) as small:
        await environment_then_task_failure(stack, client, small)


async def test_an_environment_failure_after_the_watchdog_placed_the_create_again_is_served_elsewhere(
        stack, client, tmp_path):
    """A node slow to take a create (placement's watchdog placed it again as attempt 1, and placement
    answered that one as in hand: its record said `starting` there), whose environment then failed: its
    retry elsewhere went out under the watchdog's msg id, JetStream dropped it as a duplicate and the client
    heard nothing until its own timeout (chaos, server-leader, in CI). Now it is served on the other node."""
    async with extra_edge(stack, tmp_path / "t3", "t3", 2) as small:
        first = await client.create()
        assert first.node == "t3"
        await first.destroy()
        for path in small.edge.layers.root.glob("*.erofs"):   # its copy will not mount: an environment failure
            path.write_bytes(b"not an erofs image" * 100)
        lane, start = small.edge.creates, small.edge.creates._start_sandbox

        def handled() -> int:
            return sum(n for (kind, _), n in stack.placement.outcomes.items() if kind == "CreateRequest")

        async def slow_to_take(req):   # claimed here; meanwhile the watchdog places it again, as it does
            lane._start_sandbox = start
            before = handled()
            await stack.placement._place_again(req)
            for _ in range(500):
                if handled() > before:
                    break
                await asyncio.sleep(0.02)
            assert handled() > before, "placement never handled the watchdog's attempt"
            return await start(req)

        lane._start_sandbox = slow_to_take
        moved = await client.create(timeout=30)
        try:
            assert moved.node == "t1" and (await moved.exec("echo ok")).stdout == b"ok\n"
            evs = await events_of(stack, moved.id, until={"retried", "created"})
            assert [(e.type, e.node) for e in evs if e.type in ("retried", "created", "failed")] == \
                [("retried", "t3"), ("created", "t1")]
        finally:
            await moved.destroy()


async def environment_then_task_failure(stack, client, small) -> None:
    first = await client.create()
    assert first.node == "t3"        # the small node is filled first (best fit)
    await first.destroy()
    cached = list(small.edge.layers.root.glob("*.erofs"))
    assert cached
    for path in cached:              # the node's copy goes bad (same file, other bytes): it will not mount
        path.write_bytes(b"not an erofs image" * 100)
    moved = await client.create()
    try:
        assert moved.node == "t1" and (await moved.exec("echo ok")).stdout == b"ok\n"
        evs = await events_of(stack, moved.id, until={"retried", "created"})
        retried = [e for e in evs if e.type == "retried"]
        assert len(retried) == 1 and retried[0].node == "t3" and retried[0].failure_class == "environment"
        assert "mount" in retried[0].detail
        assert [e.type for e in evs if e.node == "t1"] == ["created"]
    finally:
        await moved.destroy()
    for _ in range(100):   # placement sees the small node free again (its failed attempt released)
        [t3] = [i for i in stack.placement.ledger.nodes() if i.node == "t3"]
        if t3.used_slots == 0 and not t3.bookings:
            break
        await asyncio.sleep(0.05)
    healed = await client.create()   # the bad copy was dropped: fetched and verified again, it runs there
    try:
        assert healed.node == "t3"
        r = await healed.exec("echo out; exit 3")
        assert (r.exit_code, r.stdout) == (3, b"out\n")     # returned once: a task failure is not retried
        evs = await events_of(stack, healed.id, until={"task_failed"})
        failed = [e for e in evs if e.type == "task_failed"]
        assert len(failed) == 1 and failed[0].failure_class == "task" and "exited 3" in failed[0].detail
        for _ in range(100):   # the exec's trajectory record follows its exit record
            recs = [traj_decoder.decode(d) async for d in stack.bus.read_subject(
                streams.TRAJ_STREAM, subjects.trajectory("default", "default", healed.id))]
            if any(r.type == "exec" for r in recs):
                break
            await asyncio.sleep(0.05)
        assert [r.failure_class for r in recs if r.type == "exec"] == ["task"]
    finally:
        await healed.destroy()
    assert small.edge.layers.misses >= 2   # fetched at first use, and again after the bad copy was dropped


async def test_a_corrupt_layer_in_the_store_fails_clearly_after_one_retry_and_leaks_nothing(stack, client, tmp_path):
    from tests.test_layers import build
    root = tmp_path / "ws"
    (root / "work").mkdir(parents=True)
    (root / "work" / "f").write_text("fine\n")
    await build(stack.url, "rotten", "workspace", root)
    [rec] = [r for r in await stack.bus.kv_items(streams.IMAGES_KV) if r[0] == "rotten.1"]
    from bus.records import image_decoder
    digest = image_decoder.decode(rec[1]).digest
    await stack.bus.obj_put(streams.LAYERS_OBJ, digest, b"bit rot" * 1000)   # the stored bytes go bad
    async with extra_edge(stack, tmp_path / "t3", "t3", 2) as small:
        import libdsec
        import pytest
        with pytest.raises(libdsec.EnvironmentFailure, match=r"rotten@1 is corrupt \(digest mismatch\)"):
            await client.create(workspace="rotten")
        [sid] = [r.sandbox_id for r in await client.list(all_states=True)
                 if r.state == "failed" and "rotten@1" in r.reason]
        evs = await events_of(stack, sid, until={"retried", "failed"})   # each node publishes its own
        retried = [e for e in evs if e.type == "retried"]
        assert len(retried) == 1 and retried[0].failure_class == "environment" and "corrupt" in retried[0].detail
        failed = [e for e in evs if e.type == "failed"]
        assert len(failed) == 1 and failed[0].failure_class == "environment"
        assert {retried[0].node, failed[0].node} == {"t1", "t3"}    # tried on both nodes, once each
        for edge in (stack.edge, small.edge):   # nothing of the bad bytes kept, no half-written file
            assert not [p for p in edge.layers.root.iterdir() if digest.split(":")[1] in p.name or ".tmp" in p.name]
            assert not edge.sandboxes and not edge.capacity.used
    await stack.bus.obj_delete(streams.LAYERS_OBJ, digest)
    await stack.bus.kv_delete(streams.IMAGES_KV, "rotten.1")
    await stack.bus.kv_delete(streams.IMAGES_KV, "rotten")

"""Placement at scale, against a real nats-server: compare-and-set bookings, quotas, priorities, drain,
client-side timeouts, lost nodes, and the operator commands."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

import libdsec
from bus import streams, subjects
from bus.conn import Bus
from bus.errors import BusError
from bus.messages import CreateRequest, ExecRequest, Resources, encode
from bus.records import (Booking, NodeInfo, Quota, SandboxRecord, event_decoder, node_decoder, quota_decoder,
                         sandbox_decoder)
from bus.server import free_port
from tests.conftest import own_server
from placement import ledger as ledger_mod
from placement.quota import set_quota
from placement.reaper import Reaper

pytestmark = pytest.mark.timeout(120)
DSEC = str(Path(sys.executable).parent / "dsec")


def fake_node(name: str, slots: int = 10, age: float = 0.0, **kw) -> NodeInfo:
    """A node record as an edge would write it (no edge behind it)."""
    return NodeInfo(node=name, pool=kw.pop("pool", "local"), slots=slots, cpu=64, memory=64 << 30, disk=64 << 30,
                    max_cpu=8, max_memory=64 << 30, max_disk=64 << 30, max_pids=1 << 22,
                    heartbeat=time.time() - age, **kw)


@pytest.fixture
async def bare_server(tmp_path):
    """A provisioned nats-server of its own: fake node records there attract no other test's work."""
    srv = own_server(tmp_path, [])   # identities on; the test's buses connect as placement
    bus = await Bus.connect(srv.url, creds=srv.creds("placement"))
    await bus.provision()
    await bus.close()
    yield srv
    srv.stop()


async def test_two_engines_booking_at_once_never_pass_a_nodes_capacity(bare_server):
    nats_server = bare_server
    """Two ledgers on two connections (two engines) race 60 bookings for 10 slots: exactly 10 win."""
    buses = [await Bus.connect(nats_server.url, creds=nats_server.creds("placement")) for _ in range(2)]
    node = f"cas{free_port()}"
    try:
        await buses[0].kv_put(streams.NODES_KV, node, fake_node(node, slots=10))
        ledgers = [ledger_mod.NodeLedger(b) for b in buses]
        for led, b in zip(ledgers, buses):   # start from the record each engine would have from its watch
            raw, rev = await b.kv_entry(streams.NODES_KV, node)
            led.on_change(node, raw, rev)
        results = await asyncio.gather(*(
            ledgers[i % 2].book(node, f"r{i}", Booking(Resources(), time.time() + 60)) for i in range(60)))
        assert sum(results) == 10, results
        final = node_decoder.decode(await buses[0].kv_get(streams.NODES_KV, node))
        assert len(final.bookings) == 10
        assert sum(led.conflicts for led in ledgers) > 0, "the race must actually have happened"
        # a redelivered request finds its booking and keeps it (idempotent), without a second one
        booked = next(iter(final.bookings))
        assert await ledgers[0].book(node, booked, Booking(Resources(), time.time() + 60))
        assert len(node_decoder.decode(await buses[0].kv_get(streams.NODES_KV, node)).bookings) == 10
    finally:
        await buses[0].kv_delete(streams.NODES_KV, node)
        for b in buses:
            await b.close()


async def test_quota_exceeded_at_once_and_released_when_sandboxes_end(stack):
    tenant = "quota-n"
    await set_quota(stack.bus, Quota(tenant=tenant, max_sandboxes=2))
    for _ in range(50):   # the engine learns quotas from its watch
        if tenant in stack.placement.quotas.table:
            break
        await asyncio.sleep(0.05)
    async with libdsec.AsyncClient(stack.url, tenant=tenant) as client:
        a, b = await client.create_many(2)
        t0 = time.monotonic()
        with pytest.raises(libdsec.QuotaExceeded, match="at most 2 concurrent"):
            await client.create(timeout=30)
        assert time.monotonic() - t0 < 2, "over quota is refused at once, never queued"
        await a.destroy()
        c = await client.create(timeout=10)        # the ended sandbox no longer counts
        await asyncio.gather(b.destroy(), c.destroy())
    await set_quota(stack.bus, Quota(tenant=tenant, max_cpu=1.5))
    await asyncio.sleep(0.3)
    async with libdsec.AsyncClient(stack.url, tenant=tenant) as client:
        with pytest.raises(libdsec.QuotaExceeded, match="cpu"):
            await client.create(resources=libdsec.Resources(cpu=2))
    await stack.bus.kv_delete(streams.QUOTAS_KV, tenant)


@pytest.fixture
async def one_slot(tmp_path):
    """Its own server and a stack whose edge has room for 1 sandbox."""
    from cli.stack import Stack
    from edge.capacity import EdgeConfig
    from tests import leaks
    srv = own_server(tmp_path, ["one"])
    st = Stack(tmp_path / "state", nats_url=srv.url, metrics_port=None, edge_config=EdgeConfig(node_id="one", slots=1),
               creds=srv.creds("admin"))
    st.tenant, st.admin = srv.creds("tenant:default"), srv.creds("admin")
    with leaks.live("one", tmp_path / "state" / "edge"):
        await st.start()
        yield st
        await st.stop()
    srv.stop()


async def test_latency_requests_jump_ahead_of_queued_batch_ones(one_slot):
    st = one_slot
    async with libdsec.AsyncClient(st.url, creds=st.tenant) as client:
        holder = await client.create()
        order: list[str] = []

        async def make(prio: str):
            sb = await client.create(priority=prio, timeout=60)
            order.append(prio)
            await asyncio.sleep(0.2)
            await sb.destroy()

        batch = [asyncio.create_task(make("batch")) for _ in range(3)]
        await asyncio.sleep(0.5)                    # the batch requests queue first
        latency = asyncio.create_task(make("latency"))
        await asyncio.sleep(0.5)
        await holder.destroy()
        await asyncio.gather(latency, *batch)
        assert order[0] == "latency", order


async def test_client_timeout_is_cancelled_in_the_system_and_leaves_no_orphan(one_slot):
    st = one_slot
    async with libdsec.AsyncClient(st.url, creds=st.tenant) as client:
        holder = await client.create()
        queued: list[str] = []
        t0 = time.monotonic()
        with pytest.raises(libdsec.CapacityUnavailable, match="queued"):
            await client.create(timeout=1.5, on_queued=queued.append)
        assert 1.4 < time.monotonic() - t0 < 4 and queued, "the client is told it waits, then gives up on time"
        await holder.destroy()
        await asyncio.sleep(1.5)                    # room is free now: the timed-out request must not start
        assert st.edge.sandboxes == {}
        records = [sandbox_decoder.decode(v) for _, v in await st.bus.kv_items(streams.SANDBOXES_KV)]
        assert not [r for r in records if r.state in ("ready", "starting")]
        assert any(r.state == "expired" for r in records), "the expired request is recorded as such"


async def test_drain_takes_no_new_work_and_lets_running_sandboxes_finish(one_slot):
    st = one_slot
    async with libdsec.AsyncClient(st.url, creds=st.tenant) as client:
        running = await client.create()
        p = await asyncio.to_thread(subprocess.run, [DSEC, "node", "drain", "one", "--nats", st.url, "--creds", st.admin],
                                    capture_output=True, text=True)
        assert p.returncode == 0 and "draining" in p.stdout, p.stderr
        for _ in range(60):
            if st.edge.draining:
                break
            await asyncio.sleep(0.1)
        assert st.edge.draining
        assert (await running.exec("echo still")).stdout == b"still\n"   # running sandboxes go on
        await running.destroy()
        with pytest.raises(libdsec.CapacityUnavailable):
            await client.create(timeout=1.5)        # room, but draining: nothing new starts
        ls = await asyncio.to_thread(subprocess.run, [DSEC, "node", "ls", "--nats", st.url, "--creds", st.admin], capture_output=True,
                                     text=True)
        assert "draining" in ls.stdout
        p = await asyncio.to_thread(subprocess.run, [DSEC, "node", "undrain", "one", "--nats", st.url, "--creds", st.admin],
                                    capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        sb = await client.create(timeout=10)
        await sb.destroy()
    bad = await asyncio.to_thread(subprocess.run, [DSEC, "node", "drain", "nosuch", "--nats", st.url, "--creds", st.admin],
                                  capture_output=True, text=True)
    assert bad.returncode == 1 and "no node 'nosuch'" in bad.stderr


async def test_lost_node_is_reported_and_its_waiting_work_answered(bare_server):
    """A node record whose heartbeat stopped (no edge behind it): the reaper claims it once, marks its
    sandboxes node_lost with an event and places its queued creates again. Its pending ops stay on its
    lane, for the node to answer if it comes back (clients learn of the loss from the record and events)."""
    nats_server = bare_server
    bus = await Bus.connect(nats_server.url, creds=nats_server.creds("placement"))
    node = f"gone{free_port()}"
    try:
        await bus.kv_put(streams.NODES_KV, node, fake_node(node, age=streams.NODE_LOST_AFTER + 5, bookings={
            f"rw{node}": Booking(Resources(), time.time() + 60)}))
        sid = f"sb{node}"
        await bus.kv_put(streams.SANDBOXES_KV, f"default.{sid}", SandboxRecord(sandbox_id=sid, node=node, state="ready",
                                                                  request_id="rq"))
        for config in (streams.edge_create_consumer(node), streams.edge_ops_consumer(node)):
            await bus.ensure_consumer(*config)
        waiting = CreateRequest(request_id=f"rw{node}", sandbox_id=f"sw{node}", tenant="default",
                                deadline=time.time() + 60, node=node)
        await bus.publish(subjects.node_create(node), encode(waiting))
        exec_req = ExecRequest(exec_id=f"x{node}", sandbox_id=sid, argv=["true"])
        exits, events, replaced = asyncio.Queue(), asyncio.Queue(), asyncio.Queue()
        subs = [await bus.subscribe(subjects.output("default", node, sid, exec_req.exec_id), lambda d, s: exits.put(d)),
                await bus.subscribe(subjects.event("default", sid), lambda d, s: events.put(d))]
        watcher = await Bus.connect(nats_server.url, creds=nats_server.creds("placement"))
        # the replaced create goes back to placement: read it where placement would
        subs.append(await watcher.subscribe(subjects.create_request("default", "latency"),
                                            lambda d, s: replaced.put(d)))
        await bus.publish(subjects.node_ops(node, "default", sid), encode(exec_req))
        reapers = [Reaper(bus, ledger_mod.NodeLedger(bus)) for _ in range(2)]
        claims = await asyncio.gather(*(r.claim(node) for r in reapers))
        assert sorted(claims) == [False, True], "exactly one engine handles a lost node"
        rec = sandbox_decoder.decode(await bus.kv_get(streams.SANDBOXES_KV, f"default.{sid}"))
        assert rec.state == "node_lost"
        assert event_decoder.decode(await asyncio.wait_for(events.get(), 5)).type == "node_lost"
        assert exits.empty(), "the reaper must not answer a node's ops: a node that comes back serves them"
        assert await bus.consumer_pending(*[streams.NODE_STREAM, streams.edge_ops_consumer(node)[1].durable_name]) == 1
        again = msgspec.json.decode(await asyncio.wait_for(replaced.get(), 5), type=CreateRequest)
        assert again.request_id == waiting.request_id and again.attempt == 1 and again.node == ""
        after = node_decoder.decode(await bus.kv_get(streams.NODES_KV, node))
        assert after.lost and after.lost_handled and after.bookings == {}
        # an engine that still sees the booking (an older view) must not send the create back there
        led = ledger_mod.NodeLedger(bus)
        led.on_change(node, encode(fake_node(node, bookings={again.request_id: Booking(Resources(), 0)},
                                             lost=True)), 1)
        assert led.find_booking(again.request_id) is None
        for s in subs:
            await s.unsubscribe()
        await watcher.close()
    finally:
        for config in (streams.edge_create_consumer(node), streams.edge_ops_consumer(node)):
            await bus.delete_consumer(config[0], config[1].durable_name)
        await bus.kv_delete(streams.NODES_KV, node)
        await bus.close()


async def test_exec_on_a_sandbox_whose_node_dies_raises_node_lost_instead_of_hanging(stack):
    async with libdsec.AsyncClient(stack.url) as client:
        sb = await client.create()
        try:
            task = asyncio.create_task(sb.exec("sleep 20", timeout=60))
            await asyncio.sleep(0.5)
            # what the reaper publishes when this sandbox's node is declared lost
            from bus.records import Event
            await stack.bus.publish(subjects.event(client.tenant, sb.id),
                                    Event(type="node_lost", sandbox_id=sb.id, detail="node t1 stopped heartbeating"))
            with pytest.raises(libdsec.SandboxNotFound) as exc:
                await asyncio.wait_for(task, 5)
            assert exc.value.reason == "node_lost"
        finally:
            await sb.destroy()


async def test_top_once_shows_nodes_queues_and_placement(stack, client):
    sb = await client.create()
    await asyncio.sleep(1.2)   # engines publish their figures every second
    p = await asyncio.to_thread(subprocess.run, [DSEC, "top", "--once", "--nats", stack.url],
                                capture_output=True, text=True, timeout=30)
    await sb.destroy()
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "t1" in out and "local" in out and "queue depth: placement latency=" in out
    assert "creates/s=" in out and "p99=" in out and "burst share=" in out and "engine " in out


async def test_quota_cli_sets_lists_and_removes(stack):
    p = await asyncio.to_thread(subprocess.run, [DSEC, "quota", "set", "cliq", "--sandboxes", "3", "--memory", "2Gi",
                                                 "--nats", stack.url], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    ls = await asyncio.to_thread(subprocess.run, [DSEC, "quota", "ls", "--nats", stack.url], capture_output=True,
                                 text=True)
    assert "cliq" in ls.stdout and "2.0Gi" in ls.stdout
    more = await asyncio.to_thread(subprocess.run, [DSEC, "quota", "set", "cliq", "--cpu", "4", "--nats", stack.url],
                                   capture_output=True, text=True)   # the others stay (they were wiped: helper Q)
    assert more.returncode == 0, more.stderr
    q = quota_decoder.decode(await stack.bus.kv_get(streams.QUOTAS_KV, "cliq"))
    assert (q.max_sandboxes, q.max_cpu, q.max_memory) == (3, 4.0, 2 << 30)
    rm = await asyncio.to_thread(subprocess.run, [DSEC, "quota", "rm", "cliq", "--nats", stack.url],
                                 capture_output=True, text=True)
    assert rm.returncode == 0 and await stack.bus.kv_get(streams.QUOTAS_KV, "cliq") is None
    again = await asyncio.to_thread(subprocess.run, [DSEC, "quota", "rm", "cliq", "--nats", stack.url],
                                    capture_output=True, text=True)   # (a misspelt tenant was "removed", exit 0)
    assert again.returncode == 1 and "'cliq' has no quota" in again.stderr, again
    bad = await asyncio.to_thread(subprocess.run, [DSEC, "quota", "set", "bad.tenant", "--nats", stack.url],
                                  capture_output=True, text=True)
    assert bad.returncode == 1 and "tenant" in bad.stderr


async def test_a_quota_set_counts_the_sandboxes_already_running(stack, client):
    """Sandboxes admitted while their tenant had no quota held no share of it: with 4 running, a quota of 3
    then admitted 3 more (helper Q)."""
    running = await client.create_many(2)
    try:
        p = await asyncio.to_thread(subprocess.run, [DSEC, "quota", "set", client.tenant, "--sandboxes", "2",
                                                     "--nats", stack.url], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        with pytest.raises(libdsec.QuotaExceeded):
            await client.create()
        with pytest.raises(libdsec.QuotaExceeded, match="warm pools could keep"):   # a warm hoard past it: it
            await client.set_warm_pool("hoard", min=0, max=8)                          # took a node's whole budget
        await running.pop().destroy()
        async with await client.create():   # the room one of them left
            pass
    finally:
        await asyncio.to_thread(subprocess.run, [DSEC, "quota", "rm", client.tenant, "--nats", stack.url],
                                capture_output=True)
        for sb in running:
            await sb.destroy()


async def test_a_deleted_record_can_be_claimed_again_by_compare_and_set(bare_server):
    """The reaper frees a lost node's `starting` claims by deleting them; the next claim must name the
    tombstone's revision (a create-only write would fail on it forever)."""
    bus = await Bus.connect(bare_server.url, creds=bare_server.creds("placement"))
    try:
        await bus.kv_put(streams.SANDBOXES_KV, "sbdel", b"{}")
        await bus.kv_delete(streams.SANDBOXES_KV, "sbdel")
        value, revision = await bus.kv_entry(streams.SANDBOXES_KV, "sbdel")
        assert value is None and revision > 0
        assert await bus.kv_cas(streams.SANDBOXES_KV, "sbdel", b"{}", 0) is None
        assert await bus.kv_cas(streams.SANDBOXES_KV, "sbdel", b"{}", revision) is not None
        assert await bus.kv_entry(streams.SANDBOXES_KV, "never") == (None, 0)
    finally:
        await bus.close()


async def test_a_booking_for_a_create_placed_before_is_removed(bare_server):
    """A create delivered again after its ack was lost (a server paused or moved) is booked anew, but its
    message is a duplicate of its first placement's and is not stored: no node will take that booking, so
    it goes at once. Before, it held the room until the create's deadline plus the edge's STALE_BOOKING
    (minutes): a paused KV leader left 24 of a cluster's 125 slots held so after a burst, and a burst's tail
    waited out its 150 s (tests/test_chaos.py, pause)."""
    from placement.engine import PlacementEngine, node_msg_id
    srv = bare_server
    bus = await Bus.connect(srv.url, creds=srv.creds("placement"))
    node = f"dup{free_port()}"
    try:
        await bus.kv_put(streams.NODES_KV, node, fake_node(node, slots=4))
        engine = PlacementEngine(bus)
        raw, rev = await bus.kv_entry(streams.NODES_KV, node)
        engine.ledger.on_change(node, raw, rev)
        again = CreateRequest(request_id="rdup1", sandbox_id="sbdup1", priority="batch", deadline=time.time() + 60)
        # its first placement is on the node's lane, and the node took it (its booking left the record)
        await bus.publish_once(subjects.node_create(node), encode(msgspec.structs.replace(again, node=node)),
                               msg_id=node_msg_id(again))
        first = CreateRequest(request_id="rnew1", sandbox_id="sbnew1", priority="batch", deadline=time.time() + 60)
        assert await engine._try_place(again) and await engine._try_place(first)
        for _ in range(50):
            bookings = node_decoder.decode(await bus.kv_get(streams.NODES_KV, node)).bookings
            if "rdup1" not in bookings:
                break
            await asyncio.sleep(0.1)
        assert "rdup1" not in bookings, "a booking nobody will take holds room"
        await asyncio.sleep(1.5)   # the watch would have removed it by now: a create placed once keeps its own
        assert "rnew1" in node_decoder.decode(await bus.kv_get(streams.NODES_KV, node)).bookings
    finally:
        await bus.kv_delete(streams.NODES_KV, node)
        await bus.close()


async def test_a_booking_whose_write_was_not_confirmed_goes_once_the_request_is_placed_elsewhere(bare_server):
    """A booking write the bus did not confirm (a timeout while a KV leader is paused) may land all the
    same: once the request is placed on another node, that booking is removed where it landed, and a
    later booking of the same request on that node (written at another time) is left alone."""
    srv = bare_server
    bus = await Bus.connect(srv.url, creds=srv.creds("placement"))
    node = f"unc{free_port()}"
    try:
        await bus.kv_put(streams.NODES_KV, node, fake_node(node, slots=4))
        led = ledger_mod.NodeLedger(bus)
        raw, rev = await bus.kv_entry(streams.NODES_KV, node)
        led.on_change(node, raw, rev)
        real_update = bus.kv_update

        async def lands_unconfirmed(*args, **kwargs):   # written, but the caller hears a timeout
            await real_update(*args, **kwargs)
            raise BusError("kv update dsec-nodes: NATS did not answer in time")
        bus.kv_update = lands_unconfirmed
        with pytest.raises(BusError):
            await led.book(node, "runc1", Booking(Resources(), time.time() + 60, at=1.0))
        bus.kv_update = real_update
        raw, rev = await bus.kv_entry(streams.NODES_KV, node)
        led.on_change(node, raw, rev)   # (the node watch would bring it)
        assert "runc1" in node_decoder.decode(raw).bookings
        led.settle("runc1", placed_on="elsewhere")
        for _ in range(50):
            if "runc1" not in node_decoder.decode(await bus.kv_get(streams.NODES_KV, node)).bookings:
                break
            await asyncio.sleep(0.1)
        assert "runc1" not in node_decoder.decode(await bus.kv_get(streams.NODES_KV, node)).bookings
        # a booking of it written later (placed here again) is not the unconfirmed one: it stays
        assert await led.book(node, "runc2", Booking(Resources(), time.time() + 60, at=2.0))
        led.discard(node, "runc2", at=1.0)
        await asyncio.sleep(1.5)
        assert "runc2" in node_decoder.decode(await bus.kv_get(streams.NODES_KV, node)).bookings
    finally:
        await bus.kv_delete(streams.NODES_KV, node)
        await bus.close()


async def test_a_stop_cut_short_leaves_no_drain_for_the_next_start_but_an_operators_drain_holds(stack, tmp_path):
    """A stop marks its node draining first and removes its record last: cut short (SIGINT under load, the
    10 s budget passed), the record stayed draining, and the restarted node refused every create until an
    operator ran `dsec node undrain` (helper T2). A stop's drain is marked as such now; an operator's holds."""
    from tests.conftest import extra_edge
    from bus.nodes import set_flag
    for node, stopping, kept in (("cutstop", True, False), ("opdrain", False, True), ("opthenstop", False, True)):
        left = NodeInfo(node=node, draining=True, stopping=stopping, started_at=time.time() - 60,
                        heartbeat=time.time() - 60)
        await stack.bus.kv_put(streams.NODES_KV, node, encode(left))
        if node == "opthenstop":   # an operator's drain, then a stop cut short: the drain stays the operator's
            await set_flag(stack.bus, node, draining=True, stopping=True)
        async with extra_edge(stack, tmp_path / node, node, 2) as st:
            info = node_decoder.decode(await stack.bus.kv_get(streams.NODES_KV, node))
            assert (info.draining, st.edge.draining, info.stopping) == (kept, kept, False), (node, info)

"""Placement under faults, against a real nats-server with node records of nodes that only beat (no edge
behind them, so nothing takes their creates unless the test does): bursting fills local room first, a
node that stops beating attracts no creates and gives back the ones it did not take, and the reaper
leaves a node's newer run alone."""
from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import pytest

from bus import streams, subjects
from bus.conn import Bus
from bus.messages import CreateRequest, create_decoder, encode
from bus.records import Heartbeat, ImageRecord, SandboxRecord, node_decoder, sandbox_decoder
from tests.test_placement import bare_server, fake_node  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(120)


class Fleet:
    """Fake node records on a bare server, each beating (dsec.hb.<node>) while alive."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.alive: set[str] = set()
        self._beat = asyncio.ensure_future(self._beats())

    async def add(self, name: str, slots: int, pool: str = "local") -> None:
        await self.bus.kv_put(streams.NODES_KV, name, fake_node(name, slots=slots, pool=pool, started_at=1.0))
        await self.bus.ensure_consumer(*streams.edge_create_consumer(name))
        self.alive.add(name)

    async def _beats(self) -> None:
        while True:
            for name in list(self.alive):
                await self.bus.send(subjects.heartbeat(name), Heartbeat(node=name, started_at=1.0, at=time.time()))
            await asyncio.sleep(0.1)

    async def lanes(self, *names: str) -> list[int]:
        """How many creates wait on each node's lane."""
        return [len(await self.lane(n)) for n in names]

    async def lane(self, name: str) -> list[CreateRequest]:
        """The creates waiting on a node's lane (read, not taken)."""
        out = []
        seq = 0
        while (m := await self.bus.stored_after(streams.NODE_STREAM, subjects.node_create(name), seq)) is not None:
            seq = m.seq
            out.append(create_decoder.decode(m.data))
        return out

    async def take(self, name: str, request_id: str) -> None:
        """What the node's edge does when it takes a create: its booking leaves the record, its usage grows."""
        def mutate(raw):
            info = node_decoder.decode(raw)
            return encode(msgspec.structs.replace(info, used_slots=info.used_slots + 1, heartbeat=time.time(),
                                                  bookings={k: v for k, v in info.bookings.items() if k != request_id}))
        await self.bus.kv_update(streams.NODES_KV, name, mutate)

    async def finish(self, name: str) -> None:
        """One of its sandboxes ends: a slot is free again."""
        def mutate(raw):
            info = node_decoder.decode(raw)
            return encode(msgspec.structs.replace(info, used_slots=info.used_slots - 1, heartbeat=time.time()))
        await self.bus.kv_update(streams.NODES_KV, name, mutate)

    async def close(self) -> None:
        self._beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._beat
        for name in await self.bus.kv_items(streams.NODES_KV):
            await self.bus.kv_delete(streams.NODES_KV, name[0])


@contextlib.asynccontextmanager
async def engine_and_fleet(url: str, creds: str, threshold: float = 0.5):
    """An engine (as placement) and a fake fleet on the test's own server."""
    from placement.engine import PlacementEngine
    bus = await Bus.connect(url, creds=creds)
    image = ImageRecord(name="busybox", version=1, digest="sha256:" + "0" * 64, size=1)   # never fetched here
    await bus.kv_put(streams.IMAGES_KV, "busybox", image)
    fleet = Fleet(bus)
    engine = PlacementEngine(bus, burst_threshold=threshold)
    try:
        yield engine, fleet, bus
    finally:
        await engine.stop()
        await fleet.close()
        await bus.close()


def _create(i: int, burst: bool = True, priority: str = "batch") -> CreateRequest:
    return CreateRequest(request_id=f"rq{i}", sandbox_id=f"sb{i}", tenant="default", deadline=time.time() + 60,
                         reply_to=f"_INBOX.t.{i}", priority=priority, burst=burst)


async def _wait(cond, limit: float = 10.0):
    deadline = time.monotonic() + limit
    while not await cond():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.05)


async def test_bursting_fills_local_room_first_and_no_more_than_the_burst_pools_room(bare_server):
    """Past the threshold only the excess that fits on no local node bursts, booked on a burst-pool node with
    room (the pool lane holds nothing, however many wait); a freed local slot takes the next create before a
    freed cloud one does. Before: once past the threshold, every queued create went to the pool lane."""
    async with engine_and_fleet(bare_server.url, bare_server.creds("placement")) as (engine, fleet, bus):
        await fleet.add("l1", 2)
        await fleet.add("l2", 2)
        await fleet.add("c1", 2, pool="cloud")
        await bus.ensure_consumer(*streams.pool_create_consumer("cloud"))
        await engine.start()
        for i in range(7):
            await bus.publish(subjects.create_request("default", "batch"), encode(_create(i)), msg_id=f"rq{i}")

        async def placed() -> bool:
            return sum(await fleet.lanes("l1", "l2", "c1")) == 6
        await _wait(placed)
        await asyncio.sleep(0.5)   # the 7th waits: nothing has room
        assert await fleet.lanes("l1", "l2", "c1") == [2, 2, 2]
        assert await bus.consumer_pending(streams.NODE_STREAM, "pool-cloud-create") == 0
        assert engine.bursted == 2 and engine.queued["batch"] == 1
        for name in ("l1", "c1"):   # one local slot and one cloud slot free at once
            first = (await fleet.lane(name))[0].request_id
            await fleet.take(name, first)
            await fleet.finish(name)

        async def next_one() -> bool:
            return sum(await fleet.lanes("l1", "l2", "c1")) == 7
        await _wait(next_one)
        assert await fleet.lanes("l1", "l2", "c1") == [3, 2, 2], "the freed local slot first"


async def test_a_node_that_stops_beating_gets_no_creates_and_gives_back_what_it_did_not_take(bare_server):
    """The node placement prefers stops beating (its edge died): within a second new creates go elsewhere,
    and a create booked on it that it never took is taken back from its lane and placed again (before: it
    kept attracting creates, as the emptiest-looking node, for the 10 s until declared lost)."""
    async with engine_and_fleet(bare_server.url, bare_server.creds("placement")) as (engine, fleet, bus):
        await fleet.add("best", 3)     # best fit: the smaller one
        await fleet.add("other", 10)
        await engine.start()
        await bus.publish(subjects.create_request("default", "latency"), encode(_create(1, priority="latency")),
                          msg_id="rq1")

        async def on_best() -> bool:
            return len(await fleet.lane("best")) == 1
        await _wait(on_best)
        fleet.alive.discard("best")    # it dies, holding the create it never took
        died = time.monotonic()

        async def moved() -> bool:
            return [c.request_id for c in await fleet.lane("other")] == ["rq1"] and not await fleet.lane("best")
        await _wait(moved, 5)
        assert time.monotonic() - died < 2.0, "a create on a dead node must be placed again within about a second"
        again = (await fleet.lane("other"))[0]
        assert again.attempt == 1 and again.node == "other"
        assert "rq1" not in node_decoder.decode(await bus.kv_get(streams.NODES_KV, "best")).bookings
        await bus.publish(subjects.create_request("default", "latency"), encode(_create(2, priority="latency")),
                          msg_id="rq2")

        async def second() -> bool:
            return len(await fleet.lane("other")) == 2
        await _wait(second, 5)
        assert not await fleet.lane("best"), "a node that stopped beating gets no new create"
        assert engine.watch.taken_back == 1


async def test_the_reaper_marks_only_the_lost_run_and_leaves_a_returned_node_its_lane(bare_server):
    """Declared lost, a node's run 1 has its sandboxes marked node_lost; a record of its newer run 2 is left
    alone, and once the node is back, its lane is its own (before: the reaper marked both runs' sandboxes and
    answered the returned node's work)."""
    from placement import ledger as ledger_mod
    from placement.reaper import Reaper
    bus = await Bus.connect(bare_server.url, creds=bare_server.creds("placement"))
    try:
        await bus.kv_put(streams.NODES_KV, "back", fake_node("back", age=60, started_at=1.0))
        for sid, epoch in (("old1", 1.0), ("new2", 2.0)):
            await bus.kv_put(streams.SANDBOXES_KV, f"default.{sid}", SandboxRecord(sandbox_id=sid, node="back", state="ready",
                                                                      request_id=f"r{sid}", epoch=epoch, version=2))
        reaper = Reaper(bus, ledger_mod.NodeLedger(bus))
        assert await reaper.claim("back")
        states = {sid: sandbox_decoder.decode(await bus.kv_get(streams.SANDBOXES_KV, f"default.{sid}")).state
                  for sid in ("old1", "new2")}
        assert states == {"old1": "node_lost", "new2": "ready"}
        # it comes back (a new run), a create waits on its lane: a reaper finishing late takes nothing
        await bus.kv_put(streams.NODES_KV, "back", fake_node("back", started_at=2.0))
        await bus.ensure_consumer(*streams.edge_create_consumer("back"))
        await bus.publish(subjects.node_create("back"), encode(_create(7)))
        await reaper.finish("back", 1.0, again=True)
        assert await bus.consumer_pending(streams.NODE_STREAM, "edge-back-create") == 1
    finally:
        for key in ("old1", "new2"):
            await bus.kv_delete(streams.SANDBOXES_KV, f"default.{key}")
        await bus.delete_consumer(*[streams.NODE_STREAM, "edge-back-create"])
        await bus.kv_delete(streams.NODES_KV, "back")
        await bus.close()

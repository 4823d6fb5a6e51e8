"""Mixed load (issue 13): gVisor sandboxes, noop sandboxes and fncalls at once on one node, containers on
the session's node, each kind within its own slots on a node whose memory they share; an edge with only
fncall workers never receives a create."""
from __future__ import annotations

import asyncio

import pytest

import libdsec
from bus import streams
from bus.records import node_decoder
from tests.conftest import extra_edge

pytestmark = pytest.mark.timeout(180)
OWN_NODES = True     # its gVisor node must be the only one (conftest.KindNodes stops the shared ones)


async def record(stack, node: str):
    return node_decoder.decode(await stack.bus.kv_get(streams.NODES_KV, node))


async def test_kinds_at_once_on_one_node_each_within_its_slots(stack, client, tmp_path):
    async with extra_edge(stack, tmp_path / "mix", "k-mix", 10, backends=["gvisor", "fncall", "noop"],
                          options={"fncall": {"workers_min": 1, "workers_max": 2}},
                          kind_slots={"gvisor": 1, "noop": 2}) as st:
        info = await record(stack, "k-mix")
        assert info.backends == ["gvisor", "fncall", "noop"] and info.kind_slots["gvisor"] == 1
        calls = asyncio.ensure_future(client.call_many([{"cmd": "sleep 0.2; echo c"} for _ in range(8)]))
        g = await client.create(backend="gvisor", timeout=30)
        noops = [await client.create(backend="noop", timeout=30) for _ in range(2)]
        containers = await asyncio.gather(*(client.create(timeout=30) for _ in range(3)))
        with pytest.raises(libdsec.CapacityUnavailable):
            await client.create(backend="gvisor", timeout=2)   # its one gvisor slot is taken
        with pytest.raises(libdsec.CapacityUnavailable):
            await client.create(backend="noop", timeout=2)
        assert [r.stdout for r in await calls] == [b"c\n"] * 8, "calls ran beside the sandboxes"
        assert {sb.node for sb in containers} == {stack.edge.node}, "no container on a node without the kind"
        assert (await g.exec("echo g")).stdout == b"g\n"
        info = await record(stack, "k-mix")
        assert info.kind_used == {"gvisor": 1, "noop": 2}
        assert info.used_memory >= 2 * libdsec.Resources().to_wire().memory + (24 << 20), "gVisor's overhead booked"
        for sb in [g, *noops, *containers]:
            await sb.destroy()
        assert st.edge.created == 3


async def test_an_edge_with_only_fncall_workers_never_receives_a_create(stack, client, tmp_path):
    async with extra_edge(stack, tmp_path / "fo", "k-fnonly", 50, backends=["fncall"],
                          options={"fncall": {"workers_min": 0, "workers_max": 2}}) as st:
        info = await record(stack, "k-fnonly")
        assert info.backends == ["fncall"]
        made = await asyncio.gather(*(client.create(timeout=30) for _ in range(8)))
        assert {sb.node for sb in made} == {stack.edge.node} and st.edge.created == 0
        assert (await client.call("echo here")).node == "k-fnonly"
        await asyncio.gather(*(sb.destroy() for sb in made))

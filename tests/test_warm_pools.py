"""Warm pools: ready sandboxes per (layers, resources) key; a matching create claims one, which is
indistinguishable from a cold start (own id, hostname, env, labels, a fresh writable layer)."""
from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

import libdsec
from bus.records import WarmPool
from edge.backends.base import TRUSTED_SHELL, BackendError, SandboxSpec
from edge.warmpool import HORIZON, WINDOW, Stock
from tests.test_layers import build


async def wait_for(pred, timeout: float = 15.0, what: str = "condition") -> None:
    give_up = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < give_up, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def warm_pool(stack, client, name: str, **kwargs):
    """A pool for the test; deleted after, and its ready sandboxes gone before the leak check."""
    await client.set_warm_pool(name, **kwargs)
    try:
        yield stack.edge.warm
    finally:
        await client.delete_warm_pool(name)
        await wait_for(lambda: all_gone(stack), what="warm sandboxes destroyed")


def warm_ids(stack) -> list[str]:
    """Ready warm sandboxes of the session's edge."""
    return [s for s in stack.edge.backend.sandboxes() if s.startswith("warm-")]


def all_gone(stack) -> bool:
    """No warm sandbox starting, ready or being destroyed."""
    backend, pools = stack.edge.backend.backends["container"], stack.edge.warm
    names = [*backend._sandboxes, *backend._starting]
    return not pools.filling and not pools._retiring and not [s for s in names if s.startswith("warm-")]


async def test_a_claimed_sandbox_is_clean_and_its_own(stack, client):
    async with warm_pool(stack, client, "clean", min=2, max=2) as pools:
        await wait_for(lambda: pools.ready() == 2, what="pool filled")
        hits = pools.hits
        first = await client.create(env={"WHO": "first"}, labels={"job": "warm-a"})
        assert pools.hits == hits + 1, "the create did not claim a warm sandbox"
        key_a = stack.edge.backend.backends["container"]._key(first.id)
        assert key_a.startswith("warm-") and key_a != first.id
        r = await first.exec("hostname; echo $WHO; echo secret-a > /root/secret; echo tmp > /tmp/secret; "
                             "sleep 600 >/dev/null 2>&1 & echo started")
        assert r.stdout == f"{first.id}\nfirst\nstarted\n".encode(), r
        [rec] = [x for x in await client.list() if x.sandbox_id == first.id]
        assert rec.labels == {"job": "warm-a"} and rec.state == "ready"
        await first.destroy()

        await wait_for(lambda: pools.ready() == 2, what="pool refilled")
        second = await client.create(env={"WHO": "second"})
        try:
            assert pools.hits == hits + 2
            assert stack.edge.backend.backends["container"]._key(second.id) not in (key_a, second.id)
            r = await second.exec("hostname; echo ${WHO}-${WHO_ELSE:-none}; ls -A /root; ls -A /tmp; "
                                  "pidof sleep || echo no-sleep")
            # nothing of the first user: no file, no process; its own hostname and env
            assert r.stdout == f"{second.id}\nsecond-none\nno-sleep\n".encode(), r
            assert (await second.exec("cat /root/secret")).exit_code != 0
        finally:
            await second.destroy()


async def test_warm_sandboxes_are_reachable_by_no_one(stack, client):
    async with warm_pool(stack, client, "hidden", min=1, max=1) as pools:
        await wait_for(lambda: pools.ready() == 1, what="pool filled")
        [warm] = warm_ids(stack)
        with pytest.raises(libdsec.SandboxNotFound):
            await client.get(warm)
        with pytest.raises(libdsec.SandboxNotFound):   # straight to the node's op lane: not served either
            await libdsec.AsyncSandbox(client, warm, stack.edge.node).exec("true")


async def test_node_ls_shows_each_nodes_ready_warm_sandboxes(stack, client):
    """An operator sees where the warm stock is: `dsec node ls` had no count of it (helper-40)."""
    dsec, admin = str(Path(sys.executable).parent / "dsec"), str(stack.nats_server.iam.creds_path("admin"))
    async with warm_pool(stack, client, "shown", min=2, max=2):
        await wait_for(lambda: len(warm_ids(stack)) == 2, what="two ready")
        for _ in range(100):   # (the node record says it with its next heartbeat)
            p = await asyncio.to_thread(subprocess.run, [dsec, "node", "ls", "--nats", stack.url, "--creds", admin],
                                        capture_output=True, text=True)
            head, *rows = p.stdout.splitlines()
            mine = [r.split() for r in rows if r.split()[:1] == [stack.edge.node]]
            if mine and mine[0][head.split().index("WARM")] == "2":
                break
            await asyncio.sleep(0.1)
        assert mine and mine[0][head.split().index("WARM")] == "2", p.stdout + p.stderr


async def test_hits_misses_and_metrics(stack, client):
    from cli.metrics import StackCollector
    async with warm_pool(stack, client, "counted", min=0, max=0) as pools:   # a pool that never fills
        await wait_for(lambda: "default.counted" in pools.pools and pools.pools["default.counted"].key, what="pool resolved")
        misses = pools.misses
        sb = await client.create()
        await sb.destroy()
        assert pools.misses == misses + 1
        other = await client.create(resources=libdsec.Resources(memory="128Mi"))   # another key: neither
        await other.destroy()
        assert pools.misses == misses + 1
    families = {m.name: m for m in StackCollector(stack).collect()}
    assert families["dsec_edge_warm_pool_misses"].samples[0].value == pools.misses
    assert "dsec_edge_warm_pool_hits" in families and "dsec_edge_warm_ready" in families


async def test_the_pool_grows_with_demand_within_its_bounds(stack, client, monkeypatch):
    import edge.warmpool
    monkeypatch.setattr(edge.warmpool, "WINDOW", 120.0)   # a window no slow machine outlasts:
    monkeypatch.setattr(edge.warmpool, "HORIZON", 40.0)   # a third of the creates seen so far
    async with warm_pool(stack, client, "adaptive", min=0, max=3) as pools:
        await wait_for(lambda: "default.adaptive" in pools.pools and pools.pools["default.adaptive"].key, what="pool resolved")
        assert pools.ready() == 0          # no demand yet: min
        boxes = await client.create_many(6)
        await asyncio.gather(*(b.destroy() for b in boxes))
        await wait_for(lambda: pools.ready() == 2, what="pool grown to the demand")   # 6 creates -> 2
        boxes = await client.create_many(8)
        await asyncio.gather(*(b.destroy() for b in boxes))
        await wait_for(lambda: pools.ready() == 3, what="pool grown to its max")
        await asyncio.sleep(0.3)
        assert pools.ready() == 3 and len(warm_ids(stack)) == 3, "beyond max"


def test_target_follows_the_recent_rate():
    stock = Stock(WarmPool(name="p", min=1, max=5))
    now = 1000.0
    assert stock.target(now) == 1                          # no demand: min
    stock.demand.extend([now - 1] * 10)                    # 1 create/s over the window -> 2 s worth
    assert stock.target(now) == round(10 / WINDOW * HORIZON)
    stock.demand.extend([now] * 100)
    assert stock.target(now) == 5                          # capped at max
    assert stock.target(now + WINDOW + 1) == 1             # the window passed: back to min


async def test_a_new_layer_version_turns_the_pool_over(stack, client, tmp_path):
    ws = tmp_path / "ws"
    (ws / "work").mkdir(parents=True)
    (ws / "work" / "v").write_text("1\n")
    await build(stack.url, "warmws", "workspace", ws)
    async with warm_pool(stack, client, "layered", workspace="warmws", min=1, max=1) as pools:
        await wait_for(lambda: pools.ready() == 1, what="pool filled")
        [old_warm] = warm_ids(stack)
        (ws / "work" / "v").write_text("2\n")
        await build(stack.url, "warmws", "workspace", ws)
        await wait_for(lambda: pools.ready() == 1 and warm_ids(stack) != [old_warm], what="pool turned over")
        hits = pools.hits
        sb = await client.create(workspace="warmws")
        try:
            assert pools.hits == hits + 1
            assert (await sb.exec("cat /work/v")).stdout == b"2\n"
        finally:
            await sb.destroy()


async def test_bad_pool_settings_are_refused(client):
    with pytest.raises(libdsec.InvalidRequest, match="min and max"):
        await client.set_warm_pool("bad", min=3, max=2)
    with pytest.raises(libdsec.InvalidRequest, match="max"):
        await client.set_warm_pool("bad", max=10_000)
    with pytest.raises(libdsec.InvalidRequest, match="memory"):
        await client.set_warm_pool("bad", resources=libdsec.Resources(memory="1Ki"))
    with pytest.raises(libdsec.ImageNotFound):
        await client.set_warm_pool("bad", image="no-such-image")
    with pytest.raises(libdsec.InvalidRequest, match="no warm pool"):
        await client.delete_warm_pool("never-made")
    for name in ("x\ny", "a b", "*", ">"):   # (the name went to the store unchecked: BusError; helper T2)
        with pytest.raises(libdsec.InvalidRequest, match="no warm pool"):
            await client.delete_warm_pool(name)
    assert not [p for p in await client.warm_pools() if p.spec.name == "bad"]


async def test_a_tenant_has_at_most_max_pools_and_deleted_ones_leave_no_markers(stack, client, monkeypatch):
    """Pools of max=0 cost a tenant's quota nothing: 20,000 of them made every edge re-check each pool's
    image every 2 s, another tenant's create take 0.7 s and its listing time out, and each deleted one left a
    marker every listing read (helper T2). A tenant now has at most MAX_POOLS, and deletes sweep markers."""
    from bus import streams
    from placement import warmpools
    monkeypatch.setattr(warmpools, "MARKER_AGE", 0.5)
    monkeypatch.setattr(warmpools, "SWEEP_EVERY", 0.0)
    before = {p.spec.name for p in await client.warm_pools()}
    made = [f"many-{i}" for i in range(warmpools.MAX_POOLS - len(before))]
    try:
        for name in made:
            await client.set_warm_pool(name, min=0, max=0)
        with pytest.raises(libdsec.QuotaExceeded, match="the most one tenant may have"):
            await client.set_warm_pool("one-more", min=0, max=0)
        await client.set_warm_pool(made[0], min=0, max=1)   # (changing one it has is fine)
    finally:
        for name in made:
            await client.delete_warm_pool(name)
    await asyncio.sleep(1.0)
    await client.set_warm_pool("sweeper", min=0, max=0)
    await client.delete_warm_pool("sweeper")   # its delete sweeps, behind it, the markers older than MARKER_AGE

    async def markers() -> int:
        info = await stack.bus.js.stream_info(f"KV_{streams.WARM_POOLS_KV}",
                                              subjects_filter=f"$KV.{streams.WARM_POOLS_KV}.default.many-*")
        return len(info.state.subjects or {})
    for _ in range(50):
        if not await markers():
            break
        await asyncio.sleep(0.1)
    assert await markers() == 0   # (before: one message per name ever deleted, for good)
    # the sweeper's own marker, the bucket's last message, swept too: a read of the whole bucket still ends
    # (before: it took the purged last sequence for a replica behind, and failed every read)
    await client.set_warm_pool("keeper", min=0, max=0)
    try:
        await client.set_warm_pool("sweeper", min=0, max=0)
        await client.delete_warm_pool("sweeper")
        await asyncio.sleep(0.6)
        assert await stack.bus.kv_purge_deletes(streams.WARM_POOLS_KV, older_than=0.5) >= 1
        info = await stack.bus.js.stream_info(f"KV_{streams.WARM_POOLS_KV}",
                                              subjects_filter=f"$KV.{streams.WARM_POOLS_KV}.>")
        assert list(info.state.subjects) == [f"$KV.{streams.WARM_POOLS_KV}.default.keeper"], info.state
        assert "keeper" in {p.spec.name for p in await client.warm_pools()}
    finally:
        await client.delete_warm_pool("keeper")


async def test_only_a_fresh_sandbox_can_be_claimed(stack):
    backend = stack.edge.backend
    await backend.create(SandboxSpec(id="warm-used", layers=[]))
    try:
        await backend.exec("warm-used", [TRUSTED_SHELL, "-c", "true"], env={}, cwd="/", stdin=None, timeout=5,
                           sink=lambda *_: asyncio.sleep(0))
        with pytest.raises(BackendError, match="not a fresh one"):
            await backend.claim("warm-used", SandboxSpec(id="claimant", layers=[]))
        assert "warm-used" in backend.sandboxes() and "claimant" not in backend.sandboxes()
    finally:
        await backend.destroy("warm-used")


async def test_the_warm_cli(stack):
    from tests.test_layers import dsec
    p = await asyncio.to_thread(dsec, "warm", "set", "--nats", stack.url, "clipool", "--min", "1", "--max", "2",
                                "--memory", "128Mi")
    assert p.returncode == 0 and "clipool: busybox, 1..2 per edge" in p.stdout, p.stderr
    try:
        await wait_for(lambda: stack.edge.warm.ready() == 1, what="pool filled")
        ls = (await asyncio.to_thread(dsec, "warm", "ls", "--nats", stack.url)).stdout
        [line] = [x for x in ls.splitlines() if x.startswith("clipool")]
        assert line.split()[1:7] == ["busybox", "1", "128Mi", "1", "2", "1"] and "t1=1" in line, ls
        bad = await asyncio.to_thread(dsec, "warm", "set", "--nats", stack.url, "clipool", "--min", "5", "--max", "1")
        assert bad.returncode != 0 and "min and max" in bad.stderr
    finally:
        p = await asyncio.to_thread(dsec, "warm", "rm", "--nats", stack.url, "clipool")
        assert p.returncode == 0, p.stderr
    await wait_for(lambda: all_gone(stack), what="warm sandboxes destroyed")
    again = await asyncio.to_thread(dsec, "warm", "rm", "--nats", stack.url, "clipool")
    assert again.returncode != 0 and "no warm pool" in again.stderr


async def test_the_node_record_shows_its_warm_stock_and_layers(stack, client):
    from bus import streams
    from bus.records import layer_mark, node_decoder, pool_key
    async with warm_pool(stack, client, "advertised", min=1, max=1) as pools:
        await wait_for(lambda: pools.ready() == 1, what="pool filled")
        stock = pools.pools["default.advertised"]
        key, marks = stock.key, [layer_mark(la.digest) for la in stock.layers]
        assert key == pool_key(stock.layers, stock.spec.resources)

        async def record():
            return node_decoder.decode(await stack.bus.kv_get(streams.NODES_KV, stack.edge.node))
        give_up = time.monotonic() + 10
        while (await record()).warm.get(key) != 1:
            assert time.monotonic() < give_up, "warm stock never reached the node record"
            await asyncio.sleep(0.05)
        assert set(marks) <= set((await record()).layers)


async def test_placement_sends_a_matching_create_to_the_node_with_a_warm_sandbox(stack, client, tmp_path):
    from tests.conftest import extra_edge, hold_layers
    async with extra_edge(stack, tmp_path / "t4", "t4", 10, warm_max=0) as cold:   # keeps no warm sandbox
        await hold_layers(stack, cold, "busybox")
        probe = await client.create()           # the smaller node wins a plain best fit
        await probe.destroy()
        assert probe.node == "t4"
        async with warm_pool(stack, client, "routed", min=2, max=2) as pools:
            await wait_for(lambda: pools.ready() == 2, what="pool filled on t1")
            await wait_for(lambda: any(i.node == "t1" and i.warm for i in stack.placement.ledger.nodes()),
                           what="placement seeing t1's warm stock")
            hits = pools.hits
            sb = await client.create()
            try:
                assert sb.node == "t1" and pools.hits == hits + 1   # where one is ready, not the best fit
            finally:
                await sb.destroy()


async def test_a_warm_sandbox_whose_init_dies_leaves_the_stock_at_once(stack, client):
    """The host kills a ready warm sandbox's init: the pool drops it and starts another at once, so the next
    matching create claims a live one (before: it stayed in stock, counted ready, until a claim met it)."""
    import os
    import signal
    backend = stack.edge.backend.backends["container"]
    async with warm_pool(stack, client, "dies", min=1, max=1) as pools:
        await wait_for(lambda: pools.ready() == 1, what="pool filled")
        [dead] = warm_ids(stack)
        os.kill(backend.init_pid(dead), signal.SIGKILL)
        await wait_for(lambda: dead not in warm_ids(stack) and pools.ready() == 1, 10, "the dead one replaced")
        hits = pools.hits
        sb = await client.create()
        try:
            assert pools.hits == hits + 1 and backend._key(sb.id) != dead
            assert (await sb.exec("echo live")).stdout == b"live\n"
        finally:
            await sb.destroy()


async def test_one_tenants_pool_leaves_another_tenant_its_share_of_the_nodes_warm_budget(stack, client, monkeypatch):
    """Helper A3: a tenant with no quota set a pool of min=max=32, the node's whole warm budget, and another
    tenant's pool never filled. Now while another tenant's pool waits, a tenant holds at most an equal share
    of the budget (what it holds past it is given back)."""
    monkeypatch.setattr(stack.edge.warm, "warm_max", 4)
    pools = stack.edge.warm

    def held(owner: str) -> int:
        return sum(len(s.ready) for s in pools.pools.values() if (s.spec.owner or "default") == owner)
    async with libdsec.AsyncClient(stack.url, tenant="tenant-b") as other:
        async with warm_pool(stack, client, "hog", min=4, max=4):
            await wait_for(lambda: held("default") == 4, 60, "the first tenant's pool filled")
            await other.set_warm_pool("fair", min=2, max=2)
            try:
                await wait_for(lambda: held("tenant-b") == 2 and held("default") == 2, 60,
                               "the budget shared out")
                await asyncio.sleep(1)
                assert (held("default"), held("tenant-b")) == (2, 2)
            finally:
                await other.delete_warm_pool("fair")
        await wait_for(lambda: all_gone(stack), what="warm sandboxes destroyed")


async def test_a_pool_an_earlier_version_stored_under_its_bare_name_is_moved_to_its_tenants_key(stack, client):
    """Warm pools are keyed <tenant>.<name> now; one stored under its bare name was kept by no edge, could
    not be deleted (`dsec iam tenant rm` stopped on it) and was listed twice once set again (review R5). An
    engine's start moves it; a pool set under the new key meanwhile is kept."""
    from bus import streams
    from bus.messages import encode
    old = WarmPool(name="bare-p", image="busybox", min=0, max=0, owner="default")
    newer = WarmPool(name="bare-q", image="busybox", min=0, max=1, owner="default")
    await stack.bus.kv_put(streams.WARM_POOLS_KV, "bare-p", encode(old))
    await stack.bus.kv_put(streams.WARM_POOLS_KV, "bare-q", encode(WarmPool(name="bare-q", image="busybox", max=0, owner="default")))
    await stack.bus.kv_put(streams.WARM_POOLS_KV, "default.bare-q", encode(newer))
    try:
        await stack.placement.api.pools.migrate()
        assert await stack.bus.kv_get(streams.WARM_POOLS_KV, "bare-p") is None
        assert await stack.bus.kv_get(streams.WARM_POOLS_KV, "bare-q") is None
        assert {p.spec.name: p.spec.max for p in await client.warm_pools()
                if p.spec.name.startswith("bare-")} == {"bare-p": 0, "bare-q": 1}
    finally:
        for name in ("bare-p", "bare-q"):
            await client.delete_warm_pool(name)
    assert not [p for p in await client.warm_pools() if p.spec.name.startswith("bare-")]

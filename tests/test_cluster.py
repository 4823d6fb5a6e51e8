"""A local 3-server JetStream cluster (bus.cluster.NatsCluster): R3 provisioning, publishes surviving the
loss of the client's server (which is also the stream leader), rejoin after restart, clean stop."""
from __future__ import annotations

import asyncio
import json
import time

import psutil
import pytest

from bus import streams
from bus.cluster import NatsCluster, render
from bus.conn import Bus
from bus.errors import BusError, BusUnavailable

# A create request subject (dsec.req.create.<priority>.<id>), from the stream's own filter.
SUBJECT = next(c for c in streams.stream_configs(streams.Retention())
               if c.name == streams.REQ_STREAM).subjects[0].replace("*", "x").replace(">", "x")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """With identities on (made before the servers start); the tests' connections are the admin's."""
    from bus import iam
    root = tmp_path_factory.mktemp("cluster")
    c = NatsCluster(root, iam=iam.bootstrap(root / "iam")).start()
    c.admin = str(c.iam.creds_path("admin"))
    yield c
    c.stop()
    assert _alive(c) == []


def _alive(c: NatsCluster) -> list[int]:
    """Pids of the cluster's servers still running, plus any process started with one of its configs."""
    out = [p for p in c.pids if p is not None and psutil.pid_exists(p)
           and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if any(str(c.root) in a for a in proc.info["cmdline"] or []):
            out.append(proc.info["pid"])
    return out


async def _leader(bus: Bus, stream: str) -> str | None:
    try:
        return (await bus.nc.jetstream(timeout=1).stream_info(stream)).cluster.leader
    except Exception:
        return None


async def _replicas_current(bus: Bus, stream: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            info = (await bus.nc.jetstream(timeout=1).stream_info(stream)).cluster
        except Exception:   # no answer for a moment
            info = None
        if info and len(info.replicas) == 2 and all(p.current and not p.offline for p in info.replicas):
            return True
        await asyncio.sleep(0.2)
    return False


async def test_provision_r3(cluster):
    bus = await Bus.connect(cluster.url, creds=cluster.admin)
    try:
        await bus.provision(replicas=3)
        for name in (streams.REQ_STREAM, f"KV_{streams.NODES_KV}", f"OBJ_{streams.LAYERS_OBJ}"):
            info = await bus.js.stream_info(name)
            assert info.config.num_replicas == 3, name
            assert info.cluster.name == "dsec" and info.cluster.leader.startswith("dsec-"), name
            assert len(info.cluster.replicas) == 2, name
        assert await bus.publish(SUBJECT, b"hello", msg_id="hello-1") > 0
        await bus.kv_put(streams.IMAGES_KV, "k", b"v")
        assert await bus.kv_get(streams.IMAGES_KV, "k") == b"v"
    finally:
        await bus.close()


async def test_publishes_survive_losing_a_server(cluster):
    bus = await Bus.connect(cluster.url, creds=cluster.admin)
    try:
        await bus.provision(replicas=3)
        victim = cluster.index_of(bus.nc.connected_url)
        # Worst case: the server the client talks to is also the leader of the stream.
        await bus.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{streams.REQ_STREAM}",
                             json.dumps({"placement": {"preferred": cluster.name(victim)}}).encode(), timeout=3)
        deadline = time.monotonic() + 10
        while await _leader(bus, streams.REQ_STREAM) != cluster.name(victim):   # no answer while it moves
            assert time.monotonic() < deadline, "stream leadership did not move to the client's server"
            await asyncio.sleep(0.1)

        before = (await bus.js.stream_info(streams.REQ_STREAM)).state.messages
        acked: set[str] = set()

        async def publish_until_acked(msg_id: str, deadline: float) -> None:
            while True:
                try:
                    await bus.publish(SUBJECT, msg_id.encode(), msg_id=msg_id, retries=5, timeout=2)
                    acked.add(msg_id)
                    return
                except BusError:   # same id again: JetStream dedupes if an attempt was stored after all
                    assert time.monotonic() < deadline, f"no publish acked in time ({msg_id})"

        for n in range(10):
            await publish_until_acked(f"pre-{n}", time.monotonic() + 5)

        cluster.kill(victim)
        killed = time.monotonic()
        for n in range(20):
            await publish_until_acked(f"post-{n}", killed + 20)
            if n == 0:
                resumed = time.monotonic() - killed
        assert cluster.index_of(bus.nc.connected_url) != victim
        info = await bus.js.stream_info(streams.REQ_STREAM)
        assert info.cluster.leader != cluster.name(victim)
        assert info.state.messages - before == len(acked) == 30, "a message was lost or duplicated"
        print(f"publishes resumed {resumed:.1f}s after killing {cluster.name(victim)}")

        cluster.restart(victim)
        assert cluster.running(victim)
        assert await _replicas_current(bus, streams.REQ_STREAM, timeout=15), "restarted server did not catch up"
        await publish_until_acked("after-restart", time.monotonic() + 10)
        info = await bus.js.stream_info(streams.REQ_STREAM)
        assert info.state.messages - before == len(acked) == 31
    finally:
        await bus.close()


async def test_stop_leaves_no_process(tmp_path):
    c = NatsCluster(tmp_path / "c").start()
    try:
        assert len(set(c.pids)) == 3 and all(psutil.pid_exists(p) for p in c.pids)
        assert [(tmp_path / "c" / f"nats-{i}.conf").exists() for i in range(3)] == [True] * 3
        bus = await Bus.connect(c.url)
        await bus.provision(replicas=3)
        await bus.close()
        c.kill(2)   # a killed server is reaped too
    finally:
        c.stop()
    assert _alive(c) == []
    c.stop()   # idempotent


async def test_start_timeout_raises_and_cleans_up(tmp_path):
    c = NatsCluster(tmp_path / "c")
    with pytest.raises(BusUnavailable, match="not ready"):
        c.start(timeout=0.3)
    assert _alive(c) == []


def test_render_refuses_unfilled_placeholders():
    assert render("a: ${A}\n# ${B} in a comment\n", {"A": "1"}) == "a: 1\n# ${B} in a comment\n"
    with pytest.raises(ValueError, match="B"):
        render("a: ${A}\nb: ${B}\n", {"A": "1"})


def _consecutive_free_ports(n: int) -> int:
    """The first of n consecutive free loopback ports (what `dsec up --servers n --port P` takes)."""
    from bus.server import check_port_free, free_port
    while True:
        first = free_port()
        try:
            for p in range(first, first + n):
                check_port_free("127.0.0.1", p, "test")
            return first
        except Exception:
            continue


async def test_an_embedded_cluster_enforces_identities_on_every_server(tmp_path):
    """`dsec up --servers 3` (auth on by default): every server refuses a client without a credential,
    the default tenant creates and runs through any of them, and a tenant added at run time (`dsec iam`
    reloads every server) is served by each server while it sees nothing of the other's."""
    import nats
    import nats.errors
    import libdsec
    from bus import iam, iamserver, subjects
    from bus.creds import seed_of
    from bus.errors import AuthenticationFailed
    from cli.stack import Stack
    from edge.capacity import EdgeConfig
    from tests import leaks
    node = "tclusterauth"
    st = Stack(tmp_path / "state", port=_consecutive_free_ports(3), metrics_port=None, servers=3, auth=True,
               edge_config=EdgeConfig(node_id=node, slots=8))
    with leaks.live(node, tmp_path / "state"):
        await st.start()
        try:
            urls = st.url.split(",")
            assert len(urls) == 3
            for url in urls:
                with pytest.raises(AuthenticationFailed):
                    await Bus.connect(url, name="anonymous", timeout=2.0, reconnect=False)
            default = str(st.iam.creds_path("tenant:default"))
            async with libdsec.AsyncClient(urls[1], creds=default) as c:
                async with await c.create() as sb:
                    assert (await sb.exec("echo via-1")).stdout == b"via-1\n"
                    kept = sb.id
                    ids = iam.Iam.load(st.state_dir)
                    ids.add_tenant("acme")
                    ids.save()
                    assert iamserver.reload(ids) == 3
                    acme = str(ids.creds_path("tenant:acme"))
                    for url in urls:
                        async with libdsec.AsyncClient(url, creds=acme) as a:
                            async with await a.create() as other:
                                assert (await other.exec("echo acme")).stdout == b"acme\n"
                                assert [r.sandbox_id for r in await a.list()] == [other.id]
                    raw = await nats.connect(urls[2], nkeys_seed_str=seed_of(open(acme).read()),
                                             allow_reconnect=False, connect_timeout=2)
                    try:   # acme cannot ask in default's name: nothing in its account answers
                        with pytest.raises(nats.errors.NoRespondersError):
                            await raw.request(subjects.api("default", "sandbox-list"),
                                              b'{"kind":"list_sandboxes"}', timeout=1.5)
                    finally:
                        await raw.close()
                    assert kept in [r.sandbox_id for r in await c.list()]
            # a member killed is started again (before: it stayed down, a zombie of `dsec up`: helper 28)
            before = st.cluster.pids[2]
            st.cluster.kill(2)
            for _ in range(100):
                if st.cluster.running(2) and st.cluster.pids[2] != before:
                    break
                await asyncio.sleep(0.1)
            assert st.cluster.running(2) and st.cluster.pids[2] != before
            async with libdsec.AsyncClient(urls[2], creds=default) as c2:
                for _ in range(100):   # (until it answers again)
                    try:
                        await c2.list()
                        break
                    except libdsec.DsecError:
                        await asyncio.sleep(0.2)
                async with await c2.create() as sb:
                    assert (await sb.exec("echo again")).stdout == b"again\n"
            assert not st.broken.is_set()
        finally:
            await st.stop()


async def test_scans_of_a_replicated_bucket_read_every_page(cluster):
    """A list of every state pages through KV dsec-sandboxes with a pull consumer made per page: on a
    replicated stream its first pull sometimes met "no responders" (503) before its server had taken it up,
    and the whole list failed (helper 28: 3 of 300 pulls, a 25-page list one time in four)."""
    from contextlib import aclosing
    bus = await Bus.connect(cluster.url, creds=cluster.admin)
    try:
        await bus.provision(replicas=3)
        await asyncio.gather(*(bus.kv_put(streams.SANDBOXES_KV, f"scan.sb-{i:04d}", b"{}") for i in range(300)))
        first = (await bus.js.stream_info(f"KV_{streams.SANDBOXES_KV}")).state.first_seq
        for i in range(400):
            got = []
            async with aclosing(bus.kv_scan(streams.SANDBOXES_KV, "scan.>", first + i % 250,
                                            want=lambda: 50 - len(got))) as entries:
                async for key, _raw, _seq, _pending in entries:
                    got.append(key)
                    if len(got) == 50:
                        break
            assert len(got) == 50, (i, got)
    finally:
        await bus.close()

"""Truth under faults: records that end right however long the bus is away, sandboxes serviceable the moment
they are seen ready, execs that end typed when the platform destroys their sandbox, lock files, and the
edge's outbox surviving a crash. Each against a real nats-server (killed and restarted where it matters)."""
from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import libdsec
from bus import streams, subjects
from bus.conn import Bus
from edge.sandboxes import RECORD_WAIT
from bus.records import Quota, event_decoder, sandbox_decoder
from tests.conftest import LONG, own_server

pytestmark = pytest.mark.timeout(180)
DSEC = str(Path(sys.executable).parent / "dsec")


async def _events(bus: Bus, sandbox_id: str) -> list[str]:
    return [event_decoder.decode(d).type async for d in bus.read_subject(
        streams.EVT_STREAM, subjects.event("default", sandbox_id))]


async def _record(bus: Bus, sandbox_id: str):
    raw = await bus.kv_get(streams.SANDBOXES_KV, f"default.{sandbox_id}")
    return sandbox_decoder.decode(raw) if raw is not None else None


async def _until(what, limit: float = 30.0, every: float = 0.2):
    deadline = time.monotonic() + limit
    while True:
        try:
            got = await what()
        except libdsec.DsecError:
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {limit}s"
        await asyncio.sleep(every)


@LONG   # (26-29 s: a 3-server cluster that loses two for 12 s; `make test-long`)
async def test_a_sandbox_that_ends_while_its_records_have_no_quorum_is_recorded_once_they_do(tmp_path):
    """A 3-server cluster loses two servers for 12 s, longer than any retry window: the edge's own server
    answers, but no stream or bucket has a quorum, so nothing it writes is stored (and nothing is kept
    in a client buffer for later). The sandbox's TTL fires meanwhile. Once the servers are back its record
    says expired, its events are there exactly once, and the quota it held is free (before: 'state not
    recorded' after 8 s: the record stayed ready for good and the quota stayed held).
    In flight at the kill, each held 1 s in the node's backend: a destroy and a create. Each is answered
    only once its record is stored, after the servers are back (before: after RECORD_WAIT, 8 s, the records
    still `ready` and `starting`: a cleanup by the `ready` records missed a sandbox that was running). A third,
    a create whose answer is lost and whose time runs out meanwhile, is destroyed once it is up (before: it ran
    on, unseen, until its TTL)."""
    from bus.cluster import NatsCluster
    from cli.stack import Stack
    from edge.capacity import EdgeConfig
    from bus import iam
    from placement.quota import set_quota
    ids = iam.bootstrap(tmp_path / "iam", nodes=["tq"])   # identities on, made before the servers start
    cluster = NatsCluster(tmp_path / "nats", iam=ids).start()
    admin = str(ids.creds_path("admin"))
    st = Stack(tmp_path / "state", nats_url=cluster.urls[0], metrics_port=None,
               edge_config=EdgeConfig(node_id="tq", slots=4), creds=admin)
    try:
        boot = await Bus.connect(cluster.url, creds=admin)
        await boot.provision(replicas=3)
        await boot.close()
        await st.start()
        async with libdsec.AsyncClient(cluster.urls[0], creds=str(ids.creds_path("tenant:default"))) as client:
            await set_quota(st.bus, Quota(tenant="default", max_sandboxes=4))
            await asyncio.sleep(0.5)   # placement's quota watch
            sb = await client.create(ttl=3)
            doomed = await client.create()
            backend, inside = st.edge.backend, {"create": asyncio.Event(), "destroy": asyncio.Event()}
            entered = collections.Counter()

            def held(name: str, real, want: int):
                async def call(*args, **kw):
                    entered[name] += 1
                    if entered[name] == want:
                        inside[name].set()
                    await asyncio.sleep(1)
                    return await real(*args, **kw)
                return call

            async def answered(call):
                return await call, time.monotonic()
            started = st.edge.creates._started

            async def late(req):   # the answer to the create labelled so comes past its deadline (lost)
                if req.labels.get("answer") == "late":
                    await asyncio.sleep(req.deadline - time.time() + 1)
                await started(req)
            st.edge.creates._started = late
            backend.create, backend.destroy = held("create", backend.create, 2), held("destroy", backend.destroy, 1)
            destroying = asyncio.ensure_future(answered(doomed.destroy(timeout=60)))
            creating = asyncio.ensure_future(answered(client.create(timeout=60)))
            lost = asyncio.ensure_future(client.create(timeout=6, labels={"answer": "late"}))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in inside.values())), 20)
            cluster.kill(1)
            cluster.kill(2)
            del backend.create, backend.destroy
            t0 = time.monotonic()   # the TTL fires meanwhile, and its record waits past any retry window
            while time.monotonic() - t0 < 3 + RECORD_WAIT + 1 or sb.id in st.edge.sandboxes:   # (TTL, RECORD_WAIT)
                assert time.monotonic() - t0 < 30, "the TTL must fire while the records have no quorum"
                await asyncio.sleep(0.2)
            assert not destroying.done() and not creating.done(), "answered while their records had no quorum"
            # the lost answer's create: its time ran out while its record could not be read (its sandbox came up
            # all the same, and ran on unseen until its TTL: helper F4)
            with pytest.raises(libdsec.CapacityUnavailable, match="destroyed once it is up") as err:
                await lost
            unseen = err.value.details["sandbox_id"]
            back = time.monotonic()
            await asyncio.gather(asyncio.to_thread(cluster.restart, 1), asyncio.to_thread(cluster.restart, 2))
            (_, destroyed_at), (new, created_at) = await asyncio.wait_for(asyncio.gather(destroying, creating), 60)
            assert destroyed_at > back and created_at > back
            assert (await _record(st.bus, doomed.id)).state == "destroyed"   # stored before the answer
            assert (await _record(st.bus, new.id)).state == "ready"
            assert (await _until(lambda: _record_in(st.bus, unseen, "destroyed"), 40)).state == "destroyed"
            rec = await _until(lambda: _record_in(st.bus, sb.id, "expired"), 40)
            assert rec.state == "expired"
            assert await _until(lambda: _has_events(st.bus, sb.id, ["created", "expired"]), 20)
            again = [await client.create(timeout=30) for _ in range(3)]   # the quota they held is free
            for x in [new, *again]:
                await x.destroy()

            async def unquota() -> bool:   # (each bucket's group elects its leader in its own time after the restart)
                await st.bus.kv_delete(streams.QUOTAS_KV, "default")
                return True
            await _until(unquota, 20)
    finally:
        await st.stop()
        cluster.stop()
    from edge.backends.registry import node_leftovers as leftovers
    assert leftovers(tmp_path / "state" / "edge", "tq") == []


async def _record_in(bus: Bus, sandbox_id: str, state: str):
    rec = await _record(bus, sandbox_id)
    return rec if rec is not None and rec.state == state else None


async def _has_events(bus: Bus, sandbox_id: str, want: list[str]) -> bool:
    """Its lifecycle events are exactly want (placement's `queued`, said when the create came before the node
    was seen live, is not the sandbox's: CI saw ['queued', 'created', 'expired'])."""
    return [e for e in await _events(bus, sandbox_id) if e != "queued"] == want


async def test_the_outbox_survives_an_edge_crash_while_the_bus_is_away(tmp_path):
    """The edge destroys a sandbox (its TTL) while the server is down, then is SIGKILLed; the server comes
    back, then the edge: its outbox, read at start, records `expired` (what happened), not node_lost
    (what a restart would guess), with exactly one terminal event."""
    from cli.stack import Stack
    srv = own_server(tmp_path, ["tx"])
    placement = Stack(tmp_path / "placement", nats_url=srv.url, metrics_port=None, run_edge=False,
                      creds=srv.creds("placement"))
    await placement.start()
    edge = _edge(srv.url, tmp_path / "edge", srv.creds("edge-tx"))
    try:
        async with libdsec.AsyncClient(srv.url, creds=srv.creds("tenant:default")) as client:
            sb = await client.create(ttl=2)
            srv.kill()
            await asyncio.sleep(4)          # the TTL fires: its `expired` waits in the outbox, on disk
            edge.send_signal(signal.SIGKILL)
            edge.wait()
            srv.start()
            edge = _edge(srv.url, tmp_path / "edge", srv.creds("edge-tx"))
            rec = await _until(lambda: _record_in(placement.bus, sb.id, "expired"), 30)
            assert rec.reason == "ttl reached"
            try:
                assert await _until(lambda: _has_events(placement.bus, sb.id, ["created", "expired"]), 30)
            except AssertionError:   # (seen once in a loaded CI run: say what was there instead)
                log = [line for line in (tmp_path / "edge.log").read_text(errors="replace").splitlines()
                       if sb.id in line or "outbox" in line or "WARNING" in line or "ERROR" in line]
                raise AssertionError(f"events {await _events(placement.bus, sb.id)}; edge log:\n"
                                     + "\n".join(log[-60:])) from None
    finally:
        edge.send_signal(signal.SIGTERM)
        edge.wait(20)
        await placement.stop()
        srv.stop()
    from edge.backends.registry import node_leftovers as leftovers
    assert leftovers(tmp_path / "edge" / "edge", "tx") == []


def _edge(url: str, state: Path, creds: str) -> subprocess.Popen:
    with open(state.parent / "edge.log", "a") as log:   # (both runs' logs, for a failure to show)
        proc = subprocess.Popen([DSEC, "edge", "--nats", url, "--node-id", "tx", "--state-dir", str(state),
                                 "--creds", creds, "-v"], stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout.readline().startswith("dsec: edge")
    return proc


async def test_a_sandbox_is_serviceable_the_moment_its_ready_record_is_seen(stack, client, monkeypatch):
    """The ready record's ack is slow to come back (a busy server): a client that sees the record `ready`
    in the meantime and runs a command is served (before: not_on_this_node, as the edge registered the
    sandbox only after its record was written)."""
    bus = stack.edge.bus
    real = bus.kv_cas
    seen = asyncio.Event()

    async def slow_ready(bucket, key, value, revision):
        rev = await real(bucket, key, value, revision)
        if bucket == streams.SANDBOXES_KV and b'"state":"ready"' in value and rev is not None:
            seen.set()
            await asyncio.sleep(1.0)   # written; its ack is late
        return rev
    monkeypatch.setattr(bus, "kv_cas", slow_ready)
    creating = asyncio.ensure_future(client.create())
    await asyncio.wait_for(seen.wait(), 10)
    ids = [r.sandbox_id for r in await client.list()]
    assert ids, "the ready record is visible"
    other = await client.get(ids[-1])
    r = await other.exec(["echo", "served"])
    assert r.stdout == b"served\n"
    sb = await creating
    await sb.destroy()


async def test_an_exec_whose_sandbox_the_platform_destroys_ends_sandbox_not_found(stack, client):
    """A destroy (or the TTL) under a running command ends it SandboxNotFound with the reason, never a bare
    exit 137."""
    sb = await client.create()
    handle = await sb.exec("sleep 30", background=True)
    await asyncio.sleep(0.3)
    await sb.destroy()
    with pytest.raises(libdsec.SandboxNotFound) as ei:
        await handle.wait()
    assert ei.value.reason == "destroyed"
    assert str(ei.value) == f"sandbox {sb.id} destroyed while the command ran: destroyed by request", ei.value
    short = await client.create(ttl=1.5)
    with pytest.raises(libdsec.SandboxNotFound) as ei:
        await short.exec("sleep 30", timeout=20)
    assert ei.value.reason == "expired"
    assert str(ei.value) == f"sandbox {short.id} expired while the command ran: ttl reached", ei.value


async def test_a_sandbox_whose_init_is_killed_is_recorded_failed_saying_why(stack, client):
    """A container sandbox's init killed (by host root here; the OOM killer did it too) ended the sandbox:
    every later exec failed, but its record stayed `ready` (its slot and quota held) until its TTL, and a
    command running then ended with a wrong reason. Now the edge destroys it as failed, as for a VM that
    ended by itself: the record, the running command and the next call all say why."""
    sb = await client.create()
    handle = await sb.exec("sleep 30", background=True)
    await asyncio.sleep(0.3)
    os.kill(stack.edge.backend.backends["container"].init_pid(sb.id), signal.SIGKILL)
    with pytest.raises(libdsec.SandboxNotFound) as ei:
        await asyncio.wait_for(handle.wait(), 20)
    why = "its init ended (killed by signal 9)"
    assert ei.value.reason == "failed"
    assert str(ei.value) == f"sandbox {sb.id} failed while the command ran: {why}", ei.value
    for _ in range(100):   # (the destroy that records it runs on)
        rec = await client._record(sb.id)
        if rec.state != "ready":
            break
        await asyncio.sleep(0.05)
    assert (rec.state, rec.reason) == ("failed", why), rec
    with pytest.raises(libdsec.SandboxNotFound, match=re.escape(f"not found (failed: {why})")):
        await sb.exec("true")
    assert sb.id not in {r.sandbox_id for r in await client.list()}


async def test_an_init_killed_after_an_oom_kill_is_not_said_to_be_the_oom_killers(stack, client):
    """A command of the sandbox was OOM-killed earlier; then host root kills its init: the reason says the
    signal and that the limit fired, not that the OOM killer took the init (before: it said so)."""
    sb = await client.create(resources=libdsec.Resources(memory="32Mi"))
    r = await sb.exec("tail -c 64m /dev/zero > /dev/null; echo $?")
    assert r.stdout == b"137\n", r
    os.kill(stack.edge.backend.backends["container"].init_pid(sb.id), signal.SIGKILL)
    for _ in range(100):
        rec = await client._record(sb.id)
        if rec.state != "ready":
            break
        await asyncio.sleep(0.05)
    assert rec.state == "failed" and rec.reason.startswith("its init ended (killed by signal 9, the OOM killer having "
                                                           "fired "), rec


def test_lock_files_go_at_a_clean_exit_and_a_dead_holders_is_taken_over(tmp_path):
    from cli.locks import AlreadyRunning, Lock
    path = tmp_path / "node-x.lock"
    lock = Lock(path, "node id 'x'").acquire()
    with pytest.raises(AlreadyRunning, match=f"pid {os.getpid()}"):
        Lock(path, "node id 'x'").acquire()
    lock.release()
    assert not path.exists(), "a clean exit removes the lock file"
    holder = subprocess.Popen([sys.executable, "-c", f"from cli.locks import Lock; import time; "
                               f"Lock({str(path)!r}, 'x').acquire(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(AlreadyRunning):
        Lock(path, "node id 'x'").acquire()
    holder.kill()
    holder.wait()
    assert path.exists(), "a killed holder leaves its file"
    taken = Lock(path, "node id 'x'").acquire()   # stale: its holder is dead
    assert path.read_text() == str(os.getpid())
    taken.release()


@pytest.mark.parametrize("warm", [False, True])
async def test_a_ready_record_the_disk_cannot_keep_is_never_told_ready(stack, client, monkeypatch, warm):
    """The node's disk is full when a started sandbox's ready record goes into the outbox: the client gets
    EnvironmentFailure, the sandbox is destroyed and its id has no record (before: the OSError escaped the
    create, the request came again, and the redelivery answered `ready` for a sandbox whose record said
    `starting` for good, unlisted, holding its slot until its TTL)."""
    import errno
    outbox = stack.edge.outbox
    real = outbox.put

    async def full(change, early=None):
        if change.record is not None and change.record.state == "ready":
            raise OSError(errno.ENOSPC, "No space left on device")
        return await real(change, early)
    if warm:
        await client.set_warm_pool("full-disk", min=1, max=1)
        for _ in range(200):
            if stack.edge.warm.ready():
                break
            await asyncio.sleep(0.05)
        assert stack.edge.warm.ready() == 1
    try:
        monkeypatch.setattr(outbox, "put", full)
        hits = stack.edge.warm.hits
        with pytest.raises(libdsec.EnvironmentFailure, match="could not record"):
            await client.create(timeout=20)
        assert stack.edge.warm.hits == hits + warm
        monkeypatch.setattr(outbox, "put", real)
        assert [r for r in await client.list(all_states=True) if r.state in ("starting", "ready")] == []
        sb = await client.create(timeout=20)   # the node serves on
        await sb.destroy()
    finally:
        if warm:
            await client.delete_warm_pool("full-disk")
            for _ in range(200):
                if not stack.edge.warm.ready() and not stack.edge.warm._retiring:
                    break
                await asyncio.sleep(0.05)


async def test_a_create_sent_while_the_server_is_stopped_is_served_not_orphaned(tmp_path, monkeypatch):
    """The server is stopped (SIGSTOP) as a create is sent and for 7 s: the publish gets no ack within its
    window (10 s by default, 3 s here: CI's budget), but the request waits in the stopped server's socket
    and is served once it runs again. The create returns that sandbox (before: BusError once the window
    ended, then the sandbox was started anyway: ready, unknown to its caller, holding its slot until its
    TTL). Then an exec the same way."""
    import libdsec.sandbox
    from cli.stack import Stack
    from edge.capacity import EdgeConfig
    monkeypatch.setattr(libdsec.sandbox, "PUBLISH_RETRY_FOR", 3.0)
    srv = own_server(tmp_path, ["ts"])
    st = Stack(tmp_path / "state", nats_url=srv.url, metrics_port=None, edge_config=EdgeConfig(node_id="ts", slots=4),
               creds=srv.creds("admin"))
    await st.start()
    try:
        async with libdsec.AsyncClient(srv.url, creds=srv.creds("tenant:default")) as client:
            srv.proc.send_signal(signal.SIGSTOP)
            try:
                creating = asyncio.ensure_future(client.create(timeout=45))
                await asyncio.sleep(7)
            finally:
                srv.proc.send_signal(signal.SIGCONT)
            sb = await asyncio.wait_for(creating, 60)
            assert (await sb.exec("echo served")).stdout == b"served\n"
            ready = [r.sandbox_id for r in await client.list()]
            assert ready == [sb.id], ready      # exactly the one the caller holds
            # an exec the same way: it runs once the server does, and its caller gets its result (before:
            # BusError, and the command ran anyway: a caller retrying on that error ran it twice)
            srv.proc.send_signal(signal.SIGSTOP)
            try:
                running = asyncio.ensure_future(sb.exec("echo ran >> /tmp/runs; cat /tmp/runs", timeout=40))
                await asyncio.sleep(7)
            finally:
                srv.proc.send_signal(signal.SIGCONT)
            r = await asyncio.wait_for(running, 60)
            assert (r.exit_code, r.stdout) == (0, b"ran\n"), r
            await sb.destroy()
    finally:
        await st.stop()
        srv.stop()
    from edge.backends.registry import node_leftovers as leftovers
    assert leftovers(tmp_path / "state" / "edge", "ts") == []

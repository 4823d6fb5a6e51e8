"""Identities enforced by the NATS server (bus/iam.py): a tenant B client with its own credential attacks
tenant A ("alice"); an edge's, an ops and a revoked credential try what they may not. Every attempt is
asserted from what the server answers (no responders, JetStream not enabled for the account, a
permissions violation, an authorization violation), and A's own view is checked to be intact after."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest

import libdsec
from bus import iam, iamserver, streams, subjects
from bus.apiwire import ListSandboxes, SandboxPage
from bus.conn import Bus
from bus.creds import seed_of
from bus.messages import encode
from bus.records import EngineStats, Quota
from bus.execwire import ExitRecord, decode_output
from libdsec import control
from placement.quota import set_quota
from tests.conftest import NODE

DSEC = str(Path(sys.executable).parent / "dsec")


class Raw:
    """A plain nats-py connection with a credential, recording what the server says asynchronously."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc = None

    async def connect(self, url: str, creds: str) -> "Raw":
        async def _err(exc):
            self.errors.append(str(exc).lower())
        seed = seed_of(open(creds).read())
        self.nc = await nats.connect(url, nkeys_seed_str=seed, error_cb=_err, allow_reconnect=False,
                                     connect_timeout=2)
        return self

    async def violation(self, subject: str, timeout: float = 2.0) -> bool:
        """Whether the server reported a permissions violation on `subject` (it says so asynchronously)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any("permissions violation" in e and subject.lower() in e for e in self.errors):
                return True
            await asyncio.sleep(0.02)
        return False

    async def close(self) -> None:
        await self.nc.close()


def creds_of(stack, principal: str) -> str:
    return str(stack.nats_server.iam.creds_path(principal))


@pytest.fixture
async def alice(stack):
    async with libdsec.AsyncClient(stack.url, creds=creds_of(stack, "tenant:alice")) as c:
        yield c


@pytest.fixture
async def mallory(stack):
    raw = await Raw().connect(stack.url, creds_of(stack, "tenant:mallory"))
    yield raw
    await raw.close()


async def test_the_sdk_takes_its_tenant_from_the_credential(stack, alice):
    assert alice.tenant == "alice" and alice.creds.endswith("tenants/alice.creds")
    async with await alice.create() as sb:
        assert (await alice.get(sb.id)).id == sb.id
        rec = await stack.bus.kv_get(streams.SANDBOXES_KV, subjects.record_key("alice", sb.id))
        assert rec is not None   # stored under alice's key, by the platform


async def test_tenant_b_cannot_reach_tenant_a_through_the_platforms_subjects(stack, alice, mallory):
    js = mallory.nc.jetstream(timeout=1.5)
    async with await alice.create(labels={"job": "iam-a"}) as sb:
        r = await sb.exec("echo secret-a")
        assert r.stdout == b"secret-a\n"
        out_subject = subjects.output("alice", sb.node, sb.id, r.exec_id)
        # requests in alice's name: nothing in mallory's account answers them
        for subject, payload in [
                (subjects.create_request("alice"), b"{}"),
                (subjects.node_ops(sb.node, "alice", sb.id), b"{}"),
                (subjects.api("alice", "sandbox-list"), b'{"kind":"list_sandboxes"}'),
                (subjects.api("alice", "output-read"), encode_read(sb, r.exec_id)),
                (subjects.exec_input(sb.node, "alice", sb.id, r.exec_id), b"{}"),
                (subjects.call_request("alice"), b"{}")]:
            with pytest.raises(nats.errors.NoRespondersError):
                await mallory.nc.request(subject, payload, timeout=1.5)

        # forged exit records and lane messages go nowhere (mallory's account exports nothing to DSEC)
        forged = encode(ExitRecord(exec_id=r.exec_id, seq=3, exit_code=0))
        await mallory.nc.publish(out_subject, forged)
        await mallory.nc.publish(subjects.node_ops(sb.node, "mallory", sb.id), b"{}")
        await mallory.nc.publish(f"dsec.node.{sb.node}.create", b"{}")
        await mallory.nc.flush()

        # JetStream: mallory's account has none, and none of DSEC's: stream reads, consumers of any kind,
        # direct gets, KV and object writes, purges and deletes are all refused by the server
        refusals = {}
        attempts = {
            "stream info": lambda: js.stream_info(streams.OUT_STREAM),
            "stream list": lambda: js.streams_info(),
            "msg get": lambda: js.get_msg(streams.OUT_STREAM, seq=1),
            "direct get": lambda: js.get_last_msg(streams.OUT_STREAM, out_subject, direct=True),
            "pull consumer": lambda: js.pull_subscribe(out_subject, "steal", stream=streams.OUT_STREAM),
            "push consumer": lambda: js.add_consumer(streams.OUT_STREAM, durable_name="push", deliver_subject="dsec.x"),
            "traj consumer": lambda: js.add_consumer(streams.TRAJ_STREAM, durable_name="t", filter_subject="dsec.traj.alice.>"),
            "kv write": lambda: js.publish(f"$KV.{streams.IMAGES_KV}.busybox", b"{}"),
            "kv bind": lambda: js.key_value(streams.SANDBOXES_KV),
            "object store": lambda: js.object_store(streams.LAYERS_OBJ),
            "purge": lambda: js.purge_stream(streams.OUT_STREAM),
            "delete": lambda: js.delete_stream(streams.TRAJ_STREAM),
        }
        for what, attempt in attempts.items():
            try:
                await attempt()
                refusals[what] = "allowed"
            except nats.js.errors.ServiceUnavailableError as exc:
                refusals[what] = "no JetStream" if exc.err_code == 10039 else f"503 {exc.err_code}"
            except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
                refusals[what] = "no JetStream"   # (a publish: nothing in the account stores it)
            except Exception as exc:
                refusals[what] = f"{type(exc).__name__}: {exc}"
        assert refusals == {what: "no JetStream" for what in attempts}, refusals

        seen: list[str] = []   # (subscribed after the attempts: it would answer them)

        async def _cb(m):
            seen.append(m.subject)
        await mallory.nc.subscribe("dsec.>", cb=_cb)     # everything mallory's account can see
        await mallory.nc.subscribe(">", cb=_cb)
        await mallory.nc.flush()

        r2 = await sb.exec("echo while-b-listens")   # A's output, events and replies while B listens to everything
        assert r2.stdout == b"while-b-listens\n"

        # A's view is intact: the stream holds the real exit record only, A's sandbox answers as before
        stored = [decode_output(d, h) async for d, h in stack.bus.read_subject(streams.OUT_STREAM, out_subject,
                                                                                with_headers=True)]
        assert [type(x).__name__ for x in stored] == ["StartRecord", "OutputChunk", "ExitRecord"]
        assert stored[-1].exit_code == 0 and stored[-1].seq == 3
        await asyncio.sleep(0.2)
        assert not [s for s in seen if ".alice." in s], seen   # none of A's output, events or replies


def encode_read(sb, exec_id: str) -> bytes:
    from bus.apiwire import ReadOutput
    return encode(ReadOutput(node=sb.node, sandbox_id=sb.id, exec_id=exec_id))


async def test_tenant_b_through_its_own_subjects_finds_nothing_of_a(stack, alice):
    """B's SDK addresses A's sandbox through B's own subjects (which the server lets it use): the platform
    answers from B's tenant, so A's sandbox is one that does not exist, its list is B's, its
    trajectories are B's."""
    async with await alice.create(labels={"job": "iam-b"}) as sb, \
            libdsec.AsyncClient(stack.url, creds=creds_of(stack, "tenant:mallory")) as b:
        assert b.tenant == "mallory"
        r = await sb.exec("echo for-alice")
        theirs = libdsec.AsyncSandbox(b, sb.id, sb.node, sb.backend)
        with pytest.raises(libdsec.SandboxNotFound):
            await theirs.exec("echo pwned")
        with pytest.raises(libdsec.SandboxNotFound):
            await b.get(sb.id)
        assert sb.id not in {rec.sandbox_id for rec in await b.list(all_states=True)}
        got = [t async for t in b.trajectories(sandbox=sb.id, follow=False)]
        assert got == []
        mine = [t async for t in alice.trajectories(sandbox=sb.id, follow=False)]
        assert any(t.record.type == "exec" and t.record.exec_id == r.exec_id for t in mine)
        # a create whose payload names A is A's in nothing: the tenant is the subject's (B's)
        theirs_create = await b.create(labels={"job": "iam-b"})
        try:
            assert (await stack.bus.kv_get(streams.SANDBOXES_KV, subjects.record_key("alice", theirs_create.id))) is None
        finally:
            await theirs_create.destroy()


async def test_dsec_replay_with_b_credentials_is_refused(stack, alice):
    async with await alice.create(labels={"job": "iam-replay"}) as sb:
        await sb.exec("echo replay-me")
    env = {"DSEC_CREDS": creds_of(stack, "tenant:mallory"), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([DSEC, "replay", "--nats", stack.url, "--sandbox", sb.id], capture_output=True, text=True,
                       timeout=60, env=env)
    assert p.returncode == 1 and "replay-me" not in p.stdout, (p.stdout, p.stderr)
    assert p.stderr.startswith("dsec: error: ") and "refused" in p.stderr and "Traceback" not in p.stderr, p.stderr
    # the ops credential replays it
    env["DSEC_CREDS"] = creds_of(stack, "ops")
    p = subprocess.run([DSEC, "replay", "--nats", stack.url, "--sandbox", sb.id], capture_output=True, text=True,
                       timeout=60, env=env)
    assert p.returncode == 0 and "1| replay-me" in p.stdout, p.stderr


async def test_a_request_the_server_refuses_the_credential_fails_at_once(stack):
    # `dsec ls` with ops' or an edge's credential (neither may publish to the control API) waited its whole
    # 10 s and said "no answer within 10s" while the server's log said Publish Violation (helper U2)
    for who in ("ops", f"edge-{NODE}"):
        env = {"DSEC_CREDS": creds_of(stack, who), "PATH": "/usr/bin:/bin"}
        t0 = time.monotonic()
        p = await asyncio.to_thread(subprocess.run, [DSEC, "ls", "--nats", stack.url], capture_output=True,
                                    text=True, timeout=60, env=env)
        took = time.monotonic() - t0
        assert p.returncode == 1 and p.stdout == "", (p.stdout, p.stderr)
        assert p.stderr.startswith("dsec: error: request dsec.api.") and "refused the credential" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr and took < 5, (took, p.stderr)
    ops = await Bus.connect(stack.url, creds=creds_of(stack, "ops"))
    try:   # the SDK's own call: PermissionDenied at once, the connection fine for what it may do
        with pytest.raises(libdsec.PermissionDenied, match="refused the credential"):
            await asyncio.wait_for(control.ask(ops, "default", ListSandboxes(), SandboxPage), 5)
        await ops.flush()
    finally:
        await ops.close()


async def test_an_edge_credential_is_held_to_its_own_node(stack):
    raw = await Raw().connect(stack.url, creds_of(stack, f"edge-{NODE}"))
    try:
        js = raw.nc.jetstream(timeout=1.0)
        own = subjects.output("alice", NODE, "sbx", "ex1")
        other = subjects.output("alice", "t9", "sbx", "ex1")
        await raw.nc.publish(other, encode(ExitRecord(exec_id="ex1", seq=1, exit_code=0)))
        assert await raw.violation(other)
        for subject in ("dsec.node.t9.create", "dsec.node.t9.exec.alice.sbx", f"$KV.{streams.NODES_KV}.t9",
                        f"$KV.{streams.IMAGES_KV}.busybox", f"$JS.API.STREAM.PURGE.{streams.OUT_STREAM}",
                        f"$JS.API.CONSUMER.CREATE.{streams.NODE_STREAM}.edge-t9-ops.dsec.node.t9.exec.>",
                        f"$JS.API.CONSUMER.MSG.NEXT.{streams.NODE_STREAM}.edge-t9-ops"):
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await raw.nc.request(subject, b"{}", timeout=0.5)
            assert await raw.violation(subject), (subject, raw.errors[-3:])
        # its own node's output subject is its to publish (stored in DSEC_OUT)
        ack = await js.publish(own, encode(ExitRecord(exec_id="ex1", seq=1, exit_code=0)))
        assert ack.stream == streams.OUT_STREAM
        assert not await raw.violation(own, timeout=0.2)
    finally:
        await raw.close()


async def test_ops_can_read_but_not_delete_purge_or_publish(stack, client):
    async with await client.create() as sb:   # output of its own to keep (alone, the test found DSEC_OUT empty)
        assert (await sb.exec("echo kept")).stdout == b"kept\n"
    raw = await Raw().connect(stack.url, creds_of(stack, "ops"))
    try:
        js = raw.nc.jetstream(timeout=1.0)
        info = await js.stream_info(streams.TRAJ_STREAM)      # reads: allowed
        assert info.config.name == streams.TRAJ_STREAM
        held = (await js.stream_info(streams.OUT_STREAM)).state.messages
        for subject in (f"$JS.API.STREAM.PURGE.{streams.OUT_STREAM}", f"$JS.API.STREAM.DELETE.{streams.TRAJ_STREAM}",
                        f"$JS.API.STREAM.MSG.DELETE.{streams.OUT_STREAM}", f"$KV.{streams.IMAGES_KV}.x",
                        subjects.create_request("alice"), f"$JS.API.CONSUMER.MSG.NEXT.{streams.REQ_STREAM}.placement-latency"):
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await raw.nc.request(subject, b"{}", timeout=0.5)
            assert await raw.violation(subject), (subject, raw.errors[-3:])
        assert held > 0 and (await js.stream_info(streams.OUT_STREAM)).state.messages >= held   # nothing purged
    finally:
        await raw.close()
    # its reads through the bus (`dsec top`, replays) ask nothing it may not: a KV listing leaves its
    # ordered consumer to the server's inactivity timer instead of deleting it (ops may delete no consumer)
    seen: list[str] = []
    ops = await Bus.connect(stack.url, creds=creds_of(stack, "ops"))
    ops.nc._error_cb = lambda exc: seen.append(str(exc)) or asyncio.sleep(0)
    try:
        assert [k for k, _ in await ops.kv_items(streams.NODES_KV)]
        await ops.nc.flush()
        await asyncio.sleep(0.3)
    finally:
        await ops.close()
    assert not [e for e in seen if "violation" in e.lower()], seen


async def test_credentials_missing_malformed_unknown_and_revoked(stack, tmp_path):
    with pytest.raises(libdsec.AuthenticationFailed, match="cannot be read"):
        await libdsec.AsyncClient(stack.url, creds=str(tmp_path / "nope.creds")).connect()
    (tmp_path / "bad.creds").write_text("not a credential\n")
    with pytest.raises(libdsec.AuthenticationFailed, match="malformed"):
        await libdsec.AsyncClient(stack.url, creds=str(tmp_path / "bad.creds")).connect()
    seed, _ = iam.new_seed()
    (tmp_path / "unknown.creds").write_text(iam.creds_text(seed, "tenant:nobody"))
    t0 = time.monotonic()
    with pytest.raises(libdsec.AuthenticationFailed, match="refused the credential"):
        await libdsec.AsyncClient(stack.url, creds=str(tmp_path / "unknown.creds"), connect_timeout=5).connect()
    assert time.monotonic() - t0 < 1.5, "a refused credential is an error at once, not after the connect's retries"
    t0 = time.monotonic()
    with pytest.raises(libdsec.AuthenticationFailed, match="requires a credential"):
        await Bus.connect(stack.url, timeout=5)
    assert time.monotonic() - t0 < 1.5, "no credential is an error at once, not after the connect's retries"

    ids = stack.nats_server.iam
    ids.add_tenant("revokee")
    ids.save()
    iamserver.reload(ids)
    creds = str(ids.creds_path("tenant:revokee"))
    client = libdsec.AsyncClient(stack.url, creds=creds)
    await client.connect()
    try:
        assert await client.list() == []
        ids.revoke("tenant:revokee")
        ids.save()
        iamserver.reload(ids)
        deadline = time.monotonic() + 5
        while client.bus.connected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not client.bus.connected, "the server closed the revoked credential's connection"
        while not client.bus.refused and time.monotonic() < deadline + 5:   # its reconnect is refused
            await asyncio.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(libdsec.AuthenticationFailed, match="revoked or removed while connected"):
            await client.list()   # said at once, not as a 10 s "no answer"
        with pytest.raises(libdsec.AuthenticationFailed):
            await client.create(timeout=5)
        assert time.monotonic() - t0 < 2
    finally:
        await client.close()
        ids.remove_tenant("revokee")
        ids.save()
        iamserver.reload(ids)
    with pytest.raises(libdsec.AuthenticationFailed):
        await libdsec.AsyncClient(stack.url, creds=creds, connect_timeout=2).connect()


async def test_an_expired_credential_is_refused_by_the_server_and_its_connection_closed(stack):
    """A credential issued with a 3 s ttl: it works, then the server (swept by its ExpirySweeper) closes its
    connection and refuses it; the SDK says `expired` at once, and a raw connection that ignores the
    header is refused by the server itself."""
    ids = stack.nats_server.iam
    ids.add_tenant("expiree")
    path = str(ids.issue_tenant("expiree", ttl=3))
    ids.save()
    iamserver.reload(ids)
    try:
        assert "# Expires: " in Path(path).read_text()
        client = libdsec.AsyncClient(stack.url, creds=path)
        await client.connect()
        try:
            assert await client.list() == []
            deadline = time.monotonic() + 15
            while client.bus.connected and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not client.bus.connected, "the server closed the expired credential's connection"
            while not client.bus.refused and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            with pytest.raises(libdsec.AuthenticationFailed, match="expired at "):
                await client.list()
        finally:
            await client.close()
        with pytest.raises(libdsec.AuthenticationFailed, match=r"expiree.creds expired at \d{4}-"):
            await libdsec.AsyncClient(stack.url, creds=path, connect_timeout=2).connect()
        raw = Raw()   # a client that ignores the header: the server's own refusal
        with pytest.raises(Exception):
            await raw.connect(stack.url, path)
        assert any("authorization violation" in e for e in raw.errors), raw.errors
        assert not iam.Iam.load(ids.root).live("tenant:expiree")
        p = await asyncio.to_thread(run_dsec, "iam", "sweep", "--state-dir", str(ids.root))   # swept already
        assert p.returncode == 0 and "0 expired credential(s) taken out" in p.stdout, p.stderr
        p = await asyncio.to_thread(run_dsec, "iam", "ls", "--state-dir", str(ids.root))
        assert any(line.split()[:4] == ["expiree", "tenant", "default", "expired"] for line in p.stdout.splitlines()), \
            p.stdout
    finally:
        ids.remove_tenant("expiree")
        ids.save()
        iamserver.reload(ids)


async def test_a_flooding_tenant_is_rate_limited_while_another_creates(stack, alice):
    """10,000 control requests from mallory (past its rate of 200/s) while alice's 100 creates all succeed:
    the flooder gets RateLimited, the cluster keeps serving. Alice's latency is reported, not asserted."""
    async def creates() -> list[float]:
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            sbs = await asyncio.gather(*(alice.create() for _ in range(10)))
            times.append((time.perf_counter() - t0) * 1000)
            await asyncio.gather(*(s.destroy() for s in sbs))
        return times

    quiet = await creates()
    async with libdsec.AsyncClient(stack.url, creds=creds_of(stack, "tenant:mallory")) as flooder:
        async def flood() -> dict:
            outcomes: dict = {}
            for i in range(0, 10_000, 500):
                got = await asyncio.gather(*(flooder.quota() for _ in range(500)), return_exceptions=True)
                for g in got:
                    key = type(g).__name__
                    outcomes[key] = outcomes.get(key, 0) + 1
            return outcomes
        flooding = asyncio.ensure_future(flood())
        loud = await creates()
        outcomes = await flooding
    assert sum(outcomes.values()) == 10_000
    assert outcomes.get("RateLimited", 0) > 0, outcomes
    # the flooder's own requests may also time out (BusError) under its own flood; nothing else
    assert set(outcomes) <= {"RateLimited", "QuotaState", "BusError"}, outcomes
    assert outcomes.get("BusError", 0) < 500, outcomes
    print(f"\nalice's 10x10 creates: p50 {sorted(quiet)[5]:.0f} ms alone, {sorted(loud)[5]:.0f} ms under the flood; "
          f"mallory's 10,000: {outcomes}")


async def _quotas_seen(stack, *quotas) -> None:
    for q in quotas:
        await set_quota(stack.bus, q)
    for _ in range(100):   # the engine learns quotas from its watch
        if all(stack.placement.quotas.table.get(q.tenant) == q for q in quotas):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("placement never saw the quotas")


async def test_provisioning_again_on_a_store_that_holds_the_bounds_once(tmp_path):
    """A server whose store holds the streams' bounds but not the largest of them twice (its store sized by
    its disk): nats-server refuses a create of an existing stream, even as it is, and an update to the same
    bound (nats-server #3321), so a second provisioning, a restart's, failed. It goes through now, and
    changes what it should: a stream made before the bounds takes its bound at the next `dsec up`."""
    from bus.server import free_port, server_binary
    port = free_port()
    conf = tmp_path / "small.conf"
    conf.write_text(f"listen: 127.0.0.1:{port}\njetstream {{ store_dir: {tmp_path / 'js'}, max_file_store: 50GB }}\n")
    srv = subprocess.Popen([server_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        bus = await Bus.connect(f"nats://127.0.0.1:{port}", timeout=10)
        try:
            await bus.provision(streams.Retention())
            await bus.provision(streams.Retention())     # (before: insufficient storage resources available)
            await bus.provision(streams.Retention(trajectories_max_age=86400.0))
            cfg = (await bus.admin.stream_info(streams.TRAJ_STREAM)).config
            assert (cfg.max_age, cfg.max_bytes) == (86400.0, streams.Retention().trajectories_max_bytes)
            cfg.max_bytes = -1   # a stream made before it had a bound: `dsec up` (no retention given) bounds it
            await bus.admin.update_stream(cfg)
            await bus.provision()
            cfg = (await bus.admin.stream_info(streams.TRAJ_STREAM)).config
            assert (cfg.max_age, cfg.max_bytes) == (86400.0, streams.Retention().trajectories_max_bytes)
        finally:
            await bus.close()
    finally:
        srv.terminate()
        srv.wait(10)


async def test_a_tenant_cannot_fill_the_store_through_lanes_no_one_consumes(stack, alice, mallory):
    """A tenant's op lane names any node (dsec.node.*.exec.<tenant>.*): ops for a node that does not exist
    were stored, taken by no one, for an hour, with no bound on the stream. Mallory so filled the server's
    store for every tenant, at 250 MB/s (helper S). The lanes tenants publish into are bounded now, oldest
    dropped first; under a flood alice's sandbox still answers."""
    for name in (streams.REQ_STREAM, streams.NODE_STREAM, streams.CALL_STREAM):
        cfg = (await stack.bus.admin.stream_info(name)).config
        assert (cfg.max_bytes, cfg.discard) == (streams.LANE_MAX_BYTES, "old"), (name, cfg)
    ret = streams.Retention()   # and the limit streams tenants fill through their execs (helper S2)
    for name, bound in ((streams.OUT_STREAM, ret.output_max_bytes), (streams.EVT_STREAM, ret.events_max_bytes),
                        (streams.TRAJ_STREAM, ret.trajectories_max_bytes)):
        cfg = (await stack.bus.admin.stream_info(name)).config
        assert (cfg.max_bytes, cfg.discard) == (bound, "old") and 0 < bound < 32 << 30, (name, cfg)
    sb = await alice.create()
    cfg = (await stack.bus.admin.stream_info(streams.NODE_STREAM)).config
    cfg.max_bytes = 4 << 20   # a small bound, to flood past it quickly
    await stack.bus.admin.update_stream(cfg)
    try:
        payload = b"x" * (512 << 10)
        for i in range(40):     # 20 MiB, each stored (the stream's ack answers the request)
            ack = await mallory.nc.request(f"dsec.node.ghost{i % 3}.exec.mallory.junk{i}", payload, timeout=5)
            assert b'"seq"' in ack.data, ack.data
        state = (await stack.bus.admin.stream_info(streams.NODE_STREAM)).state
        assert state.bytes <= 4 << 20, state
        assert (await sb.exec("echo still")).stdout == b"still\n"
    finally:
        cfg.max_bytes = streams.LANE_MAX_BYTES
        await stack.bus.admin.update_stream(cfg)
        for i in range(3):
            await stack.bus.admin.purge_stream(streams.NODE_STREAM, subject=f"dsec.node.ghost{i}.>")
        await sb.destroy()


async def test_a_project_sees_its_own_its_tenant_sees_all_and_quotas_nest(stack, alice):
    """Projects alice/p1 and alice/p2: each its own account and credential; a project lists and reaches only
    its own sandboxes, alice's credential lists all of them; a project's creates count against its own
    quota and alice's."""
    ids = stack.nats_server.iam
    made: list = []
    try:
        c1_creds, c2_creds = str(ids.add_project("alice", "p1")), str(ids.add_project("alice", "p2"))
        ids.save()
        iamserver.reload(ids)
        async with libdsec.AsyncClient(stack.url, creds=c1_creds) as p1, \
                libdsec.AsyncClient(stack.url, creds=c2_creds) as p2:
            assert p1.tenant == "alice__p1" and p2.tenant == "alice__p2"
            # nested quotas: p1 at most 1, alice (with all its projects) at most 3
            await _quotas_seen(stack, Quota(tenant="alice__p1", max_sandboxes=1), Quota(tenant="alice", max_sandboxes=3))
            own = await alice.create()
            s1 = await p1.create()
            made += [own, s1]
            assert (await s1.exec("echo in-p1")).stdout == b"in-p1\n"
            assert await stack.bus.kv_get(streams.SANDBOXES_KV, f"alice.p1.{s1.id}") is not None   # under alice's keys

            # a project sees its own alone; a sibling and the tenant's own sandboxes do not exist for it
            assert [r.sandbox_id for r in await p1.list()] == [s1.id]
            assert await p2.list() == []
            for client, sid in ((p2, s1.id), (p1, own.id)):
                with pytest.raises(libdsec.SandboxNotFound):
                    await client.get(sid)
            forged = libdsec.AsyncSandbox(p2, s1.id, s1.node)   # a handle made up by the sibling
            with pytest.raises(libdsec.SandboxNotFound):
                await forged.exec("echo stolen", timeout=10)

            # the tenant's credential sees every project's sandboxes, and acts only on its own
            seen = {r.sandbox_id: r.tenant for r in await alice.list()}
            assert seen[s1.id] == "alice__p1" and seen[own.id] == "alice", seen
            with pytest.raises(libdsec.PermissionDenied, match="project alice/p1"):
                await alice.get(s1.id)
            rm = await asyncio.to_thread(subprocess.run, [DSEC, "rm", "--nats", stack.url, s1.id], capture_output=True,
                                         text=True, env={**os.environ, "DSEC_CREDS": creds_of(stack, "tenant:alice")})
            assert rm.returncode != 0 and "project alice/p1's" in rm.stderr and "operator" not in rm.stderr, rm.stderr
            assert (await alice.quota()).sandboxes == len(seen)
            ls = await asyncio.to_thread(subprocess.run, [DSEC, "quota", "ls", "--nats", stack.url],
                                         capture_output=True, text=True)   # what each holds, a project by its name
            rows = {line.split()[0]: line.split()[-1] for line in ls.stdout.splitlines()[1:]}
            assert (rows.get("alice/p1"), rows.get("alice")) == ("1", "2"), ls.stdout + ls.stderr

            live = len(await alice.list())
            assert live == 2, "only this test's sandboxes of alice are running"
            with pytest.raises(libdsec.QuotaExceeded, match="project alice/p1: at most 1 concurrent"):
                await p1.create(timeout=10)
            s2 = await p2.create()   # alice holds 3 now: own, p1's, p2's
            made.append(s2)
            with pytest.raises(libdsec.QuotaExceeded, match="tenant alice: at most 3 concurrent"):
                await p2.create(timeout=10)
            with pytest.raises(libdsec.QuotaExceeded, match="tenant alice: at most 3 concurrent"):
                await alice.create(timeout=10)
            await s2.destroy()
            made.remove(s2)
            made.append(await alice.create(timeout=10))   # p2's ended sandbox no longer counts against alice
            for sb in made:
                await sb.destroy()
            made.clear()
    finally:
        for sb in made:
            try:
                await sb.destroy()
            except libdsec.DsecError:
                pass
        for tenant in ("alice", "alice__p1"):
            await stack.bus.kv_delete(streams.QUOTAS_KV, tenant)
        for account in ids.projects("alice"):
            ids.remove_tenant(account)
        ids.save()
        iamserver.reload(ids)


async def test_a_projects_requests_take_from_its_tenants_rate(stack):
    """The control API's rate step: a project's own rate, and its tenant's, which its siblings share."""
    from placement.api import Call, ControlApi
    api = ControlApi(stack.bus, images=None, quotas=stack.placement.quotas)
    table = stack.placement.quotas.table
    saved = {k: table.get(k) for k in ("rt", "rt__a", "rt__b")}
    table.update({"rt": Quota(tenant="rt", rate=2.0), "rt__a": Quota(tenant="rt__a", rate=100.0)})
    table.pop("rt__b", None)

    async def nxt(call):
        return "passed"
    try:
        calls = [Call(subject="dsec.api.rt__a.quota", data=b"", tenant="rt__a") for _ in range(4)]
        assert [await api._limit(c, nxt) for c in calls] == ["passed"] * 4   # rt's burst: twice its rate
        for account in ("rt__a", "rt__b", "rt"):
            with pytest.raises(libdsec.RateLimited, match="tenant rt passed its rate of 2 "):
                await api._limit(Call(subject=f"dsec.api.{account}.quota", data=b"", tenant=account), nxt)
        table["rt"] = Quota(tenant="rt", rate=1000.0)
        table["rt__a"] = Quota(tenant="rt__a", rate=1.0)
        api._buckets.clear()
        assert await api._limit(Call(subject="", data=b"", tenant="rt__a"), nxt) == "passed"
        assert await api._limit(Call(subject="", data=b"", tenant="rt__a"), nxt) == "passed"
        with pytest.raises(libdsec.RateLimited, match="project rt/a passed its rate of 1 "):
            await api._limit(Call(subject="", data=b"", tenant="rt__a"), nxt)
        assert await api._limit(Call(subject="", data=b"", tenant="rt__b"), nxt) == "passed"
    finally:
        for k, v in saved.items():
            if v is None:
                table.pop(k, None)
            else:
                table[k] = v


async def test_a_tenants_rate_is_shared_by_the_engines_alive(stack):
    """Each engine admits rate / (engines heard from lately): a second engine's figures halve the share, its
    silence gives it back."""
    from placement.api import DEFAULT_RATE
    api = stack.placement.api

    async def engines_become(n: int) -> None:
        for _ in range(100):
            if api.engines() == n:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"engines {api.engines()}, not {n}")
    try:
        await engines_become(1)
        assert api._rate_of("nobody-special") == DEFAULT_RATE
        await stack.bus.kv_put(streams.ENGINES_KV, "ghost", EngineStats(engine="ghost", at=time.time()))
        await engines_become(2)
        assert api._rate_of("nobody-special") == DEFAULT_RATE / 2
        await stack.bus.kv_put(streams.ENGINES_KV, "ghost", EngineStats(engine="ghost", at=time.time() - 60))
        await engines_become(1)
    finally:
        await stack.bus.kv_delete(streams.ENGINES_KV, "ghost")


def test_tenant_and_project_names_cannot_collide():
    for bad in ("a__b", "a_", "_a", "A", "a.b", "", "x" * 64):
        with pytest.raises(libdsec.InvalidRequest):
            iam.check_name(bad)
    assert iam.check_name("a_b-c") == "a_b-c"
    assert subjects.account_name("acme/p1") == "acme__p1" and subjects.tenant_root("acme__p1") == "acme"
    assert subjects.record_key("acme__p1", "sb-1") == "acme.p1.sb-1" and subjects.record_key("acme", "sb-1") == "acme.sb-1"
    assert subjects.sees("acme", "acme__p1") and not subjects.sees("acme__p1", "acme")
    assert not subjects.sees("acme__p1", "acme__p2") and not subjects.sees("acm", "acme__p1")
    assert iam.principal_name("project:acme/p1") == "tenant:acme__p1"


def run_dsec(*args: str, creds: str | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", **({"DSEC_CREDS": creds} if creds else {})}
    return subprocess.run([DSEC, *args], capture_output=True, text=True, timeout=60, env=env)


async def test_an_exec_running_when_its_credential_is_revoked_ends_with_authentication_failed(stack):
    """helper-40: an exec in flight when its tenant's credential was revoked waited out its timeout plus 15 s
    (46 s), then said "no exit record ... node unavailable", though the node was fine: the client was refused."""
    ids = stack.nats_server.iam
    ids.add_tenant("revokedmid")
    ids.save()
    iamserver.reload(ids)
    client = libdsec.AsyncClient(stack.url, creds=str(ids.creds_path("tenant:revokedmid")))
    await client.connect()
    try:
        sb = await client.create()
        handle = await sb.exec("echo a; sleep 8; echo b", timeout=30, background=True)
        first = await handle.stream().__anext__()
        assert first.data == b"a\n"
        ids.revoke("tenant:revokedmid")
        ids.save()
        iamserver.reload(ids)
        t0 = time.monotonic()
        with pytest.raises(libdsec.AuthenticationFailed, match="revoked or removed while connected"):
            await handle.wait()
        assert time.monotonic() - t0 < 12, time.monotonic() - t0   # (within the quiet checks' 8 s, not 46 s)
    finally:
        await client.close()
        ids.issue_tenant("revokedmid")   # a fresh credential, to end its sandbox
        ids.save()
        iamserver.reload(ids)
        async with libdsec.AsyncClient(stack.url, creds=str(ids.creds_path("tenant:revokedmid"))) as again:
            for rec in await again.list():
                await (await again.get(rec.sandbox_id)).destroy()
        ids.remove_tenant("revokedmid")
        ids.save()
        iamserver.reload(ids)


async def test_an_operator_reaches_a_revoked_tenants_sandboxes_and_another_tenants_credential_is_refused(stack):
    """helper-40: a tenant whose credential was revoked left its sandboxes running to their TTL, beyond anyone's
    reach: admin's `dsec ls` and `dsec rm` act as the credential's own principal and found none. And a tenant's
    credential naming another tenant (--tenant, tenant=) waited out a create's 60 s, or blamed placement."""
    ids = stack.nats_server.iam
    ids.add_tenant("revokedops")
    ids.save()
    iamserver.reload(ids)
    admin, url = creds_of(stack, "admin"), stack.url
    try:
        async with libdsec.AsyncClient(url, creds=str(ids.creds_path("tenant:revokedops"))) as c:
            sb = await c.create()
        ids.revoke("tenant:revokedops")
        ids.save()
        iamserver.reload(ids)
        p = await asyncio.to_thread(run_dsec, "ls", "--nats", url, creds=admin)   # (admin's own: none)
        assert p.returncode == 0 and sb.id not in p.stdout, (p.stdout, p.stderr)
        p = await asyncio.to_thread(run_dsec, "ls", "--nats", url, "--tenant", "revokedops", creds=admin)
        assert p.returncode == 0 and f"{sb.id}   ready" in p.stdout, (p.stdout, p.stderr)
        p = await asyncio.to_thread(run_dsec, "exec", "--nats", url, "--tenant", "revokedops", sb.id, "--", "echo",
                                    "reached", creds=admin)
        assert (p.returncode, p.stdout) == (0, "reached\n"), p.stderr
        p = await asyncio.to_thread(run_dsec, "rm", "--nats", url, "--tenant", "revokedops", sb.id, creds=admin)
        assert p.returncode == 0, p.stderr
        rec = await stack.bus.kv_get(streams.SANDBOXES_KV, subjects.record_key("revokedops", sb.id))
        assert b'"destroyed"' in rec
        t0 = time.monotonic()   # another tenant's credential: refused before anything is sent
        p = await asyncio.to_thread(run_dsec, "create", "--nats", url, "--tenant", "revokedops",
                                    creds=creds_of(stack, "tenant:alice"))
        assert p.returncode == 1 and "is tenant alice's: it acts on no other tenant's sandboxes" in p.stderr, p.stderr
        assert time.monotonic() - t0 < 10, time.monotonic() - t0
        with pytest.raises(libdsec.PermissionDenied, match="asked for revokedops"):
            libdsec.AsyncClient(url, tenant="revokedops", creds=creds_of(stack, "tenant:alice"))
    finally:
        async with libdsec.AsyncClient(url, tenant="revokedops", creds=admin) as op:
            for rec in await op.list():
                await (await op.get(rec.sandbox_id)).destroy()
        ids.remove_tenant("revokedops")
        ids.save()
        iamserver.reload(ids)


async def test_dsec_iam_adds_limits_refuses_removal_with_live_sandboxes_and_revokes(stack, tmp_path):
    state = str(stack.nats_server.iam.root)
    url = stack.url
    try:
        p = await asyncio.to_thread(run_dsec, "iam", "tenant", "add", "cli-t", "--state-dir", state)
        assert p.returncode == 0 and "server reloaded" in p.stdout, p.stderr
        creds = str(Path(state) / "creds" / "tenants" / "cli-t.creds")
        p = await asyncio.to_thread(run_dsec, "run", "--nats", url, "--", "echo", "as-cli-t", creds=creds)
        assert p.returncode == 0 and p.stdout == "as-cli-t\n", p.stderr
        p = await asyncio.to_thread(run_dsec, "iam", "set", "cli-t", "--rate", "7", "--sandboxes", "3",
                                    "--state-dir", state, "--nats", url, creds=str(Path(state) / "creds" / "admin.creds"))
        assert p.returncode == 0 and "sandboxes=3" in p.stdout and "rate=7" in p.stdout, p.stderr
        p = await asyncio.to_thread(run_dsec, "iam", "project", "add", "cli-t/p1", "--state-dir", state)
        assert p.returncode == 0 and "server reloaded" in p.stdout, p.stderr
        pcreds = str(Path(state) / "creds" / "tenants" / "cli-t__p1.creds")
        p = await asyncio.to_thread(run_dsec, "iam", "set", "cli-t/p1", "--sandboxes", "1", "--state-dir", state,
                                    "--nats", url, creds=str(Path(state) / "creds" / "admin.creds"))
        assert p.returncode == 0 and "limits of cli-t/p1: sandboxes=1" in p.stdout, p.stderr
        p = await asyncio.to_thread(run_dsec, "iam", "ls", "--state-dir", state)
        rows = [line.split()[:3] for line in p.stdout.splitlines()]
        assert ["cli-t", "tenant", "7.0"] in rows and ["cli-t/p1", "project", "default"] in rows, p.stdout
        kept = tmp_path / "kept.creds"   # a copy the holder kept: refused once the tenant is gone
        kept.write_text(Path(creds).read_text())
        async with libdsec.AsyncClient(url, creds=creds) as c, libdsec.AsyncClient(url, creds=pcreds) as pc:
            sb, psb = await c.create(), await pc.create()
            await c.set_warm_pool("cli-t-pool", min=0, max=0)
            p = await asyncio.to_thread(run_dsec, "ls", "--nats", url, creds=pcreds)   # the project's own alone
            assert p.returncode == 0 and psb.id in p.stdout and sb.id not in p.stdout, (p.stdout, p.stderr)
            p = await asyncio.to_thread(run_dsec, "iam", "tenant", "rm", "cli-t", "--state-dir", state, "--nats", url)
            assert p.returncode == 1 and p.stderr.startswith("dsec: error: project cli-t/p1 has 1 live sandbox") \
                and "--force" in p.stderr, p.stderr
            assert (await sb.exec("echo still-here")).stdout == b"still-here\n"
            assert (await psb.exec("echo p-still-here")).stdout == b"p-still-here\n"
            p = await asyncio.to_thread(run_dsec, "iam", "tenant", "rm", "cli-t", "--force", "--state-dir", state,
                                        "--nats", url)
            assert p.returncode == 0 and "removed" in p.stdout, p.stderr
            for account, sid in (("cli-t", sb.id), ("cli-t__p1", psb.id)):
                rec = await stack.bus.kv_get(streams.SANDBOXES_KV, subjects.record_key(account, sid))
                assert b'"destroyed"' in rec   # destroyed first, then the accounts went
            assert not Path(pcreds).exists() and "cli-t__p1" not in iam.Iam.load(Path(state)).tenants
            assert await stack.bus.kv_get(streams.WARM_POOLS_KV, "cli-t.cli-t-pool") is None   # (it kept its name: T2)
        p = await asyncio.to_thread(run_dsec, "ls", "--nats", url, creds=str(kept))
        assert p.returncode == 1 and "AuthenticationFailed" not in p.stderr and "refused the credential" in p.stderr, \
            p.stderr
    finally:
        stack.nats_server.iam = iam.Iam.load(Path(state))   # what the commands wrote
        for account in ("cli-t", "cli-t__p1"):
            await stack.bus.kv_delete(streams.QUOTAS_KV, account)


async def test_dsec_iam_clears_an_expired_or_revoked_project_and_refuses_bad_names_in_a_line(stack):
    """`project rm --force` destroyed a project's sandboxes with the project's own credential: once that had
    expired, the removal failed ("credential ... expired"), and the sandbox ran on, holding quota, until its
    TTL (helper S); a revoked project's were not even looked at, and the project went with them running. A
    platform admin acts for it now. A bad tenant name printed a traceback; it is one line."""
    state = str(stack.nats_server.iam.root)
    url, admin = stack.url, str(Path(state) / "creds" / "admin.creds")
    try:
        p = await asyncio.to_thread(run_dsec, "iam", "tenant", "add", "cli-x", "--state-dir", state)
        assert p.returncode == 0, p.stderr
        sids = {}
        for name, ttl in (("old", ["--ttl", "4s"]), ("gone", [])):
            p = await asyncio.to_thread(run_dsec, "iam", "project", "add", f"cli-x/{name}", *ttl, "--state-dir", state)
            assert p.returncode == 0, p.stderr
            async with libdsec.AsyncClient(url, creds=str(Path(state) / "creds" / "tenants" / f"cli-x__{name}.creds")) as c:
                sids[name] = (await c.create(ttl=600)).id
        p = await asyncio.to_thread(run_dsec, "iam", "creds", "revoke", "project:cli-x/gone", "--state-dir", state)
        assert p.returncode == 0, p.stderr
        await asyncio.sleep(5)    # old's credential has expired
        for name in ("old", "gone"):
            p = await asyncio.to_thread(run_dsec, "iam", "project", "rm", f"cli-x/{name}", "--state-dir", state,
                                        "--nats", url)
            assert p.returncode == 1 and "1 live sandbox" in p.stderr, (name, p.stderr)
            if name == "gone":   # (its revocation stands: nothing was issued to it on the way)
                assert not (Path(state) / "creds" / "tenants" / "cli-x__gone.creds").exists()
                assert not iam.Iam.load(Path(state)).tenants["cli-x__gone"].users
            p = await asyncio.to_thread(run_dsec, "iam", "project", "rm", f"cli-x/{name}", "--force", "--state-dir",
                                        state, "--nats", url, creds=admin)
            assert p.returncode == 0 and "removed" in p.stdout, (name, p.stderr)
            rec = await stack.bus.kv_get(streams.SANDBOXES_KV, subjects.record_key(f"cli-x__{name}", sids[name]))
            assert b'"destroyed"' in rec, (name, rec)
        for bad in ("a.b", "a*", "a>", "a__b", ""):
            p = await asyncio.to_thread(run_dsec, "iam", "tenant", "add", bad, "--state-dir", state)
            assert p.returncode == 1 and p.stderr.startswith("dsec: error: ") and "Traceback" not in p.stderr \
                and len(p.stderr.splitlines()) == 1, (bad, p.stderr)
        p = await asyncio.to_thread(run_dsec, "iam", "tenant", "rm", "cli-x", "--state-dir", state, "--nats", url)
        assert p.returncode == 0, p.stderr
    finally:
        stack.nats_server.iam = iam.Iam.load(Path(state))

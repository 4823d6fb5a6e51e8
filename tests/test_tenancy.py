"""The tenant tokens on the subjects (docs/streams.md, "Renamed subjects"): a sandbox's output goes to its own
tenant's and node's subject, and a node serves an op or a control only for the tenant whose sandbox it
is. Here tenant B addresses tenant A's sandbox through its own tenant's subjects, as its SDK would. (With
credentials, the NATS server also refuses B's use of A's subjects; that is the auth layer's test.)"""
from __future__ import annotations

import asyncio
import dataclasses
import collections
import time

import pytest

import libdsec
from bus import subjects
from bus.messages import ErrorReply, op_reply_decoder
from bus.execwire import ExecSignal
from libdsec.sandbox import AsyncSandbox


@pytest.fixture
async def other(stack):
    async with libdsec.AsyncClient(stack.url, tenant="tenant-b") as c:
        yield c


async def test_another_tenant_cannot_touch_a_sandbox_even_knowing_its_id_and_node(stack, client, other):
    async with await client.create() as sb:
        await sb.write_file("/root/mine", b"a's data")
        theirs = AsyncSandbox(other, sb.id, sb.node, sb.backend)   # B knows A's id and node
        attempts = {
            "exec": lambda: theirs.exec("echo pwned > /root/mine", timeout=10),
            "read_file": lambda: theirs.read_file("/root/mine"),
            "write_file": lambda: theirs.write_file("/root/mine", b"forged"),
            "snapshot": lambda: theirs.snapshot(tag="stolen"),
            "suspend": lambda: theirs.suspend(),
            "destroy": lambda: theirs.destroy(),
        }
        outcomes = {}
        for what, attempt in attempts.items():
            try:
                outcomes[what] = f"returned {await attempt()!r}"
            except libdsec.DsecError as exc:
                outcomes[what] = f"{type(exc).__name__}: {exc.details.get('reason', '')}"
        assert outcomes == {what: "SandboxNotFound: never_existed" for what in attempts}, outcomes
        assert await sb.read_file("/root/mine") == b"a's data"        # untouched, and still running
        assert (await sb.exec("echo alive")).stdout == b"alive\n"
        assert await other.snapshots(tag="stolen") == [] and await client.snapshots(tag="stolen") == []


async def test_output_goes_to_its_tenants_and_nodes_subject_only(stack, client, other):
    seen_a: list[str] = []
    seen_b: list[str] = []

    async def on_a(_data, subject):
        seen_a.append(subject)

    async def on_b(_data, subject):
        seen_b.append(subject)
    subs = [await stack.bus.subscribe(f"dsec.out.{client.tenant}.>", on_a),
            await stack.bus.subscribe(f"dsec.out.{other.tenant}.>", on_b)]
    try:
        async with await client.create() as sb:
            r = await sb.exec("echo to-a")
            assert r.stdout == b"to-a\n"
            await stack.bus.flush()
        want = subjects.output(client.tenant, sb.node, sb.id, r.exec_id)
        assert want in seen_a and set(seen_a) == {want}, seen_a
        assert seen_b == []
    finally:
        for s in subs:
            await s.unsubscribe()


async def test_a_running_exec_takes_controls_only_on_its_tenants_subject(stack, client, other):
    async with await client.create() as sb:
        h = await sb.exec("sleep 30", background=True)
        try:
            forged = subjects.exec_input(sb.node, other.tenant, sb.id, h.id)
            for _ in range(50):
                data = await stack.bus.request(forged, ExecSignal(exec_id=h.id, signal=9), 5)
                reply = op_reply_decoder.decode(data)
                assert isinstance(reply, ErrorReply) and reply.code == "exec_not_running", reply
                own = await stack.bus.request(subjects.exec_input(sb.node, client.tenant, sb.id, h.id),
                                              ExecSignal(exec_id=h.id, signal=0 + 18), 5)   # SIGCONT: harmless
                if not isinstance(op_reply_decoder.decode(own), ErrorReply):
                    break
                await asyncio.sleep(0.1)   # not started yet
            else:
                raise AssertionError("the exec never took a control on its own subject")
            assert not h.done
        finally:
            await h.kill()


async def test_a_create_is_the_tenant_of_its_subject_whatever_its_payload_says(stack, client, other):
    """A create sent on tenant B's subject naming tenant A in its payload makes B's sandbox, never A's
    (the tenant is learnt from the subject, which the server's permissions scope on)."""
    from bus.messages import CreateRequest, Resources, create_reply_decoder, encode
    from libdsec.ids import new_id
    sid = new_id("sb")
    replies: asyncio.Queue = asyncio.Queue()
    inbox = stack.bus.inbox() + ".forged"
    sub = await stack.bus.subscribe(inbox, lambda data, _s: replies.put(data))
    try:
        req = CreateRequest(request_id=new_id("r"), sandbox_id=sid, tenant=client.tenant, image="busybox",
                            resources=Resources(cpu=0.1, memory=64 << 20), ttl=60, deadline=time.time() + 30,
                            sent_at=time.time(), reply_to=inbox)
        await stack.bus.publish(subjects.create_request(other.tenant), encode(req), msg_id=req.request_id)
        reply = create_reply_decoder.decode(await asyncio.wait_for(replies.get(), 30))
        assert type(reply).__name__ == "SandboxReady", reply
        assert sid in [r.sandbox_id for r in await other.list()]
        assert sid not in [r.sandbox_id for r in await client.list(all_states=True)]
        await (await other.get(sid)).destroy()
    finally:
        await sub.unsubscribe()


async def test_an_op_whose_subject_names_no_tenant_is_refused_not_served_as_the_owner(stack, client):
    """The lane's subject of before the tenant token (dsec.node.<node>.exec.<sandbox>), or one with a token
    that is no tenant name, is never served on the payload's word."""
    from bus.messages import DestroyRequest, ErrorReply, encode, op_reply_decoder
    from libdsec.ids import new_id
    async with await client.create() as sb:
        for subject in (f"dsec.node.{sb.node}.exec.{sb.id}", f"dsec.node.{sb.node}.exec.{client.tenant}.{sb.id}.x",
                        f"dsec.node.{sb.node}.exec.a+b.{sb.id}"):
            replies: asyncio.Queue = asyncio.Queue()
            inbox = stack.bus.inbox()
            sub = await stack.bus.subscribe(inbox, lambda data, _s: replies.put(data))
            try:
                rid = new_id("o")
                await stack.bus.publish(subject, encode(DestroyRequest(request_id=rid, sandbox_id=sb.id, reply_to=inbox,
                                                                       deadline=time.time() + 10)), msg_id=rid)
                reply = op_reply_decoder.decode(await asyncio.wait_for(replies.get(), 10))
                assert isinstance(reply, ErrorReply) and reply.code == "invalid_request", (subject, reply)
            finally:
                await sub.unsubscribe()
        assert (await sb.exec("echo alive")).stdout == b"alive\n"


async def test_a_create_whose_subject_names_no_tenant_is_refused(stack, client):
    from bus.messages import CreateRequest, ErrorReply, Resources, create_reply_decoder, encode
    from libdsec.ids import new_id
    replies: asyncio.Queue = asyncio.Queue()
    inbox = stack.bus.inbox()
    sub = await stack.bus.subscribe(inbox, lambda data, _s: replies.put(data))
    try:
        sid = new_id("sb")
        req = CreateRequest(request_id=new_id("r"), sandbox_id=sid, tenant=client.tenant, image="busybox",
                            resources=Resources(cpu=0.1, memory=64 << 20), ttl=60, deadline=time.time() + 30,
                            sent_at=time.time(), reply_to=inbox)
        await stack.bus.publish("dsec.req.create.latency.a+b", encode(req), msg_id=req.request_id)
        reply = create_reply_decoder.decode(await asyncio.wait_for(replies.get(), 10))
        assert isinstance(reply, ErrorReply) and reply.code == "invalid_request", reply
        assert sid not in [r.sandbox_id for r in await client.list(all_states=True)]
    finally:
        await sub.unsubscribe()


async def test_how_a_sandbox_ended_is_told_only_to_its_tenant(stack, client, other):
    sb = await client.create()
    await sb.destroy()
    with pytest.raises(libdsec.SandboxNotFound) as own:
        await sb.exec("true", timeout=5)
    assert own.value.reason == "destroyed"
    for attempt in (lambda t: t.exec("true", timeout=5), lambda t: t.read_file("/etc/hostname")):
        with pytest.raises(libdsec.SandboxNotFound) as theirs:
            await attempt(AsyncSandbox(other, sb.id, sb.node, sb.backend))
        assert theirs.value.reason == "never_existed", theirs.value


async def test_a_tenants_warm_sandboxes_are_claimed_only_by_its_own_creates(stack, client, other):
    from tests.test_warm_pools import wait_for, warm_pool
    async with warm_pool(stack, client, "owned", min=1, max=1) as pools:
        await wait_for(lambda: pools.ready() == 1, what="pool filled")
        hits = pools.hits
        async with await other.create():
            assert pools.hits == hits and pools.ready() == 1, "another tenant's create took the pool's sandbox"
        async with await client.create():
            assert pools.hits == hits + 1


async def test_replies_go_to_the_tenants_own_reply_space_and_never_into_anothers(stack, client, other):
    """The SDK's replies come on dsec.reply.<tenant>.>; a request that names another tenant's reply subject is
    terminated unanswered (a tenant cannot make the platform publish into another's answers)."""
    from bus.messages import CreateRequest, Resources, encode
    from libdsec.ids import new_id
    assert client._replies.prefix.startswith(f"dsec.reply.{client.tenant}.")
    seen: list[str] = []

    async def on_reply(_data, subject):
        seen.append(subject)
    sub = await stack.bus.subscribe(f"dsec.reply.{client.tenant}.>", on_reply)
    try:
        sb = await client.create()        # its own replies arrive in its own space
        await sb.destroy()
        assert seen, "no reply came on the tenant's own reply subjects"
        seen.clear()
        sid = new_id("sb")
        req = CreateRequest(request_id=new_id("r"), sandbox_id=sid, tenant=other.tenant, image="busybox",
                            resources=Resources(cpu=0.1, memory=64 << 20), ttl=60, deadline=time.time() + 30,
                            sent_at=time.time(), reply_to=f"dsec.reply.{client.tenant}.forged.x")
        terminated = stack.placement.outcomes[("CreateRequest", "term")]
        await stack.bus.publish(subjects.create_request(other.tenant), encode(req), msg_id=req.request_id)
        for _ in range(100):   # placement terminates it (within milliseconds)
            if stack.placement.outcomes[("CreateRequest", "term")] > terminated:
                break
            await asyncio.sleep(0.05)
        assert stack.placement.outcomes[("CreateRequest", "term")] == terminated + 1
        await asyncio.sleep(0.5)
        assert sid not in [r.sandbox_id for r in await other.list(all_states=True)]
        await stack.bus.flush()
        assert seen == []
    finally:
        await sub.unsubscribe()


async def test_a_bad_message_of_one_tenant_is_never_answered_into_anothers_reply_space(stack, client, other):
    """An undecodable op or create was answered (`invalid_request`) on the reply subject it named before the
    lane looked at whose that was: tenant B so published error replies with request ids of its choosing into
    tenant A's reply space, on B's own op and create lanes (helper S). They are terminated unanswered now;
    B's own bad message is still answered."""
    seen: list[bytes] = []

    async def on_reply(data, _subject):
        seen.append(data)
    answers: asyncio.Queue = asyncio.Queue()
    async with await client.create() as victim:
        sub = await stack.bus.subscribe(f"dsec.reply.{client.tenant}.>", on_reply)
        own = await stack.bus.subscribe(f"dsec.reply.{other.tenant}.own.>", lambda data, _s: answers.put(data))
        try:
            lane = subjects.node_ops(victim.node, other.tenant, victim.id)
            forged = b'{"kind":"nonsense","request_id":"FORGED","reply_to":"dsec.reply.%s.victim.r1"}' % (
                client.tenant.encode())
            await stack.bus.publish(lane, forged, msg_id="f1")
            await stack.bus.publish(subjects.create_request(other.tenant), forged.replace(b"r1", b"r2"), msg_id="f2")
            bad = b'{"kind":"nonsense","request_id":"OWN","reply_to":"dsec.reply.%s.own.r3"}' % other.tenant.encode()
            await stack.bus.publish(lane, bad, msg_id="f3")
            answer = op_reply_decoder.decode(await asyncio.wait_for(answers.get(), 10))
            assert isinstance(answer, ErrorReply) and answer.request_id == "OWN" and answer.code == "invalid_request"
            await asyncio.sleep(1)
            await stack.bus.flush()
            assert seen == [], seen
        finally:
            await sub.unsubscribe()
            await own.unsubscribe()


async def test_one_tenants_file_ops_take_at_most_its_turns_and_anothers_are_served_meanwhile(stack, client, other,
                                                                                          monkeypatch):
    """Tenant A keeps 12 listings of a 10,000-entry directory in flight (each page walks it again). Every one
    ran in the edge's few threads at once, FIFO with everyone's: at 128 in flight another tenant's 5 ms read
    took 10 s, then timed out (helper F2). Now A runs at most PER_TENANT["files"] of them at a time (B's read and
    snapshot are served beside them), and past its share of the lane's backlog it is RateLimited."""
    from edge import ops
    registry = stack.edge.backend
    real, running, peak = registry.file_op, {}, {}

    async def counted(sandbox_id, op, who):
        running[sandbox_id] = running.get(sandbox_id, 0) + 1
        peak[sandbox_id] = max(peak.get(sandbox_id, 0), running[sandbox_id])
        try:
            return await real(sandbox_id, op, who)
        finally:
            running[sandbox_id] -= 1
    monkeypatch.setattr(registry, "file_op", counted)
    async with await client.create() as a, await other.create() as b:
        assert (await a.exec("mkdir /tmp/d && cd /tmp/d && seq 10000 | xargs touch", timeout=60)).exit_code == 0
        listings = [asyncio.ensure_future(a.files.list("/tmp/d")) for _ in range(12)]
        await asyncio.sleep(0.2)
        assert (await b.read_file("/etc/passwd")).startswith(b"root:")
        snap = await b.snapshot(tag="meanwhile")
        assert [len(x) for x in await asyncio.gather(*listings)] == [10000] * 12
        await other.delete_snapshot(snap)
        assert peak[a.id] <= ops.PER_TENANT["files"], peak
        # past its share of the lane's backlog, A is told to slow down (its waiting ops held the lane's credit: at
        # 256, no other tenant's op was even pulled)
        monkeypatch.setattr(ops, "OP_BACKLOG", 8)
        monkeypatch.setattr(ops, "SHARE_MIN", 4)
        got = await asyncio.gather(*(a.files.list("/tmp/d") for _ in range(12)), return_exceptions=True)
        assert any(isinstance(g, libdsec.RateLimited) for g in got), got
        assert all(isinstance(g, libdsec.RateLimited) or len(g) == 10000 for g in got), got


async def test_one_tenants_long_execs_leave_the_nodes_other_exec_slots_to_others(stack, client, other):
    """Helper A2: tenant A's 256 long execs held every exec slot of the node (the lane's credit), and B's
    `exec true` waited 93 s, then failed as expired (an InvalidRequest); A's 1,024 background ones made every
    other tenant's background exec fail. Now one tenant runs at most TENANT_SHARE of each: past it, its exec
    is RateLimited at once, and B's run."""
    from chronus.execs import TENANT_SHARE
    most = stack.edge.ops.max_execs
    share = int(most * TENANT_SHARE)
    async with await client.create(resources=libdsec.Resources(pids=2048, memory="1Gi")) as a, \
            await other.create() as b:
        held = [asyncio.ensure_future(a.exec(["sleep", "60"], timeout=90)) for _ in range(most)]
        for _ in range(300):   # every slot is taken: A's share runs, the rest of A's are refused
            await asyncio.sleep(0.05)
            refused = [t for t in held if t.done()]
            if len(refused) >= most - share:
                break
        assert len(refused) == most - share, len(refused)
        assert all(isinstance(t.exception(), libdsec.RateLimited) for t in refused), [t.exception() for t in refused]
        assert "the most one tenant may" in str(refused[0].exception())
        t0 = time.monotonic()
        assert (await b.exec("echo served", timeout=10)).stdout == b"served\n"
        assert time.monotonic() - t0 < 3
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)


async def test_one_tenants_flood_of_ops_leaves_another_tenants_ops_their_turn(stack, client, other, monkeypatch):
    """Helper A4: the node's op lane took ops first come, first served, 256 at a time: tenant B's 1,500
    parallel suspend/resume/set_timeout loops put A's exec at 0.9 s, 12,000 of them at 22 s. Here 300 of B's
    set_timeouts are held in the node (each as if its sandbox were slow): A's set_timeout and exec are served
    meanwhile, in A's own turn; B's run at most PER_TENANT["ops"] at a time, and past its share of the lane's
    backlog B is told to slow down at once; its destroy is still served (in a turn of its own, never refused).
    Every one of B's ends, none lost."""
    from edge import ops
    box, real = stack.edge.box, stack.edge.box.set_timeout
    release, running, peak = asyncio.Event(), [0], [0]

    async def slow(sandbox_id, seconds):
        if sandbox_id == b.id:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            try:
                await release.wait()
            finally:
                running[0] -= 1
        return await real(sandbox_id, seconds)
    monkeypatch.setattr(box, "set_timeout", slow)
    monkeypatch.setattr(ops, "OP_BACKLOG", 200)
    async with await client.create() as a, await other.create() as b, await other.create() as b2:
        flood = [asyncio.ensure_future(b.set_timeout(600, timeout=60)) for _ in range(300)]
        for _ in range(200):   # B's past its share (200 alone) are refused at once
            await asyncio.sleep(0.05)
            if sum(t.done() for t in flood) >= 100 and running[0] == ops.PER_TENANT["ops"]:
                break
        t0 = time.monotonic()
        await a.set_timeout(600, timeout=30)
        assert (await a.exec("echo served", timeout=30)).stdout == b"served\n"
        served = time.monotonic() - t0
        refused = [t for t in flood if t.done()]
        await b2.destroy(timeout=30)   # B is past its share, and its 64 turns are held
        assert (await other._record(b2.id)).state == "destroyed"
        release.set()
        got = await asyncio.gather(*flood, return_exceptions=True)
    assert served < 2, f"A waited {served:.1f} s behind B's held ops"
    assert peak[0] == ops.PER_TENANT["ops"], peak
    assert all(isinstance(t.exception(), libdsec.RateLimited) for t in refused), [t.exception() for t in refused]
    assert len(refused) >= 100 and "its share of the node's op lane (" in str(refused[0].exception())
    assert sum(g is None for g in got) == 300 - len(refused), collections.Counter(type(g).__name__ for g in got)


async def test_the_nodes_exec_slots_hold_however_many_tenants_share_them(stack, client, other, monkeypatch):
    """The lane now holds more deliveries than the node's exec slots (other ops wait their turns there):
    execs still run at most max_execs at once, whoever's they are; the rest wait for a slot, then run."""
    execs = stack.edge.execs
    monkeypatch.setattr(execs, "limits", dataclasses.replace(execs.limits, max_execs=4))
    monkeypatch.setattr(execs, "_slots", asyncio.Semaphore(4))

    async def started(sb) -> int:   # (a file op: no exec slot needed to look)
        return sum(e.name.startswith("s.") for e in await sb.files.list("/tmp"))
    async with await client.create() as a, await other.create() as b:
        def held(sb):   # each marks its start in its sandbox, then waits for /go
            return asyncio.ensure_future(sb.exec("touch /tmp/s.$$; while [ ! -e /go ]; do sleep 0.05; done",
                                                 timeout=60))
        first = [held(a) for _ in range(3)]   # A's share of the 4: 3
        for _ in range(100):
            await asyncio.sleep(0.1)
            if await started(a) == 3:
                break
        then = [held(b) for _ in range(3)]   # one slot is left
        await asyncio.sleep(2)
        assert [await started(a), await started(b)] == [3, 1]
        await a.write_file("/go", b"")
        assert [r.exit_code for r in await asyncio.gather(*first)] == [0] * 3
        for _ in range(100):
            await asyncio.sleep(0.1)
            if await started(b) == 3:
                break
        assert await started(b) == 3   # B's two waiting ones ran once A's ended
        await b.write_file("/go", b"")
        assert [r.exit_code for r in await asyncio.gather(*then)] == [0] * 3


async def test_an_exec_waiting_for_a_slot_is_refused_if_its_sandbox_was_suspended_meanwhile(stack, client, other,
                                                                                          monkeypatch):
    """An exec that waited for one of the node's exec slots is looked at again when it gets one: its sandbox
    suspended meanwhile, it is refused SandboxSuspended, not started in a frozen sandbox (where it would hold
    the slot until the sandbox is resumed)."""
    execs = stack.edge.execs
    monkeypatch.setattr(execs, "limits", dataclasses.replace(execs.limits, max_execs=1))
    monkeypatch.setattr(execs, "_slots", asyncio.Semaphore(1))
    async with await client.create() as a, await other.create() as b:
        first = asyncio.ensure_future(a.exec("touch /tmp/s; while [ ! -e /go ]; do sleep 0.05; done", timeout=60))
        for _ in range(100):
            await asyncio.sleep(0.1)
            if any(e.name == "s" for e in await a.files.list("/tmp")):
                break
        waiting = asyncio.ensure_future(b.exec("echo ran", timeout=30))
        await asyncio.sleep(1)
        await b.suspend()
        await a.write_file("/go", b"")
        assert (await first).exit_code == 0
        with pytest.raises(libdsec.SandboxSuspended):
            await asyncio.wait_for(waiting, 20)
        await b.resume()
        assert (await b.exec("echo ran", timeout=30)).stdout == b"ran\n"

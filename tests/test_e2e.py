"""The whole path through a real nats-server, placement, edge and container backend."""
from __future__ import annotations

import asyncio

import pytest

import libdsec

pytestmark = pytest.mark.timeout(60)


async def test_create_exec_stream_files_destroy(client):
    sb = await client.create(image="busybox", resources=libdsec.Resources(cpu=1.0, memory="128Mi", pids=64,
                                                                          disk="64Mi"),
                             ttl=600, env={"A": "1"}, labels={"job": "j1"})
    assert sb.id and sb.node
    r = await sb.exec(["sh", "-c", "echo hi; echo $A$B >&2; exit 3"], env={"B": "2"}, timeout=10)
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"hi\n", b"12\n")
    assert r.duration > 0
    events = [ev async for ev in sb.stream(["sh", "-c", "for i in 1 2 3; do echo $i; sleep 0.1; done"])]
    assert [e.data for e in events[:-1]] == [b"1\n", b"2\n", b"3\n"]
    assert all(e.stream == "stdout" for e in events[:-1])
    assert isinstance(events[-1], libdsec.Exit) and events[-1].exit_code == 0
    await sb.write_file("/tmp/a.py", b"print(1)")
    assert await sb.read_file("/tmp/a.py") == b"print(1)"
    r = await sb.exec("pwd; cat", cwd="/tmp", stdin=b"from stdin")
    assert r.stdout == b"/tmp\nfrom stdin"
    same = await client.get(sb.id)
    assert (await same.exec("cat /tmp/a.py")).stdout == b"print(1)"
    await sb.destroy()
    with pytest.raises(libdsec.SandboxNotFound) as ei:
        await sb.destroy()
    assert ei.value.reason == "destroyed"
    with pytest.raises(libdsec.SandboxNotFound):
        await sb.exec("echo hi")
    with pytest.raises(libdsec.SandboxNotFound) as ei:
        await client.get(sb.id)
    assert ei.value.reason == "destroyed"


async def test_output_streams_as_produced(client):
    async with await client.create() as sb:
        seen = []
        t0 = asyncio.get_running_loop().time()
        async for ev in sb.stream("echo first; sleep 1; echo second"):
            seen.append((asyncio.get_running_loop().time() - t0, ev))
        first_at = seen[0][0]
        second_at = seen[1][0]
        assert seen[0][1].data == b"first\n" and second_at - first_at > 0.5, "lines must arrive as produced"


async def test_context_manager_and_create_many(client):
    async with await client.create() as sb:
        sid = sb.id
    with pytest.raises(libdsec.SandboxNotFound):
        await client.get(sid)
    many = await client.create_many(8, image="busybox")
    assert len({s.id for s in many}) == 8
    results = await asyncio.gather(*(s.exec(f"echo {i}") for i, s in enumerate(many)))
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(8)]
    await asyncio.gather(*(s.destroy() for s in many))


async def test_create_many_fails_as_a_whole(client, stack):
    before = len(stack.edge.sandboxes)
    with pytest.raises(libdsec.InvalidRequest):
        await client.create_many(3, image="busybox", resources=libdsec.Resources(memory="1Mi"))
    assert len(stack.edge.sandboxes) == before


async def test_concurrent_execs_in_one_and_many_sandboxes(client):
    sbs = await client.create_many(4)
    try:
        rs = await asyncio.gather(*(sbs[i % 4].exec(f"sleep 0.5; echo {i}") for i in range(64)))
        assert sorted(int(r.stdout) for r in rs) == list(range(64))
    finally:
        await asyncio.gather(*(s.destroy() for s in sbs))


async def test_background_process_survives_between_execs(client):
    async with await client.create() as sb:
        await sb.exec("sh -c 'while true; do date +%s%N > /tmp/tick; sleep 0.1; done' >/dev/null 2>&1 &"
                      " while [ ! -s /tmp/tick ]; do sleep 0.01; done")
        first = await sb.read_file("/tmp/tick")
        await asyncio.sleep(1.2)
        assert await sb.read_file("/tmp/tick") != first


async def test_signal_exit_code(client):
    async with await client.create() as sb:
        r = await sb.exec("kill -9 $$")
        assert r.exit_code == 137


async def test_sync_client(stack):
    await asyncio.to_thread(_use_sync_client, stack.url)   # the stack serves on this loop meanwhile


def _use_sync_client(url: str) -> None:
    with libdsec.Client(url) as client:
        with client.create(image="busybox", labels={"job": "syncj"}) as sb:
            assert sb.exec("echo hi").stdout == b"hi\n"
            out = [ev for ev in sb.stream(["sh", "-c", "echo a; echo b >&2"])]
            assert {(e.stream, e.data) for e in out[:-1]} == {("stdout", b"a\n"), ("stderr", b"b\n")}
            sb.write_file("/tmp/x", "y")
            assert sb.read_file("/tmp/x") == b"y" and list(sb.files.read_pieces("/tmp/x")) == [b"y"]
            # the rest of the async API's calls, each a real round trip (helper-40: these were missing)
            term = sb.terminal(["cat"], rows=20, cols=60)
            pid = term.started()
            assert term.send_stdin(b"typed\n") and term.resize(30, 100) and sb.resize_terminal(pid, 40, 120)
            seen = b""
            for ev in term.stream(lines=False):
                seen += ev.data if isinstance(ev, libdsec.Output) else b""
                if b"typed" in seen.replace(b"\r", b""):
                    break
            assert term.kill() is True
            with pytest.raises(libdsec.Unsupported):   # created with network "none": it keeps it
                sb.set_network("mirror-only")
            assert client.quota().sandboxes >= 1
            snap = sb.snapshot(tag="syncsnap")
            assert client.snapshot(snap.id).id == snap.id
            client.delete_snapshot(snap.id)
        # the trajectories too (they were the async client's only): records in order, each acked plainly
        seen = []
        for t in client.trajectories(job="syncj", follow=False, durable="syncd"):
            seen.append((t.record.type, t.record.shell))
            t.ack()
        assert seen[0] == ("created", "") and ("exec", "echo hi") in seen and seen[-1][0] == "destroyed", seen
        assert list(client.trajectories(job="syncj", follow=False, durable="syncd")) == []   # all acked


async def test_ttl_destroys(client, stack):
    sb = await client.create(ttl=1)
    await asyncio.sleep(2.5)
    with pytest.raises(libdsec.SandboxNotFound) as ei:
        await sb.exec("echo hi")
    assert ei.value.reason == "expired"


async def test_events_and_kv_record(client, stack):
    from bus import streams, subjects
    from bus.records import event_decoder, sandbox_decoder
    async with await client.create(labels={"job": "jx"}) as sb:
        rec = sandbox_decoder.decode(await stack.bus.kv_get(streams.SANDBOXES_KV, subjects.record_key(client.tenant, sb.id)))
        assert rec.state == "ready" and rec.labels == {"job": "jx"} and rec.node == sb.node
    evs = [event_decoder.decode(d) async for d in stack.bus.read_subject(streams.EVT_STREAM,
                                                                         subjects.event("default", sb.id))]
    assert [e.type for e in evs] == ["created", "destroyed"]


async def test_output_readable_later_from_stream(client, stack):
    from bus import streams, subjects
    from bus.execwire import ExitRecord, OutputChunk, decode_output
    async with await client.create() as sb:
        await sb.exec("echo later")
        node = sb.node
    recs = []
    async for data, headers in stack.bus.read_subject(streams.OUT_STREAM, subjects.output(client.tenant, node, sb.id, "*"),
                                                      with_headers=True):
        recs.append(decode_output(data, headers))
    assert any(isinstance(r, OutputChunk) and r.data == b"later\n" for r in recs)
    assert isinstance(recs[-1], ExitRecord) and recs[-1].exit_code == 0 and node


async def test_redelivered_exec_never_runs_twice(client, stack):
    """The same exec id published twice (a retry past the dedupe window, or a redelivery) runs once."""
    from bus import streams, subjects
    from bus.messages import ExecRequest, encode
    from bus.execwire import ExitRecord, output_decoder
    async with await client.create() as sb:
        req = ExecRequest(exec_id="xonce1", sandbox_id=sb.id, argv=["sh", "-c", "echo run >> /tmp/count"],
                          timeout=10)
        before = stack.edge.ops.duplicates
        for msg_id in ("first", "second"):   # distinct Nats-Msg-Ids: JetStream's dedupe does not catch it
            await stack.bus.publish(subjects.node_ops(sb.node, client.tenant, sb.id), encode(req), msg_id=msg_id)
        for _ in range(200):   # the second delivery was seen and refused
            if stack.edge.ops.duplicates > before:
                break
            await asyncio.sleep(0.02)
        assert stack.edge.ops.duplicates == before + 1
        for _ in range(200):   # and the first delivery finished: its exit record is stored
            if await stack.bus.last_on_subject(streams.OUT_STREAM, subjects.output(client.tenant, sb.node, sb.id, "xonce1")):
                break
            await asyncio.sleep(0.02)
        assert (await sb.read_file("/tmp/count")) == b"run\n"
        recs = [output_decoder.decode(d) async for d in stack.bus.read_subject(
            streams.OUT_STREAM, subjects.output(client.tenant, sb.node, sb.id, "xonce1"))]
        assert sum(isinstance(r, ExitRecord) for r in recs) == 1

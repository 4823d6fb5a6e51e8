"""Trajectories: every exec and lifecycle step of a sandbox on dsec.traj.<tenant>.<job>.<sandbox>, in
order, readable by any NATS client, and `dsec replay` printing the episode byte for byte."""
from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import os
import subprocess
import time
import sys
from pathlib import Path


import pytest

from tests.conftest import raw_nats

import libdsec
from bus import streams, subjects

DSEC = str(Path(sys.executable).parent / "dsec")
BINARY = bytes(range(256)) * 4 + b"\xff\xfe no newline at the end"
ACK_WAIT = 3.0   # longer than a reader's wait for more records, so its own unacked ones never come back to it


async def test_an_episode_is_recorded_in_order_and_replayed_byte_for_byte(stack, client):
    sb = await client.create(labels={"job": "jt1"})
    await sb.write_file("/tmp/blob", BINARY)
    r1 = await sb.exec("echo one; echo two >&2; exit 4")
    r2 = await sb.exec(["/bin/busybox", "cat", "/tmp/blob"])
    await sb.exec("true", user="65534", cwd="/tmp")     # as whom and where it ran is recorded
    await sb.destroy()
    assert (r1.exit_code, r2.stdout) == (4, BINARY)
    # any NATS client reads the timeline: plain nats-py, JSON
    nc = await raw_nats(stack.url)
    try:
        sub = await nc.jetstream().subscribe(subjects.trajectory("default", "jt1", sb.id), ordered_consumer=True)
        records = []
        while len(records) < 5:
            records.append(json.loads((await sub.next_msg(timeout=5)).data))
        await sub.unsubscribe()
    finally:
        await nc.close()
    assert [r["type"] for r in records] == ["created", "exec", "exec", "exec", "destroyed"]
    first, second = records[1], records[2]
    assert (first["user"], first["cwd"], records[3]["user"], records[3]["cwd"]) == ("", "", "65534", "/tmp")
    assert first["shell"] == "echo one; echo two >&2; exit 4" and first["exit_code"] == 4
    assert (first["stdout_bytes"], first["stderr_bytes"]) == (4, 4)
    assert second["argv"] == ["/bin/busybox", "cat", "/tmp/blob"]
    assert second["stdout_sha256"] == hashlib.sha256(BINARY).hexdigest() and second["stdout_bytes"] == len(BINARY)
    assert all(r["v"] == 1 and r["kind"] == "traj" and r["id"] for r in records)
    # replay: the same bytes the SDK saw, on the same streams; JSON mode gives the records themselves (the
    # replays that read the same records run at once: one after another they took 16 s of CI's budget)
    def replay(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([DSEC, "replay", *args, "--nats", stack.url], capture_output=True, timeout=60)
    p, js, text = await asyncio.gather(*(asyncio.to_thread(replay, *args) for args in (
        ["--sandbox", sb.id], ["--job", "jt1", "--format", "json"], ["--job", "jt1"])))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    # two pipes: which of the two lines the relay read first is a race, each stream keeps its own order
    assert (b"$ echo one; echo two >&2; exit 4\n1| one\n2| two\n# exit 4" in out or
            b"$ echo one; echo two >&2; exit 4\n2| two\n1| one\n# exit 4" in out)
    *whole, last = BINARY.split(b"\n")
    marked = b"".join(b"1| " + line + b"\n" for line in whole) + b"1| " + last
    assert b"$ /bin/busybox cat /tmp/blob\n" + marked + b"\n\\ no newline at end\n# exit 0" in out
    assert b"$ true\n#   (as 65534, in /tmp)\n# exit 0" in out
    assert out.index(b" created") < out.index(b"$ echo") < out.index(b" destroyed")
    lines = [json.loads(line) for line in js.stdout.splitlines()]
    assert [r["type"] for r in lines if r["kind"] == "traj"] == ["created", "exec", "exec", "exec", "destroyed"]
    assert [r["seq"] for r in lines if r["kind"] == "traj"] == sorted(r["seq"] for r in lines if r["kind"] == "traj")
    assert not [r for r in lines if r["kind"] == "aged_out"]
    assert f"$ true\n#   (sandbox {sb.id} of default, as 65534, in /tmp)\n# exit 0".encode() in text.stdout   # whose
    # output aged out of DSEC_OUT: json says so too, not only text (a reader took what was left for all: T)
    await stack.bus.js.purge_stream(streams.OUT_STREAM, subject=subjects.output("default", first["node"], sb.id,
                                                                                  first["exec_id"]))
    js, later, future, none = await asyncio.gather(*(asyncio.to_thread(replay, *args) for args in (
        ["--job", "jt1", "--format", "json"], ["--job", "jt1", "--format", "json", "--seq", str(lines[-1]["seq"])],
        ["--job", "jt1", "--since", "2099-01-01T00:00:00"], ["--sandbox", "sbnosuch"])))
    gone = [json.loads(line) for line in js.stdout.splitlines() if json.loads(line)["kind"] == "aged_out"]
    assert gone == [{"kind": "aged_out", "exec_id": first["exec_id"], "kept_only": True, "records": 0}], gone
    assert [json.loads(line)["type"] for line in later.stdout.splitlines()] == ["destroyed"]
    assert future.returncode == 1 and b"no trajectory records" in future.stderr
    assert none.returncode == 1 and b"no trajectory records" in none.stderr


async def test_a_durable_trajectory_consumer_resumes_where_it_left_off(client):
    job, durable = f"jd{os.getpid()}", f"reward{os.getpid()}"
    sb = await client.create(labels={"job": job})
    for i in range(3):
        await sb.exec(f"echo {i}")
    for _ in range(100):   # an exec's record follows its exit record by a few milliseconds
        if len([t async for t in client.trajectories(job=job, follow=False)]) == 4:
            break
        await asyncio.sleep(0.05)
    seen = []   # a reward model reads everything so far, acks only the first two records, then dies
    async for t in client.trajectories(job=job, durable=durable, follow=False, ack_wait=ACK_WAIT):
        seen.append(t.record)
        if len(seen) <= 2:
            await t.ack()
    assert [r.type for r in seen] == ["created", "exec", "exec", "exec"]
    await sb.exec("echo 3")
    await sb.destroy()
    await asyncio.sleep(ACK_WAIT + 0.5)   # past the ack wait: what it never acked is due again
    again = []
    async for t in client.trajectories(job=job, durable=durable, follow=False, ack_wait=ACK_WAIT):
        again.append(t.record)
        await t.ack()
    ids = [r.id for r in again]
    assert len(ids) == 4 and not {r.id for r in seen[:2]} & set(ids), "acked records never come again"
    assert {r.id for r in seen[2:]} <= set(ids), "the unacked records come again"
    assert [r.type for r in again if r.id not in {x.id for x in seen}] == ["exec", "destroyed"]
    after = []   # nothing left for it now; a new reader from a sequence reads from there on
    async for t in client.trajectories(job=job, durable=durable, follow=False):
        after.append(t)
    assert after == []
    everything = [t.record.type async for t in client.trajectories(job=job, since=1, follow=False)]
    assert everything == ["created", "exec", "exec", "exec", "exec", "destroyed"]
    later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=1)
    assert [t async for t in client.trajectories(job=job, since=later, follow=False)] == []


async def test_a_durable_reader_left_mid_batch_gives_back_what_it_never_handed_out(client):
    """A reader that stops after its first record leaves the rest of its fetched batch to the next reader at
    once: it waited the ack wait (30 s) for them (helper U2)."""
    job, durable = f"jb{os.getpid()}", f"brk{os.getpid()}"
    async with await client.create(labels={"job": job}) as sb:
        for i in range(3):
            await sb.exec(f"echo {i}")
    for _ in range(100):
        if len([t async for t in client.trajectories(job=job, follow=False)]) == 5:
            break
        await asyncio.sleep(0.05)
    async for t in client.trajectories(job=job, durable=durable, follow=False):
        await t.ack()
        first = t.record
        break
    t0 = time.monotonic()
    rest = []
    async for t in client.trajectories(job=job, durable=durable, follow=False):
        rest.append(t.record)
        await t.ack()
    assert time.monotonic() - t0 < 10, time.monotonic() - t0
    assert first.type == "created" and [r.type for r in rest] == ["exec", "exec", "exec", "destroyed"], rest


async def test_records_past_one_answer_come_at_once_in_order_and_none_is_left_out(client):
    """Records of much output (12 execs of 70,000 bytes: an answer holds ~768 KiB) past what one fetch's answer
    holds were left to the consumer's ack wait: a reader that was told nothing more was pending stopped with
    9 of the 14 records and no error, and a following one got them 30 s later, after newer ones (a sandbox's
    `destroyed` before its last exec: helper T). They come in the next fetch now, in order."""
    import time
    job = f"jbig{os.getpid()}"
    sb = await client.create(labels={"job": job})
    for i in range(12):
        await sb.exec(["sh", "-c", f"head -c 70000 /dev/zero | tr '\\0' {chr(97 + i)}"])
    await sb.destroy()
    want = ["created"] + ["exec"] * 12 + ["destroyed"]
    for _ in range(100):   # (the last records follow by milliseconds)
        got = [t.record for t in [t async for t in client.trajectories(job=job, follow=False)]]
        if len(got) >= 14:
            break
        await asyncio.sleep(0.1)
    assert [r.type for r in got] == want
    assert [r.stdout[:1] for r in got[1:13]] == [bytes([97 + i]) for i in range(12)]
    t0, seen = time.monotonic(), []   # a durable reader, acking as it goes: all of them, in order, at once
    async for t in client.trajectories(job=job, durable=f"big{os.getpid()}", follow=False):
        seen.append(t.record.type)
        await t.ack()
    assert seen == want and time.monotonic() - t0 < 5, (seen, time.monotonic() - t0)


async def test_a_durable_reader_asked_with_other_settings_is_refused_not_hung_or_emptied(client):
    """A durable reader read again with another `since` retried the server's refusal for ever with follow
    (no record, no error), and one read for another job had its filter rewritten silently and read nothing
    (helper T). Both are InvalidRequest now."""
    job, durable = f"jset{os.getpid()}", f"set{os.getpid()}"
    async with await client.create(labels={"job": job}) as sb:
        await sb.exec("true")
    first = [t async for t in client.trajectories(job=job, durable=durable, since=1, follow=False)]
    assert first, "the reader read its job"
    with pytest.raises(libdsec.InvalidRequest, match="other settings"):
        await asyncio.wait_for(anext(client.trajectories(job=job, durable=durable, since=5, follow=True)), 15)
    with pytest.raises(libdsec.InvalidRequest, match="reads another job"):
        await asyncio.wait_for(anext(client.trajectories(job=job + "x", durable=durable, follow=False)), 15)


async def test_one_tenant_holds_at_most_its_readers_and_leaves_the_stream_to_others(stack, client, monkeypatch):
    """Helper A3: one tenant's 1,000 durable readers filled DSEC_TRAJ's consumers, and no other tenant (nor the
    operator's replay) read a trajectory. Now a tenant holds at most MAX_READERS (64; here 3 more than it holds
    as the test begins): past it, RateLimited; a dropped durable one makes room."""
    from placement import streamapi
    held = sum(d.startswith("trajectory reader") and subjects.tenant_root(d.rpartition(" of tenant ")[2]) == "default"
               for d in await stack.bus.consumer_descriptions(streams.TRAJ_STREAM))
    monkeypatch.setattr(streamapi, "MAX_READERS", held + 3)

    async def read(c, name):
        return [t async for t in c.trajectories(durable=name, follow=False, job="no-such-job")]
    names = []
    try:
        with pytest.raises(libdsec.RateLimited, match="the most one tenant may"):
            for i in range(8):   # (a reader of an earlier test that expires meanwhile leaves room for one more)
                await read(client, f"hog{i}")
                names.append(f"hog{i}")
        assert 3 <= len(names) < 8
        async with libdsec.AsyncClient(stack.url, tenant="tenant-b") as other:
            assert await read(other, "b-reader") == []
            await other.drop_trajectory_reader("b-reader")
        await client.drop_trajectory_reader(names.pop())
        assert await read(client, "one-more") == []
        names.append("one-more")
    finally:
        for name in names:
            await client.drop_trajectory_reader(name)


async def test_a_reader_keeps_its_consumer_between_fetches_and_rebinds_a_gone_one(stack, client, monkeypatch):
    """A reader fetching in several batches has its consumer created once, not once per fetch; a durable
    reader whose consumer went behind the engine's back is bound afresh and reads everything again."""
    from bus import streams
    from libdsec import trajectories as trajmod
    from placement.streamapi import reader_consumer
    monkeypatch.setattr(trajmod, "BATCH", 2)   # 7 records: 4 fetches and the last, empty one
    job, durable = f"jk{os.getpid()}", f"keep{os.getpid()}"
    sb = await client.create(labels={"job": job})
    for i in range(5):
        await sb.exec(f"echo {i}")
    await sb.destroy()
    for _ in range(100):
        if len([t async for t in client.trajectories(job=job, follow=False)]) == 7:
            break
        await asyncio.sleep(0.05)
    reads = stack.placement.api.reads
    before = reads.consumer_creates
    assert len([t async for t in client.trajectories(job=job, follow=False)]) == 7
    assert reads.consumer_creates - before == 1, "one consumer per reader, not one per fetch"
    first = []
    async for t in client.trajectories(job=job, durable=durable, follow=False, ack_wait=ACK_WAIT):
        first.append(t.record.type)
        await t.ack()
    assert first == ["created"] + ["exec"] * 5 + ["destroyed"]
    await stack.bus.delete_consumer(streams.TRAJ_STREAM, reader_consumer("default", durable))
    again = [t.record.type async for t in client.trajectories(job=job, durable=durable, follow=False,
                                                                 ack_wait=ACK_WAIT)]
    assert again == first, "a gone consumer is made again, from the start"
    await stack.bus.delete_consumer(streams.TRAJ_STREAM, reader_consumer("default", durable))


async def test_trajectory_arguments_are_checked(client):
    with pytest.raises(libdsec.InvalidRequest):
        client.trajectories(job=42)   # (a job of any text is taken: see the test above)
    with pytest.raises(libdsec.InvalidRequest):
        client.trajectories(since="yesterday")


async def test_a_tenants_newlines_cannot_forge_lines_of_the_text_replay(stack, client):
    """A command, a cwd or a user holding a newline printed as several lines of `dsec replay`: a script
    `true\\n# exit 0 ...` made a lookalike exit line, in a tenant's own replay and in an operator's replay of a
    job that another tenant's sandbox joined by its label (helper T2). Each is one line now, its newlines
    escaped, and a job's commands say whose sandbox they ran in."""
    forged = "# 12:00:00 sbforged destroyed"
    async with await client.create(labels={"job": "jforge"}) as sb:
        await sb.exec(f"true\n{forged}")
        await sb.exec(["mkdir", "-p", f"/tmp/x\n{forged}"])
        await sb.exec("true", cwd=f"/tmp/x\n{forged}")
        with pytest.raises(libdsec.ExecFailed):   # its error, which names argv[0], is on the exit line (review R2)
            await sb.exec([f"nosuch\n{forged}\n#"])
    for scope in (["--sandbox", sb.id], ["--job", "jforge"]):
        p = await asyncio.to_thread(subprocess.run, [DSEC, "replay", *scope, "--nats", stack.url],
                                    capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        assert forged not in p.stdout.splitlines(), p.stdout
        assert f"$ true\\n{forged}" in p.stdout and f"in /tmp/x\\n{forged}" in p.stdout, p.stdout
    assert f"(sandbox {sb.id} of default, in /tmp/x" in p.stdout, p.stdout


@pytest.mark.parametrize("run", range(3))   # (its end wrote a traceback in 2 runs of 5: helper U2)
async def test_replay_follow_prints_records_as_they_come_and_stops_at_the_end(stack, client, run):
    sb = await client.create(labels={"job": "jfollow"})
    proc = await asyncio.create_subprocess_exec(DSEC, "replay", "--sandbox", sb.id, "--follow", "--nats", stack.url,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert b" created" in await asyncio.wait_for(proc.stdout.readline(), 30)
        await sb.exec("echo live")
        assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"$ echo live\n"
        assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"1| live\n"
        await sb.destroy()
        rest, err = await asyncio.wait_for(proc.communicate(), 30)   # it ends by itself after `destroyed`
        assert proc.returncode == 0, err
        assert rest.startswith(b"# exit 0") and rest.rstrip().endswith(b"destroyed: destroyed by request")
        assert err == b"", err   # (the reader was closed after the bus: "exception was never retrieved")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_replay_follow_of_a_sandbox_that_never_existed_says_so_at_once(stack):
    """`dsec replay --sandbox <a wrong id> --follow` waited for ever, printing nothing (helper-40)."""
    p = await asyncio.to_thread(subprocess.run, [DSEC, "replay", "--sandbox", "sbnosuch0000", "--follow", "--nats",
                                                 stack.url], capture_output=True, text=True, timeout=20)
    assert (p.returncode, p.stdout) == (1, ""), p
    assert "no sandbox sbnosuch0000: it has no record and no trajectory records" in p.stderr, p.stderr


async def test_a_command_too_long_for_one_record_is_cut_and_the_sandbox_record_still_moves_on(stack, client):
    """An exec of 900 KB of arguments writing 100 KB on each stream: its trajectory record (argv plus the two
    streams' first 64 KiB) came to 1.08 MB, which the NATS server refused. The node's outbox tried it again
    forever and the sandbox's later changes waited behind it: after destroy() its record still read `ready`.
    Now the record keeps the command's first 64 KiB with the size and sha256 of what was sent."""
    sb = await client.create(labels={"job": "jcut"})
    words = ["y" * 30_000] * 30
    script = "head -c 100000 /dev/zero | tr '\\0' a; head -c 100000 /dev/zero | tr '\\0' b >&2"
    r = await sb.exec(["sh", "-c", script, "x", *words])
    assert (r.exit_code, r.stdout, r.stderr) == (0, b"a" * 100_000, b"b" * 100_000)
    await sb.destroy()
    for _ in range(50):   # the destroyed record is stored behind the exec's trajectory record
        rec = await client._record(sb.id)
        if rec.state == "destroyed":
            break
        await asyncio.sleep(0.1)
    assert rec.state == "destroyed"
    sent = b"".join(w.encode() + b"\0" for w in ["sh", "-c", script, "x", *words])
    nc = await raw_nats(stack.url)
    try:
        sub = await nc.jetstream().subscribe(subjects.trajectory("default", "jcut", sb.id), ordered_consumer=True)
        records = [json.loads((await sub.next_msg(timeout=5)).data) for _ in range(3)]
        await sub.unsubscribe()
    finally:
        await nc.close()
    assert [x["type"] for x in records] == ["created", "exec", "destroyed"]
    cut = records[1]
    assert cut["command_cut"] and cut["command_bytes"] == len(sent) == 900_117
    assert cut["command_sha256"] == hashlib.sha256(sent).hexdigest()
    kept = b"".join(w.encode() + b"\0" for w in cut["argv"])
    assert cut["argv"][:4] == ["sh", "-c", script, "x"] and len(kept) <= 64 << 10 and sent.startswith(kept[:-1])
    assert cut["stdout_bytes"] == cut["stderr_bytes"] == 100_000 and cut["stdout"]   # its output kept as ever
    p = await asyncio.to_thread(subprocess.run, [DSEC, "replay", "--sandbox", sb.id, "--nats", stack.url],
                                capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert f"...[cut: 900,117 bytes were sent, sha256 {cut['command_sha256']}]".encode() in p.stdout


async def test_a_job_label_that_is_not_a_subject_token_is_found_by_its_name(client):
    """A job label of any text (`run.42`, spaces, unicode) is filed under a token made of it, and readers
    given the label as written find it; two labels that differ only in such characters stay apart (before:
    every such label was filed under `default`, and a reader given it was refused)."""
    tag = os.getpid()
    names = [f"run.{tag}", f"run {tag}", f"rün/{tag}"]
    boxes = [await client.create(labels={"job": name}) for name in names]
    try:
        for sb in boxes:
            await sb.exec("true")
    finally:
        for sb in boxes:
            await sb.destroy()
    tokens = []
    for name, sb in zip(names, boxes):
        for _ in range(100):
            got = [t.record async for t in client.trajectories(job=name, follow=False)]
            if [r.type for r in got] == ["created", "exec", "destroyed"]:
                break
            await asyncio.sleep(0.05)
        assert {r.sandbox_id for r in got} == {sb.id} and [r.type for r in got] == ["created", "exec", "destroyed"]
        assert got[0].job not in ("default", name)
        tokens.append(got[0].job)
    assert len(set(tokens)) == 3   # each its own


async def test_replay_into_a_reader_that_leaves_ends_quietly(stack, client):
    """`dsec replay ... | head -1`: the reader leaves early; replay ends as a shell tool does (SIGPIPE's exit
    status, nothing on stderr) instead of 'dsec: error: Broken pipe'."""
    async with await client.create() as sb:
        await sb.exec("seq 1 30000")   # more than a pipe holds
        sid = sb.id
    line = f"set -o pipefail; {DSEC} replay --sandbox {sid} --nats {stack.url} | head -1"
    for _ in range(50):   # (its records follow its end by a moment)
        p = await asyncio.to_thread(subprocess.run, ["bash", "-c", line], capture_output=True, text=True, timeout=60)
        if "no trajectory records" not in p.stderr:
            break
        await asyncio.sleep(0.1)
    assert (p.returncode, p.stderr) == (141, ""), (p.returncode, p.stderr)
    assert len(p.stdout.splitlines()) == 1

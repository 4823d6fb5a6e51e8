"""Snapshots: a sandbox's writable layer packed as a layer over its own; create, fork and roll back from it;
a snapshot of a snapshot stores only the new diff; deleting one others are built on is refused."""
from __future__ import annotations

import asyncio
import base64

import pytest

import libdsec
from bus import streams

SETUP = ("mkdir -p /data/sub && echo hello > /data/a.txt && chmod 640 /data/a.txt && ln -s a.txt /data/link && "
         "echo gone > /data/sub/tmp && rm /bin/vi && head -c 20971520 /dev/urandom > /data/big && "
         "rm -rf /data/sub && mkdir /data/sub && echo new > /data/sub/file")
STATE = ("stat -c '%a %s %N' /data/a.txt /data/link /data/sub/file; cat /data/a.txt /data/sub/file; "
         "ls /bin/vi 2>&1; md5sum /data/big | cut -d' ' -f1")


async def test_snapshot_fork_rollback_and_snapshot_of_a_snapshot(stack, client):
    sb = await client.create(labels={"job": "snaps"}, env={"FROM": "origin"}, resources=libdsec.Resources(disk="128Mi"))
    made: list[libdsec.AsyncSandbox] = []
    snaps = []
    try:
        assert (await sb.exec(SETUP)).exit_code == 0
        want = (await sb.exec(STATE)).stdout
        assert b"640" in want and b"-> 'a.txt'" in want and b"No such file" in want
        snap = await sb.snapshot(tag="step-1")
        snaps.append(snap)
        assert snap.tag == "step-1" and len(snap.layers) == 2 and snap.size > 20 << 20
        await sb.exec("echo changed > /data/a.txt; rm /data/big; touch /data/after")
        forks = await client.fork(snap, n=8)
        made += forks
        states = await asyncio.gather(*(f.exec(STATE) for f in forks))
        assert all(s.stdout == want for s in states)            # contents, modes, links, deletions, big files
        assert (await forks[0].exec("echo $FROM")).stdout == b"origin\n"   # the snapshot's env
        await forks[0].exec("echo mine > /data/a.txt")
        assert (await forks[1].exec("cat /data/a.txt")).stdout == b"hello\n"   # independent
        h = await sb.exec("sleep 60", background=True)
        with pytest.raises(libdsec.ImageNotFound, match="nosuch"):   # as fork says it
            await sb.rollback("nosuch")
        await sb.rollback("step-1")                              # the filesystem back to step-1, processes afresh
        assert (await sb.exec(STATE)).stdout == want
        assert (await sb.exec("ls /data/after 2>&1")).exit_code != 0
        assert (await asyncio.wait_for(h.wait(), 10)).exit_code == 137   # its process went with the restart
        child = await forks[0].snapshot(tag="step-2")           # a snapshot of a snapshot: only the new diff
        snaps.append(child)
        assert [la.digest for la in child.layers[:2]] == [la.digest for la in snap.layers]
        assert child.size < 1 << 20
        grand = await client.create(from_snapshot="step-2")
        made.append(grand)
        assert (await grand.exec("cat /data/a.txt; md5sum /data/big | cut -d' ' -f1")).stdout == \
            b"mine\n" + want.split(b"\n")[-2] + b"\n"
        assert [s.id for s in await client.snapshots(tag="step-1")] == [snap.id]
        with pytest.raises(libdsec.InvalidRequest, match="built on it"):
            await client.delete_snapshot(snap)
        with pytest.raises(libdsec.InvalidRequest, match="in use"):
            await client.delete_snapshot(child)
    finally:
        await asyncio.gather(*(s.destroy() for s in [sb, *made]), return_exceptions=True)
    await client.delete_snapshot(snaps[1])
    await client.delete_snapshot(snaps[0])
    assert await client.snapshots(tag="step-1") == [] and await client.snapshots(tag="step-2") == []
    # nothing of them stays stored: no record, no delete marker, no object, no object's deleted-marker
    # (helper S2's soak: each deleted snapshot left a marker in both, for good)
    for s in snaps:
        meta = base64.urlsafe_b64encode(s.layers[-1].digest.encode()).decode()
        for stream, subject in ((f"KV_{streams.SNAPSHOTS_KV}", f"$KV.{streams.SNAPSHOTS_KV}.>"),
                                (f"OBJ_{streams.LAYERS_OBJ}", f"$O.{streams.LAYERS_OBJ}.M.{meta}")):
            info = await stack.bus.js.stream_info(stream, subjects_filter=subject)
            assert not [k for k in (info.state.subjects or {}) if s.id in k or meta in k], (stream, info.state.subjects)
    # and no node keeps their bytes: the session edge's cache held both (made there, used there)
    files = [stack.edge.layers.path(s.layers[-1]) for s in snaps]
    for _ in range(50):
        if not any(f.exists() for f in files):
            break
        await asyncio.sleep(0.1)
    assert [f.name for f in files if f.exists()] == []
    with pytest.raises(libdsec.ImageNotFound):
        await client.create(from_snapshot=snaps[0].id)

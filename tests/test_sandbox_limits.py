"""Bombs and isolation through the SDK: each limit fires (asserted from the kernel's own counters), the
sandbox still answers afterwards, and the host is untouched."""
from __future__ import annotations

import asyncio
import time

import os
from pathlib import Path

import psutil
import pytest

import libdsec
from edge.backends.cgroups import NodeCgroups, procs_under
from tests.test_failure_classes import events_of

pytestmark = pytest.mark.timeout(120)


def groups(stack, sb) -> dict[str, Path]:
    return NodeCgroups(stack.edge.node).sandbox(stack.edge.backend.backends["container"]._key(sb.id))   # its name, if it was warm


async def test_fork_bomb_hits_the_pids_limit(client, stack):
    async with await client.create(resources=libdsec.Resources(pids=64)) as sb, await client.create() as bystander:
        with pytest.raises(libdsec.ExecTimeout):
            await sb.exec("bomb(){ bomb | bomb & }; bomb; sleep 30", timeout=4)
        assert stack.edge.backend.backends["container"].limit_events(sb.id)["pids_max"] > 0, "pids limit never fired"
        assert (await sb.exec("echo ok")).stdout == b"ok\n"
        assert (await bystander.exec("echo fine")).stdout == b"fine\n"


async def test_memory_bomb_is_oom_killed_inside(client, stack):
    async with await client.create(resources=libdsec.Resources(memory="64Mi")) as sb, \
            await client.create() as bystander:
        r = await sb.exec("tail /dev/zero", timeout=60)
        assert r.exit_code == 137
        # said, not a bare 137 as a kill -9 gives (helper-40): the task's own failure, and why
        assert r.failure_class == "task" and r.fault.startswith("out of memory: the kernel's OOM killer killed "), r
        r = await sb.exec("sh -c 'tail /dev/zero; echo \"tail: $?\"; exit 3'", timeout=60)   # a child chosen
        assert (r.exit_code, r.stdout, r.failure_class) == (3, b"tail: 137\n", "task") and "out of memory" in r.fault
        killed = await sb.exec("kill -9 $$", timeout=60)   # a 137 of no OOM says nothing of memory
        assert (killed.exit_code, killed.failure_class, killed.fault) == (137, "", "")
        failed = [e for e in await events_of(stack, sb.id, until={"task_failed"}) if e.type == "task_failed"]
        for _ in range(100):
            if len(failed) == 3:
                break
            await asyncio.sleep(0.05)
            failed = [e for e in await events_of(stack, sb.id) if e.type == "task_failed"]
        assert ["out of memory" in e.detail for e in failed] == [True, True, False], failed
        assert stack.edge.backend.backends["container"].limit_events(sb.id)["oom_kill"] > 0, "the memory cgroup never OOM-killed"
        assert r.peak_memory <= (64 << 20) + (1 << 20)
        assert (await sb.exec("echo ok")).stdout == b"ok\n"
        assert (await bystander.exec("echo fine")).stdout == b"fine\n"


async def test_disk_fill_gives_enospc_at_the_cap(client, stack):
    async with await client.create(resources=libdsec.Resources(disk="20Mi")) as sb:
        r = await sb.exec("dd if=/dev/zero of=/tmp/big bs=1M count=100", timeout=60)
        assert r.exit_code != 0
        assert b"Disk quota exceeded" in r.stderr or b"No space left" in r.stderr, r.stderr
        size = int((await sb.exec("wc -c < /tmp/big")).stdout)
        assert 10 << 20 <= size <= 21 << 20, size
        assert (await sb.exec("rm /tmp/big; echo ok")).stdout == b"ok\n"


async def test_output_flood_is_truncated(client, stack):
    async with await client.create() as sb, await client.create() as bystander:
        r = await sb.exec("yes | head -c 50000000", max_output=1 << 20, timeout=60)
        assert r.truncated and len(r.stdout) == 1 << 20 and r.exit_code == 0
        flood = asyncio.create_task(sb.exec("yes", max_output=1 << 20, timeout=3))   # unbounded, for 3 s
        lines = [ev async for ev in bystander.stream("for i in 1 2 3 4 5; do echo $i; sleep 0.2; done")]
        assert [ev.data for ev in lines[:-1]] == [b"%d\n" % i for i in range(1, 6)]
        with pytest.raises(libdsec.ExecTimeout) as ei:
            await flood
        assert ei.value.truncated and len(ei.value.stdout) == 1 << 20
        assert (await sb.exec("echo ok")).stdout == b"ok\n"


async def test_hanging_command_times_out_and_its_tree_is_gone(client, stack):
    async with await client.create() as sb:
        with pytest.raises(libdsec.ExecTimeout) as ei:
            await sb.exec("echo started; sleep 100000 & sleep 100000", timeout=2)
        assert isinstance(ei.value, TimeoutError) and ei.value.stdout == b"started\n"
        sleeps = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "100000"]]
        assert sleeps == [], "the timed-out command's process tree survived"
        # and reaped: its helper (dsec-enter), in none of the exec's cgroups, outlives the kill and reaps the
        # command. Killed with it, it left the command's zombie to the host's init, the orphan reaper of its
        # pid namespace, which reaped it up to seconds later; the sandbox's init could not end before, and a
        # destroy right after a timeout took about 2 s (helper S2).
        base = stack.edge.backend.backends["container"]._sandboxes[sb.id].ids.base   # its processes' host uids
        zombies = [p.info for p in psutil.process_iter(["pid", "ppid", "name", "status", "uids"])
                   if p.info["status"] == psutil.STATUS_ZOMBIE and p.info["uids"]
                   and base <= p.info["uids"].real < base + 65536]
        assert zombies == [], zombies
        assert (await sb.exec("echo ok")).stdout == b"ok\n"
    sb = await client.create()
    with pytest.raises(libdsec.ExecTimeout):
        await sb.exec("sleep 100000", timeout=1)
    began = time.monotonic()
    await sb.destroy()
    assert time.monotonic() - began < 1.0


async def test_isolation_is_real(client, stack):
    async with await client.create() as sb:
        r = await sb.exec("hostname; cat /proc/net/dev | tail -n +3 | cut -d: -f1; echo $$; cat /proc/1/cmdline")
        host, *rest = r.stdout.decode().split("\n")
        assert host == sb.id
        assert [x.strip() for x in rest[:-2]] == ["lo"], r.stdout
        assert int(rest[-2]) > 1 and "catatonit" in rest[-1]
        status = (await sb.exec("cat /proc/self/status")).stdout.decode()
        assert "NoNewPrivs:\t0" in status and "Seccomp:\t2" in status   # setuid programs work; the filter holds
        cap_eff = int(next(line for line in status.splitlines() if line.startswith("CapEff")).split()[1], 16)
        assert not cap_eff & (1 << 21), "CAP_SYS_ADMIN must be dropped"
        assert (await sb.exec("mount -t tmpfs x /mnt")).exit_code != 0
        pids = procs_under(groups(stack, sb)["pids"])
        assert pids
        for ns in ("mnt", "pid", "net", "uts", "ipc"):
            assert os.readlink(f"/proc/{pids[0]}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns


async def test_write_file_through_planted_symlinks_stays_inside(client, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("host data")
    async with await client.create() as sb:
        await sb.exec(f"ln -s {victim} /tmp/evil; ln -s ../../../../../../../{tmp_path} /tmp/up")
        for path in ("/tmp/evil", "/tmp/up/victim"):
            try:
                await sb.write_file(path, b"pwned")
                landed = True
            except libdsec.FileOpError:
                landed = False
            if landed:   # then it landed inside the sandbox's own root, at the link's target there
                assert (await sb.exec(f"cat {victim}")).stdout == b"pwned"
        assert victim.read_text() == "host data"
        try:
            data = await sb.read_file("/tmp/evil")
        except libdsec.FileOpError:
            data = b""
        assert data != b"host data"


async def test_no_way_to_the_edge_process_group_or_terminal(client, stack):
    """A command has its own session: kill(0) hits only its own group, /dev/tty is no terminal."""
    async with await client.create() as sb:
        r = await sb.exec("kill -9 0; echo unreachable")
        assert r.exit_code == 137 and r.stdout == b""
        r = await sb.exec("echo x > /dev/tty")
        assert r.exit_code != 0 and b"No such device" in r.stderr, r.stderr
        r = await sb.exec("mknod /tmp/console c 5 1 && cat /tmp/console")
        assert r.exit_code != 0
        assert stack.edge.sandboxes and (await sb.exec("echo alive")).stdout == b"alive\n"


async def test_a_sandbox_mounts_few_superblocks_of_its_own(client):
    """Every superblock on the host costs each memory cgroup a slot in its shrinker map, for as long as the
    host runs (the kernel sizes each memcg's map by the most superblocks ever alive at once): with 5,000
    sandboxes that was ~0.5 MiB per sandbox (kmalloc-1k, alloc_shrinker_info). A sandbox mounts three of its
    own: its root overlay, /proc and /dev/pts (its IPC namespace's mqueue is a fourth, not mounted). /dev
    and /sys bind the node's (nodemounts.py), /dev/shm a directory of its writable layer, its masked dirs
    the node's trusted tmpfs. Before: seven, then five (sysfs and a /dev tmpfs of its own)."""
    async with await client.create() as a, await client.create() as b:
        seen = []
        for sb in (a, b):
            r = await sb.exec("cat /proc/self/mountinfo")
            assert r.exit_code == 0, r.stderr
            devs = {}
            for line in r.stdout.decode().splitlines():
                fields = line.split()
                devs[fields[2]] = fields[fields.index("-") + 1]
            seen.append(devs)
        own = {dev: kind for dev, kind in seen[0].items() if dev not in seen[1]}
        assert sorted(own.values()) == ["devpts", "overlay", "proc"], own

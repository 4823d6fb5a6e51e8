"""The microvm kind's templates (issue 15): creates restore a saved VM instead of booting one, and what
each restored VM must own is its own: hostname, clock, RNG state, files. A template follows its layers
(a layer rewritten in place is a new template) and one that cannot restore fails its create typed,
leaving nothing, and is built again by the next."""
from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

import libdsec
from edge import erofs
from edge.backends.base import BackendError, Limits, SandboxSpec
from edge.backends.microvm import MicroVMBackend, accel, guest
from edge.backends.microvm.qemu import qemu_processes
from tests import leaks

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
async def vmnode(stack, kind_nodes):
    return await kind_nodes.get(stack, "microvm")


@pytest.fixture(scope="module")
async def backend(tmp_path_factory):
    """A microvm backend of its own (no bus), for what the SDK does not reach: layers rewritten in place."""
    state = tmp_path_factory.mktemp("vmb")
    b = MicroVMBackend(state, "k-vmb")
    with leaks.live("k-vmb", state):
        await b.start()
        try:
            yield b
        finally:
            await b.stop()
            assert b.leftovers() == []


async def test_eight_creates_from_one_template_share_nothing(client, vmnode):
    backend = vmnode.edge.backend.backends["microvm"]
    built = backend._templates.built
    sbs = []
    try:   # at once (one after another: 26 s of CI's budget): racing creates share the one template built
        sbs = await client.create_many(8, backend="microvm", timeout=120)
        # one template for the 8 (none if an earlier module's create of this size built it on this shared node)
        assert backend._templates.built - built <= 1, "one template for the 8"
        outs = await asyncio.gather(*(sb.exec("hostname; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; "
                                              "echo; date +%s; echo $(hostname) > /tmp/mine; ls /tmp", timeout=60)
                                      for sb in sbs))
        now = time.time()
        names, rngs, clocks, files = zip(*((o.stdout.decode().split("\n", 3)) for o in outs))
        assert list(names) == [sb.id for sb in sbs], names
        assert len(set(rngs)) == 8 and all(len(r) == 32 for r in rngs), rngs   # reseeded: no shared RNG state
        assert all(abs(int(c) - now) < 30 for c in clocks), (clocks, now)       # the host's clock, not the template's
        assert all(f.split() == ["mine"] for f in files), files
        mine = await asyncio.gather(*(sb.read_file("/tmp/mine") for sb in sbs))
        assert [m.strip() for m in mine] == [sb.id.encode() for sb in sbs]
    finally:
        await asyncio.gather(*(sb.destroy() for sb in sbs), return_exceptions=True)
    assert all(backend.residue(sb.id) == [] for sb in sbs)


async def test_the_agent_keeps_its_oom_protection_and_commands_get_none(client, vmnode):
    """The agent (a microVM's pid 1 for its commands) is the last the guest's OOM killer takes: -1000. Its
    exec child is a vfork (dsec-agent.c exec_spawn) that sets its own score to 0 before its exec; the kernel
    passes such a write on to every user of the memory except from a vfork child, so the agent's stays.
    Checked with a child made by clone(CLONE_VM) alone: the agent read 0 after one exec."""
    async with await client.create(backend="microvm", timeout=120) as sb:
        for _ in range(3):
            r = await sb.exec("cat /proc/1/oom_score_adj /proc/self/oom_score_adj; sh -c 'cat /proc/self/oom_score_adj'")
            assert r.stdout.split() == [b"-1000", b"0", b"0"], r


async def test_a_warm_microvm_is_claimed_renamed_and_leaves_nothing(client, vmnode):
    backend = vmnode.edge.backend.backends["microvm"]
    await client.set_warm_pool("w-vm", backend="microvm", min=1, max=1)
    try:
        for _ in range(600):
            pools = [p for p in await client.warm_pools() if p.spec.name == "w-vm"]
            if pools and pools[0].total:
                break
            await asyncio.sleep(0.1)
        assert pools and pools[0].total == 1, "the pool never filled"
        hits = vmnode.edge.warm.hits
        sb = await client.create(backend="microvm", timeout=60)
        assert vmnode.edge.warm.hits == hits + 1
        key = backend._vms[sb.id].key
        assert key.startswith("warm-") and key != sb.id
        r = await sb.exec("hostname; ls /tmp")
        assert r.stdout.split() == [sb.id.encode()], r.stdout      # its own name, nothing of the warm-up
        await sb.destroy()
        assert backend.residue(sb.id) == [] and not backend._dir(key).exists()
    finally:
        await client.delete_warm_pool("w-vm")


def _layer(tmp: Path, version: str, dst: Path) -> None:
    root = tmp / f"root-{version}"
    erofs.busybox_rootfs(root)
    (root / "etc" / "version").write_text(version)
    erofs.pack_dir(root, dst)


async def _run(b: MicroVMBackend, sandbox_id: str, cmd: str) -> bytes:
    out = bytearray()

    async def sink(_stream, data: bytes) -> None:
        out.extend(data)
    res = await b.exec(sandbox_id, ["/bin/sh", "-c", cmd], env={}, cwd="/", stdin=None, timeout=30, sink=sink)
    assert res.exit_code == 0, (res, out)
    return bytes(out)


async def test_a_layer_rewritten_in_place_gets_a_new_template(backend, tmp_path):
    layer = tmp_path / "layer.erofs"
    _layer(tmp_path, "one", layer)
    spec = lambda i: SandboxSpec(f"lay{i}", [str(layer)], Limits(memory=128 << 20), kind="microvm")  # noqa: E731
    built = backend._templates.built
    await backend.create(spec(1))
    try:
        assert await _run(backend, "lay1", "cat /etc/version") == b"one"
        await backend.destroy("lay1")
        _layer(tmp_path, "two", layer)      # the same path, other bytes
        await backend.create(spec(2))
        assert await _run(backend, "lay2", "cat /etc/version") == b"two"
        assert backend._templates.built == built + 2
    finally:
        for i in (1, 2):
            if f"lay{i}" in backend.sandboxes():
                await backend.destroy(f"lay{i}")


async def test_a_template_that_does_not_restore_fails_typed_leaves_nothing_and_is_rebuilt(backend, tmp_path):
    layer = tmp_path / "layer.erofs"
    _layer(tmp_path, "three", layer)
    spec = lambda i: SandboxSpec(f"bad{i}", [str(layer)], Limits(memory=128 << 20), kind="microvm")  # noqa: E731
    before = set(backend._templates.held())
    await backend.create(spec(1))
    await backend.destroy("bad1")
    (key,) = set(backend._templates.held()) - before
    tpl = backend._templates._ready[key]
    tpl.state.write_bytes(b"QEVM garbage" * 100)       # its device state, corrupted
    with pytest.raises(BackendError, match="restoring"):
        await backend.create(spec(2))
    assert backend.residue("bad2") == [] and "bad2" not in backend.sandboxes()
    assert tpl.key not in backend._templates.held(), "a template that fails is dropped"
    built = backend._templates.built
    await backend.create(spec(3))
    try:
        assert await _run(backend, "bad3", "cat /etc/version") == b"three"
        assert backend._templates.built == built + 1
    finally:
        await backend.destroy("bad3")


async def test_the_node_record_names_the_accelerator(stack, vmnode):
    backend = vmnode.edge.backend.backends["microvm"]
    info = vmnode.edge.capacity.node_info()
    assert info.accel == {"microvm": backend.accel} and backend.accel in ("kvm", "tcg")
    if accel.kvm_device():   # this host's kind: a PVM /dev/kvm that opens and hangs a guest: the probe said so
        assert json.loads((guest.cache_dir() / "accel.json").read_text())


async def test_below_the_guest_minimum_is_refused_at_once(client, vmnode):
    """Below a VM's least memory, or with a single process (its agent forks beside each command: a template
    never came up, and the create failed 5 s later as an environment failure, helper V), refused at once."""
    t = time.monotonic()
    with pytest.raises(libdsec.InvalidRequest, match="128"):
        await client.create(backend="microvm", resources=libdsec.Resources(memory="64Mi"), timeout=30)
    with pytest.raises(libdsec.InvalidRequest, match="pids: a microvm sandbox needs at least 2"):
        await client.create(backend="microvm", resources=libdsec.Resources(pids=1), timeout=30)
    with pytest.raises(libdsec.InvalidRequest, match="disk: a microvm sandbox's writable disk is at least 16Mi"):
        await client.create(backend="microvm", resources=libdsec.Resources(disk="1Mi"), timeout=30)   # (was 14.7Mi)
    assert time.monotonic() - t < 5
    t = time.monotonic()   # a network on a node without Aether: refused before a template boots (it took 2.5-11 s)
    with pytest.raises(libdsec.InvalidRequest, match="runs no Aether"):
        await client.create(backend="microvm", resources=libdsec.Resources(memory="216Mi"),
                            network=libdsec.Network(allow=["example.test"]), timeout=30)
    assert time.monotonic() - t < 1


async def test_qemu_sees_only_its_own_disks_and_devices(client, vmnode):
    """QEMU runs as the sandbox's uid in a mount namespace of its own: the node's state dir (other VMs'
    disks, templates) and layer cache are empty to it, /dev holds only what a TCG guest needs."""
    backend = vmnode.edge.backend.backends["microvm"]
    a = await client.create(backend="microvm", timeout=120)
    b = await client.create(backend="microvm", timeout=120)
    try:
        (pid,) = qemu_processes(backend.state_dir, backend._vms[a.id].key)
        root = Path(f"/proc/{pid}/root")
        assert os.stat(f"/proc/{pid}").st_uid == backend._vms[a.id].ids.base != 0
        assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        assert list((root / backend.state_dir.relative_to("/")).iterdir()) == [], "the node's state dir is hidden"
        assert not (root / backend._dir(b.id).relative_to("/")).exists(), "a neighbour's disk is out of sight"
        assert sorted(p.name for p in (root / "dev").iterdir()) == sorted(
            ("null", "zero", "full", "random", "urandom") + (("kvm",) if backend.accel == "kvm" else ()))
        assert (await a.exec("echo ok")).stdout == b"ok\n"      # and the VM still runs
    finally:
        await asyncio.gather(a.destroy(), b.destroy())


async def test_a_vm_does_not_keep_the_hosts_other_mounts_alive(client, vmnode, tmp_path):
    """QEMU's mount namespace was a copy of every mount of the host: a filesystem the host unmounted while
    a VM ran stayed alive in it. Another node's upper pool so stayed mounted, its loop device attached to
    the deleted image, for as long as a VM started while that node ran (helper S). It now holds only the
    mounts QEMU reads: the host's loop mount, unmounted, lets its device go."""
    import subprocess
    image = tmp_path / "pool.img"
    subprocess.run(["truncate", "-s", "16M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    point = tmp_path / "other-node"
    point.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(point)], check=True)
    try:
        async with await client.create(backend="microvm", timeout=120) as sb:
            subprocess.run(["umount", str(point)], check=True)
            held = subprocess.run(["losetup", "-j", str(image)], capture_output=True, text=True).stdout
            assert held == "", f"the VM keeps the host's loop mount alive: {held}"
            assert (await sb.exec("echo ok")).stdout == b"ok\n"      # and the VM still runs
    finally:
        subprocess.run(["umount", str(point)], capture_output=True)
        for dev in subprocess.run(["losetup", "-j", str(image)], capture_output=True, text=True).stdout.splitlines():
            subprocess.run(["losetup", "-d", dev.split(":")[0]], capture_output=True)


async def _seen_starting(client, memory: str):
    """A create of a VM of this memory (a size no other test uses: its template boots, seconds) and its
    record while it is still starting."""
    resources = libdsec.Resources(memory=memory)
    task = asyncio.ensure_future(client.create(backend="microvm", resources=resources, timeout=120))
    size = resources.to_wire().memory
    for _ in range(400):
        starting = next((r for r in await client.list(all_states=True)
                         if r.state == "starting" and r.resources.memory == size), None)
        if starting is not None or task.done():
            break
        await asyncio.sleep(0.02)
    assert starting is not None, "the create was never seen starting"
    return task, starting


async def test_a_starting_vm_is_waited_for_by_get_and_destroyed_by_dsec_rm(client, vmnode):
    """A sandbox still starting (a VM whose template boots: seconds) was "not found (starting)" to get() and
    to `dsec rm`, though it came up a moment later (helper V). get() waits for it now, and rm destroys it."""
    import subprocess
    import sys

    async def got() -> None:
        task, starting = await _seen_starting(client, "200Mi")
        sb = await client.get(starting.sandbox_id)
        assert sb.id == starting.sandbox_id and (await sb.exec("echo up")).stdout == b"up\n"
        assert (await task).id == sb.id
        await sb.destroy()

    async def removed() -> None:
        task, starting = await _seen_starting(client, "208Mi")
        env = dict(os.environ, DSEC_CREDS=client.creds or "")
        rm = await asyncio.to_thread(subprocess.run, [str(Path(sys.executable).parent / "dsec"), "rm", "--nats",
                                                      client.url, starting.sandbox_id],
                                     capture_output=True, text=True, env=env)
        assert rm.returncode == 0 and rm.stdout.strip() == starting.sandbox_id, rm.stderr
        assert (await client._record(starting.sandbox_id)).state == "destroyed"
        await task   # (it did start; destroyed since)
    await asyncio.gather(got(), removed())   # (their templates boot at once: one after the other, 13 s of CI's)


async def test_a_suspended_vm_snapshots_and_stays_suspended(client, vmnode):
    backend = vmnode.edge.backend.backends["microvm"]
    sb = await client.create(backend="microvm", timeout=120)
    try:
        await sb.exec("echo kept > /root/f")
        await sb.suspend()
        snap = await sb.snapshot(timeout=120)
        assert (await backend._vms[sb.id].qmp.execute("query-status"))["status"] == "paused"
        await sb.resume()
        assert (await sb.exec("echo still writable > /root/g && cat /root/f")).stdout == b"kept\n"   # thawed
        (fork,) = await client.fork(snap, 1, backend="microvm", timeout=120)
        assert (await fork.exec("cat /root/f; ls /root")).stdout == b"kept\nf\n"
        await fork.destroy()
    finally:
        await sb.destroy()


async def test_a_sparse_file_past_the_disk_limit_is_refused_and_the_vm_goes_on(client, vmnode):
    """As for containers, a snapshot packs files at their apparent size: past the disk limit it is refused
    (InvalidRequest), the tar in the guest is stopped and the layer thawed."""
    sb = await client.create(backend="microvm", resources=libdsec.Resources(disk="16Mi"), timeout=120)
    try:
        await sb.exec("truncate -s 1G /root/sparse")
        with pytest.raises(libdsec.InvalidRequest, match="disk limit"):
            await sb.snapshot(timeout=120)
        assert (await sb.exec("rm /root/sparse && echo ok > /root/after && cat /root/after")).stdout == b"ok\n"
        assert (await sb.exec("ps -o comm | grep -c tar || true")).stdout.strip() == b"0"
    finally:
        await sb.destroy()


async def test_qemus_translation_cache_fits_its_cgroup_allowance(client, vmnode):
    """Under TCG, QEMU's own memory beside the guest's RAM must stay below what its cgroup allows for it
    (kinds.OVERHEAD): its translation cache, by default a 1 GiB mapping filled as new code runs, is bounded."""
    from bus import kinds
    backend = vmnode.edge.backend.backends["microvm"]   # (under KVM there is no cache: the bound holds too)
    sb = await client.create(backend="microvm", timeout=120)
    try:
        (pid,) = qemu_processes(backend.state_dir, backend._vms[sb.id].key)
        anon = []
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            f = line.split()
            if len(f) == 5:     # no path: an anonymous mapping of QEMU's own (the guest's RAM is the memfd)
                lo, hi = (int(x, 16) for x in f[0].split("-"))
                anon.append(hi - lo)
        assert max(anon) <= 64 << 20 < kinds.OVERHEAD["microvm"][0], sorted(anon)[-3:]
    finally:
        await sb.destroy()


async def test_a_memory_snapshot_forks_go_on_with_its_running_processes(client, vmnode):
    """snapshot(memory=True): forks go on from that instant. A process whose state lives only in its memory
    (a counter from a random start) runs on in each fork from where it was; each fork is its own (hostname,
    RNG); the source goes on too, and an exec streaming through the save loses and repeats no byte."""
    backend = vmnode.edge.backend.backends["microvm"]
    sb = await client.create(backend="microvm", timeout=120)
    forks = []
    try:
        ticker = await sb.exec("n=$(od -An -N2 -tu2 /dev/urandom | tr -d ' '); echo $n > /root/start; "
                               "while :; do n=$((n+1)); echo $n > /root/c; mv /root/c /root/count; sleep 0.2; done",  # (whole)
                               background=True)
        # frames in flight both ways while the VM is saved: 64 KiB chunks out, credit back
        lines = await sb.exec("for i in $(seq 1 400); do echo line$i; head -c 65536 /dev/zero | tr '\\0' x; echo; "
                              "done", background=True, max_output=32 << 20)
        for _ in range(100):
            if (await sb.exec("cat /root/count 2>/dev/null || true")).stdout.strip():
                break
        start = int((await sb.read_file("/root/start")).strip())
        snap = await sb.snapshot(memory=True, timeout=120)
        assert not lines.done, "the stream ended before the save: it tested nothing"
        assert (snap.memory_node, snap.memory_kind) == ("k-microvm", "microvm")
        assert snap.id in backend.memories()
        assert (await lines.wait()).stdout == b"".join(b"line%d\n%s\n" % (i, b"x" * 65536) for i in range(1, 401))
        # the files-only fork boots a template of its own meanwhile (one after the other: CI's budget)
        got = await asyncio.gather(client.fork(snap, 2, timeout=120),
                                   client.fork(snap, 1, memory=False, backend="microvm", timeout=120),
                                   return_exceptions=True)
        forks = [f for g in got if not isinstance(g, BaseException) for f in g]   # (destroyed at the end)
        for g in got:
            if isinstance(g, BaseException):
                raise g
        files_only = forks[2]
        assert [f.backend for f in forks] == ["microvm", "microvm", "microvm"]

        async def goes_on(f) -> str:
            out = (await f.exec("hostname; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; "
                                "cat /root/count; sleep 1; cat /root/count; ps -o args | grep -c '[w]hile :'")).stdout
            name, rng, before, after, tickers = out.decode().split()
            assert name == f.id
            assert start < int(before) < int(after), (start, before, after)   # its memory's counter, running on
            assert tickers == "1", out                                         # the source's process, not a new one
            assert (await f.exec("seq 1 5000 | wc -l")).stdout == b"5000\n"   # its own execs are not mixed with it
            return rng
        assert len(set(await asyncio.gather(*(goes_on(f) for f in forks[:2])))) == 2
        again = int((await sb.read_file("/root/count")).strip())
        await asyncio.sleep(0.6)
        assert int((await sb.read_file("/root/count")).strip()) > again     # the source's ticker goes on
        await ticker.kill()
        assert (await ticker.wait()).exit_code != 0
        out = (await files_only.exec("cat /root/start; ps -o args | grep -c '[w]hile :' || true")).stdout.split()
        assert out == [str(start).encode(), b"0"], out       # its files, none of its processes
    finally:
        await asyncio.gather(*(f.destroy() for f in forks), sb.destroy(), return_exceptions=True)
    assert all(backend.residue(x.id) == [] for x in [sb, *forks])


async def test_a_memory_snapshot_is_refused_or_forked_only_as_it_can_be(client, vmnode):
    """Typed refusals, each leaving nothing: memory of a container (Unsupported, before anything is sent);
    a fork of it at other resources or of no memory (InvalidRequest); a fork whose memory the node no longer
    holds (ImageNotFound, not retried elsewhere)."""
    backend = vmnode.edge.backend.backends["microvm"]
    ct = await client.create(timeout=60)
    sb = await client.create(backend="microvm", timeout=120)
    try:
        with pytest.raises(libdsec.Unsupported, match="memory"):
            await ct.snapshot(memory=True)
        plain = await sb.snapshot(timeout=120)
        with pytest.raises(libdsec.InvalidRequest, match="has no memory"):
            await client.create(from_snapshot=plain, memory=True, timeout=60)
        snap = await sb.snapshot(memory=True, timeout=120)
        with pytest.raises(libdsec.InvalidRequest, match="fixes the resources"):
            await client.create(from_snapshot=snap, resources=libdsec.Resources(memory="512Mi"), timeout=60)
        backend.drop_memory(snap.id)
        with pytest.raises(libdsec.ImageNotFound, match="not held"):
            await client.create(from_snapshot=snap, timeout=60)
        assert os.listdir(backend.state_dir / "vms") == [sb.id]     # the refused fork left no VM behind
        assert (await sb.exec("echo fine")).stdout == b"fine\n"
    finally:
        await asyncio.gather(ct.destroy(), sb.destroy(), return_exceptions=True)
    assert backend.residue(sb.id) == []


async def test_a_deleted_snapshots_memory_is_dropped_from_its_node(client, vmnode, monkeypatch):
    """The node holds a memory snapshot's RAM while its snapshot exists, and drops it (memfd, dir) once the
    snapshot is deleted, without waiting for another memory snapshot."""
    import edge.agent
    backend = vmnode.edge.backend.backends["microvm"]
    monkeypatch.setattr(edge.agent, "MEMORY_PRUNE_EVERY", 0.2)
    sb = await client.create(backend="microvm", timeout=120)
    try:
        snap = await sb.snapshot(memory=True, timeout=120)
        await asyncio.sleep(1.0)
        assert snap.id in backend.memories()                  # its record exists: kept
        await client.delete_snapshot(snap)
        for _ in range(100):
            if snap.id not in backend.memories():
                break
            await asyncio.sleep(0.1)
        assert snap.id not in backend.memories() and not (backend._memory_root / snap.id).exists()
    finally:
        await sb.destroy()

"""The fullvm kind (issue 15): a whole Debian under QEMU q35, its systemd pid 1 of the commands' world,
restored from a template per (layers, size) like a microVM, each restore its own machine; its poweroff
ends the sandbox as failed, and an image that cannot boot as a full VM fails typed leaving nothing."""
from __future__ import annotations

import asyncio
import os
import time

import pytest

import libdsec
from edge import erofs
from edge.backends.base import BackendError, Limits, SandboxSpec
from edge.backends.fullvm import FullVMBackend
from edge.backends.microvm import guest
from tests import leaks
from tests.conftest import ended_record

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
async def fvmnode(stack, kind_nodes):
    return await kind_nodes.get(stack, "fullvm")


async def test_a_full_vm_is_a_whole_debian_and_each_restore_its_own(client, fvmnode):
    backend = fvmnode.edge.backend.backends["fullvm"]
    built = backend._templates.built
    sbs = await asyncio.gather(*(client.create(backend="fullvm", timeout=180) for _ in range(3)))
    try:
        assert backend._templates.built - built <= 1, "one template, three restores"   # (or an earlier one's)
        outs = [(await sb.exec("cat /proc/1/comm; systemctl is-system-running; uname -r; hostname; "
                               "cat /etc/machine-id; . /etc/os-release; echo $VERSION_CODENAME", timeout=60))
                for sb in sbs]
        kernel = guest.build().version
        ids = set()
        for sb, out in zip(sbs, outs):
            comm, state, release, name, machine_id, codename = out.stdout.decode().split()
            assert comm == "systemd" and state == "running", out     # (busybox's /etc over Debian's too)
            assert release == kernel and release != os.uname().release, out    # its own kernel
            assert name == sb.id and codename == "bookworm", out
            ids.add(machine_id)
        assert len(ids) == 3, f"restores share a machine-id: {ids}"
    finally:
        await asyncio.gather(*(sb.destroy() for sb in sbs), return_exceptions=True)
    assert all(backend.residue(sb.id) == [] for sb in sbs)


READ_OS = ("c() { awk '/^Cached:/ { print $2 }' /proc/meminfo; }; a=$(c); "
           "cat /usr/lib/x86_64-linux-gnu/*.so* | wc -c; echo $(( $(c) - a ))")


async def test_a_full_vms_os_layer_is_read_through_dax_not_copied_into_its_memory(client, fvmnode):
    """The OS layer (150 MiB, under every full VM) is a virtio-pmem device the guest mounts with DAX: its
    files are read straight from the host's page cache of the layer file, shared by every full VM on the
    node, instead of each guest copying what it reads into its own RAM. Reading 50 MB of the OS's libraries
    grew the guest's page cache by ~25 MB on a disk (virtio-blk) and grows it by well under 8 MB."""
    async with await client.create(backend="fullvm", timeout=180) as sb:
        r = await sb.exec(f"ls /sys/block; {READ_OS}", timeout=60)
        assert r.exit_code == 0, r
        *devices, read, grown = r.stdout.decode().split()
        assert "pmem0" in devices, r.stdout
        assert int(read) > 40 << 20 and int(grown) < 8 << 10, f"read {read} bytes, page cache grew {grown} KiB"


async def test_a_full_vm_writing_over_its_pmem_changes_no_byte_of_the_hosts_layer(client, fvmnode):
    """The attack on the shared layer from inside. The OS layer file is mapped into every full VM on the node;
    a guest's root finds it as /dev/pmem0. The guest's kernel holds it read-only, and a privileged VM's root
    that makes it writable and writes 8 MiB over it changes nothing: QEMU maps the file read-only and drops
    the writes, so the host's file keeps every byte and both VMs still read the same libraries as the host."""
    from edge.backends.fullvm import osimage
    from edge.erofs import file_digest
    files = ["usr/lib/x86_64-linux-gnu/libc.so.6", "usr/bin/ls"]
    look = "echo 3 > /proc/sys/vm/drop_caches; sha256sum " + " ".join(f"/{f}" for f in files)
    before = file_digest(osimage.path())
    expected = await asyncio.to_thread(_host_sums, osimage.path(), files)
    async with await client.create(backend="fullvm", timeout=180, privileged=True) as bad, \
            await client.create(backend="fullvm", timeout=180) as other:
        r = await other.exec("dd if=/dev/zero of=/dev/pmem0 bs=4k count=1 oflag=direct && echo wrote", timeout=60)
        assert b"wrote" not in r.stdout and r.exit_code != 0, r      # a root command: refused
        r = await bad.exec("blockdev --setrw /dev/pmem0 && "
                           "dd if=/dev/urandom of=/dev/pmem0 bs=1M count=8 oflag=direct && echo wrote", timeout=60)
        assert b"wrote" in r.stdout, r      # the write went through to its device...
        for sb in (bad, other):             # ...and nothing read changed
            r = await sb.exec(look, timeout=60)
            assert [line.split()[0] for line in r.stdout.decode().splitlines()] == expected, r
    assert file_digest(osimage.path()) == before


def _host_sums(layer, paths: list[str]) -> list[str]:
    """sha256 of files of an EROFS layer, read on the host."""
    import hashlib
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as mnt:
        subprocess.run(["mount", "-t", "erofs", "-o", "ro", str(layer), mnt], check=True)
        try:
            return [hashlib.sha256(open(os.path.join(mnt, p), "rb").read()).hexdigest() for p in paths]
        finally:
            subprocess.run(["umount", mnt], check=True)


async def test_a_full_vm_forks_from_its_memory_with_its_services_running(client, fvmnode):
    """A service systemd started before a memory snapshot runs on in the fork, as the same process;
    the fork is still a whole OS with its own hostname and machine-id."""
    backend = fvmnode.edge.backend.backends["fullvm"]
    sb = await client.create(backend="fullvm", timeout=180)
    fork = None
    try:
        await sb.exec("systemd-run --unit=ticker sh -c 'while :; do sleep 0.3; done' && "
                      "systemctl show -p MainPID --value ticker > /root/pid", timeout=60)
        snap = await sb.snapshot(memory=True, timeout=180)
        (fork,) = await client.fork(snap, 1, timeout=180)
        out = (await fork.exec("systemctl is-active ticker; cat /root/pid; systemctl show -p MainPID --value ticker; "
                               "systemctl is-system-running; hostname; cat /etc/machine-id", timeout=60)).stdout.split()
        mine = (await sb.exec("cat /etc/machine-id")).stdout.strip()
        assert out[:5] == [b"active", out[1], out[1], b"running", fork.id.encode()], out   # the same process
        assert out[5] != mine, "the fork shares its source's machine-id"
    finally:
        await asyncio.gather(*(x.destroy() for x in (sb, fork) if x is not None), return_exceptions=True)
    assert backend.residue(sb.id) == [] and (fork is None or backend.residue(fork.id) == [])


async def test_its_poweroff_ends_the_sandbox_failed_and_leaves_nothing(client, fvmnode):
    backend = fvmnode.edge.backend.backends["fullvm"]
    sb = await client.create(backend="fullvm", timeout=180)
    try:
        try:     # systemd's shutdown kills the command (a signal's exit), or the VM's end cuts it short
            r = await sb.exec("systemctl poweroff; sleep 60", timeout=90)
            assert r.exit_code < 0 or r.exit_code > 128, r
        except libdsec.SandboxNotFound as err:
            assert err.reason == "failed", err
        rec = await ended_record(client, sb.id, 60)
        assert rec.state == "failed" and "VM exited" in rec.reason, rec
    finally:
        with pytest.raises(libdsec.SandboxNotFound):
            await sb.destroy()
    assert backend.residue(sb.id) == []


async def test_below_the_full_vms_minimum_is_refused_at_once(client, fvmnode):
    t = time.monotonic()
    with pytest.raises(libdsec.InvalidRequest, match="256"):
        await client.create(backend="fullvm", resources=libdsec.Resources(memory="192Mi"), timeout=30)
    assert time.monotonic() - t < 5


async def test_an_image_that_cannot_boot_as_a_full_vm_fails_typed_leaving_nothing(tmp_path):
    """A layer over the OS whose /lib/systemd/systemd is no program: the create fails naming why, with no
    QEMU, dir, group or template left."""
    root = tmp_path / "root"
    erofs.busybox_rootfs(root)
    (root / "lib" / "systemd").mkdir(parents=True)
    (root / "lib" / "systemd" / "systemd").write_text("not a program\n")
    layer = tmp_path / "nosystemd.erofs"
    erofs.pack_dir(root, layer)
    state = tmp_path / "state"
    b = FullVMBackend(state, "k-fvbad")
    with leaks.live("k-fvbad", state):
        await b.start()
        try:
            with pytest.raises(BackendError, match="cannot boot as a full VM"):
                await b.create(SandboxSpec("bad1", [str(layer)], Limits(memory=256 << 20), kind="fullvm"))
            assert b.residue("bad1") == [] and b.sandboxes() == []
        finally:
            await b.stop()
        assert b.leftovers() == []

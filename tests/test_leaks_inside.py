"""What a sandbox can read of the host and its neighbours (issue 12, leaks), each tried from inside."""
from __future__ import annotations

import asyncio
import errno

import pytest

import libdsec
from tests.test_attacks import armed

pytestmark = pytest.mark.timeout(120)


async def test_mountinfo_and_cgroup_name_no_host_path(client, stack):
    """/proc/self/mountinfo shows no host directory (layer cache, writable layers, the trusted shell's),
    and /proc/self/cgroup shows the sandbox's own cgroups as "/" (a cgroup namespace)."""
    async with await client.create() as sb:
        info = (await sb.exec("cat /proc/self/mountinfo")).stdout.decode()
        state = str(stack.edge.backend.backends["container"].state_dir)
        assert state not in info and "dsec-" not in info, info
        assert "lowerdir=/" not in info and "upperdir=/" not in info, info
        for line in info.splitlines():   # no host directory bound in (roots within proc or devtmpfs are fine)
            root = line.split()[3]
            assert not root.startswith(("/tmp", "/work", "/var", "/run", "/home", "/root", "/srv", "/opt")), line
        groups = (await sb.exec("cat /proc/self/cgroup")).stdout.decode()
        assert "dsec-" not in groups and stack.edge.node not in groups, groups
        assert all(line.split(":", 2)[2] in ("/", "/x2") or line.split(":", 2)[2].startswith("/x")
                   for line in groups.splitlines()), groups


async def test_host_block_devices_disk_use_and_kernel_pages_are_masked(client, stack):
    """/sys/block (every loop backing file), btrfs qgroups (every sandbox's disk use), vmcoreinfo, and
    the kernel page tables of /proc (kpageflags, kpagecount, kpagecgroup), slabinfo, vmallocinfo,
    key-users read as empty."""
    async with await client.create() as sb:
        r = await sb.exec("for d in /sys/block /sys/class/block /sys/fs/btrfs /sys/devices/virtual/block; do "
                          "ls -A $d; done | wc -l; "
                          "cat /sys/kernel/vmcoreinfo /proc/kpageflags /proc/kpagecount /proc/kpagecgroup "
                          "/proc/slabinfo /proc/vmallocinfo /proc/key-users /proc/cmdline /proc/partitions "
                          "2>/dev/null | wc -c")
        assert r.stdout.split() == [b"0", b"0"], r.stdout + r.stderr


async def test_no_host_hotplug_events(client, stack, hostile):
    """A netlink uevent socket (the host's hotplug events: the sandbox's netns is the host user
    namespace's) is refused."""
    async with await client.create() as sb:
        await armed(sb, hostile)
        assert (await sb.exec("/tmp/hostile uevent")).stdout == f"{errno.EPERM}\n".encode()


async def test_no_vsock_to_the_hosts_hypervisor(client, stack, hostile):
    """vsock is no namespace's: a sandbox's AF_VSOCK socket reached past its network namespace to the host's
    hypervisor and its services (CID 2; helper-44). Refused, as Docker's default profile does."""
    async with await client.create() as sb:
        await armed(sb, hostile)
        assert (await sb.exec("/tmp/hostile vsock")).stdout == f"{errno.EPERM}\n".encode()


async def test_io_uring_is_refused(client, stack, hostile):
    """io_uring (a large kernel surface with a history of privilege escalations; Docker's default profile
    refuses it) made a ring in a sandbox: its setup, enter and register are EPERM now."""
    async with await client.create() as sb:
        await armed(sb, hostile)
        assert (await sb.exec("/tmp/hostile syscall io_uring")).stdout == f"{errno.EPERM}\n".encode()


async def test_page_cache_probe_on_shared_layers_is_refused(client, stack, hostile):
    """mincore and fadvise(DONTNEED) on a file of a shared layer would tell which files a neighbour
    reads (evict, wait, probe): both are refused."""
    async with await client.create() as sb:
        await armed(sb, hostile)
        r = await sb.exec("/tmp/hostile probe /bin/busybox")
        assert r.stdout == f"mincore={errno.EPERM} fadvise={errno.EPERM}\n".encode(), r.stdout


def dirty_pages(path) -> int:
    """The file's dirty pages (cachestat(2)): the host's whole Dirty count drained by writeback of what other
    tests wrote (1,079 -> 975 MiB in CI while one exec ran), which told nothing about sync."""
    import ctypes
    import os
    libc = ctypes.CDLL(None, use_errno=True)
    whole, stat = (ctypes.c_uint64 * 2)(0, 0), (ctypes.c_uint64 * 5)()   # (offset, length 0: to its end)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syscall(451, fd, ctypes.byref(whole), ctypes.byref(stat), 0) != 0:   # SYS_cachestat
            raise OSError(ctypes.get_errno(), "cachestat")
    finally:
        os.close(fd)
    return stat[1]   # (nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted)


async def test_sync_from_a_sandbox_does_not_flush_the_host(client, stack, tmp_path):
    """sync(2) inside is a no-op (success): it would flush every filesystem of the host (here: the 200 MiB
    of a file the host wrote and did not sync stay dirty). fsync of its own files succeeds (its overlay is
    volatile: the kernel omits sync calls to the upper, see the threat model)."""
    host_file = tmp_path / "dirty"
    with open(host_file, "wb") as f:
        for _ in range(200):
            f.write(b"\1" * (1 << 20))
    try:
        before = dirty_pages(host_file)
        assert before >= 150 << 8, f"the file has only {before >> 8} MiB dirty: cannot tell"
        async with await client.create() as sb:
            r = await sb.exec("echo data | dd of=/f conv=fsync 2>/dev/null && sync && cat /f")
            assert r.exit_code == 0 and r.stdout == b"data\n", r.stdout + r.stderr
            after = dirty_pages(host_file)
        assert after >= before // 2, f"a sandbox's sync flushed the host: {before >> 8} -> {after >> 8} MiB dirty"
    finally:
        host_file.unlink()


async def meminfo(sb) -> dict[str, int]:
    r = await sb.exec("cat /proc/meminfo")
    assert r.exit_code == 0, r.stderr
    return {line.split(":")[0]: int(line.split()[1]) for line in r.stdout.decode().splitlines() if line.strip()}


async def test_proc_views_follow_the_sandbox_and_survive_an_lxcfs_restart(client, stack):
    """/proc/meminfo, cpuinfo and uptime are the sandbox's (lxcfs under the edge's state dir): its memory
    limit, its use as it grows, its cores, its own uptime. When lxcfs is killed the edge starts it again
    and the running sandbox's views come back."""
    import os
    import signal
    async with await client.create(resources=libdsec.Resources(memory="64Mi", cpu=1)) as sb:
        before = await meminfo(sb)
        assert before["MemTotal"] == 65536, before
        await sb.exec("head -c 20971520 /dev/zero > /dev/shm/fill")
        after = await meminfo(sb)
        assert before["MemFree"] - after["MemFree"] >= 15 * 1024, (before, after)   # its own use, live
        cores = int((await sb.exec("grep -c ^processor /proc/cpuinfo")).stdout)
        assert cores == 1, f"cpuinfo shows {cores} cores for a 1-core sandbox"
        up = int((await sb.exec("cut -d. -f1 /proc/uptime")).stdout)
        with open("/proc/uptime") as f:
            host_up = float(f.read().split()[0])
        assert up < min(600, host_up - 1), (up, host_up)   # its own (since its init started), not the host's
        views = stack.edge.backend.backends["container"]._views
        restarts = views.restarts
        os.kill(views.proc.pid, signal.SIGKILL)
        for _ in range(100):
            r = await sb.exec("head -1 /proc/meminfo")
            if views.restarts > restarts and r.exit_code == 0 and b"65536" in r.stdout:
                break
            await asyncio.sleep(0.1)
        assert views.restarts > restarts, "lxcfs was not started again"
        assert r.exit_code == 0 and b"65536" in r.stdout, r.stdout + r.stderr
        assert (await meminfo(sb))["MemTotal"] == 65536


async def test_direct_writes_are_throttled_on_the_pool_device(client, stack):
    """blkio throttles each sandbox's I/O on the pool's loop device (what cgroup v1 can: direct and
    synchronous writes); the bytes a direct write makes are charged to the sandbox's own group."""
    from edge.backends.cgroups import IO_LIMITS
    backend = stack.edge.backend.backends["container"]
    device = backend._uppers.device()
    assert device, "the pool has no loop device"
    async with await client.create() as sb:
        group = backend._cgroups.sandbox(backend._key(sb.id))["blkio"]
        for name, value in IO_LIMITS:
            assert (group / name).read_text().split() == [device, str(value)], name
        r = await sb.exec("dd if=/dev/zero of=/tmp/d bs=1M count=8 oflag=direct 2>&1")
        assert r.exit_code == 0, r.stdout
        served = (group / "blkio.throttle.io_service_bytes").read_text()
        writes = [int(line.split()[2]) for line in served.splitlines()
                  if line.startswith(device + " ") and line.split()[1] == "Write"]
        assert writes and writes[0] >= 8 << 20, served

"""What a sandbox can read of the host and its neighbours (issue 12, leaks), each tried from inside."""
from __future__ import annotations

import errno

import pytest

from tests.test_attacks import armed

pytestmark = pytest.mark.timeout(120)


async def test_mountinfo_and_cgroup_name_no_host_path(client, stack):
    """/proc/self/mountinfo shows no host directory (layer cache, writable layers, the trusted shell's),
    and /proc/self/cgroup shows the sandbox's own cgroups as "/" (a cgroup namespace)."""
    async with await client.create() as sb:
        info = (await sb.exec("cat /proc/self/mountinfo")).stdout.decode()
        state = str(stack.edge.backend.state_dir)
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
                          "/proc/slabinfo /proc/vmallocinfo /proc/key-users 2>/dev/null | wc -c")
        assert r.stdout.split() == [b"0", b"0"], r.stdout + r.stderr


async def test_no_host_hotplug_events(client, stack, hostile):
    """A netlink uevent socket (the host's hotplug events: the sandbox's netns is the host user
    namespace's) is refused."""
    async with await client.create() as sb:
        await armed(sb, hostile)
        assert (await sb.exec("/tmp/hostile uevent")).stdout == f"{errno.EPERM}\n".encode()


async def test_page_cache_probe_on_shared_layers_is_refused(client, stack, hostile):
    """mincore and fadvise(DONTNEED) on a file of a shared layer would tell which files a neighbour
    reads (evict, wait, probe): both are refused."""
    async with await client.create() as sb:
        await armed(sb, hostile)
        r = await sb.exec("/tmp/hostile probe /bin/busybox")
        assert r.stdout == f"mincore={errno.EPERM} fadvise={errno.EPERM}\n".encode(), r.stdout


def dirty() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("Dirty:"))


async def test_sync_from_a_sandbox_does_not_flush_the_host(client, stack, tmp_path):
    """sync(2) inside is a no-op (success): it would flush every filesystem of the host (here: 200 MiB
    the host wrote and did not sync stay dirty). The sandbox's own fsync still works."""
    host_file = tmp_path / "dirty"
    with open(host_file, "wb") as f:
        for _ in range(200):
            f.write(b"\1" * (1 << 20))
    try:
        before = dirty()
        assert before >= 150 << 20, f"the host holds only {before >> 20} MiB dirty: cannot tell"
        async with await client.create() as sb:
            r = await sb.exec("echo data > /tmp/f && sync && fsync /tmp/f 2>/dev/null; cat /tmp/f")
            assert r.exit_code == 0 and r.stdout == b"data\n", r.stdout + r.stderr
            after = dirty()
        assert after >= before - (50 << 20), f"a sandbox's sync flushed the host: {before >> 20} -> {after >> 20} MiB dirty"
    finally:
        host_file.unlink()

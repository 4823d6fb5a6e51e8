"""Attacks from inside the sandboxes whose commands dsec-agent runs (gVisor, microVMs, full VMs), each the attack
itself (issue 15: the tamper and bomb tests hold inside a VM; commands are confined as in a container):
- a root command moving itself out of the groups that hold its limits, then forking past them;
- the kernel's sysrq trigger and /proc/sys, module loading, the agent's memory;
- the trusted shell and the agent replaced or unmounted.
And a privileged VM (create(privileged=True)): it may do all of that to its own kernel, even crash it, and
the host and its neighbours are untouched."""
from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import subprocess

import pytest

import libdsec
from tests.conftest import ended_record, long_for

pytestmark = pytest.mark.timeout(180)
KINDS = ["gvisor", "microvm", "fullvm"]
VMS = ["microvm", "fullvm"]
# 64 forks of a sleep, then the sleeps counted (builtins only: past the limit no fork is needed). Under the
# image's sh, whose failed fork fails at once (bash, the trusted shell, retries one for up to 15 s: each of
# these tests took 15 s longer, and CI's budget is 30 minutes).
FORKS_PAST_THE_LIMIT = ["sh", "-c", "i=0; while [ $i -lt 64 ]; do (sleep 5 &) 2>/dev/null; i=$((i+1)); done; "
                        "n=0; for p in /proc/[0-9]*; do read -r c < $p/comm && [ \"$c\" = sleep ] && n=$((n+1)); "
                        "done 2>/dev/null; echo $n; kill -9 -1"]


@pytest.fixture(scope="module", autouse=True)
async def nodes(stack, kind_nodes):
    """The gVisor, microVM and full-VM nodes of tests/backends (conftest.KindNodes), by kind."""
    return {kind: await kind_nodes.get(stack, kind) for kind in KINDS}


def _vm_memory(kind: str) -> dict:
    """A sandbox of 32 pids (a microVM's of 192Mi); a full VM's of the default resources, whose template the
    other modules' full VMs restore from (a template of its own took a boot, ~30 s of CI's budget)."""
    if kind == "fullvm":
        return {}
    memory = {"microvm": "192Mi"}.get(kind)
    return {"resources": libdsec.Resources(memory=memory, pids=32) if memory else libdsec.Resources(pids=32)}


# A full VM's systemd mounts the same hierarchies under /sys/fs/cgroup: out of sight too. gVisor's sentry
# (Debian's runsc, 2022) gives a child's new mount namespace to its parent too, so there the agent covers its
# group's mount point for everyone and keeps it open (a root command raised its own pids.max, or moved itself
# to the root group, then forked past the limit: helper-44).
@pytest.mark.parametrize("kind", long_for(KINDS, "fullvm"))   # (a full VM's: a template of its own, 32 pids)
async def test_a_root_command_cannot_leave_its_limit_groups(client, kind):
    limited = {"resources": libdsec.Resources(pids=32)} if kind == "fullvm" else _vm_memory(kind)
    async with await client.create(backend=kind, timeout=120, **limited) as sb:
        r = await sb.exec("for g in /dev/.pids /dev/.mem /sys/fs/cgroup/pids /sys/fs/cgroup/memory; do "
                          "echo $$ > $g/cgroup.procs && echo moved $g; "
                          "echo 100000 > $g/sandbox/pids.max && echo raised $g; "
                          "umount $g && echo unmounted $g; "
                          "echo $$ > $g/sandbox/cgroup.procs && echo moved-up $g; ls $g; done; "
                          "mount -t cgroup -o pids none /mnt && echo mounted; true", timeout=30)
        assert b"moved" not in r.stdout and b"mounted" not in r.stdout, r
        assert r.stdout.strip() == b"", r      # the groups are out of sight: empty, unwritable
        r = await sb.exec(FORKS_PAST_THE_LIMIT, timeout=30)
        assert int(r.stdout.split()[0]) < 32, r


# A microVM's commands share one masked mount namespace, made when the agent starts (a namespace copied and
# masked per exec cost each exec ~1 ms under TCG, and more for its teardown). Shared, it must stay as it was
# made: a root command that tries to unmask it, mount over it or leave it changes nothing the next one sees.
async def test_a_microvms_commands_share_one_masked_namespace_that_none_can_change(client):
    async with await client.create(backend="microvm", timeout=120, **_vm_memory("microvm")) as sb:
        look = "readlink /proc/self/ns/mnt; wc -c < /proc/kcore; ls -A /dev/.pids; grep -c ' /proc/sys ' /proc/self/mountinfo"
        # two at once (a namespace's number is reused once it is freed): the same namespace, not two alike
        first, other = await asyncio.gather(*(sb.exec(f"{look}; sleep 1", timeout=30) for _ in range(2)))
        assert first.stdout == other.stdout, (first, other)
        r = await sb.exec("umount /proc/kcore; umount -l /proc/sys; umount -l /dev/.pids; "
                          "mount -t tmpfs none /tmp && echo mounted; mount -o remount,rw /proc/sys && echo rw; "
                          "unshare -m sh -c 'umount -l /proc/kcore && echo own-ns-only'; "
                          "echo 1 > /proc/sys/kernel/domainname && echo wrote; true", timeout=30)
        assert b"mounted" not in r.stdout and b"rw" not in r.stdout and b"wrote" not in r.stdout, r
        second = await sb.exec(look, timeout=30)
        assert first.stdout == second.stdout, (first, second)
        ns, kcore, *rest = second.stdout.decode().split("\n")
        assert ns.startswith("mnt:[") and kcore == "0" and rest[:2] == ["1", ""], second   # still masked


# gVisor (runsc 2022) refuses sysrq and modules too, but lets a command read the agent's /proc/1/environ and
# SIGKILL it (its pid 1): the sandbox then ends. VMs only, for now. In a full VM, pid 1 is systemd and the
# agent has no pid in the commands' namespace: no command sees it, signals it or reads its memory.
@pytest.mark.parametrize("kind", VMS)
async def test_the_kernel_is_out_of_a_commands_reach(client, kind):
    async with await client.create(backend=kind, timeout=120, **_vm_memory(kind)) as sb:
        seen = ("for p in /proc/[0-9]*; do read -r c < $p/comm && [ \"$c\" = agent ] && echo seen; done; "
                if kind == "fullvm" else "")     # (a microVM's agent is its commands' pid 1)
        r = await sb.exec("echo c > /proc/sysrq-trigger; echo 1 > /proc/sys/vm/drop_caches && echo wrote; "
                          "printf junk > /tmp/m.ko; insmod /tmp/m.ko; cat /proc/1/environ && echo read; "
                          "echo -1000 > /proc/self/oom_score_adj && echo wrote; "
                          f"{seen}kill -9 1; kill -9 -1; sleep 0.2; true", timeout=30)
        assert b"read" not in r.stdout and b"seen" not in r.stdout, r   # the agent is not a command's to see
        assert b"wrote" not in r.stdout, r
        assert b"not permitted" in r.stderr, r.stderr
        assert (await sb.exec("echo alive")).stdout == b"alive\n", "the agent and the kernel are unharmed"
        if kind == "fullvm":
            assert (await sb.exec("cat /proc/1/comm")).stdout == b"systemd\n"


# The classic chroot escape, as a static program of the command's own: chroot into a subdir while the cwd
# stays outside, climb, chroot to what is there. The agent enters the guest's root by chroot (an initramfs
# cannot be pivoted away), so the climb ends in the initramfs: its mounts (the kernel's own /proc, /sys, the
# raw devices) must be gone by then. Before, the command found /proc/sysrq-trigger and core_pattern
# writable there (a core_pattern pipe runs as the kernel's root, outside every limit).
ESCAPE = r"""
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>
int main(void) {
    mkdir("/tmp/esc-x", 0755);
    if (chdir("/") || chroot("/tmp/esc-x")) { perror("chroot"); return 1; }
    for (int i = 0; i < 64; i++) if (chdir("..")) break;
    if (chroot(".")) { perror("chroot ."); return 1; }
    if (access("/newroot", F_OK) == 0) puts("climbed");
    const char *reach[] = {"/proc/sysrq-trigger", "/proc/sys/kernel/core_pattern", "/sys/kernel/uevent_helper",
                           "/dev/vda", "/dev/vdb", "/dev/mem", "/rw/upper", "/trusted/agent"};
    for (unsigned i = 0; i < sizeof reach / sizeof *reach; i++)
        if (access(reach[i], F_OK) == 0) printf("reached %s\n", reach[i]);
    return 0;
}
"""


@pytest.mark.parametrize("kind", VMS)
async def test_a_chroot_escape_reaches_nothing_of_the_guest_kernels(client, kind, tmp_path):
    src, prog = tmp_path / "escape.c", tmp_path / "escape"
    src.write_text(ESCAPE)
    subprocess.run(["cc", "-Os", "-static", "-s", "-o", str(prog), str(src)], check=True)
    async with await client.create(backend=kind, timeout=120, **_vm_memory(kind)) as sb:
        await sb.write_file("/tmp/escape", prog.read_bytes(), mode=0o755)   # stripped: under 700 KB
        r = await sb.exec(["/tmp/escape"], timeout=30)
        assert r.exit_code == 0, r
        assert b"reached" not in r.stdout, r.stdout
        assert (await sb.exec("echo alive")).stdout == b"alive\n"


async def test_a_full_vms_systemd_loads_no_module_for_a_command(client):
    """A root command in a full VM can write a unit and have systemd (every capability the guest gives it)
    start it: the unit still cannot reach the kernel's module loader or raw devices, as the agent drops
    SYS_MODULE and SYS_RAWIO from systemd's bounding set. Before, the unit's insmod reached the kernel's
    parser ("invalid module format")."""
    unit = ("[Service]\nType=oneshot\nExecStart=/bin/sh -c \"grep CapBnd /proc/self/status > /tmp/caps; "
            "insmod /tmp/m.ko 2> /tmp/ins; echo $? >> /tmp/ins\"\n")
    async with await client.create(backend="fullvm", timeout=120, **_vm_memory("fullvm")) as sb:
        await sb.write_file("/etc/systemd/system/evil.service", unit.encode())
        r = await sb.exec("printf junk > /tmp/m.ko; systemctl daemon-reload && systemctl start evil && "
                          "cat /tmp/ins /tmp/caps", timeout=60)
        assert r.exit_code == 0, r
        assert b"not permitted" in r.stdout and b"invalid module format" not in r.stdout, r.stdout
        bounding = int(r.stdout.split(b"CapBnd:")[1].split()[0], 16)
        assert not bounding & (1 << 16 | 1 << 17), hex(bounding)    # SYS_MODULE, SYS_RAWIO
        assert (await sb.exec("systemctl is-system-running")).stdout == b"running\n"


@pytest.mark.parametrize("kind", KINDS)
async def test_the_relay_trusts_nothing_a_command_can_replace(client, kind):
    async with await client.create(backend=kind, timeout=120, **_vm_memory(kind)) as sb:
        r = await sb.exec(["/bin/sh", "-c",
                           "rm -f /bin/sh && printf '#!/bin/busybox sh\\necho hijacked\\n' > /bin/sh && "
                           "chmod 755 /bin/sh; "
                           "cp /bin/busybox /.dsec/sh && echo replaced; umount /.dsec/upper && echo unmounted; "
                           "umount -l /.dsec && echo unmounted; mount -o remount,rw /.dsec && echo remounted; true"])
        assert b"replaced" not in r.stdout and b"unmounted" not in r.stdout and b"remounted" not in r.stdout, r
        r = await sb.exec("echo through the trusted shell")
        assert r.stdout == b"through the trusted shell\n"
        assert (await sb.exec(["/bin/sh"])).stdout == b"hijacked\n"     # the image's own shell is the sandbox's


async def test_privileged_is_refused_where_it_means_nothing(client):
    with pytest.raises(libdsec.Unsupported, match="container.*privileged"):
        await client.create(privileged=True)


async def test_a_privileged_vm_owns_its_kernel_and_touches_nothing_else(client, stack, nodes):
    """Its commands keep every capability: a module load reaches the kernel's parser, and sysrq crashes
    its kernel. Its neighbour, created before, and the node's containers go on; the crashed VM's execs
    fail typed, and destroying it leaves nothing."""
    backend = nodes["microvm"].edge.backend.backends["microvm"]
    neighbour = await client.create(backend="microvm", timeout=120)
    container = await client.create(timeout=30)
    vm = await client.create(backend="microvm", privileged=True, timeout=120)
    try:
        r = await vm.exec("printf junk > /tmp/m.ko; insmod /tmp/m.ko; cat /proc/sys/kernel/sysrq; "
                          "echo 1 > /proc/sys/vm/drop_caches && echo dropped")
        assert b"not permitted" not in r.stderr and b"dropped" in r.stdout, r
        with pytest.raises(libdsec.SandboxNotFound) as err:    # the exec it cut short says why
            await vm.exec("echo c > /proc/sysrq-trigger; sleep 30", timeout=60)
        assert err.value.reason == "failed", err.value
        rec = await ended_record(client, vm.id, 30)
        assert rec.state == "failed" and "VM exited" in rec.reason, rec
        assert "Kernel panic - not syncing: sysrq triggered crash" in rec.reason, rec   # the line that says why
        assert str(err.value) == f"sandbox {vm.id} not found (failed: {rec.reason})", err.value
        with pytest.raises(libdsec.SandboxNotFound):
            await vm.exec("echo after", timeout=10)
        assert (await neighbour.exec("echo fine")).stdout == b"fine\n"
        assert (await container.exec("echo fine")).stdout == b"fine\n"
        assert os.path.exists("/proc/self")   # the host goes on
    finally:
        await asyncio.gather(vm.destroy(), neighbour.destroy(), container.destroy(), return_exceptions=True)
    assert backend.residue(vm.id) == [] and backend.residue(neighbour.id) == []


async def test_a_gvisor_command_cannot_reach_the_agents_channel_to_the_edge(client):
    """helper-44: runsc (2022) let a root command open the agent's /proc/1/fd/1 and /proc/1/fd/0, its channel to
    the edge, whatever its dumpability: frames written there passed for another exec's (a forged exit 0 and
    output for a grader's command still running), and the next exec's request (argv, environment) could be
    read off it. The commands have a pid namespace of their own, where the agent has no pid."""
    async with await client.create(backend="gvisor", timeout=60) as sb:
        victim = await sb.exec("sleep 2; echo real-output; exit 3", background=True)
        forged = b"".join(struct.pack("<IBI", 5 + len(p), ord(k), xid) + p for xid in range(1, 64)   # the agent's
                          for k, p in (("O", b"ALL TESTS PASSED (forged)\n"), ("X", struct.pack("<iQQ", 0, 0, 0))))
        assert len(forged) < 4096   # (one write: a pipe keeps it whole among the agent's own frames)
        await sb.files.write("/tmp/forged", forged)
        r = await sb.exec("cat /tmp/forged > /proc/1/fd/1; (timeout 4 cat /proc/1/fd/0 > /tmp/stolen 2>&1 &); "
                          "readlink /proc/1/fd/0; readlink /proc/1/fd/1", timeout=30)
        assert r.stdout == b"/dev/null\n/dev/null\n", r   # pid 1 there is the namespace's init, holding nothing
        graded = await sb.exec(["env", "GRADER_TOKEN=hunter2", "echo", "grader-run"])
        assert (graded.exit_code, graded.stdout) == (0, b"grader-run\n"), graded
        done = await victim.wait()
        assert (done.exit_code, done.stdout) == (3, b"real-output\n"), done
        await asyncio.sleep(2.5)
        assert b"hunter2" not in await sb.read_file("/tmp/stolen")
        r = await sb.exec("echo $$; sleep 0.2", background=True)   # the pid it is given is the one it has
        assert (await r.wait()).stdout == b"%d\n" % r.pid, r.pid
        # the commands' pid 1 only reaps: it holds no capability a command could borrow (helper-46)
        r = await sb.exec("grep -E '^Cap(Prm|Eff|Bnd)' /proc/1/status")
        assert r.stdout == b"CapPrm:\t0000000000000000\nCapEff:\t0000000000000000\nCapBnd:\t0000000000000000\n", r


async def test_no_process_a_gvisor_command_sees_holds_the_agents_files(client, hostile):
    """helper-45: each exec's child, forked by the agent, held every fd of the agent from its fork to its first
    close (its channel to the edge, its /proc, the pids hierarchy), and a command reading /proc/N/fd of every
    process as fast as it could caught it there. A spawner no command sees forks them now (dsec-commands.h).
    The scanner, run while execs start one after another, finds none of the agent's files, and what it tries
    changes nothing: every exec's exit and output are its own, the limit holds."""
    async with await client.create(backend="gvisor", timeout=120, resources=libdsec.Resources(pids=32)) as sb:
        await sb.files.write("/tmp/hostile", hostile, mode=0o755)
        scan = await sb.exec(["/tmp/hostile", "fdscan", "5"], background=True)
        started = asyncio.get_running_loop().time()
        runs = []
        while asyncio.get_running_loop().time() - started < 4.5:
            i = len(runs)
            runs.append((i, await sb.exec(f"echo run-{i}; exit {i % 7}", timeout=30)))
        done = await scan.wait()               # (before: exit 0 and no output at once, forged on the channel)
        found = done.stdout.splitlines()
        assert found and found[-1].startswith(b"scanned ") and int(found[-1].split()[1]) > 0, done
        # each line a file no pipe, socket or terminal that a process held: the commands' own (/etc/passwd,
        # read by a shell) may be; the agent's never were again (before: host:[1], host:[2], its channel, forged
        # frames written; /, its /proc; /dev/.pids, pids.max raised; an exec group's cgroup.procs)
        reached = [line for line in found[:-1] if line.startswith((b"host:", b"/\t", b"/dev/.pids"))
                   or any(what in line for what in (b"forged", b"raised", b"a /proc"))]
        assert reached == [], found
        for i, r in runs:
            assert (r.exit_code, r.stdout, r.stderr) == (i % 7, b"run-%d\n" % i, b""), (i, r)
        assert len(runs) > 20, len(runs)
        r = await sb.exec(FORKS_PAST_THE_LIMIT, timeout=30)
        assert int(r.stdout.split()[0]) < 32, r


async def test_a_gvisor_file_op_raced_by_a_link_swap_lands_nowhere_unseen(client, nodes, hostile):
    """helper-45: a file op checks where its path lands (the sentry's own mounts are refused), then acts; a
    command swapping a directory on the path for a link to /proc as fast as it could took 739 of 3,881 writes
    onto the root's own /proc on the host (read back by read_file, never seen inside). The file ops' view of
    the root has an empty read-only mount over each such directory (files.cover_view): raced or not, nothing
    lands there."""
    backend = nodes["gvisor"].edge.backend.backends["gvisor"]
    async with await client.create(backend="gvisor", timeout=120) as sb:
        await sb.files.write("/tmp/hostile", hostile, mode=0o755)
        swapper = await sb.exec(["/tmp/hostile", "swap", "/tmp/x", "/proc", "6"], background=True)
        await asyncio.sleep(0.3)
        written = refused = 0
        until = asyncio.get_running_loop().time() + 5
        while asyncio.get_running_loop().time() < until:        # (the swapper goes on for 6 s)
            try:
                await sb.write_file(f"/tmp/x/pwned-{written + refused}", b"HIDDEN\n")
                written += 1
            except libdsec.FileOpError:
                refused += 1
        assert (await swapper.wait()).stdout.startswith(b"swapped "), swapper
        root = backend._rootfs(backend._live(sb.id).key)
        for top in ("proc", "sys", "dev", ".dsec"):
            assert [n for n in os.listdir(root / top) if n.startswith("pwned")] == [], top
        r = await sb.exec("ls /tmp/x | grep -c pwned; ls /proc | grep -c pwned; true")
        assert r.stdout.split()[1:] == [b"0"], r
        assert written > 0 and refused > 0, (written, refused)   # the race ran both ways


async def test_a_gvisor_sandbox_of_two_pids_starts_and_runs(client):
    """The spawner and the commands' init count in no limit: with them in the sandbox's group (the sentry charges
    a fork to the forking task's own group), the init's fork was refused at pids=2 and the create failed
    (helper-47)."""
    async with await client.create(backend="gvisor", timeout=60, resources=libdsec.Resources(pids=2)) as sb:
        assert (await sb.exec(["echo", "two"])).stdout == b"two\n"


async def test_a_gvisor_sandbox_whose_agent_is_killed_ends_failed(client, nodes):
    """runsc (2022) lets a command SIGKILL its pid namespace's pid 1 (the commands' init; it was the agent
    itself): no command can run after, and the agent ends, so the sandbox ends. It must say so (failed, the
    exec it cut short too), not pass for a lost node."""
    backend = nodes["gvisor"].edge.backend.backends["gvisor"]
    sb = await client.create(backend="gvisor", timeout=60)
    try:
        with pytest.raises(libdsec.SandboxNotFound) as err:
            await sb.exec("kill -9 1; sleep 5", timeout=30)
        assert err.value.reason == "failed", err.value
        rec = await ended_record(client, sb.id, 30)
        assert rec.state == "failed" and "agent ended" in rec.reason, rec
        assert str(err.value) == f"sandbox {sb.id} not found (failed: {rec.reason})", err.value
    finally:
        with contextlib.suppress(libdsec.SandboxNotFound):
            await sb.destroy()
    assert backend.residue(sb.id) == []

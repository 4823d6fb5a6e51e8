"""CPU classes (issue 17, part C): a batch sandbox's every process (its init, its commands and their forks)
runs at SCHED_IDLE under the smallest cpu shares, checked from the host's /proc and cgroup; a latency one at
SCHED_OTHER under the default shares; none can raise its own class. The latency effect is bench.cpuclass's."""
from __future__ import annotations

import os

import pytest

import libdsec
from edge.backends import kernel
from edge.backends.cgroups import BATCH_SHARES, own_paths, procs_under
from tests.conftest import extra_edge

# a batch group: idle where the kernel has cpu.idle (this one does), else the smallest shares
BATCHED = "idle" if os.path.exists("/sys/fs/cgroup/cpu/cpu.idle") else BATCH_SHARES


def _classes(groups) -> tuple[int, set[int]]:
    """(the class of the sandbox's cpu group where the scheduler weighs it against the edge's own processes:
    the cpu.shares, or "idle" for an idle group, of its ancestor that is a sibling of them; the scheduling
    policies of every process in the groups). Shares further down weigh it only against other sandboxes."""
    own = own_paths()["cpu"]
    top = own / groups["cpu"].relative_to(own).parts[0]
    idle = top / "cpu.idle"
    shares = "idle" if idle.exists() and idle.read_text().strip() == "1" else int((top / "cpu.shares").read_text())
    policies = set()
    for pid in procs_under(groups["freezer"]):
        try:
            policies.add(os.sched_getscheduler(pid))
        except ProcessLookupError:
            pass
    return shares, policies


FORKS = "(sleep 300 & sh -c 'sleep 300 & sleep 300' & yes &) >/dev/null 2>&1; sleep 0.2; echo started"


async def test_every_process_of_a_batch_sandbox_runs_at_its_class(stack, client):
    container = stack.edge.backend.backends["container"]
    async with await client.create(cpu_class="batch") as batch, \
            await client.create(priority="batch") as by_priority, \
            await client.create(priority="batch", cpu_class="latency") as latency:
        for sb, cls in ((batch, "batch"), (by_priority, "batch"), (latency, "latency")):
            assert (await sb.exec(["/bin/sh", "-c", FORKS])).stdout == b"started\n"
            assert (await client._record(sb.id)).cpu_class == cls
            shares, policies = _classes(container._cgroups.sandbox(sb.id))
            assert len(procs_under(container._cgroups.sandbox(sb.id)["freezer"])) >= 5   # init, sleeps, yes
            if cls == "batch":
                assert (shares, policies) == (BATCHED, {os.SCHED_IDLE}), (sb.id, shares, policies)
            else:
                assert (shares, policies) == (1024, {os.SCHED_OTHER}), (sb.id, shares, policies)
        # a batch sandbox cannot leave its class: not by renice below 0, not by the scheduler call itself
        r = await batch.exec("renice -n -5 -p $$; echo rc=$?")
        assert b"rc=0" not in r.stdout, r
        await batch.write_file("/tmp/escape", _escape_binary(), mode=0o755)
        r = await batch.exec(["/tmp/escape"])
        assert r.stdout == b"setrlimit -1 sched_setscheduler -1 policy 5\n", r   # 5: SCHED_IDLE
        shares, policies = _classes(container._cgroups.sandbox(batch.id))
        assert (shares, policies) == (BATCHED, {os.SCHED_IDLE})
        # the cgroup is the host's: the sandbox's root cannot write it
        r = await batch.exec("echo 1024 > /sys/fs/cgroup/cpu/cpu.shares; echo rc=$?")
        assert b"rc=0" not in r.stdout + r.stderr, r
        assert _classes(container._cgroups.sandbox(batch.id))[0] == BATCHED


async def test_a_command_may_run_on_every_cpu_of_its_sandbox(stack, client, tmp_path):
    """The edge spawns a command's helper bound to the CPU it runs on, and the helper binds itself again to clone
    the command (so neither waits behind a batch sandbox's work on a CPU the kernel counts as idle); the
    command, its forks and a fncall call must not keep that binding: each may run on every CPU its sandbox's
    cpuset holds."""
    every = os.sched_getaffinity(0)
    cpus = (stack.edge.backend.backends["container"]._cgroups.base["cpuset"] / "cpuset.cpus").read_text().strip()
    want = b"Cpus_allowed_list:\t" + cpus.encode() + b"\n"   # the node's cpuset, in the kernel's list form
    with kernel.on_this_cpu():
        assert len(os.sched_getaffinity(0)) == 1
    assert os.sched_getaffinity(0) == every
    show = ["grep", "Cpus_allowed_list", "/proc/self/status"]
    for kw in ({}, {"cpu_class": "batch"}):
        async with await client.create(**kw) as sb:
            for _ in range(4):
                assert (await sb.exec(show)).stdout == want, kw
            assert (await sb.exec("sh -c 'grep Cpus_allowed_list /proc/self/status'")).stdout == want, kw
            # a command binding itself is told yes and stays free (sched_setaffinity is a no-op inside:
            # test_a_sandbox_moving_its_threads_between_cpus_cannot_freeze_the_node)
            r = await sb.exec("taskset -c 0 grep Cpus_allowed_list /proc/self/status")
            assert (r.exit_code, r.stdout) == (0, want), (kw, r)
    async with extra_edge(stack, tmp_path / "fn", "fn-aff", 8, backends=["fncall"],
                          options={"fncall": {"workers_min": 1, "workers_max": 1}}):
        for _ in range(4):   # a call: the worker's resident helper clones it
            assert (await client.call(show)).stdout == want


ESCAPE_C = r"""
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <sys/resource.h>
int main(void) {
    struct rlimit r = {40, 40};
    int a = setrlimit(RLIMIT_NICE, &r);
    struct sched_param p = {0};
    int b = sched_setscheduler(0, SCHED_OTHER, &p);
    printf("setrlimit %d sched_setscheduler %d policy %d\n", a, b, sched_getscheduler(0));
    return 0;
}
"""


def _escape_binary() -> bytes:
    """A static program that tries to leave SCHED_IDLE (built here with the host's compiler)."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "escape.c")
        with open(src, "w") as f:
            f.write(ESCAPE_C)
        subprocess.run(["cc", "-static", "-Os", "-s", "-o", os.path.join(tmp, "escape"), src], check=True)
        with open(os.path.join(tmp, "escape"), "rb") as f:
            return f.read()


async def test_bad_cpu_class_is_refused(client):
    with pytest.raises(libdsec.InvalidRequest, match="cpu_class"):
        await client.create(cpu_class="realtime")


@pytest.fixture(scope="module")
async def gvisor_node(stack, tmp_path_factory):
    async with extra_edge(stack, tmp_path_factory.mktemp("gvcls"), "k-gvcls", 4, backends=["gvisor"]) as st:
        yield st


async def test_a_batch_gvisor_sandbox_runs_at_its_class(stack, client, gvisor_node):
    gv = gvisor_node.edge.backend.backends["gvisor"]
    async with await client.create(backend="gvisor", cpu_class="batch") as sb:
        assert (await sb.exec(["/bin/sh", "-c", FORKS])).stdout == b"started\n"
        shares, policies = _classes(gv._cgroups.sandbox(gv._sandboxes[sb.id].key))
        assert (shares, policies) == (BATCHED, {os.SCHED_IDLE}), (shares, policies)

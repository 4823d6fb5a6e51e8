"""The gVisor kind's stronger boundary (issue 13 C): inside, the kernel is gVisor's sentry, and a syscall
the host kernel allows a container (pidfd_getfd on oneself) is one the sentry does not implement:
ENOSYS. The same probe, in a container sandbox, succeeds. Files a gVisor sandbox makes are owned on the
host by its own uid range, never by host root."""
from __future__ import annotations

import asyncio
import errno
import os

import pytest

import libdsec
from bus import streams
from bus.records import node_decoder
from tests.test_attacks import armed, background

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
async def gvisor(stack, kind_nodes):
    return await kind_nodes.get(stack, "gvisor")


async def test_the_kernel_inside_is_gvisors_and_it_lacks_what_the_host_has(client, gvisor, hostile):
    async with await client.create(backend="gvisor") as g, await client.create() as c:
        for sb in (g, c):
            await sb.files.write("/tmp/h", hostile, mode=0o755)
        r = await g.exec("uname -r; cat /proc/version; dmesg")
        assert r.exit_code == 0 and r.stdout.startswith(b"4.4.0") and b"Starting gVisor" in r.stdout, r.stdout
        assert b"gVisor" not in (await c.exec("dmesg 2>&1; cat /proc/version")).stdout
        inside = (await g.exec(["/tmp/h", "syscall", "pidfd_getfd"])).stdout.strip()
        container = (await c.exec(["/tmp/h", "syscall", "pidfd_getfd"])).stdout.strip()
        assert inside == str(errno.ENOSYS).encode(), "the sentry does not implement pidfd_getfd"
        assert container == b"ok", "the host kernel does, for a container"


async def test_files_made_inside_are_owned_by_the_sandboxs_range_on_the_host(client, gvisor):
    async with await client.create(backend="gvisor") as sb:
        await sb.exec("echo mine > /tmp/made-inside && mkdir /tmp/dir")
        await sb.write_file("/tmp/written", b"x")
        backend = gvisor.edge.backend.backends["gvisor"]
        root = backend._rootfs(backend._sandboxes[sb.id].key)
        owners = {os.stat(root / "tmp" / n).st_uid for n in ("made-inside", "dir", "written")}
        base = backend._sandboxes[sb.id].ids.base
        assert owners == {base} and base >= 1 << 28, (owners, base)
        r = await sb.exec("id -u; cat /proc/self/uid_map")
        assert r.stdout.split()[0] == b"0"   # root inside, a range of its own outside


async def test_a_gvisor_image_that_cannot_boot_fails_typed_and_leaves_nothing(client, gvisor, stack):
    with pytest.raises(libdsec.ImageNotFound):
        await client.create(backend="gvisor", image="no-such-image", timeout=10)
    assert gvisor.edge.backend.leaks() == []


async def test_stopping_every_new_pid_inside_stalls_nothing_outside(stack, client, gvisor, hostile):
    """The spawner-stop attack from inside a gVisor sandbox: it stops only its own commands; a neighbour
    (gVisor and container) runs on, and its node is never declared lost."""
    async with await client.create(backend="gvisor") as attacker, \
            await client.create(backend="gvisor") as neighbour, await client.create() as other:
        await armed(attacker, hostile)
        await background(attacker, "/tmp/hostile stopper 10", "/tmp/stopper.out", ready="/tmp/stopper.ready")
        own = [asyncio.ensure_future(attacker.exec("sleep 1", timeout=3)) for _ in range(3)]
        done = []
        for i in range(20):
            for sb in (neighbour, other):
                done.append((await sb.exec(["echo", str(i)], timeout=5)).stdout)
        assert done == [f"{i}\n".encode() for i in range(20) for _ in range(2)]
        await asyncio.gather(*own, return_exceptions=True)   # its own commands: stopped (timed out) or not
        assert int((await attacker.read_file("/tmp/stopped")).decode()) >= 1, "the attack stopped nothing"
        raw = await stack.bus.kv_get(streams.NODES_KV, gvisor.edge.node)
        assert not node_decoder.decode(raw).lost


async def test_planted_setuid_and_capabilities_are_not_privileged_on_the_host(client, gvisor, hostile):
    """The setuid plant from inside a gVisor sandbox: on the host the file is setuid to the sandbox's own
    unprivileged uid, and a file capability set inside is either kept by the sentry alone or namespaced
    to that uid."""
    async with await client.create(backend="gvisor") as sb:
        await armed(sb, hostile)
        r = await sb.exec("cp /tmp/hostile /tmp/rootsh && chmod 4755 /tmp/rootsh && cp /tmp/hostile /tmp/capped"
                          " && /tmp/hostile setcap /tmp/capped")
        assert r.exit_code == 0, (r.stdout, r.stderr)
        backend = gvisor.edge.backend.backends["gvisor"]
        key = backend._sandboxes[sb.id].key
        base = backend._sandboxes[sb.id].ids.base
        st = (backend._rootfs(key) / "tmp" / "rootsh").stat()
        assert st.st_mode & 0o4000 and st.st_uid == base != 0, (oct(st.st_mode), st.st_uid, base)
        try:
            cap = os.getxattr(backend._rootfs(key) / "tmp" / "capped", "security.capability")
        except OSError:
            cap = b""   # the sentry keeps it (if at all): nothing the host kernel would honour
        if cap:
            assert int.from_bytes(cap[:4], "little") >> 24 == 3 and int.from_bytes(cap[20:24], "little") == base


async def test_proc_inside_shows_nothing_of_the_host(client, gvisor):
    async with await client.create(backend="gvisor") as sb:
        r = await sb.exec("cat /proc/self/mountinfo /proc/mounts; ls /proc; cat /proc/cmdline 2>&1")
        text = r.stdout.decode()
        for host_thing in ("/run/dsec", "edge-gvisor", "uppers", "/tmp/pytest", "nats"):
            assert host_thing not in text, host_thing
        pids = [p for p in (await sb.exec("ls /proc")).stdout.decode().split() if p.isdigit()]
        assert 1 < len(pids) < 8, pids   # its own processes only (the agent, this exec)

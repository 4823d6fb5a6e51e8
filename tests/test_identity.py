"""Sandbox identities (issue 12): host uid ranges leased host-wide, given back only once nothing is
charged to them, and the per-sandbox kernel limits of a sandbox's user namespace."""
from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from edge.backends import idmap, kernel
from edge.backends.base import CapacityExhausted, Limits
from edge.backends.base import CommandNotStarted
from edge.backends.container import ContainerBackend, leftovers
from tests import leaks
from tests.backend_fixtures import Sandboxes, busybox_layer, fixed_state_dir  # noqa: F401

pytestmark = pytest.mark.timeout(180)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def hold_key(uid: int) -> int:
    """A child process of host uid `uid` holding a key in its session keyring (until killed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            _libc.syscall(250, 1, None)   # KEYCTL_JOIN_SESSION_KEYRING: a fresh one of this uid
            ok = _libc.syscall(248, b"user", b"held", b"x", 1, -3) > 0   # add_key to the session keyring
            os.write(w, b"1" if ok else b"0")
            signal.pause()
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1", "the child could not add a key"
    os.close(r)
    return pid


def test_ranges_are_leased_host_wide_and_never_shared(tmp_path: Path) -> None:
    """Two edges (node ids) on one host take distinct ranges; when all are taken a create is refused
    with an error naming uid ranges; a released range is leased again."""
    a = idmap.Allocator("na", leases=str(tmp_path), count=3)
    b = idmap.Allocator("nb", leases=str(tmp_path), count=3)
    a.setup()
    got = [a.lease("s1"), b.lease("s2"), a.lease("s3")]
    assert len({r.index for r in got}) == 3
    assert all(abs(x.base - y.base) >= idmap.SIZE for x in got for y in got if x != y)
    with pytest.raises(CapacityExhausted, match="no free uid range"):
        b.lease("s4")
    assert b.release(got[1]) is True
    assert b.lease("s4").index == got[1].index
    assert set(a.held()) == {got[0].index, got[2].index} and a.held()[got[0].index] == "s1"
    assert oct(os.stat(tmp_path).st_mode & 0o777) == "0o700"


def test_a_range_holding_keys_drains_before_reuse(tmp_path: Path) -> None:
    """A range whose uid still owns a key is not given back (draining); once the key is gone it is."""
    alloc = idmap.Allocator("nk", leases=str(tmp_path), count=1)
    alloc.setup()
    rng = alloc.lease("s1")
    holder = hold_key(rng.base + 7)
    try:
        assert idmap.charged(rng)
        assert alloc.release(rng) is False
        assert alloc.held() == {rng.index: idmap.DRAINING}
        with pytest.raises(CapacityExhausted):
            alloc.lease("s2")
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    deadline = time.monotonic() + 10
    while idmap.charged(rng) and time.monotonic() < deadline:   # the kernel collects the key
        time.sleep(0.05)
    assert alloc.lease("s2").index == rng.index


async def _backend(tmp_path_factory, name: str, count: int | None = None) -> tuple[ContainerBackend, Path, str]:
    state, node = fixed_state_dir(tmp_path_factory, name), f"t{name}"
    backend = ContainerBackend(state, node, upper_pool_size=1 << 30)
    if count is not None:
        backend._ids = idmap.Allocator(node, count=count, leases=str(state.parent / f"{name}-leases"))
    await backend.start()
    return backend, state, node


async def test_out_of_ranges_is_a_capacity_error_and_the_node_stays_healthy(tmp_path_factory, busybox_layer,
                                                                            hostile):
    """With one range left, a second sandbox is refused (CapacityExhausted, naming it) and the first
    keeps working; a key the first left behind is never readable by the next sandbox of that range."""
    backend, state, node = await _backend(tmp_path_factory, "ranges", count=1)
    sbs = Sandboxes(backend, busybox_layer)
    with leaks.live(node, state):
        try:
            first = await sbs.create()
            with pytest.raises(CapacityExhausted, match="uid range"):
                await sbs.create()
            assert (await sbs.run(first, ["echo", "ok"])).stdout == b"ok\n"
            await backend.write_file(first, "/tmp/hostile", hostile, 0o755)
            serial = (await sbs.run(first, ["/tmp/hostile", "persist", "secret-of-first"])).out.split()[0]
            assert int(serial) > 0
            base = backend._live(first).ids.base
            await backend.destroy(first)
            deadline = time.monotonic() + 15
            while True:
                try:
                    second = await sbs.create()
                    break
                except CapacityExhausted:   # its keys are still being collected: the range drains
                    assert time.monotonic() < deadline, "the range never came back"
                    await asyncio.sleep(0.1)
            assert backend._live(second).ids.base == base
            await backend.write_file(second, "/tmp/hostile", hostile, 0o755)
            seen = (await sbs.run(second, ["/tmp/hostile", "describe", serial])).out.split()[0]
            assert seen in (str(errno.ENOKEY), str(errno.EACCES)), f"the next tenant read the key: {seen}"
        finally:
            await backend.stop()
    assert leftovers(state, node) == []


async def test_user_namespaces_are_bounded_per_sandbox(tmp_path_factory, busybox_layer):
    """Each exec holds one user namespace while any of its processes lives. A sandbox that keeps 1024 of
    them (leftover processes) gets a clear error on the next exec, and a neighbour still runs commands.
    Before, they were charged to host root (user.max_user_namespaces for the whole host)."""
    backend, state, node = await _backend(tmp_path_factory, "userns")
    sbs = Sandboxes(backend, busybox_layer)
    with leaks.live(node, state):
        try:
            hog = await sbs.create(Limits(pids=4096, memory=1 << 30))
            neighbour = await sbs.create()
            for i in range(1024):
                r = await sbs.run(hog, ["sh", "-c", "sleep 600 >/dev/null 2>&1 &"])
                assert r.result.exit_code == 0, (i, r.stderr)
            with pytest.raises(CommandNotStarted, match=f"limit of {kernel.USERNS_PER_SANDBOX} user namespaces"):
                await sbs.run(hog, ["true"])
            assert (await sbs.run(neighbour, ["echo", "fine"])).stdout == b"fine\n"
        finally:
            await backend.stop()
    assert leftovers(state, node) == []


async def test_a_restarted_edge_gives_back_its_ranges(tmp_path_factory, busybox_layer):
    """Leases outlive an edge crash (they are host-wide files); the next start of that node kills what
    the crashed run left and gives its ranges back."""
    backend, state, node = await _backend(tmp_path_factory, "restart")
    sbs = Sandboxes(backend, busybox_layer)
    await sbs.create()
    held = backend._ids.held()
    assert len(held) == 1
    os.kill(backend.launcher_pid, signal.SIGKILL)   # the first one "crashes": its zygote dies, it is never
    for _ in range(200):                             # stopped, and what it ran (lxcfs too) stays behind
        if not backend._launcher.alive:
            break
        await asyncio.sleep(0.01)
    again = ContainerBackend(state, node, upper_pool_size=1 << 30)
    with leaks.live(node, state):
        try:
            await again.start()
            assert again._ids.held() == {}
        finally:
            await again.stop()
            await backend._launcher.close()
    assert leftovers(state, node) == []



async def test_snapshots_store_owners_relative_to_the_sandbox(client, stack):
    """A snapshot's layer holds owners as the sandbox saw them (its root is 0, not its host uid), so a fork
    (another range) sees the same owners; the packed layer on disk says so too."""
    sb = await client.create()
    made = []
    try:
        r = await sb.exec("mkdir /data && touch /data/mine /data/app && chown 1000:1000 /data/app && "
                          "stat -c '%u:%g %n' /data/mine /data/app")
        want = b"0:0 /data/mine\n1000:1000 /data/app\n"
        assert r.stdout == want, r.stdout + r.stderr
        snap = await sb.snapshot(tag="owners")
        fork = (await client.fork(snap, n=1))[0]
        made.append(fork)
        assert (await fork.exec("stat -c '%u:%g %n' /data/mine /data/app")).stdout == want
        assert stack.edge.backend.backends["container"]._live(fork.id).ids.base != stack.edge.backend.backends["container"]._live(sb.id).ids.base
        layer = stack.edge.layers.path(snap.layers[-1])   # the fork on this node fetched it
        mnt = Path(f"/tmp/dsec-owners-{os.getpid()}")
        mnt.mkdir()
        try:
            subprocess.run(["mount", "-t", "erofs", "-o", "ro", str(layer), str(mnt)], check=True)
            try:
                assert (mnt / "data" / "app").stat().st_uid == 1000
                assert (mnt / "data" / "mine").stat().st_uid == 0
            finally:
                subprocess.run(["umount", str(mnt)], check=True)
        finally:
            mnt.rmdir()
    finally:
        await asyncio.gather(*(s.destroy() for s in [sb, *made]), return_exceptions=True)
    await client.delete_snapshot(snap)


async def test_the_images_setuid_programs_work_inside(client, hostile):
    """Setuid programs of the image work inside as in any container (su, ping, sudo): a setuid-root file
    of an image layer, run by uid 1000, runs as euid 0, the sandbox's root (a host uid of its range, so
    nothing is privileged on the host), and so does one made in the writable layer (the host's views of
    both stay nosuid: test_attacks). Before, no_new_privs and nosuid layer views made both run as 1000."""
    sb = await client.create()
    made = []
    try:
        await sb.exec("mkdir -p /opt")
        await sb.files.write("/opt/suid", hostile, mode=0o755)
        r = await sb.exec("chmod 4755 /opt/suid && stat -c '%u:%g %a' /opt/suid && /opt/suid drop 1000 /opt/suid euid")
        assert r.stdout == b"0:0 4755\n0\n", r.stdout + r.stderr
        snap = await sb.snapshot(tag="suid")
        image = (await client.fork(snap, n=1))[0]    # /opt/suid now lies in an image layer
        made.append(image)
        r = await image.exec("stat -c '%u:%g %a' /opt/suid && /opt/suid drop 1000 /opt/suid euid && "
                             "/opt/suid drop 1000 /bin/busybox id -u")
        assert r.stdout == b"0:0 4755\n0\n1000\n", r.stdout + r.stderr
    finally:
        for s in made:
            await s.destroy()
        await sb.destroy()


def test_user_namespaces_are_made_away_from_the_zygote_and_kept_per_range():
    """The keeper's maker makes each range's user namespace: its stub is never a child of the caller (the
    zygote, which walks all its children on every SIGCHLD), the namespace is owned by the range's root
    uid, and a range asked for again gets the namespace it was given before."""
    import fcntl
    import struct
    from edge.backends import nskeeper
    ns_get_owner_uid = 0xB704
    signals: list[int] = []
    old = signal.signal(signal.SIGCHLD, lambda *_: signals.append(1))
    keeper = nskeeper.Keeper()
    bases = [idmap.IdRange(idmap.COUNT - 1 - i).base for i in range(3)]   # never leased by tests (the top)
    fds: list[int] = []
    try:
        keeper.start()
        for base in bases:
            fds.append(keeper.get(base))
        assert signals == [], "a stub exited as the caller's child"
        for base, fd in zip(bases, fds):
            owner = struct.unpack("I", fcntl.ioctl(fd, ns_get_owner_uid, b"\0" * 4))[0]
            assert owner == base, (owner, base)
        again = keeper.get(bases[0])
        fds.append(again)
        assert os.fstat(again).st_ino == os.fstat(fds[0]).st_ino, "a range keeps its namespace"
        assert len({os.fstat(fd).st_ino for fd in fds[:3]}) == 3
    finally:
        for fd in fds:
            os.close(fd)
        if keeper.sock is not None:
            keeper.sock.close()
            os.waitpid(keeper.pid, 0)
        signal.signal(signal.SIGCHLD, old)

"""FnCall (issue 13 B): stateless calls on pooled workers, through the SDK against a node running only
fncall workers. Isolation between calls is checked the way an attacker would try to pass state: the
next call on the same worker looks for what the previous one left."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import psutil
import pytest

import libdsec
from bus import streams
from tests.conftest import extra_edge

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
async def hostile_image(stack, hostile, tmp_path_factory) -> str:
    """busybox with the attack toolbox at /hostile (too large to send with each call)."""
    from bus.images import ImageRegistry
    from edge.erofs import busybox_rootfs, pack_dir
    root = tmp_path_factory.mktemp("hostile") / "root"
    root.mkdir()
    busybox_rootfs(root)
    (root / "hostile").write_bytes(hostile)
    (root / "hostile").chmod(0o755)
    layer = root.parent / "layer.erofs"
    digest = pack_dir(root, layer)
    rec, _ = await ImageRegistry(stack.bus).publish("fn-hostile", layer, digest)
    return f"{rec.name}@{rec.version}"


@contextlib.asynccontextmanager
async def fncall_node(stack, tmp_path, name: str, workers_min: int, workers_max: int):
    async with extra_edge(stack, tmp_path / name, name, 8, backends=["fncall"],
                          options={"fncall": {"workers_min": workers_min, "workers_max": workers_max}}) as st:
        yield st


async def test_a_call_returns_its_result_with_files_and_a_trajectory(stack, client, tmp_path):
    async with fncall_node(stack, tmp_path, "fn-a", 1, 2) as st:
        r = await client.call("cat /tmp/in.txt | tr a-z A-Z; echo oops >&2; cp /tmp/in.txt out.txt; exit 3",
                              files={"/tmp/in.txt": b"hello\n"}, read_back=["/tmp/out.txt"], labels={"job": "fnj"})
        assert (r.exit_code, r.stdout, r.stderr) == (3, b"HELLO\n", b"oops\n")
        assert r.files == {"/tmp/out.txt": b"hello\n"} and r.node == st.edge.node and r.worker
        assert r.error is None and not r.ok and r.duration > 0 and r.peak_memory > 0
        argv = await client.call(["printf", "%s|", "a b", "c"])
        assert argv.stdout == b"a b|c|" and argv.ok
        traj = [t async for t in client.trajectories(job="fnj", follow=False)]
        calls = [t.record for t in traj if t.record.type == "call" and t.record.id == r.call_id]
        assert len(calls) == 1 and calls[0].exit_code == 3 and calls[0].stdout == b"HELLO\n"
        assert calls[0].node == st.edge.node


async def test_a_call_whose_files_cannot_come_back_still_returns_its_result(stack, client, tmp_path):
    """A read_back file that is not there, not a regular file, or past what the answer (one bus message) has
    room for after the output is named in `unread`: the command ran, and its exit code and output come back.
    Before: EnvironmentFailure (the result lost, the node blamed), or a bare DsecError ("the answer was too
    large to send") once output and files passed 1 MiB encoded (helper G)."""
    full = "head -c 262144 /dev/zero; head -c 262144 /dev/zero >&2; "
    async with fncall_node(stack, tmp_path, "fn-back", 1, 1):
        r = await client.call(full + "head -c 600000 /dev/urandom > /tmp/big; echo small > /tmp/s; mkdir /tmp/d; "
                              "exit 3", read_back=["/tmp/s", "/tmp/big", "/tmp/nope", "/tmp/d"])
        assert (r.exit_code, len(r.stdout), len(r.stderr), r.error) == (3, 262144, 262144, None)
        assert r.files == {"/tmp/s": b"small\n"}
        assert sorted(r.unread) == ["/tmp/big", "/tmp/d", "/tmp/nope"], r.unread
        assert "left in the call's answer" in r.unread["/tmp/big"] and "no such file" in r.unread["/tmp/nope"]
        room = await client.call("head -c 600000 /dev/urandom > /tmp/big", read_back=["/tmp/big"])
        assert len(room.files["/tmp/big"]) == 600000 and room.unread == {}   # with no output, the whole limit


async def test_calls_are_isolated_on_one_reused_worker(stack, client, tmp_path, hostile_image):
    """One worker: every call reports it, and none sees a file, process, env, IPC object or memory of an
    earlier one; the root and /dev stay read-only (a call cannot replace /dev/null for the next)."""
    async with fncall_node(stack, tmp_path, "fn-iso", 1, 1):
        img, res = hostile_image, libdsec.Resources(memory="256Mi")
        leave = ("echo s3cret > /tmp/secret; mkdir -p /tmp/d/e; echo x > /dev/shm/shm-secret; chmod 0 /tmp/d; "
                 "/hostile sysv 4242; export LEAK=1; (sleep 300 >/dev/null 2>&1 &) ; (/hostile hog 64 >/tmp/hog.out 2>&1 &); "
                 "sleep 0.5; cat /tmp/hog.out; echo pwned > /bin/pwned 2>/dev/null || echo ro; "
                 "rm -f /dev/null 2>/dev/null; echo x > /dev/planted 2>/dev/null || echo devro")
        first = await client.call(leave, image=img, resources=res)   # (its background processes hold no output
        assert first.stdout.split() == [b"ok", b"held", b"ro", b"devro"] and not first.timed_out, first   # pipe)
        assert first.peak_memory > 64 << 20, first
        look = ("ls -A /tmp /dev/shm | grep -v '^/\\|^$' | tr '\\n' ' '; echo; "
                "/hostile sysvfind 4242; echo LEAK=${LEAK:-none}; "
                "n=0; for p in /proc/[0-9]*; do n=$((n+1)); done; echo procs=$n; "
                "test -e /bin/pwned -o -e /dev/planted -o ! -c /dev/null && echo planted || echo clean")
        seen = set()
        for _ in range(25):   # (each call is wiped after: 25 show it as well as 100, in a quarter of the time)
            r = await client.call(look, image=img, resources=res)
            seen.add(r.worker)
            lines = r.stdout.decode().split("\n")
            # /tmp holds only what this call was given; the sysv objects, env, processes of before are gone
            assert lines[0].strip() == "", r.stdout
            assert lines[1:5] == ["0", "LEAK=none", "procs=2", "clean"], r.stdout   # the init and this shell
            assert r.peak_memory < 32 << 20, "the 64 MiB hog of the first call is gone"
        assert seen == {first.worker}, "the same worker served every call"
        # a call that writes /dev/shm alone (no /tmp): the wipe saw it empty and the next call read the file
        # (a btrfs dir listed through the fd the wipe kept shows no entry made since: helper-44, across tenants)
        for n in range(3):
            planted = await client.call(f"echo s3cret-{n} > /dev/shm/only-{n}; ls -A /dev/shm", image=img,
                                        resources=res)
            assert planted.stdout == b"only-%d\n" % n, planted
            after = await client.call("ls -A /dev/shm /tmp; cat /dev/shm/* 2>&1", image=img, resources=res)
            assert after.stdout == b"/dev/shm:\n\n/tmp:\ncat: can't open '/dev/shm/*': No such file or directory\n", \
                after.stdout
        big = await client.call("/hostile hog 200", image=img, resources=libdsec.Resources(memory="128Mi"),
                                timeout=20)
        assert big.exit_code != 0 and not big.timed_out and b"held" not in big.stdout, big   # killed at its limit (the
        # toolbox's hog was optimised away: it "held" 200 MiB in 700 kB, and this passed on its timeout)


async def test_a_call_that_leaves_a_very_deep_tree_does_not_take_its_worker_out_of_the_pool(stack, client, tmp_path):
    """A chain of 1,500 directories left in /tmp: the wipe's recursive rmtree raised RecursionError, so the
    worker was neither wiped nor retired, out of the pool for good; any tenant so took a node's workers one
    call at a time (helper G). The wipe removes any depth now; the next call is served on a clean /tmp."""
    async with fncall_node(stack, tmp_path, "fn-deep", 1, 1):
        deep = await client.call("cd /tmp && p=$(printf 'x/%.0s' $(seq 1500)) && mkdir -p $p && cd $p && "   # (3,000
                                 "echo leaf > f; ln -s / up; echo made", timeout=60)                      # bytes: one mkdir)
        assert deep.stdout == b"made\n", deep
        after = await client.call("ls -A /tmp | wc -l", timeout=30)
        assert after.stdout.strip() == b"0" and after.worker == deep.worker, after


async def test_the_pool_grows_under_load_and_shrinks_when_idle(stack, client, tmp_path, monkeypatch):
    from edge.backends import fncall
    monkeypatch.setattr(fncall, "IDLE_RETIRE", 1.0)
    async with fncall_node(stack, tmp_path, "fn-grow", 2, 6) as st:
        backend = st.edge.backend.backends["fncall"]
        results = await client.call_many([{"cmd": "sleep 0.5; echo $((6*7))"} for _ in range(64)])
        assert [r.stdout for r in results] == [b"42\n"] * 64
        assert len({r.worker for r in results}) == 6 and backend.started >= 6, "grew to its maximum"
        for _ in range(100):
            if backend.workers() == 2:
                break
            await asyncio.sleep(0.1)
        assert backend.workers() == 2, "shrank back to its minimum once idle"


async def test_bad_calls_fail_typed_and_a_batch_goes_on(stack, client, tmp_path):
    async with fncall_node(stack, tmp_path, "fn-bad", 1, 2) as st:
        with pytest.raises(libdsec.InvalidRequest, match="at most cpu"):
            await client.call("true", resources=libdsec.Resources(cpu=64))
        with pytest.raises(libdsec.InvalidRequest, match="cmd"):
            await client.call([])
        with pytest.raises(libdsec.InvalidRequest, match="absolute"):
            await client.call("true", read_back=["relative"])
        for bad in ({"files": {"/etc/x": b"1"}}, {"files": {"/tmp/../etc/x": b"1"}},   # (they ran first, then
                    {"read_back": ["/tmp/../etc/passwd"]}):                           # EnvironmentFailure: G)
            with pytest.raises(libdsec.InvalidRequest, match="under /tmp or /dev/shm"):
                await client.call("echo ran", **bad)
        with pytest.raises(libdsec.ImageNotFound):
            await client.call("true", image="no-such-image")
        with pytest.raises(libdsec.ExecFailed, match="no-such-cmd"):
            await client.call(["no-such-cmd"])
        t = await client.call("sleep 30 & sleep 30; echo never", timeout=1)
        assert t.timed_out and t.stdout == b""
        batch = await client.call_many([{"cmd": "echo 1"}, {"cmd": "true", "bogus": 1}, {"cmd": ["no-such"]},
                                        {"cmd": "echo 4"}])
        assert [r.stdout for r in batch] == [b"1\n", b"", b"", b"4\n"]
        assert isinstance(batch[1].error, libdsec.InvalidRequest) and isinstance(batch[2].error, libdsec.ExecFailed)
        assert st.edge.calls.served == 6   # what the SDK refused never reached a node
        after = await client.call("echo fine")
        assert after.ok, "the node is healthy after all of it"


async def test_a_call_no_node_can_take_fails_at_once_or_after_its_wait_and_never_runs_later(stack, client, tmp_path):
    """With no node running fncall workers a call fails at once, unsent (it waited its whole `wait`, 30 s by
    default, for a worker none had). One sent while a node was there (the client trusts that answer a few
    seconds) that no worker takes fails after its wait, and a node coming later drops it, never runs it."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(libdsec.CapacityUnavailable, match="no node runs fncall workers.*not sent"):
        await client.call("echo never > /dev/null", timeout=1)
    assert loop.time() - t0 < 2
    assert (await stack.bus.js.consumer_info(streams.CALL_STREAM, "calls-latency")).num_pending == 0
    client._fncall.until = loop.time() + 60   # as if a node had been there a moment ago
    with pytest.raises(libdsec.CapacityUnavailable, match="no fncall worker"):
        await client.call("echo late > /dev/null", timeout=1, wait=1)
    assert loop.time() - t0 < 15
    async with fncall_node(stack, tmp_path, "fn-late", 1, 1) as st:   # a node comes only now
        await client.call("true")   # served after the stale call was pulled (in order)
        assert st.edge.calls.served == 1, "the stale call was dropped, not run"
        for _ in range(100):   # the call's ack follows its reply (and its trajectory record)
            info = await stack.bus.js.consumer_info(streams.CALL_STREAM, "calls-latency")
            if info.num_pending == 0 and info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.05)
        assert info.num_pending == 0 and info.num_ack_pending == 0, "nothing of the stale call is left queued"


async def test_fncall_has_no_sandboxes(client):
    with pytest.raises(libdsec.Unsupported, match="client.call"):
        await client.create(backend="fncall")


async def test_a_tenants_quota_bounds_its_calls_on_a_node_while_others_run(stack, tmp_path):
    from bus.records import Quota
    await stack.bus.kv_put(streams.QUOTAS_KV, "fnq", Quota(tenant="fnq", max_cpu=1.0))
    try:
        async with fncall_node(stack, tmp_path, "fn-q", 4, 4) as st, \
                libdsec.AsyncClient(stack.url, tenant="fnq") as capped, \
                libdsec.AsyncClient(stack.url, tenant="fnfree") as free:
            await asyncio.gather(capped.call("true"), free.call("true"))   # workers started, quota seen
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            one = [{"cmd": "sleep 0.4", "resources": libdsec.Resources(cpu=1)}]
            slow = asyncio.ensure_future(capped.call_many(one * 3))
            fast = await free.call_many(one * 3)
            fast_done = loop.time() - t0
            assert all(r.ok for r in fast) and all(r.ok for r in await slow)
            slow_done = loop.time() - t0
            assert slow_done >= 1.2, "one core at a time: the capped tenant's calls ran one after another"
            assert fast_done < slow_done, (fast_done, slow_done)   # the other tenant was not held back
            assert st.edge.calls.held_back > 0
    finally:
        await stack.bus.kv_delete(streams.QUOTAS_KV, "fnq")


def _servers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.cmdline()[:2] == ["dsec-enter", "--serve"]]


async def test_a_worker_runs_its_calls_through_its_own_exec_server(stack, client, tmp_path):
    """A worker's calls go through its resident exec server, which entered the worker once and collects
    their output itself, with no spawn of the helper per call; a command too large for one request goes
    the one-shot way with the same result; a killed server is replaced at the next call, which is
    answered; a stopped node leaves no server."""
    async with fncall_node(stack, tmp_path, "fn-srv", 1, 1) as st:
        workers = st.edge.backend.backends["fncall"]._workers
        assert (await client.call(["echo", "one"])).stdout == b"one\n"
        (worker,) = workers._sandboxes.values()
        server = worker.resident
        assert server is not None and not server.closed and server.pid in [p.pid for p in _servers()]
        # entered once: in the worker's namespaces itself, each command its own child (no helper between),
        # the command in the worker's group and the server out of it (a timeout kills that group)
        for ns in ("mnt", "ipc", "net", "user"):
            assert os.readlink(f"/proc/{server.pid}/ns/{ns}") == os.readlink(f"/proc/{worker.init_pid}/ns/{ns}")
        slow = asyncio.ensure_future(client.call(["sleep", "3"]))
        pids: list[int] = []
        for _ in range(200):
            pids = worker.call_group.procs()
            if pids:
                break
            await asyncio.sleep(0.01)
        (pid,) = pids
        assert psutil.Process(pid).ppid() == server.pid and psutil.Process(pid).name() == "sleep"
        assert (await slow).exit_code == 0
        spawned = []
        one_shot = workers._spawner.spawn
        workers._spawner.spawn = lambda *a, **k: (spawned.append(a[3]), one_shot(*a, **k))[1]
        for i in range(5):
            assert (await client.call(["echo", str(i)])).stdout == f"{i}\n".encode()
        # the server collects the output itself: stdin fed, pieces past what it holds back sent ahead,
        # each stream cut at max_output and the cut reported, a bigger piece of env still in one request
        data = bytes(range(256)) * 240
        fed = await client.call(["sh", "-c", "cat; echo e1 >&2; head -c 190000 /dev/zero | tr '\\0' z"],
                                stdin=data)
        assert (fed.exit_code, fed.stdout, fed.stderr, fed.truncated) == (0, data + b"z" * 190000, b"e1\n", False)
        cut = await client.call(["sh", "-c", "head -c 500000 /dev/zero | tr '\\0' y; echo short >&2"],
                                max_output=1000)
        assert (cut.stdout, cut.stderr, cut.truncated) == (b"y" * 1000, b"short\n", True)
        mid = await client.call(["sh", "-c", 'printf %s "$BIG" | wc -c'], env={"BIG": "x" * 70_000})
        assert (mid.exit_code, mid.stdout.strip()) == (0, b"70000")
        assert spawned == [] and worker.resident is server
        # more than one request holds (128 KiB): the one-shot way, with the same result
        env = {f"BIG{i}": "x" * 60_000 for i in range(3)}
        big = await client.call(["sh", "-c", 'printf %s "$BIG0$BIG1$BIG2" | wc -c'], env=env)
        assert (big.exit_code, big.stdout.strip()) == (0, b"180000") and len(spawned) == 1
        os.kill(server.pid, signal.SIGKILL)
        await server.exited
        again = await client.call(["echo", "again"])
        assert (again.exit_code, again.stdout) == (0, b"again\n"), again
        assert worker.resident is not server and not worker.resident.closed and server.closed
        last = worker.resident
    assert last.closed and last.exited.done() and _servers() == []

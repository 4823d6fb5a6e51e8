"""The E2B facade (issue 18): E2B-style agent code, unchanged after libdsec.e2b.install(), on a real stack."""
from __future__ import annotations

import asyncio
import time
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


async def test_agent_code_written_for_e2b_runs_unchanged(e2b_env):
    await asyncio.to_thread(_agent_loop)   # the stack serves on this loop meanwhile


def _agent_loop() -> None:
    """What an E2B rollout does, written against `e2b` as its users write it."""
    import time
    from e2b import Sandbox, SandboxQuery
    from e2b.exceptions import InvalidArgumentException, SandboxNotFoundException
    from e2b.sandbox.commands.command_handle import CommandExitException
    from e2b.sandbox.filesystem.filesystem import FileType

    with pytest.raises(InvalidArgumentException, match="nonsense"):
        Sandbox.create(template="busybox", nonsense=1)
    with pytest.raises(InvalidArgumentException, match="on_timeout"):
        Sandbox.create(template="busybox", lifecycle={"on_timeout": "hibernate"})
    sbx = Sandbox.create(template="busybox", timeout=120, metadata={"job": "e2b-t1"}, envs={"A": "1"},
                         api_key="e2b_ignored", domain="ignored.example")
    try:
        r = sbx.commands.run("echo $A; echo err >&2")
        assert (r.stdout, r.stderr, r.exit_code) == ("1\n", "err\n", 0)
        seen: list[str] = []
        r = sbx.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=seen.append, envs={"B": "2"}, cwd="/tmp")
        assert "".join(seen) == "1\n2\n3\n" == r.stdout
        assert sbx.commands.run("pwd; echo $B", cwd="/tmp", envs={"B": "2"}).stdout == "/tmp\n2\n"
        with pytest.raises(CommandExitException) as ei:
            sbx.commands.run("echo partial; exit 3")
        assert (ei.value.exit_code, ei.value.stdout) == (3, "partial\n")
        parts: list[str] = []                                     # a line not finished yet arrives as it is
        h = sbx.commands.run("printf 'abc'; sleep 30; echo def", background=True, on_stdout=parts.append)
        for _ in range(100):
            if parts:
                break
            time.sleep(0.05)
        assert parts == ["abc"] and h.stdout == "abc"
        assert h.kill() is True
        # E2B's sync run ignores a background command's handlers, so code written for it gives them to wait()
        # too: each chunk reaches a handler once (helper-41: every chunk still to come came twice)
        seen_once: list[str] = []
        h = sbx.commands.run("echo one; sleep 0.3; echo two", background=True, on_stdout=seen_once.append)
        h.wait(on_stdout=seen_once.append)
        assert "".join(seen_once) == "one\ntwo\n", seen_once
        h = sbx.commands.run("echo started; sleep 60", background=True)
        for _ in range(100):
            if h.stdout:
                break
            time.sleep(0.05)
        assert h.kill() is True
        with pytest.raises(CommandExitException) as ei:
            h.wait()
        # as E2B's envd says a command it killed (its CLI checks exitCode -1 and error "signal: killed"): DSec
        # said 137, error None (helper-41); a command's own non-zero exit says "exit status N", as envd's
        assert (ei.value.exit_code, ei.value.error) == (-1, "signal: killed") and "started" in ei.value.stdout
        assert (h.exit_code, h.error) == (-1, "signal: killed")
        with pytest.raises(CommandExitException) as ei:
            sbx.commands.run("echo out; echo err >&2; exit 3")
        assert (ei.value.exit_code, ei.value.error, ei.value.stdout, ei.value.stderr) == (3, "exit status 3",
                                                                                      "out\n", "err\n")

        info = sbx.files.write("/work/sub/a.txt", "hello")       # parents made, as E2B does
        assert (info.path, info.type) == ("/work/sub/a.txt", FileType.FILE)
        assert sbx.files.read("/work/sub/a.txt") == "hello"
        assert sbx.files.read("/work/sub/a.txt", format="bytes") == bytearray(b"hello")
        entries = sbx.files.list("/work", depth=2)
        assert [(e.path, e.type) for e in entries] == [("/work/sub", FileType.DIR), ("/work/sub/a.txt", FileType.FILE)]
        assert entries[1].size == 5 and entries[1].permissions == "-rw-r--r--" and entries[1].owner == "root"
        sbx.files.write("/work/m", "x", metadata={"k": "v"})
        assert sbx.files.get_info("/work/m").metadata == {"k": "v"}
        sbx.files.remove("/work/m")
        assert sbx.files.make_dir("/work/d") is True and sbx.files.exists("/work/d")
        moved = sbx.files.rename("/work/sub/a.txt", "/work/d/b.txt")
        assert moved.name == "b.txt" and not sbx.files.exists("/work/sub/a.txt")
        sbx.files.remove("/work/d")
        assert not sbx.files.exists("/work/d/b.txt")
        with pytest.raises(Exception) as ei:
            sbx.files.read("/work/missing")
        assert type(ei.value).__name__ == "FileNotFoundException"

        got = sbx.get_info()
        assert got.sandbox_id == sbx.sandbox_id and got.metadata == {"job": "e2b-t1"} and got.template_id == "busybox"
        # E2B's fields and types (helper-41: sandbox_domain was missing, cpu_count a float)
        assert (got.cpu_count, got.memory_mb, got.sandbox_domain) == (1, 256, None), got
        assert type(got.cpu_count) is int
        assert sbx.is_running()
        listed = Sandbox.list(query=SandboxQuery(metadata={"job": "e2b-t1"})).next_items()
        assert [i.sandbox_id for i in listed] == [sbx.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"job": "nobody"})).next_items() == []

        again = Sandbox.connect(sbx.sandbox_id)
        assert again.commands.run("cat /work/sub/../d 2>/dev/null || echo gone").stdout == "gone\n"
    finally:
        killed = sbx.kill()
    assert killed is True
    assert Sandbox.kill(sbx.sandbox_id) is False                 # never raises for a missing one
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sbx.sandbox_id)


async def test_the_async_sandbox_in_the_callers_loop(e2b_env):
    from e2b import AsyncSandbox
    from e2b.exceptions import NotFoundException
    sbx = await AsyncSandbox.create(template="busybox")
    try:
        out: list[str] = []
        r = await sbx.commands.run("echo one; echo two >&2", on_stderr=out.append)
        assert (r.stdout, out) == ("one\n", ["two\n"])
        await sbx.files.write("/x.bin", b"\x00\xff" * 300_000)
        assert await sbx.files.read("/x.bin", format="bytes") == bytearray(b"\x00\xff" * 300_000)
        assert await sbx.pause() is True and await sbx.pause() is False   # paused already: False
        assert not await sbx.is_running()
        back = await AsyncSandbox.connect(sbx.sandbox_id)     # resumes it
        assert await back.is_running()
        assert (await back.commands.run("echo back")).stdout == "back\n"
        def oops(text: str) -> None:
            raise RuntimeError(f"the caller's handler failed on {text!r}")
        with pytest.raises(RuntimeError, match="handler failed"):   # the command is this call's: killed
            await back.commands.run("echo x; exec sleep 51", on_stdout=oops)
        for _ in range(30):
            if not any("sleep 51" in " ".join(p.args) for p in await back.commands.list()):
                break
            await asyncio.sleep(0.1)
        assert not any("sleep 51" in " ".join(p.args) for p in await back.commands.list())
    finally:
        assert await sbx.kill() is True
    with pytest.raises(NotFoundException):
        await AsyncSandbox.get_info(sbx.sandbox_id)
    from e2b.exceptions import SandboxException, TimeoutException
    with pytest.raises(SandboxException) as ei:   # a killed sandbox: not found (TimeoutException is for a command
        await sbx.commands.run("echo late")       # running when it was killed)
    assert isinstance(ei.value, NotFoundException) and not isinstance(ei.value, TimeoutException), repr(ei.value)


async def test_timeouts_pause_and_connect_extends_never_shortens(e2b_env):
    import time
    from e2b import AsyncSandbox, SandboxState
    sbx = await AsyncSandbox.create(template="busybox", timeout=2, lifecycle={"on_timeout": "pause"})
    try:
        await sbx.files.write("/kept", "yes")
        await asyncio.sleep(3.5)
        info = await sbx.get_info()
        assert info.state == SandboxState.PAUSED            # paused at its timeout, not killed
        back = await AsyncSandbox.connect(sbx.sandbox_id, timeout=60)
        assert await back.is_running() and await back.files.read("/kept") == "yes"
        end = (await back.get_info()).end_at.timestamp()
        assert abs(end - (time.time() + 60)) < 5
        await AsyncSandbox.connect(sbx.sandbox_id, timeout=5)   # never shortens
        assert abs((await back.get_info()).end_at.timestamp() - end) < 1
        await back.set_timeout(1)                               # set_timeout does
        await asyncio.sleep(2.5)
        assert (await back.get_info()).state == SandboxState.PAUSED
    finally:
        assert await sbx.kill() is True


async def test_commands_by_pid_list_kill_stdin_and_connect(e2b_env):
    await asyncio.to_thread(_by_pid)


def _by_pid() -> None:
    """E2B's process surface: a pid on every handle, commands.list/kill/send_stdin/connect by it, from a
    second Sandbox object too (as a restarted client would)."""
    from e2b import Sandbox
    from e2b.exceptions import NotFoundException
    from e2b.sandbox.commands.command_handle import CommandExitException
    sbx = Sandbox.create(template="busybox", timeout=120)
    try:
        h = sbx.commands.run("echo $$; cat", background=True, stdin=True)
        assert h.pid > 1
        listed = sbx.commands.list()
        assert [(p.pid, p.cmd, p.args) for p in listed] == [(h.pid, "/bin/bash", ["-l", "-c", "echo $$; cat"])]
        assert listed[0].tag
        sbx.commands.send_stdin(h.pid, "to cat\n")
        other = Sandbox.connect(sbx.sandbox_id)                 # another client's view
        again = other.commands.connect(h.pid)
        assert again.pid == h.pid
        other.commands.close_stdin(h.pid)
        res = again.wait()
        assert (res.exit_code, res.stdout) == (0, f"{h.pid}\nto cat\n")
        assert h.wait().stdout == f"{h.pid}\nto cat\n"
        assert sbx.commands.list() == []
        with pytest.raises(NotFoundException):
            sbx.commands.send_stdin(h.pid, "late")
        with pytest.raises(NotFoundException):
            sbx.commands.connect(h.pid)

        s = sbx.commands.run("sleep 60", background=True)
        assert sbx.commands.kill(s.pid) is True
        with pytest.raises(CommandExitException) as ei:
            s.wait()
        assert (ei.value.exit_code, ei.value.error) == (-1, "signal: killed")
        assert sbx.commands.kill(s.pid) is False                # ended: not found, never raises
        assert sbx.commands.run("echo $$").exit_code == 0
    finally:
        sbx.kill()


_FIRST_CLIENT = """
import os, signal, sys
import libdsec.e2b
libdsec.e2b.install()
from e2b import Sandbox
sbx = Sandbox.create(template="busybox", timeout=120)
h = sbx.commands.run("echo start; read line; echo got $line; for i in 1 2 3; do echo $i; sleep 0.2; done",
                     background=True, stdin=True)
print(sbx.sandbox_id, h.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)   # the client process dies: no close, no goodbye
"""
_SECOND_CLIENT = """
import sys
import libdsec.e2b
libdsec.e2b.install()
from e2b import Sandbox
sbx = Sandbox.connect(sys.argv[1])
pid = int(sys.argv[2])
assert pid in [p.pid for p in sbx.commands.list()], sbx.commands.list()
h = sbx.commands.connect(pid)
sbx.commands.send_stdin(pid, "hello\\n")
res = h.wait()
sys.stdout.write(res.stdout)
assert sbx.kill()
"""


async def test_a_command_outlives_its_client_process_and_another_process_reattaches(e2b_env):
    """The first client process is SIGKILLed right after starting a command; a second process connects by
    the sandbox's id and the command's pid, writes its stdin, and gets all its output from the start."""
    first = await asyncio.create_subprocess_exec(sys.executable, "-c", _FIRST_CLIENT,
                                                 stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(first.communicate(), 120)
    assert first.returncode == -9
    sandbox_id, pid = out.decode().split()
    second = await asyncio.create_subprocess_exec(sys.executable, "-c", _SECOND_CLIENT, sandbox_id, pid,
                                                  stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(second.communicate(), 120)
    assert second.returncode == 0, err.decode()[-2000:]
    assert out == b"start\ngot hello\n1\n2\n3\n"


async def test_watch_dir_in_both_flavours(e2b_env):
    from e2b import AsyncSandbox
    from e2b.exceptions import FileNotFoundException, InvalidArgumentException
    from e2b.sandbox.filesystem.watch_handle import FilesystemEvent, FilesystemEventType
    sbx = await AsyncSandbox.create(template="busybox")
    try:
        await sbx.files.make_dir("/w")
        seen: list = []
        ended: list = []
        handle = await sbx.files.watch_dir("/w", seen.append, on_exit=ended.append, recursive=True)
        await sbx.files.write("/w/sub/new.txt", "hi")       # makes /w/sub first
        for _ in range(100):
            if len(seen) >= 6 and (seen[-1].name, seen[-1].type) == ("sub/new.txt", FilesystemEventType.CHMOD):
                break
            await asyncio.sleep(0.05)
        E = FilesystemEventType   # the edge's write: made and owned by the sandbox's root, truncated, written, moded
        got = [(e.name, e.type) for e in seen]
        got = [ev for i, ev in enumerate(got) if i == 0 or got[i - 1] != ev]   # inotify merges a repeat not yet read
        assert got == [("sub", E.CREATE), ("sub", E.CHMOD), ("sub/new.txt", E.CREATE), ("sub/new.txt", E.CHMOD),
                       ("sub/new.txt", E.WRITE), ("sub/new.txt", E.CHMOD)]
        assert isinstance(seen[0], FilesystemEvent)
        await handle.stop()
        assert ended == [None]
        timed: list = []   # one that ends at its timeout says so, as E2B's (it said None, as if stopped: helper-41)
        await sbx.files.watch_dir("/w", seen.append, on_exit=timed.append, timeout=1)
        for _ in range(100):
            if timed:
                break
            await asyncio.sleep(0.05)
        assert [type(e).__name__ for e in timed] == ["TimeoutException"], timed
        with pytest.raises(FileNotFoundException):
            await sbx.files.watch_dir("/missing", seen.append)
        await sbx.files.write("/w-file", "x")
        with pytest.raises(InvalidArgumentException, match="not a directory: /w-file"):   # (E2B's envd: so)
            await sbx.files.watch_dir("/w-file", seen.append)
        await asyncio.to_thread(_sync_watch, sbx.sandbox_id)
    finally:
        await sbx.kill()


def _sync_watch(sandbox_id: str) -> None:
    from e2b import Sandbox
    from e2b.exceptions import SandboxException
    from e2b.sandbox.filesystem.watch_handle import FilesystemEventType
    import time
    sbx = Sandbox.connect(sandbox_id)
    w = sbx.files.watch_dir("/w")
    sbx.commands.run("echo a > /w/f; rm /w/f")
    got: list = []
    for _ in range(100):
        got += w.get_new_events()
        if len(got) >= 3:
            break
        time.sleep(0.05)
    assert [(e.name, e.type) for e in got] == [("f", FilesystemEventType.CREATE), ("f", FilesystemEventType.WRITE),
                                               ("f", FilesystemEventType.REMOVE)]
    assert w.get_new_events() == []
    w.stop()
    with pytest.raises(SandboxException, match="already stopped"):
        w.get_new_events()


async def test_pty_as_e2b_has_it(e2b_env):
    from e2b import AsyncSandbox
    from e2b.sandbox.commands.command_handle import PtySize
    sbx = await AsyncSandbox.create(template="busybox")
    try:
        data = bytearray()
        term = await sbx.pty.create(PtySize(rows=24, cols=80), data.extend, envs={"X": "y"})
        assert term.pid > 1
        await sbx.pty.send_stdin(term.pid, b"echo pty-$((3+4)) $X $LANG; stty size\n")
        for _ in range(200):
            if b"24 80\r\n" in data:
                break
            await asyncio.sleep(0.05)
        await sbx.pty.resize(term.pid, PtySize(rows=40, cols=120))
        await sbx.pty.send_stdin(term.pid, b"stty size\n")
        for _ in range(200):
            if b"40 120\r\n" in data:
                break
            await asyncio.sleep(0.05)
        assert b"pty-7 y C.UTF-8\r\n24 80\r\n" in data and b"40 120\r\n" in data
        assert await sbx.pty.kill(term.pid) is True
        assert await sbx.pty.kill(term.pid) is False
        await asyncio.to_thread(_sync_pty, sbx.sandbox_id)
    finally:
        await sbx.kill()


def _sync_pty(sandbox_id: str) -> None:
    from e2b import Sandbox
    from e2b.sandbox.commands.command_handle import PtySize
    sbx = Sandbox.connect(sandbox_id)
    term = sbx.pty.create(PtySize(rows=10, cols=50))
    sbx.pty.send_stdin(term.pid, b"echo sync-$((5*5)); exit 0\n")
    got = bytearray()
    result = term.wait(on_pty=got.extend)       # what came before wait() too
    assert result.exit_code == 0 and b"sync-25\r\n" in got


async def test_snapshots_and_fork(e2b_env):
    await asyncio.to_thread(_snapshots)


def _snapshots() -> None:
    """create_snapshot -> create(snapshot_id) -> list_snapshots -> fork(count) -> delete_snapshot, as E2B code does."""
    from e2b import Sandbox
    from e2b.exceptions import InvalidArgumentException
    sbx = Sandbox.create(template="busybox", timeout=120)
    made: list = []
    snap = None
    try:
        sbx.files.write("/state/step", "12")
        snap = sbx.create_snapshot(name="step-12")
        assert snap.snapshot_id.startswith("snap") and snap.names == ["step-12"]
        assert sbx.commands.run("echo alive").stdout == "alive\n"        # frozen only while it was taken
        child = Sandbox.create(snap.snapshot_id, timeout=60)
        made.append(child)
        assert child.files.read("/state/step") == "12" and child.sandbox_id != sbx.sandbox_id
        mine = sbx.list_snapshots().next_items()
        assert [s.snapshot_id for s in mine] == [snap.snapshot_id]
        assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots(name="step-12").next_items()]
        pages = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id, limit=1)
        assert pages.next_items() and not pages.has_next

        sbx.files.write("/state/step", "13")
        forks = sbx.fork(2, 60)        # fork(count, timeout), as docs/e2b.md says (it made 60 forks of 2 s)
        assert len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks), forks
        assert all(55 < f.get_info().end_at.timestamp() - time.time() <= 61 for f in forks), forks
        made += forks
        for f in forks:
            assert f.files.read("/state/step") == "13"
        forks[0].files.write("/state/step", "mine")                     # each its own
        assert forks[1].files.read("/state/step") == "13" and sbx.files.read("/state/step") == "13"
        with pytest.raises(InvalidArgumentException, match="count"):
            sbx.fork(count=0)
        with pytest.raises(InvalidArgumentException, match="from 1 to 100"):
            sbx.fork(300)
        with pytest.raises(InvalidArgumentException, match="in use"):   # child runs on it
            Sandbox.delete_snapshot(snap.snapshot_id)
        child.kill()
        made.remove(child)
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
        snap = None

        def fork_snapshots() -> list[str]:
            return [s.snapshot_id for s in Sandbox.list_snapshots(name="e2b-fork").next_items()]
        first = fork_snapshots()
        assert len(first) == 1
        forks[0].kill()
        assert fork_snapshots() == first            # its other fork still runs on it
        forks[1].kill()
        made.clear()
        assert fork_snapshots() == []               # its last fork killed: the fork's snapshot went too
        brief = sbx.fork(1, 1)                      # ends by its timeout: the next fork() removes its snapshot
        assert len(brief) == 1 and len(fork_snapshots()) == 1
        time.sleep(3)
        made += sbx.fork(1, 60)
        assert len(fork_snapshots()) == 1 and fork_snapshots() != first
        # another process's fork snapshots, left by it (its forks all ended), go at a fork() once old
        # enough: they stayed for good and held their image (helper U2)
        from libdsec.e2b.sandbox_async import snapshots
        left = [snapshots._FORKED.pop(f.sandbox_id) for f in made[-1:]]   # (as if another process made them)
        made[-1].kill()
        made.pop()
        assert fork_snapshots() == left
        snapshots.SWEEP_AFTER = 0.0
        try:
            made += sbx.fork(1, 60)
        finally:
            snapshots.SWEEP_AFTER = 600.0
        assert len(fork_snapshots()) == 1 and fork_snapshots() != left
    finally:
        for s in made:
            s.kill()
        sbx.kill()


async def test_the_details_e2b_code_relies_on(e2b_env):
    await asyncio.to_thread(_details)


def _details() -> None:
    """What E2B's own tests found: metadata in user.e2b.*, header-token keys, timeouts as TimeoutException,
    a killed sandbox's command as a TimeoutException, iteration over a handle, stream reads as context
    managers, relative cwd, list order and pages, lifecycle forms, Secret refused."""
    import datetime
    import hashlib
    import time
    from e2b import Sandbox, SandboxQuery, Secret
    from e2b.exceptions import FileNotFoundException, InvalidArgumentException, SandboxException, TimeoutException
    tag = f"details-{time.time_ns()}"
    first = Sandbox.create(template="busybox", timeout=120, metadata={"t": tag},
                           lifecycle={"on_timeout": {"action": "pause", "keep_memory": None}})
    second = Sandbox.create(template="busybox", timeout=120, metadata={"t": tag}, lifecycle={"on_timeout": None})
    try:
        # E2B calls DSec does not offer say so, as the facade's other refusals do (they were AttributeError)
        for name in ("get_host", "get_metrics", "upload_url", "download_url", "sandbox_domain"):
            with pytest.raises(InvalidArgumentException, match=f"{name} is not offered by DSec"):
                getattr(first, name)
        assert not hasattr(first, "get_host") and getattr(first, "sandbox_domain", None) is None
        with pytest.raises(AttributeError):
            first.no_such_call
        info = first.files.write("/m.txt", "x", metadata={"author": "me"})
        assert info.metadata == {"author": "me"}
        assert first.files.get_info("/m.txt").metadata == {"author": "me"}
        first.files.write("/m.txt", "y")
        assert first.files.get_info("/m.txt").metadata is None           # a rewrite without metadata clears it
        for bad in ({"bad key": "v"}, {"": "v"}, {"k": "a\nb"}, {"k\n": "v"}):
            with pytest.raises(InvalidArgumentException):
                first.files.write("/m.txt", "z", metadata=bad)
        with pytest.raises(TimeoutException):
            first.commands.run("sleep 10", timeout=1)
        h = first.commands.run("echo one; sleep 0.2; echo two >&2", background=True)
        assert [c for c in h] == [("one\n", None, None), (None, "two\n", None)]
        with first.files.read("/m.txt", format="stream") as stream:
            assert b"".join(stream) == b"y"
        # as E2B's envd answers them (400: InvalidArgumentException), not SandboxException (helper-41)
        first.files.make_dir("/home/user/adir")
        for call in (lambda: first.files.read("/home/user/adir"), lambda: first.files.write("/home/user/adir", "x"),
                     lambda: first.commands.run("pwd", cwd="/nonexistent")):
            with pytest.raises(InvalidArgumentException):
                call()
        # a stream is read as it is taken, a piece at a time (helper-41: 200 MB were read whole first, 609 MiB held)
        first.commands.run("head -c 3145728 /dev/urandom > /tmp/big")
        digest = first.commands.run("sha256sum /tmp/big").stdout.split()[0]
        with first.files.read("/tmp/big", format="stream") as stream:
            pieces = list(stream)
        assert len(pieces) > 1 and hashlib.sha256(b"".join(pieces)).hexdigest() == digest
        with first.files.read("/tmp/big", format="stream") as stream:
            next(stream)
            first.commands.run("echo more >> /tmp/big")   # changed after its first piece: said, not mixed
            with pytest.raises(SandboxException, match="changed while read"):
                list(stream)
        first.files.make_dir("/home/user/sub")
        assert first.commands.run("pwd", cwd="sub").stdout == "/home/user/sub\n"   # relative: the user's home
        # /proc and /sys: the sandbox's own, as a program of it reads them (not the host's; not refused)
        boot = first.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
        assert first.files.read("/proc/sys/kernel/random/boot_id") == boot
        assert first.files.read("/proc/1/cmdline", format="bytes") == first.commands.run(
            "cat /proc/1/cmdline").stdout.encode()
        assert first.files.read("/proc/self/status").startswith("Name:\tcat\n")
        with pytest.raises(FileNotFoundException):
            first.files.read("/proc/no-such-file")

        listed = Sandbox.list(query=SandboxQuery(metadata={"t": tag}))
        assert [s.sandbox_id for s in listed.next_items()] == [second.sandbox_id, first.sandbox_id]   # newest first
        assert listed.next_token is None and not listed.has_next
        pages = Sandbox.list(query=SandboxQuery(metadata={"t": tag}), limit=1, order="asc")
        assert [s.sandbox_id for s in pages.next_items()] == [first.sandbox_id] and pages.has_next
        assert [s.sandbox_id for s in pages.next_items()] == [second.sandbox_id] and pages.next_token is None
        later = second.get_info().started_at + datetime.timedelta(seconds=1)
        assert Sandbox.list(query=SandboxQuery(metadata={"t": tag}, started_after=later)).next_items() == []
        assert len(Sandbox.list(query=SandboxQuery(metadata={"t": tag}, template="busybox")).next_items()) == 2

        running = second.commands.run("sleep 60", background=True)
        second.kill()
        with pytest.raises(TimeoutException, match="killed or reached its end of life"):
            running.wait()
        with pytest.raises(InvalidArgumentException, match="keep_memory"):
            Sandbox.create(template="busybox", lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}})
        with pytest.raises(InvalidArgumentException, match="secrets"):
            Secret()
        from e2b import BuildException, GitAuthException, Template   # importable, as E2B code imports them
        from e2b.exceptions import AuthenticationException, VolumeNotFoundException, NotFoundException
        assert issubclass(GitAuthException, AuthenticationException) and issubclass(VolumeNotFoundException,
                                                                                    NotFoundException)
        assert not issubclass(BuildException, SandboxException)
        for use in (lambda: Template(), lambda: Template.build("x")):
            with pytest.raises(InvalidArgumentException, match="dsec image build"):
                use()
    finally:
        first.kill()
        second.kill()


async def test_what_a_new_user_of_the_facade_ran_into(e2b_env, stack, monkeypatch):
    """Helper E's findings, each as its user hit it."""
    await asyncio.to_thread(_sync_findings, monkeypatch)
    await asyncio.to_thread(_loop_findings, stack, monkeypatch)   # (each asyncio.run() there: a loop of its own)


def _sync_findings(monkeypatch) -> None:
    import threading
    from e2b import Sandbox
    from e2b.exceptions import SandboxException
    from libdsec.e2b.sandbox_async.commands import command
    sbx = Sandbox.create(template="busybox", timeout=120)
    try:
        # a handler that calls the sandbox: it ran on the facade's loop thread and waited on it for ever
        seen: list = []
        r = sbx.commands.run("echo one; sleep 0.2; echo two", timeout=10,
                             on_stdout=lambda text: seen.append((text, sbx.files.exists("/tmp"), threading.current_thread())))
        caller = threading.current_thread()   # as E2B's: in the caller's thread
        assert r.stdout == "one\ntwo\n" and seen == [("one\n", True, caller), ("two\n", True, caller)]
        def boom(text: str) -> None:
            raise RuntimeError(f"the handler failed on {text!r}")
        with pytest.raises(RuntimeError, match="handler failed"):   # (its output all read: it was dropped: review)
            sbx.commands.run("echo x", on_stdout=boom)
        got: list = []   # E2B's wait(on_pty, on_stdout, on_stderr); request_timeout where E2B takes it
        h = sbx.commands.run("read line; echo got $line", background=True, stdin=True)
        h.send_stdin("x\n", request_timeout=5)
        h.close_stdin(request_timeout=5)
        assert h.wait(None, got.append).stdout == "got x\n" and "".join(got) == "got x\n"
        h = sbx.commands.run("sleep 30", background=True)   # (sleep: a handle disconnected, not a CancelledError)
        h.disconnect()
        with pytest.raises(SandboxException, match="disconnected"):
            h.wait()
        h = Sandbox.connect(sbx.sandbox_id).commands.connect(h.pid)
        assert h.kill() is True
        # helper U2: a chunk that only began a character called on_stdout(''), and a cut character at the end
        # reached the result, never the handler
        cut: list = []
        r = sbx.commands.run("printf '\\303'; sleep 0.3; printf '\\251\\n'; printf 'ab\\303'", on_stdout=cut.append)
        assert "" not in cut and "".join(cut) == r.stdout == "\u00e9\nab\ufffd", (cut, r.stdout)
        # helper U2: `server & echo started` ran until its timeout (the server held the output) and the
        # server was killed with it; as E2B's, the run ends with the shell and the server keeps running
        t0 = time.monotonic()
        assert sbx.commands.run("sleep 60 & echo started", timeout=20).stdout == "started\n"
        assert time.monotonic() - t0 < 5
        from tests.backends.test_contract import ALIVE
        assert sbx.commands.run(ALIVE).stdout == "alive\n"
        # helper U2: a line over ~64 KB was refused (the script held it twice), and ~ was a directory named ~
        long = "echo " + "a" * 100_000
        assert sbx.commands.run(long).stdout == "a" * 100_000 + "\n"
        assert sbx.commands.run("echo ${__dsec_line:-unset}").stdout == "unset\n"   # (the line's own variable)
        sbx.files.write("~/tilde.txt", "t")
        assert sbx.files.read("/home/user/tilde.txt") == "t" and sbx.files.exists("~/tilde.txt")
        assert sbx.commands.run("pwd", cwd="~", user="root").stdout == "/root\n"
        assert sbx.commands.run("pwd", cwd="~/", user="root").stdout == "/root\n"
        # output past the cap was cut without a word (16 MiB: the native default): the result's error says so
        monkeypatch.setattr(command, "MAX_OUTPUT", 1000)
        r = sbx.commands.run("head -c 5000 /dev/zero | tr '\\0' b")
        assert len(r.stdout) == 1000 and "dropped" in (r.error or ""), r.error
    finally:
        sbx.kill()


def _loop_findings(stack, monkeypatch) -> None:
    import psutil
    from e2b import AsyncSandbox
    from e2b.exceptions import AuthenticationException, SandboxException
    from libdsec.e2b.sandbox_async import main

    def connections() -> int:
        port = int(stack.url.rsplit(":", 1)[1])
        return sum(1 for c in psutil.Process().net_connections() if c.raddr and c.raddr.port == port)
    before, kept = connections(), len(main._clients)   # (the sync facade's own loop keeps one)
    for _ in range(5):   # a connection per loop was kept for ever (pytest-asyncio: a loop per test)
        assert asyncio.run(AsyncSandbox.kill("sbnosuch0000000")) is False
    assert connections() == before and len(main._clients) == kept


    async def at_once() -> list:   # first uses at once: each closed the other's connection while in use (review)
        return await asyncio.gather(*(AsyncSandbox.kill("sbnosuch0000000") for _ in range(3)))
    assert asyncio.run(at_once()) == [False, False, False]
    assert connections() == before and len(main._clients) == kept
    sbx = asyncio.run(AsyncSandbox.create(template="busybox", timeout=60))
    try:
        t0 = time.monotonic()   # used in another loop: 30 s, then "NATS did not answer" (and it had run)
        with pytest.raises(SandboxException, match="another event loop.*AsyncSandbox.connect"):
            asyncio.run(sbx.commands.run("echo hi"))
        assert time.monotonic() - t0 < 5
    finally:
        assert asyncio.run(AsyncSandbox.kill(sbx.sandbox_id)) is True
    monkeypatch.setenv("DSEC_CREDS", "/nonexistent/creds")   # E2B's classes from create too (were DSec's)
    with pytest.raises(AuthenticationException):
        asyncio.run(AsyncSandbox.create(template="busybox"))

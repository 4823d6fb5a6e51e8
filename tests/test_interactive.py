"""Interactive stdin (an async iterable fed while the command runs) and background execs (a handle to
stream, wait for or kill later)."""
from __future__ import annotations

import asyncio
import json
import signal
import sys


import pytest

from tests.conftest import raw_nats

import libdsec
from bus import subjects


async def test_stdin_reaches_the_command_as_it_is_produced(client):
    async with await client.create() as sb:
        questions: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def source():
            while (q := await questions.get()) is not None:
                yield q

        answers = []
        await questions.put(b"q0\n")
        async for ev in sb.stream("while read line; do echo got-$line; done; echo bye", stdin=source()):
            if isinstance(ev, libdsec.Exit):
                assert ev.exit_code == 0
                break
            answers.append(ev.data)
            n = len(answers)
            # the next question is only sent once the answer to the last one came back: interactive
            await questions.put(f"q{n}\n".encode() if n < 5 else None)
        assert answers == [b"got-q%d\n" % i for i in range(5)] + [b"bye\n"]


async def test_a_large_streamed_stdin_arrives_whole(client):
    async with await client.create() as sb:
        async def source():
            for i in range(16):
                yield bytes([65 + i]) * (128 << 10)

        r = await sb.exec("wc -c; ", stdin=source())
        assert r.stdout.strip() == str(16 * (128 << 10)).encode()
        r = await sb.exec(["/bin/busybox", "md5sum"], stdin=source())
        import hashlib
        assert r.stdout.split()[0].decode() == hashlib.md5(b"".join(bytes([65 + i]) * (128 << 10)
                                                                     for i in range(16))).hexdigest()


async def test_stdin_to_a_command_that_does_not_read_it_does_not_hang(client):
    async with await client.create() as sb:
        async def endless():
            while True:
                yield b"x" * 65536

        r = await asyncio.wait_for(sb.exec("head -c 10 > /dev/null; echo read-enough", stdin=endless()), 30)
        assert r.stdout == b"read-enough\n"


async def test_a_background_exec_can_be_streamed_waited_for_and_killed(stack, client):
    async with await client.create(labels={"job": "bg"}) as sb:
        counter = await sb.exec("i=0; while :; do echo $i; i=$((i+1)); usleep 20000; done", background=True)
        assert isinstance(counter, libdsec.ExecHandle) and not counter.done
        sleepers = [await sb.exec("sleep 60", background=True) for _ in range(3)]
        assert (await sb.exec("echo meanwhile")).stdout == b"meanwhile\n"   # the lane is not held by them
        seen = []
        async for ev in counter.stream():
            seen.append(ev.data)
            if len(seen) == 5:
                break
        assert seen == [b"%d\n" % i for i in range(5)]
        assert await counter.kill() is True
        r = await counter.wait()
        assert r.exit_code == 128 + signal.SIGKILL
        lines = r.stdout.split()
        assert lines[:5] == [b"0", b"1", b"2", b"3", b"4"] and lines == [b"%d" % i for i in range(len(lines))]
        assert await counter.kill() is False     # already ended
        assert await sleepers[0].kill(signal.SIGTERM) is True
        assert (await sleepers[0].wait()).exit_code == 128 + signal.SIGTERM
        done = await sb.exec("sleep 0.2; echo done", background=True)
        assert (await done.wait()).stdout == b"done\n"
        with pytest.raises(libdsec.InvalidRequest):
            await sleepers[1].kill(0)
        for h in sleepers[1:]:
            await h.close()      # stop listening; the sandbox's destroy ends them
    nc = await raw_nats(stack.url)
    try:
        sub = await nc.jetstream().subscribe(subjects.trajectory("default", "bg", sb.id), ordered_consumer=True)
        records = []
        while not records or records[-1]["type"] != "destroyed":
            records.append(json.loads((await sub.next_msg(timeout=10)).data))
    finally:
        await nc.close()
    execs = {r["exec_id"]: r for r in records if r["type"] == "exec"}
    assert execs[counter.id]["background"] is True and execs[counter.id]["exit_code"] == 137


async def test_a_background_exec_ends_with_its_sandbox(client):
    sb = await client.create()
    h = await sb.exec("sleep 60", background=True)
    await asyncio.sleep(0.3)
    await sb.destroy()
    try:   # it ends at once, one way or the other: killed with the sandbox, or told the sandbox is gone
        r = await asyncio.wait_for(h.wait(), 10)
        assert r.exit_code == 128 + signal.SIGKILL
    except libdsec.SandboxNotFound:
        pass


async def test_a_failing_stdin_source_ends_stdin_and_is_reported(client):
    async with await client.create() as sb:
        async def broken():
            yield b"some\n"
            raise ValueError("source broke")

        with pytest.raises(ValueError, match="source broke"):
            await asyncio.wait_for(sb.exec("cat", stdin=broken()), 20)


async def test_a_handle_can_be_read_again_after_its_end(client):
    async with await client.create() as sb:
        h = await sb.exec("printf 'a\\nb'", background=True)
        r = await h.wait()
        assert r.stdout == b"a\nb"
        assert [ev async for ev in h.stream()][-1].exit_code == 0     # stream() after the end: the Exit
        h2 = await sb.exec("echo x; exit 3", background=True)
        first = None
        async for ev in h2.stream():
            first = ev
            break
        assert first == libdsec.Output("stdout", b"x\n")
        assert (await h2.wait()).exit_code == 3 and (await h2.wait()).stdout == b"x\n"


async def test_the_sync_client_has_background_execs_too(stack):
    def scenario():
        with libdsec.Client(stack.url) as client, client.create() as sb:
            h = sb.exec("echo a; sleep 30", background=True)
            first = next(iter(h.stream()))
            assert first == libdsec.Output("stdout", b"a\n")
            assert h.kill() is True
            r = h.wait()
            assert (r.exit_code, r.stdout) == (137, b"a\n") and h.done
            assert [ev.data for ev in sb.stream("echo x; echo y") if isinstance(ev, libdsec.Output)] == [b"x\n", b"y\n"]
    await asyncio.wait_for(asyncio.to_thread(scenario), 60)


async def test_a_handle_loses_nothing_when_left_cancelled_or_read_again(client):
    async with await client.create() as sb:
        h = await sb.exec("printf 'a\\nb\\nc\\n'; sleep 0.5; echo d", background=True)
        async for ev in h.stream():     # the three lines arrive in one chunk: take one, leave
            assert ev == libdsec.Output("stdout", b"a\n")
            break
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(h.wait(), 0.05)    # a cancelled wait leaves the handle whole
        rest = [ev async for ev in h.stream()]
        assert [ev.data for ev in rest[:-1]] == [b"b\n", b"c\n", b"d\n"] and rest[-1].exit_code == 0
        assert (await h.wait()).stdout == b"a\nb\nc\nd\n"
        assert (await h.wait()).stdout == b"a\nb\nc\nd\n"


async def _runs(sb, marker: str) -> bool:
    return any(marker in p.shell + " ".join(p.argv) for p in await sb.processes())


async def test_leaving_a_stream_before_its_end_kills_its_command(stack, client):
    """sb.stream(cmd) started the command for this loop alone: left before the Exit (a break, an exception
    in the loop, the sync twin's break) it is killed at once, not left running for its timeout unseen."""
    async with await client.create() as sb:
        async for ev in sb.stream("echo up; exec sleep 31"):
            assert ev == libdsec.Output("stdout", b"up\n")
            break
        await asyncio.sleep(0)    # (the left generator is closed by the loop's finalizer: a moment later)
        await _until_gone(sb, "sleep 31")
        with pytest.raises(KeyError):
            async for ev in sb.stream("echo up; exec sleep 32", timeout=120):
                raise KeyError("the caller's own failure")
        await _until_gone(sb, "sleep 32")

        def sync_break():
            with libdsec.Client(stack.url) as sync_client:
                same = sync_client.get(sb.id)
                for ev in same.stream("echo up; exec sleep 33"):
                    return ev
        assert await asyncio.wait_for(asyncio.to_thread(sync_break), 30) == libdsec.Output("stdout", b"up\n")
        await _until_gone(sb, "sleep 33")
        assert [ev.data async for ev in sb.stream("echo whole") if isinstance(ev, libdsec.Output)] == [b"whole\n"]


async def _until_gone(sb, marker: str, limit: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + limit
    while await _runs(sb, marker):
        assert asyncio.get_running_loop().time() < deadline, f"`{marker}` still runs {limit}s after the stream was left"
        await asyncio.sleep(0.1)


async def test_a_closed_sync_client_says_so(stack):
    """After close(), the sync client and its sandboxes raise the SDK's typed error naming the cause (before:
    RuntimeError from a closed event loop, or a hang); close() again is harmless."""
    def scenario():
        client = libdsec.Client(stack.url)
        sb = client.create()
        sb_id = sb.id
        client.close()
        client.close()
        for call in (client.list, lambda: client.create(), lambda: sb.exec("true"), sb.destroy,
                     lambda: list(sb.stream("true"))):
            with pytest.raises(libdsec.SandboxError, match="client is closed"):
                call()
        with libdsec.Client(stack.url) as again:
            again.get(sb_id).destroy()
    await asyncio.wait_for(asyncio.to_thread(scenario), 60)


async def test_a_cancelled_exec_kills_its_command(stack, client):
    """A foreground exec cancelled (wait_for's timeout, a task cancelled, Ctrl-C of the sync client) kills its
    command instead of leaving it running for its own timeout (300 s here) unseen."""
    async with await client.create() as sb:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sb.exec("echo up; exec sleep 41", timeout=300), 1)
        await _until_gone(sb, "sleep 41")
        task = asyncio.ensure_future(sb.exec("exec sleep 42", timeout=300))
        await asyncio.sleep(1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _until_gone(sb, "sleep 42")
        script = (f"import libdsec\nwith libdsec.Client({stack.url!r}) as c:\n"
                  f"    c.get({sb.id!r}).exec('exec sleep 43', timeout=300)\n")
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stderr=asyncio.subprocess.PIPE)
        for _ in range(100):
            if await _runs(sb, "sleep 43"):
                break
            await asyncio.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert b"KeyboardInterrupt" in err and b"Task was destroyed" not in err and b"Event loop is closed" not in err, err
        await _until_gone(sb, "sleep 43", 1.0)   # gone when the interrupted program ended

"""A running sandbox's expiry rewritten (sb.set_timeout) and a TTL that suspends (on_timeout="suspend")."""
from __future__ import annotations

import asyncio
import time

import pytest

import libdsec
from bus import validate
from bus.messages import SetTimeoutRequest

pytestmark = pytest.mark.timeout(120)


async def _record(client, sid):
    rec = await client._record(sid)
    assert rec is not None
    return rec


async def test_set_timeout_shortens_and_lengthens(client):
    long, short = await client.create(ttl=600), await client.create(ttl=2)
    try:
        await long.set_timeout(1)
        await short.set_timeout(30)
        before = time.time()
        assert abs((await _record(client, short.id)).expires_at - (before + 30)) < 3
        await asyncio.sleep(3.5)
        with pytest.raises(libdsec.SandboxNotFound) as ei:
            await long.exec("true")
        assert ei.value.reason == "expired"
        assert (await _record(client, long.id)).state == "expired"
        assert (await short.exec("echo alive")).stdout == b"alive\n"   # past its first 2 s
        await short.set_timeout(0)                                     # at once
        await asyncio.sleep(1.5)
        assert (await _record(client, short.id)).state == "expired"
    finally:
        for sb in (long, short):
            try:
                await sb.destroy()
            except libdsec.SandboxNotFound:
                pass


async def test_a_ttl_that_suspends_keeps_the_sandbox(client):
    sb = await client.create(ttl=1.5, on_timeout="suspend")
    try:
        await sb.exec("echo kept > /tmp/state")
        await asyncio.sleep(3)
        rec = await _record(client, sb.id)
        assert (rec.state, rec.suspended, rec.on_timeout) == ("ready", True, "suspend")
        with pytest.raises(libdsec.SandboxSuspended):
            await sb.exec("true")
        await sb.set_timeout(20)                       # counts from the resume
        await sb.resume()
        await asyncio.sleep(1)
        assert (await sb.exec("cat /tmp/state")).stdout == b"kept\n"
        rec = await _record(client, sb.id)
        assert not rec.suspended and rec.expires_at > time.time() + 15
    finally:
        await sb.destroy()


async def test_a_sandbox_its_ttl_suspended_runs_its_ttl_again_when_resumed(client):
    """resume() reported success, and the TTL froze it again within 0.5 s: its expiry had come (helper Q)."""
    sb = await client.create(ttl=1.5, on_timeout="suspend")
    try:
        await asyncio.sleep(2.5)
        assert (await _record(client, sb.id)).suspended
        await sb.resume()
        await asyncio.sleep(0.7)
        assert (await sb.exec("echo on")).stdout == b"on\n"
        rec = await _record(client, sb.id)
        assert not rec.suspended and rec.expires_at > time.time()
    finally:
        await sb.destroy()


async def test_bad_timeouts_are_refused(client):
    with pytest.raises(libdsec.InvalidRequest, match="on_timeout"):
        await client.create(on_timeout="later")
    with pytest.raises(libdsec.Unsupported):
        await client.create(backend="fncall", on_timeout="suspend")
    async with await client.create() as sb:
        with pytest.raises(libdsec.InvalidRequest):
            await sb.set_timeout(-1)
        # no longer than a create may live (7 days): a month was taken, by the SDK and by the node
        with pytest.raises(libdsec.InvalidRequest, match="at most 604800"):
            await sb.set_timeout(validate.MAX_TTL + 1)
        with pytest.raises(libdsec.InvalidRequest, match="timeout must be 0..604800"):
            await client._op(sb.node, sb.id, lambda rid, to, dl: SetTimeoutRequest(
                request_id=rid, sandbox_id=sb.id, timeout=20 * 86400.0, reply_to=to, deadline=dl), 10)
        await sb.set_timeout(validate.MAX_TTL)
        assert (await sb.exec("echo ok")).stdout == b"ok\n"


async def test_a_sandbox_suspended_past_max_paused_is_destroyed_as_expired(client, stack):
    """--max-paused (default 24 h): a suspended sandbox keeps its slot and memory that long, not forever."""
    import msgspec
    old = stack.edge.config
    stack.edge.config = msgspec.structs.replace(old, max_paused=2.0)
    try:
        sb = await client.create(ttl=600, on_timeout="suspend")
        kept = await client.create(ttl=600)
        await sb.suspend()
        await asyncio.sleep(1.0)
        assert (await _record(client, sb.id)).state == "ready"        # within max_paused: kept
        for _ in range(60):
            rec = await _record(client, sb.id)
            if rec.state != "ready":
                break
            await asyncio.sleep(0.2)
        assert (rec.state, rec.reason) == ("expired", "suspended longer than --max-paused (2 s)")
        assert (await kept.exec("echo running")).stdout == b"running\n"   # a running one is no paused one
        await kept.destroy()
    finally:
        stack.edge.config = old


async def test_a_command_that_exited_before_its_timeout_keeps_its_exit_code(client):
    # `sh -c 'sleep 100 & exit 5'`: the shell exits 5 at once, its sleep holds the output open until the
    # timeout; the error said only "timed out" and the 5 was lost (helper-40)
    async with await client.create() as sb:
        with pytest.raises(libdsec.ExecTimeout) as err:
            await sb.exec("echo out; sleep 100 & exit 5", timeout=2)
        assert (err.value.exit_code, err.value.stdout) == (5, b"out\n")
        assert str(err.value).endswith("(the command itself had ended, exit code 5: processes it left running held "
                                       "its output open)"), err.value
        with pytest.raises(libdsec.ExecTimeout) as err:   # killed by the timeout: SIGKILL's 137, nothing more said
            await sb.exec("sleep 100", timeout=1)
        assert err.value.exit_code == 137 and str(err.value).endswith("its process tree was killed"), err.value

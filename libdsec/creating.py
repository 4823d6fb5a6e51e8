"""The client's side of a create: replies routed to their waiting callers, the sandbox's record read when no
reply comes, and a create given up on (its time ran out, its caller cancelled it) watched until it settles,
destroyed if it comes up, so that no sandbox runs on unseen."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import msgspec

from bus import subjects
from bus.conn import Bus
from bus.errors import BusError, CapacityUnavailable, DsecError, from_code
from bus.messages import CreateRequest, ErrorReply, Queued, SandboxReady, create_reply_decoder, encode
from libdsec.sandbox import AsyncSandbox, send_request

if TYPE_CHECKING:
    from libdsec.client import AsyncClient

RECHECK_EVERY = 3.0   # seconds without a reply after which the sandbox's record is read instead
SETTLE_EVERY = 0.25   # how often a cancelled create's or a starting sandbox's record is read again
SETTLE_SLOWLY = 2.0   # ... once its deadline is past
ABANDON_AFTER = 60.0  # seconds past its deadline a create given up on is watched, to be destroyed if it comes up
CLAIM_SEEN = 1.0      # seconds past a create's deadline by which a node's claim of it (written before) is read
CLOSE_WAIT = 15.0     # seconds close() waits for cancelled creates to settle (each destroyed once ready)
FINAL = ("destroyed", "expired", "failed", "node_lost")   # states a sandbox never leaves
UNKNOWN = object()    # a record that could not be read
DONE = object()       # a create given up on that has settled
EXPIRES = ("no node starts it later, and one that was starting as the time ran out is destroyed once it is up "
           "(sandbox {})")   # what a create whose time ran out then comes to


async def next_reply(q: asyncio.Queue[bytes], timeout: float) -> bytes | None:
    """The next reply, or None when `timeout` seconds pass first."""
    if timeout <= 0:
        return None
    try:
        return await asyncio.wait_for(q.get(), timeout=timeout)
    except asyncio.TimeoutError:
        return None


class Replies:
    """One wildcard inbox subscription; replies are routed to waiters by request id."""

    def __init__(self, bus: Bus, tenant: str) -> None:
        self.bus = bus
        self.prefix = f"{subjects.replies(tenant)}.{bus.inbox().rsplit('.', 1)[-1]}"   # dsec.reply.<tenant>.<nuid>
        self._waiters: dict[str, asyncio.Queue[bytes]] = {}
        self._sub = None

    async def open(self) -> None:
        async def _cb(data: bytes, subject: str) -> None:
            q = self._waiters.get(subject.rsplit(".", 1)[-1])
            if q is not None:
                q.put_nowait(data)
        self._sub = await self.bus.subscribe(f"{self.prefix}.*", _cb)

    def register(self, request_id: str) -> tuple[str, asyncio.Queue[bytes]]:
        q: asyncio.Queue[bytes] = asyncio.Queue()
        self._waiters[request_id] = q
        return f"{self.prefix}.{request_id}", q

    def forget(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)


async def read_record(record: Callable[[str], Awaitable[Any]], sandbox_id: str):
    """The sandbox's record by `record`, None when it has none, UNKNOWN when it cannot be read now."""
    try:
        return await asyncio.wait_for(record(sandbox_id), timeout=2)
    except (DsecError, asyncio.TimeoutError):
        return UNKNOWN


class GivenUp:
    """Creates given up on (the time ran out, or the caller cancelled): each watched, in the background, until
    it settles, and destroyed if it comes up. record(sandbox_id) reads its record (None: it has none);
    destroy(sandbox_id, node) ends it."""

    def __init__(self, record: Callable[[str], Awaitable[Any]],
                 destroy: Callable[[str, str], Awaitable[None]]) -> None:
        self.record = record
        self.destroy = destroy
        self.watching: set[asyncio.Task] = set()

    async def end_if_up(self, sandbox_id: str):
        """One look: DONE once it has settled (final, or up and destroyed now), else what the read of its record
        said (None, UNKNOWN, or its record, `starting`)."""
        rec = await read_record(self.record, sandbox_id)
        if rec is None or rec is UNKNOWN:
            return rec
        if rec.state in FINAL:
            return DONE
        if rec.state == "ready":
            with contextlib.suppress(DsecError, asyncio.TimeoutError):
                await self.destroy(sandbox_id, rec.node)
                return DONE
        return rec

    async def now_or_later(self, sandbox_id: str, deadline: float, doubtful: bool) -> None:
        """A create whose time ran out: destroyed now if it is up, else watched in the background."""
        look = await self.end_if_up(sandbox_id)
        if look is not DONE:
            self.later(sandbox_id, deadline, doubtful or look is UNKNOWN)

    def later(self, sandbox_id: str, deadline: float, doubtful: bool = False) -> None:
        task = asyncio.ensure_future(self.when_settled(sandbox_id, deadline, doubtful))
        self.watching.add(task)
        task.add_done_callback(self.watching.discard)

    async def when_settled(self, sandbox_id: str, deadline: float, doubtful: bool = False) -> None:
        """Destroyed once it is ready. It may still be starting, or wait for room until its deadline, past which
        no node starts it: a node claims the id (`starting`) before it starts a sandbox, so with the bus
        answering all along, no record 1 s past the deadline means none ever will. But a warm sandbox's claim
        is its `ready` record, and one its node started just before the deadline is recorded when the bus
        takes the record, which after a server of 3 was killed came up to 30 s later (helper F4: 18 sandboxes
        of creates that timed out ran on until their TTL; one read of the record, 2 s, saw them starting). So
        when a read of its record failed (doubtful), or it is starting, it is watched until ABANDON_AFTER past
        the deadline, every SETTLE_SLOWLY once that passed. A cancelled create ran on too, a VM of 352 MiB no
        one held, until its TTL (helper V)."""
        while time.time() < deadline + ABANDON_AFTER:
            look = await self.end_if_up(sandbox_id)
            if look is DONE:
                return
            doubtful = doubtful or look is UNKNOWN
            if look is None and not doubtful and time.time() > deadline + CLAIM_SEEN:
                return   # never claimed by its deadline, the bus answering: never started
            await asyncio.sleep(SETTLE_EVERY if time.time() < deadline + RECHECK_EVERY else SETTLE_SLOWLY)

    async def close(self, wait: float | None = None) -> None:
        """Wait up to `wait` (CLOSE_WAIT) seconds for the watched creates to settle; stop watching the rest."""
        if not self.watching:
            return
        _done, late = await asyncio.wait(self.watching, timeout=CLOSE_WAIT if wait is None else wait)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)


async def wait_ready(client: "AsyncClient", req: CreateRequest, timeout: float, on_queued=None) -> AsyncSandbox:
    """Send the create and wait for its sandbox to run: its reply, or its record when replies do not come.
    CapacityUnavailable (or the bus's error, when the create was never taken) once its deadline passes; the
    create is then given up on (client._given_up), as it is when the caller cancels this."""
    bus, replies, given_up = client._need_bus(), client._replies, client._given_up
    assert replies is not None
    reply_to, q = replies.register(req.request_id)
    req = msgspec.structs.replace(req, reply_to=reply_to)
    queued = ""
    unsent: BusError | None = None
    doubtful = False   # a read of its record failed meanwhile (the bus in trouble: its record may come late)
    try:
        # A publish the bus did not ack may still be taken (it waits in our connection's buffer, or in a
        # stopped server's socket): so not an error yet. It is sent again (its msg id stores it once)
        # and the reply waited for until the deadline, past which no node starts it.
        unsent = await _send(bus, client.tenant, req)
        while True:
            left = req.deadline - time.time()
            data = await next_reply(q, min(left, RECHECK_EVERY))
            if data is None:
                if left <= RECHECK_EVERY:
                    break
                if unsent is not None:
                    unsent = await _send(bus, client.tenant, req)
                # A reply is a core message: one sent while our connection moved to another server
                # is gone. The sandbox's record says whether it was served meanwhile.
                rec = await read_record(client._record, req.sandbox_id)
                if rec is UNKNOWN:
                    doubtful, rec = True, None
                if rec is not None and rec.request_id == req.request_id and rec.state == "ready":
                    return AsyncSandbox(client, rec.sandbox_id, rec.node, rec.backend, rec.network)
                if rec is not None and rec.request_id == req.request_id:
                    unsent = None   # taken (its ack was lost): served or being served
                continue
            try:
                reply = create_reply_decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue   # junk on our inbox is skipped
            unsent = None   # an answer to it: it was taken
            match reply:
                case SandboxReady():
                    return AsyncSandbox(client, reply.sandbox_id, reply.node, req.backend, req.network)
                case Queued():
                    if not queued and on_queued is not None:
                        on_queued(reply.reason)
                    queued = reply.reason or "queued"
                case ErrorReply():   # (the id tells which sandbox, e.g. one lost with its node)
                    raise from_code(reply.code, reply.message, reason=reply.reason, sandbox_id=req.sandbox_id)
        await given_up.now_or_later(req.sandbox_id, req.deadline, doubtful or unsent is not None)
        expires = EXPIRES.format(req.sandbox_id)
        if unsent is not None:
            raise BusError(f"{unsent}; the create was not taken within {timeout:.0f}s and expires: {expires}",
                           sandbox_id=req.sandbox_id) from unsent
        why = f" (queued: {queued})" if queued else ""
        raise CapacityUnavailable(f"no sandbox could be started within {timeout:.0f}s{why}; the request "
                                  f"expires: {expires}", sandbox_id=req.sandbox_id)
    except asyncio.CancelledError:   # the caller gave up (wait_for, Ctrl-C): it must not run on unseen
        given_up.later(req.sandbox_id, req.deadline, doubtful or unsent is not None)
        raise
    finally:
        replies.forget(req.request_id)


async def _send(bus: Bus, tenant: str, req: CreateRequest) -> BusError | None:
    """Publish the create request (again: its msg id stores it once); the BusError when the bus did not ack it
    in time (a refusal, PermissionDenied or a bad request, is raised)."""
    return await send_request(bus, subjects.create_request(tenant, req.priority), encode(req), req.request_id,
                              req.deadline - RECHECK_EVERY)

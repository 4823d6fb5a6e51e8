"""The steps every lane handler shares, run as one chain around it on the pull worker (bus.pull_worker(...,
steps=[...])): decode the message into its one type (a bad one answered once, typed, and terminated), the
tenant from the subject (never from the payload), a lease for the work's duration, bus errors retried,
outcomes counted. A handler then does only its own work, on `d.msg`."""
from __future__ import annotations

import collections
import logging
from typing import Awaitable, Callable

import msgspec

from bus import subjects
from bus.errors import BusError, InvalidRequest
from bus.messages import ErrorReply, salvage
from bus.pull import Delivery, Handler, Lease, Verdict

log = logging.getLogger(__name__)

Step = Callable[[Delivery, Handler], Awaitable[Verdict]]


def chain(handler, steps: list):
    """handler inside steps (the first is outermost), each step(item, next): a lane's Delivery -> Verdict
    here, a control request -> its reply in placement/api.py."""
    for step in reversed(steps):
        handler = _link(step, handler)
    return handler


def _link(step, nxt):
    async def run(item):
        return await step(item, nxt)
    return run


def decoded(bus, decoder, what: str, on_bad: Callable | None = None) -> Step:
    """d.msg is the message decoded; an undecodable one is answered `invalid_request` on the reply subject
    it names (if it names one), handed to on_bad(envelope, exc), and terminated."""
    async def step(d: Delivery, nxt: Handler) -> Verdict:
        try:
            d.msg = decoder.decode(d.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            env = salvage(d.data)
            await bus.reply(env.reply_to, ErrorReply(request_id=env.request_id, code=InvalidRequest.code,
                                                     message=f"bad {what} request: {exc}"))
            if on_bad is not None:
                await on_bad(d, env, exc)
            return Verdict.TERM
        return await nxt(d)
    return step


def tenant_from_subject(bus, position: int, tokens: int) -> Step:
    """d.tenant is the subject's token at `position` of a `tokens`-token subject (the server's permissions
    scope on it); the message's own `tenant` field, if it has one, is overwritten with it. A subject of
    another shape (another length, a token that is no tenant name) is never served on the payload's word:
    it is answered `invalid_request` (when the message names a reply subject) and terminated. A message
    whose reply subject is in another tenant's reply space (dsec.reply.<other>.>) is terminated unanswered."""
    async def step(d: Delivery, nxt: Handler) -> Verdict:
        parts = d.subject.split(".")
        tenant = parts[position] if len(parts) == tokens else ""
        if not subjects.is_token(tenant):
            log.warning("refused a message on %r: no tenant token where one must be", d.subject)
            await bus.reply(getattr(d.msg, "reply_to", ""), ErrorReply(
                request_id=getattr(d.msg, "request_id", ""), code=InvalidRequest.code,
                message=f"subject {d.subject!r} does not name a tenant where it must (token {position + 1} of {tokens})"))
            return Verdict.TERM
        owner = subjects.reply_tenant(getattr(d.msg, "reply_to", ""))
        if owner and owner != tenant:   # answers sent into another tenant's reply space: never
            log.warning("refused a message on %r: its reply subject is tenant %s's", d.subject, owner)
            return Verdict.TERM
        d.tenant = tenant
        if getattr(d.msg, "tenant", tenant) != tenant:
            d.msg = msgspec.structs.replace(d.msg, tenant=tenant)
        return await nxt(d)
    return step


def leased(every: float) -> Step:
    """The message's ack wait is extended every `every` seconds while the handler works."""
    async def step(d: Delivery, nxt: Handler) -> Verdict:
        lease = Lease(d, every=every)
        try:
            return await nxt(d)
        finally:
            lease.cancel()
    return step


def retried_on_bus_errors(delay: float, what: str) -> Step:
    """A BusError (a hiccup, a leader election) is no answer: the message comes again after `delay`."""
    async def step(d: Delivery, nxt: Handler) -> Verdict:
        try:
            return await nxt(d)
        except BusError as exc:
            log.warning("%s retried: %s", what, exc)
            d.nak_delay = delay
            return Verdict.NAK
    return step


def counted(outcomes: collections.Counter) -> Step:
    """outcomes[(message kind, verdict)] += 1 for every message handled."""
    async def step(d: Delivery, nxt: Handler) -> Verdict:
        verdict = Verdict.NAK
        try:
            verdict = await nxt(d)
            return verdict
        finally:
            outcomes[(type(d.msg).__name__ if d.msg is not None else "undecoded", verdict.value)] += 1
    return step

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


def tenant_lane(bus, decoder, what: str, position: int, tokens: int, on_bad: Callable | None = None) -> list[Step]:
    """The steps of a lane tenants publish on: decoded, then tenant_from_subject (the tenant's token at
    `position` of a `tokens`-token subject), neither answering into another tenant's reply space."""
    return [decoded(bus, decoder, what, on_bad, tenant_at=(position, tokens)),
            tenant_from_subject(bus, position, tokens)]


def _subject_tenant(subject: str, position: int, tokens: int) -> str:
    parts = subject.split(".")
    tenant = parts[position] if len(parts) == tokens else ""
    return tenant if subjects.is_token(tenant) else ""


def _may_answer(reply_to: str, tenant: str) -> bool:
    """Whether a message on tenant's subject ("": none) may be answered on reply_to: never in the reply space
    of another (dsec.reply.<other>.>), where a tenant would otherwise inject answers of its choosing."""
    owner = subjects.reply_tenant(reply_to)
    return not owner or owner == tenant


def decoded(bus, decoder, what: str, on_bad: Callable | None = None,
            tenant_at: tuple[int, int] | None = None) -> Step:
    """d.msg is the message decoded; an undecodable one is answered `invalid_request` on the reply subject
    it names (if it names one: on a tenant's lane, tenant_at, only one of its subject's tenant), handed to
    on_bad(envelope, exc), and terminated."""
    async def step(d: Delivery, nxt: Handler) -> Verdict:
        try:
            d.msg = decoder.decode(d.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            env = salvage(d.data)
            if tenant_at is None or _may_answer(env.reply_to, _subject_tenant(d.subject, *tenant_at)):
                await bus.reply(env.reply_to, ErrorReply(request_id=env.request_id, code=InvalidRequest.code,
                                                         message=f"bad {what} request: {exc}"))
            else:
                log.warning("refused a bad message on %r: its reply subject is another tenant's", d.subject)
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
        tenant = _subject_tenant(d.subject, position, tokens)
        reply_to = getattr(d.msg, "reply_to", "")
        if not _may_answer(reply_to, tenant):   # answers sent into another tenant's reply space: never
            log.warning("refused a message on %r: its reply subject %r is another tenant's", d.subject, reply_to)
            return Verdict.TERM
        if not tenant:
            log.warning("refused a message on %r: no tenant token where one must be", d.subject)
            await bus.reply(reply_to, ErrorReply(
                request_id=getattr(d.msg, "request_id", ""), code=InvalidRequest.code,
                message=f"subject {d.subject!r} does not name a tenant where it must (token {position + 1} of {tokens})"))
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

"""The SDK's side of the control API (bus/apiwire.py): one request to `dsec.api.<tenant>.<verb>`, one typed
reply or a typed error. Reads are asked again when a reply is lost (a connection moving to another
server), or answered with a bus error (the engine's own read of the bus failed: a server of the cluster
killed, a bucket's leader moving); changes are asked once."""
from __future__ import annotations

import asyncio
import time

import msgspec

from bus import subjects
from bus.apiwire import VERB_OF, api_reply_decoder
from bus.conn import Bus
from bus.errors import AuthenticationFailed, BusError, BusUnavailable, PermissionDenied, from_code
from bus.messages import ErrorReply, Wire

ASK_TIMEOUT = 10.0
TRY_FOR = 2.0          # seconds the first try of a read waits for its reply; each later try twice the one before
                       # (a lost reply is asked again soon, an engine slow under load is not asked 5 times over)
# asked again when a reply is lost: reads, and what is harmless twice (an ack; a fetch, whose records
# are handed out again after the reader's ack wait)
READS = ("sandbox-get", "sandbox-list", "snapshot-get", "snapshot-list", "pool-list", "quota-get", "backends-get",
         "output-read", "traj-fetch", "traj-ack")


async def ask(bus: Bus, tenant: str, request: Wire, expect: type, timeout: float = ASK_TIMEOUT) -> Wire:
    """The reply of type `expect`; the server's error as its DsecError class; BusUnavailable when no
    placement engine serves the API; BusError when none answers within `timeout`."""
    verb = VERB_OF[type(request)]
    subject = subjects.api(tenant, verb)
    give_up = time.monotonic() + timeout
    once = verb not in READS
    wait = TRY_FOR
    while True:
        left = give_up - time.monotonic()
        try:
            data = await bus.request(subject, request, timeout=max(0.05, left if once else min(wait, left)))
        except (BusUnavailable, AuthenticationFailed, PermissionDenied):
            raise
        except BusError as exc:
            if once or time.monotonic() >= give_up:
                if not bus.connected:   # (the server went away: it said "no answer", the base BusError)
                    raise BusUnavailable(f"control API {verb}: not connected to NATS (the server went away; "
                                         f"reconnecting) for its {timeout:g}s") from None
                raise BusError(f"control API {verb}: no answer within {timeout:g}s ({exc})") from None
            wait *= 2
            await asyncio.sleep(0.05)
            continue
        if data is None:
            if time.monotonic() + 0.2 >= give_up:
                raise BusUnavailable(f"control API {verb}: no placement engine serves it (is `dsec up` running?)")
            await asyncio.sleep(0.2)   # an engine restarting: its subscription is back in a moment
            continue
        try:
            reply = api_reply_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BusError(f"control API {verb}: undecodable reply: {exc}") from None
        if isinstance(reply, ErrorReply):
            if not once and reply.code == BusError.code and time.monotonic() + 0.5 < give_up:
                await asyncio.sleep(0.25)   # (after a server of 3 was killed: "kv scan ... did not answer in time")
                continue
            raise from_code(reply.code, reply.message, reason=reply.reason)
        if not isinstance(reply, expect):
            raise BusError(f"control API {verb}: expected {expect.__name__}, got {type(reply).__name__}")
        return reply

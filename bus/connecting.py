"""A connection's first connect to NATS, and what nats-py's callbacks say of it after: a credential the
server refuses and a port where nothing listens are each said at once, as one typed error, instead of after
nats-py's retries; reconnects, closes and refused publishes are handed to the Bus once it is made."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Callable

import nats
import nats.errors

from bus.creds import expired
from bus.errors import AuthenticationFailed, BusUnavailable

log = logging.getLogger("bus.conn")

# A server that stops answering (paused, its host gone, a half-open TCP connection) is noticed after
# PING_INTERVAL * MAX_PINGS seconds and the client moves to another server of the cluster; nats-py's
# defaults (2 minutes) would leave an edge silent, and so declared lost, long before that.
PING_INTERVAL = 1.0
MAX_PINGS = 3
REFUSED_FOR = 3.0   # seconds every connect of a first connection may be refused before nothing is said to listen


class Attempt:
    """One connection's nats-py callbacks: while it first connects (refusals, noted to end the connect at
    once) and after, for its Bus (`bus`, set once made: reconnect listeners, closes, refused publishes)."""

    def __init__(self) -> None:
        self.refused: list[str] = []       # the server's refusals of the credential (the Bus keeps this list)
        self.listeners: list[Callable[[], None]] = []   # called after every reconnect (Bus.on_reconnect)
        self.bus = None
        self._denied = asyncio.Event()     # refused at the first connect: said at once, not after the retries
        self._nobody = asyncio.Event()     # every connect refused for REFUSED_FOR: nothing listens
        self._refused_since: float | None = None

    async def connect(self, nc: nats.NATS, servers: list[str], url: str, creds: str | None, auth: dict, *,
                      name: str, timeout: float, reconnect: bool) -> None:
        """nc connected to one of servers; AuthenticationFailed (naming the file and why) or
        BusUnavailable within `timeout` (REFUSED_FOR when every connect is refused) otherwise."""
        try:
            connecting = asyncio.ensure_future(
                nc.connect(servers, name=name, connect_timeout=timeout, max_reconnect_attempts=-1 if reconnect else 0,
                           allow_reconnect=reconnect, reconnect_time_wait=0.5, error_cb=self._errors,
                           reconnected_cb=self._reconnected, closed_cb=self._closed, ping_interval=PING_INTERVAL,
                           max_outstanding_pings=MAX_PINGS, pending_size=64 << 20, **auth))
            refusal, silence = asyncio.ensure_future(self._denied.wait()), asyncio.ensure_future(self._nobody.wait())
            try:
                await asyncio.wait({connecting, refusal, silence}, timeout=timeout + 1,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                refusal.cancel()
                silence.cancel()
            if not connecting.done():
                await stop(connecting)
                with contextlib.suppress(Exception):
                    await nc.close()
                raise asyncio.TimeoutError
            connecting.result()
        except (asyncio.TimeoutError, OSError, nats.errors.Error) as exc:
            if self.refused or "authorization violation" in str(exc).lower():
                raise AuthenticationFailed(
                    f"NATS at {url} refused the credential {creds}: {expired(creds) or 'unknown, revoked or expired'}"
                    if creds else
                    f"NATS at {url} requires a credential: pass creds= (the SDK), --creds or $DSEC_CREDS "
                    f"(`dsec up` writes them under its state dir, .dsec/creds/){where(url)}") from None
            why = f": connection refused for {REFUSED_FOR:g}s (nothing listens there)" if self._nobody.is_set() else ""
            raise BusUnavailable(f"cannot connect to NATS at {url}{why}") from exc

    async def _errors(self, exc: Exception) -> None:
        text = str(exc)
        if self.bus is None:   # every connect refused (a host of several addresses: each) for REFUSED_FOR
            if isinstance(exc, ConnectionRefusedError) or (isinstance(exc, OSError) and "[Errno 111]" in text):
                if self._refused_since is None:
                    self._refused_since = time.monotonic()
                if time.monotonic() - self._refused_since >= REFUSED_FOR:
                    self._nobody.set()
            else:
                self._refused_since = None
        if "authorization violation" in text.lower() or "authentication" in text.lower():
            self.refused.append(text)
            self._denied.set()
        elif self.bus is not None:
            self.bus._violation(text)
        log.debug("nats: %s", exc)

    async def _closed(self) -> None:
        if self.bus is not None:
            self.bus._closed()

    async def _reconnected(self) -> None:   # pull requests and push consumers died with the old server
        log.info("nats: reconnected")
        self.refused.clear()   # (a server that refused the credential took it back)
        for fn in list(self.listeners):
            fn()


async def stop(connecting: asyncio.Future) -> None:
    """Stop nats-py's first connect. One cancel may be lost: Python 3.11's wait_for drops a cancel that lands as
    the connect it waits on fails (refused at once), and nats-py's loop then tries the next server of a URL
    list for ever (helper-42: a list of 3 ports nothing listened on hung for good). So cancelled until it ends."""
    for _ in range(50):
        connecting.cancel()
        await asyncio.wait({connecting}, timeout=0.1)
        if connecting.done():
            break
    if connecting.done() and not connecting.cancelled():
        connecting.exception()   # (retrieved: not logged as never retrieved)


def where(url: str) -> str:
    """'; the `dsec up` serving it keeps them in ...': said when one runs on this host."""
    from bus.creds import running_state_dirs
    dirs = running_state_dirs(url)
    if len(dirs) != 1:
        return ""
    return f"; the `dsec up` serving it keeps them in {dirs[0]}/creds/ (export DSEC_STATE_DIR={dirs[0]})"

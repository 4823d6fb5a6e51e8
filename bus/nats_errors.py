"""The one translation of nats-py's errors into DSec's (BusError, BusUnavailable; InvalidRequest for a message too large)."""
from __future__ import annotations

import asyncio
import contextlib

import nats.errors
import nats.js.errors

from bus.errors import BusError, BusUnavailable, InvalidRequest, PermissionDenied


@contextlib.contextmanager
def mapped_errors(what: str):
    """Translate nats errors raised inside the block into BusError / BusUnavailable, once."""
    try:
        yield
    except (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError) as exc:
        raise BusError(f"{what}: NATS did not answer in time") from exc   # (TimeoutError is an OSError too)
    except (nats.errors.NoServersError, nats.errors.ConnectionClosedError, OSError) as exc:
        raise BusUnavailable(f"{what}: NATS unavailable ({exc.__class__.__name__})") from exc
    except nats.js.errors.APIError as exc:
        if getattr(exc, "err_code", None) == 10039 or getattr(exc, "code", None) == 403:   # no JetStream in this account / not permitted
            raise PermissionDenied(f"{what}: the NATS server refused it ({exc.description})") from exc
        raise BusError(f"{what}: {exc}") from exc
    except nats.errors.MaxPayloadError as exc:   # bad input, not a sick bus: no retry helps
        raise InvalidRequest(f"{what}: the message is larger than the NATS server takes (its max_payload, 1 MiB "
                             "in DSec's nats.conf): pass large data as stdin or a file") from exc
    except nats.errors.Error as exc:
        raise BusError(f"{what}: {exc}") from exc


def check_fits(nc, what: str, data: bytes, headers: dict[str, str] | None = None) -> None:
    """InvalidRequest when a message is larger than the server takes (its max_payload counts headers and
    payload; nats-py checks the payload only). The server answers one larger by closing the connection:
    one tenant's oversized request, forwarded with a few fields more by placement, cut placement off the bus."""
    size = len(data) + (12 + sum(len(k) + len(v) + 4 for k, v in headers.items()) if headers else 0)
    limit = getattr(nc, "max_payload", 0)
    if limit and size > limit:
        raise InvalidRequest(f"{what}: {size:,} bytes is larger than the NATS server takes (its max_payload, "
                             f"{limit:,}): pass large data as stdin or a file")


def not_found(exc: BusError) -> bool:
    """Whether a mapped error says the message or object asked for is not there (not a failure)."""
    return isinstance(exc.__cause__, nats.js.errors.NotFoundError)   # ObjectNotFoundError is one too


def timed_out(exc: BusError) -> bool:
    """Whether a mapped error is a plain timeout (nothing arrived in time)."""
    return isinstance(exc.__cause__, (nats.errors.TimeoutError, asyncio.TimeoutError))

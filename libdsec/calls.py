"""Stateless function calls (the fncall kind): `client.call(...)` runs one command on a pre-started worker
of any node that runs fncall workers and returns its CallResult; there is no sandbox id to manage.
`client.call_many([...])` runs a batch, results in input order, each failure its own result."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import msgspec

from bus import subjects, validate
from bus.apiwire import Backends, GetBackends
from bus.errors import CapacityUnavailable, DsecError, InvalidRequest, from_code
from bus.callwire import CallReply, CallRequest, call_reply_decoder
from bus.messages import ErrorReply, encode
from libdsec.ids import new_id
from libdsec.resources import Resources

if TYPE_CHECKING:
    from libdsec.client import AsyncClient

REPLY_GRACE = 5.0     # seconds past its queue wait and its run a caller waits for the answer


@dataclass
class CallResult:
    """How a call ended. error is set (and the rest left at defaults) when the call failed before its
    command ran to an end (bad input, no worker in time, a command that could not start)."""

    exit_code: int = -1
    stdout: bytes = b""
    stderr: bytes = b""
    duration: float = 0.0          # seconds the command ran
    cpu_time: float = 0.0          # seconds of CPU it used
    peak_memory: int = 0           # bytes, the most its processes held
    timed_out: bool = False        # killed at its timeout (the whole tree)
    truncated: bool = False        # output beyond max_output was dropped
    files: dict[str, bytes] = field(default_factory=dict)   # read_back paths -> their bytes
    unread: dict[str, str] = field(default_factory=dict)    # read_back paths not read back -> why (not there,
                                                            # not a regular file, past the answer's room)
    worker: str = ""               # the worker that ran it (node-local id)
    node: str = ""
    call_id: str = ""
    waited: float = 0.0            # seconds from sent to started
    error: DsecError | None = None

    @property
    def ok(self) -> bool:
        """It ran to an end with exit code 0."""
        return self.error is None and self.exit_code == 0 and not self.timed_out


def _request(tenant: str, cmd: str | Sequence[str], *, stdin: bytes | str, files: dict[str, bytes | str] | None,
             image: str, timeout: float, resources: Resources | None, read_back: Sequence[str] | None,
             env: dict[str, str] | None, cwd: str, priority: str, labels: dict[str, str] | None,
             max_output: int, wait: float) -> CallRequest:
    if isinstance(cmd, str):
        argv, shell = [], cmd
    elif isinstance(cmd, (list, tuple)) and all(isinstance(a, str) for a in cmd):
        argv, shell = list(cmd), ""
    else:
        raise InvalidRequest(f"cmd must be a string (trusted shell) or a list of strings, got {cmd!r}")
    if priority not in subjects.PRIORITIES:
        raise InvalidRequest(f"priority must be one of {', '.join(subjects.PRIORITIES)}, got {priority!r}")
    validate.seconds(timeout, "timeout")
    validate.seconds(wait, "wait")
    now = time.time()
    req = CallRequest(call_id=new_id("c"), tenant=tenant, image=image, argv=argv, shell=shell,
                      env=dict(env or {}), cwd=cwd, stdin=stdin.encode() if isinstance(stdin, str) else bytes(stdin),
                      files={p: d.encode() if isinstance(d, str) else bytes(d) for p, d in (files or {}).items()},
                      read_back=list(read_back or []), timeout=float(timeout),
                      resources=Resources.of(resources).to_wire(), labels=dict(labels or {}),
                      max_output=int(max_output), deadline=now + wait, sent_at=now)
    validate.check_call(req)   # before anything is sent: the node checks again
    return req


OFFERED_FOR = 5.0   # seconds a client trusts an answer that some node runs fncall workers
ASK_FOR = 2.0       # seconds a call waits for that answer (none: it is sent as if yes)


@dataclass
class Offered:
    """A client's last answer to whether some live node runs fncall workers (asked once for many calls)."""

    until: float = 0.0                    # (monotonic) trusted until
    asking: asyncio.Future | None = None  # the question in flight, which concurrent calls share


async def _need_fncall(client: "AsyncClient") -> None:
    """CapacityUnavailable at once when placement says no live node runs fncall workers: the call would wait
    its whole `wait` (30 s by default) for a worker none has. A yes, or no answer within ASK_FOR (calls go
    to the nodes' lane, not through placement), is kept OFFERED_FOR seconds."""
    seen = client._fncall
    if time.monotonic() < seen.until:
        return
    if seen.asking is None or seen.asking.done():
        seen.asking = asyncio.ensure_future(client._ask(GetBackends(), Backends, timeout=ASK_FOR))
    try:
        answer = await asyncio.shield(seen.asking)
    except DsecError:   # no answer (placement down or slow, a control API from before the question): the call
        seen.until = time.monotonic() + OFFERED_FOR   # goes as it did, straight to the nodes' lane
        return
    if answer.known and "fncall" not in answer.kinds:
        raise CapacityUnavailable("no node runs fncall workers (no live node offers the fncall backend kind; "
                                  "start one with e.g. `dsec up --backend fncall`): the call was not sent")
    seen.until = time.monotonic() + OFFERED_FOR


async def call(client: "AsyncClient", cmd: str | Sequence[str], *, stdin: bytes | str = b"",
               files: dict[str, bytes | str] | None = None, image: str = "busybox", timeout: float = 10.0,
               resources: Resources | None = None, read_back: Sequence[str] | None = None,
               env: dict[str, str] | None = None, cwd: str = "/tmp", priority: str = "latency",
               labels: dict[str, str] | None = None, max_output: int = validate.MAX_CALL_OUTPUT,
               wait: float = 30.0) -> CallResult:
    """One call (see AsyncClient.call)."""
    req = _request(client.tenant, cmd, stdin=stdin, files=files, image=image, timeout=timeout,
                   resources=resources, read_back=read_back, env=env, cwd=cwd, priority=priority, labels=labels,
                   max_output=max_output, wait=wait)
    bus, replies = client._need_bus(), client._replies
    assert replies is not None
    await _need_fncall(client)
    reply_to, q = replies.register(req.call_id)
    req = msgspec.structs.replace(req, reply_to=reply_to)
    try:
        await bus.publish(subjects.call_request(req.tenant, priority), encode(req), msg_id=req.call_id,
                          timeout=1.5, retries=5, retry_for=min(10.0, wait))
        give_up = req.deadline + req.timeout + REPLY_GRACE
        while True:
            try:
                async with asyncio.timeout(max(0.0, give_up - time.time())):
                    data = await q.get()   # (in a timeout, not wait_for: no task per wait)
            except TimeoutError:
                raise CapacityUnavailable(f"no fncall worker took call {req.call_id} within {wait:.0f}s (no node "
                                          "runs fncall workers, or all were busy); it will not run later") from None
            try:
                reply = call_reply_decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue   # junk on our inbox is skipped
            if isinstance(reply, ErrorReply):
                raise from_code(reply.code, reply.message, call_id=req.call_id)
            assert isinstance(reply, CallReply)
            return CallResult(exit_code=reply.exit_code, stdout=reply.stdout, stderr=reply.stderr,
                              duration=reply.duration, cpu_time=reply.cpu_time, peak_memory=reply.peak_memory,
                              timed_out=reply.timed_out, truncated=reply.truncated, files=dict(reply.files),
                              unread=dict(reply.unread),
                              worker=reply.worker, node=reply.node, call_id=req.call_id, waited=reply.waited)
    finally:
        replies.forget(req.call_id)


async def call_many(client: "AsyncClient", calls: Sequence[dict[str, Any]]) -> list[CallResult]:
    """Every call at once; results in input order, a failed one as CallResult(error=...)."""
    async def one(spec: Any) -> CallResult:
        try:
            if not isinstance(spec, dict) or "cmd" not in spec:
                raise InvalidRequest(f"each call is a dict of call()'s arguments with a 'cmd', got {spec!r}")
            kwargs = dict(spec)
            return await call(client, kwargs.pop("cmd"), **kwargs)
        except TypeError as exc:   # an argument call() does not take
            return CallResult(error=InvalidRequest(f"bad call arguments: {exc}"))
        except DsecError as exc:
            return CallResult(error=exc, call_id=str(exc.details.get("call_id", "")))
    return list(await asyncio.gather(*(one(c) for c in calls)))

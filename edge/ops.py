"""An edge's op lane: exec, destroy and file operations on the sandboxes it runs."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from bus import streams, subjects
from bus.errors import DsecError, ExecFailed, FileOpError, InvalidRequest, SandboxNotFound
from bus.messages import (DestroyRequest, ErrorReply, ExecRequest, ExitRecord, OkReply, ReadFile, WriteFile,
                          op_decoder, output_decoder, salvage, sandbox_decoder)
from bus.pull import Delivery, Verdict
from chronus.relay import OutputRelay
from edge.backends.base import BackendError, SandboxGone

if TYPE_CHECKING:
    from edge.agent import Edge

log = logging.getLogger(__name__)

LEASE_EVERY = 10.0          # seconds between in-progress acks of a long exec
REMEMBERED_EXECS = 100_000  # exec ids kept to refuse a redelivered exec


class OpLane:
    """Pulls dsec.node.<node>.exec.> and runs each op; execs run concurrently up to max_execs."""

    def __init__(self, edge: "Edge") -> None:
        self.edge = edge
        self.bus = edge.bus
        self._worker = None
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()

    async def start(self) -> None:
        """Start pulling ops."""
        self._worker = await self.bus.pull_worker(streams.edge_ops_consumer(self.edge.node), self._handle,
                                                  credit=lambda: self.edge.config.max_execs)

    async def stop(self) -> None:
        """Stop pulling; cancel ops in flight (their sandboxes are about to be destroyed)."""
        if self._worker:
            await self._worker.stop(drain=False)

    async def _handle(self, d: Delivery) -> Verdict:
        try:
            op = op_decoder.decode(d.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            env = salvage(d.data)
            await self._reply(env.reply_to, ErrorReply(request_id=env.request_id, code=InvalidRequest.code,
                                                       message=f"bad request: {exc}"))
            if env.exec_id and env.sandbox_id:
                await self._exec_error(env.sandbox_id, env.exec_id, InvalidRequest(f"bad exec request: {exc}"))
            return Verdict.TERM
        match op:
            case ExecRequest():
                await self._exec(op, d)
            case DestroyRequest():
                await self._answer(op, self._destroy(op))
            case WriteFile():
                await self._answer(op, self._write(op))
            case ReadFile():
                await self._answer(op, self._read(op))
        return Verdict.ACK

    # ---- replies ------------------------------------------------------------------------------

    async def _reply(self, reply_to: str, msg) -> None:
        if reply_to:
            with contextlib.suppress(DsecError):
                await self.bus.send(reply_to, msg)

    async def _answer(self, op, work) -> None:
        try:
            if op.deadline and time.time() > op.deadline:
                work.close()
                raise InvalidRequest("request expired before the node served it")
            data = await work
            reply = OkReply(request_id=op.request_id, data=data or b"")
        except DsecError as err:
            reply = ErrorReply(request_id=op.request_id, code=err.code, message=str(err),
                               reason=str(err.details.get("reason", "")))
        await self._reply(op.reply_to, reply)

    async def _gone(self, sandbox_id: str) -> SandboxNotFound:
        """The typed error for a sandbox this node does not run, with the reason the system recorded."""
        reason, state = "never_existed", ""
        with contextlib.suppress(DsecError):
            raw = await self.bus.kv_get(streams.SANDBOXES_KV, sandbox_id)
            if raw is not None:
                with contextlib.suppress(msgspec.DecodeError):
                    state = sandbox_decoder.decode(raw).state
                    reason = state if state != "ready" else "not_on_this_node"
        return SandboxNotFound(f"sandbox {sandbox_id} not found ({reason})", reason=reason)

    async def _require(self, sandbox_id: str) -> None:
        if sandbox_id not in self.edge.sandboxes:
            raise await self._gone(sandbox_id)

    # ---- ops ----------------------------------------------------------------------------------

    async def _destroy(self, op: DestroyRequest) -> None:
        await self._require(op.sandbox_id)
        try:
            await self.edge.destroy(op.sandbox_id, "destroyed", "destroyed by request")
        except (KeyError, SandboxGone):
            raise await self._gone(op.sandbox_id) from None

    async def _write(self, op: WriteFile) -> None:
        await self._require(op.sandbox_id)
        try:
            await self.edge.backend.write_file(op.sandbox_id, op.path, op.data, op.mode)
        except SandboxGone:
            raise await self._gone(op.sandbox_id) from None
        except BackendError as exc:
            raise FileOpError(str(exc)) from exc

    async def _read(self, op: ReadFile) -> bytes:
        await self._require(op.sandbox_id)
        try:
            return await self.edge.backend.read_file(op.sandbox_id, op.path, op.limit)
        except SandboxGone:
            raise await self._gone(op.sandbox_id) from None
        except BackendError as exc:
            raise FileOpError(str(exc)) from exc

    # ---- exec ---------------------------------------------------------------------------------

    def _first_time(self, exec_id: str) -> bool:
        if exec_id in self._seen:
            return False
        self._seen[exec_id] = None
        if len(self._seen) > REMEMBERED_EXECS:
            self._seen.popitem(last=False)
        return True

    async def _exec_error(self, sandbox_id: str, exec_id: str, err: DsecError) -> None:
        with contextlib.suppress(DsecError, ValueError):
            relay = OutputRelay(self.bus, subjects.token(sandbox_id, "sandbox_id"),
                                subjects.token(exec_id, "exec_id"), 0)
            await relay.finish(exit_code=-1, error_code=err.code, error=str(err),
                                 reason=str(err.details.get("reason", "")))

    async def _exec(self, op: ExecRequest, d: Delivery) -> None:
        try:
            subjects.token(op.exec_id, "exec_id"), subjects.token(op.sandbox_id, "sandbox_id")
        except ValueError as exc:
            return await self._exec_error(op.sandbox_id, op.exec_id, InvalidRequest(str(exc)))
        if not self._first_time(op.exec_id) or await self._already_ran(op, d):
            return   # a redelivered exec never runs twice
        try:
            self._check_exec(op)
            await self._require(op.sandbox_id)
        except DsecError as err:
            return await self._exec_error(op.sandbox_id, op.exec_id, err)
        relay = OutputRelay(self.bus, op.sandbox_id, op.exec_id, op.max_output)
        lease = asyncio.create_task(self._keep_lease(d))
        t0 = time.monotonic()
        try:
            res = await self.edge.backend.exec(op.sandbox_id, op.argv, env=dict(op.env), cwd=op.cwd,
                                               stdin=op.stdin or None, timeout=op.timeout, sink=relay.sink)
        except SandboxGone:
            return await self._exec_error(op.sandbox_id, op.exec_id, await self._gone(op.sandbox_id))
        except BackendError as exc:
            await relay.finish(exit_code=-1, duration=time.monotonic() - t0, error_code=ExecFailed.code,
                               error=str(exc))
            return
        finally:
            lease.cancel()
        await relay.finish(exit_code=res.exit_code, duration=res.duration, cpu_time=res.cpu_time,
                           peak_memory=res.peak_memory, timed_out=res.timed_out)

    @staticmethod
    def _check_exec(op: ExecRequest) -> None:
        if not op.argv or not all(op.argv):
            raise InvalidRequest("argv must be a non-empty list of non-empty strings")
        if not 0 < op.timeout <= 7 * 24 * 3600:
            raise InvalidRequest(f"timeout must be > 0 seconds, got {op.timeout}")
        if not op.cwd.startswith("/"):
            raise InvalidRequest(f"cwd must be an absolute path, got {op.cwd!r}")
        if op.deadline and time.time() > op.deadline:
            raise InvalidRequest("exec request expired before the node served it")

    async def _already_ran(self, op: ExecRequest, d: Delivery) -> bool:
        """After an edge restart, a redelivered exec may have run before: its output subject tells."""
        if d.num_delivered <= 1:
            return False
        with contextlib.suppress(DsecError, msgspec.DecodeError):
            last = await self.bus.last_on_subject(streams.OUT_STREAM, subjects.output(op.sandbox_id, op.exec_id))
            return last is not None and isinstance(output_decoder.decode(last), ExitRecord)
        return False

    @staticmethod
    async def _keep_lease(d: Delivery) -> None:
        while True:
            await asyncio.sleep(LEASE_EVERY)
            await d.in_progress()

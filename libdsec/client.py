"""AsyncClient: create sandboxes and attach to them, over the bus."""
from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import msgspec

from bus import creds as credentials, kinds, subjects, validate
from bus.apiwire import (DeleteSnapshot, DeleteWarmPool, Done, GetQuota, GetSandbox, GetSnapshot, ListSandboxes,
                         ListSnapshots, ListWarmPools, QuotaState, SandboxPage, SetWarmPool, SnapshotList, WarmPoolList)
from bus.kinds import check_create_kind
from bus.conn import Bus
from bus.errors import (DsecError, InvalidRequest, PermissionDenied, SandboxError, SandboxNotFound,
                         from_code)
from bus.messages import (
    CreateRequest, ErrorReply, ResumeRequest, SuspendRequest, encode,
    op_reply_decoder)
from bus.records import SandboxRecord, SnapshotRecord, WarmPool
from libdsec import calls, control, creating, warmpools
from libdsec.ids import new_id
from libdsec.network import Network, to_wire as network_policy
from libdsec.resources import Resources
from libdsec.sandbox import PUBLISH_RETRIES, PUBLISH_RETRY_FOR, PUBLISH_TRY, AsyncSandbox

DEFAULT_CREATE_TIMEOUT = 60.0
DEFAULT_TTL = 600.0
MAX_MANY = 10_000   # sandboxes one create_many (or fork) starts: n=100,000 spent 32 s of CPU before it failed


class AsyncClient:
    """The asynchronous SDK entry point; use as `async with AsyncClient(url) as client`."""

    def __init__(self, url: str = "nats://127.0.0.1:4222", *, tenant: str | None = None, creds: str | None = None,
                 connect_timeout: float = 5.0) -> None:
        """creds: the tenant's credential file; default $DSEC_CREDS, else the one `dsec up` wrote for the
        tenant under $DSEC_STATE_DIR (.dsec/creds/tenants/<tenant>.creds), else none (a server without
        auth). tenant: default $DSEC_TENANT, else the one the credential names, else `default`; a project
        under a tenant is `tenant/project` (it sees its own sandboxes; the tenant's credential sees its
        projects' too). Admin's credential may name any tenant (an operator acting on its sandboxes)."""
        self.url = url
        tenant = tenant or os.environ.get("DSEC_TENANT") or None
        tenant = subjects.account_name(tenant) if tenant else tenant
        self.creds = creds or credentials.default_creds(f"tenant:{tenant or 'default'}")
        own = credentials.tenant_of_creds(self.creds) if self.creds else None
        if tenant is None:
            tenant = own
        elif own is not None and subjects.account_name(own) != tenant:
            # (the server drops every request it would make: a create waited out its 60 s, a list blamed placement)
            raise PermissionDenied(f"credential {self.creds} is tenant {own}'s: it acts on no other tenant's "
                                   f"sandboxes (asked for {subjects.display_name(tenant)}; admin's credential "
                                   f"acts on any tenant's)")
        try:
            self.tenant = subjects.token(tenant or "default", "tenant")
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        self.connect_timeout = connect_timeout
        self.bus: Bus | None = None
        self._loop: asyncio.AbstractEventLoop | None = None   # the event loop it connected in
        self._replies: creating.Replies | None = None
        self._given_up = creating.GivenUp(self._record, self._destroy_given_up)   # creates, destroyed if they come up
        self._fncall = calls.Offered()              # whether some node runs fncall workers (calls.py)

    async def __aenter__(self) -> "AsyncClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def connect(self) -> None:
        """Connect to the bus (BusUnavailable if nobody answers)."""
        self.bus = await Bus.connect(self.url, name="libdsec", timeout=self.connect_timeout, creds=self.creds)
        self._loop = asyncio.get_running_loop()
        self._replies = creating.Replies(self.bus, self.tenant)
        await self._replies.open()

    async def close(self) -> None:
        """Close the connection (sandboxes live on until destroyed or their TTL; a create cancelled meanwhile
        is given up to creating.CLOSE_WAIT seconds to settle and be destroyed)."""
        await self._given_up.close()
        if self.bus is not None:
            await self.bus.close()
            self.bus = None

    def _need_bus(self) -> Bus:
        here = asyncio._get_running_loop()
        if here is not None and self._loop is not None and here is not self._loop:   # (it would never answer)
            raise SandboxError("this client was connected in another event loop (each asyncio.run() has its own): "
                               "connect a client in this one (for the E2B facade: AsyncSandbox.connect(id))")
        if self.bus is None:
            raise SandboxError("client is not connected (use `async with AsyncClient(...)`)")
        return self.bus

    # ---- create -------------------------------------------------------------------------------

    def _request(self, image: str, backend: str, resources: Resources | None, ttl: float,
                 env: dict[str, str] | None, labels: dict[str, str] | None, timeout: float,
                 priority: str = "latency", burst: bool | None = None, workspace: str | None = None,
                 toolkit: str | None = None) -> CreateRequest:
        validate.seconds(ttl, "ttl")
        validate.seconds(timeout, "timeout")
        if not isinstance(image, str) or not image:
            raise InvalidRequest(f"image must be a non-empty string, got {image!r}")
        for what, ref in (("workspace", workspace), ("toolkit", toolkit)):
            if ref is not None and (not isinstance(ref, str) or not ref):
                raise InvalidRequest(f"{what} must be a name or name@version, got {ref!r}")
        if priority not in subjects.PRIORITIES:
            raise InvalidRequest(f"priority must be one of {', '.join(subjects.PRIORITIES)}, got {priority!r}")
        if burst is not None and not isinstance(burst, bool):
            raise InvalidRequest(f"burst must be True, False or None, got {burst!r}")
        if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise InvalidRequest("env must map str to str")
        validate.check_labels(labels or {})   # (their types too)
        rid = new_id("r")
        now = time.time()
        return CreateRequest(request_id=rid, sandbox_id=new_id("sb"), tenant=self.tenant, image=image,
                             backend=backend, resources=Resources.of(resources).to_wire(), ttl=float(ttl),
                             env=dict(env or {}), labels=dict(labels or {}), deadline=now + timeout, sent_at=now,
                             priority=priority, burst=burst, workspace=workspace or "",  # type: ignore[arg-type]
                             toolkit=toolkit or "")

    async def create(self, image: str = "busybox", *, backend: str | None = None, resources: Resources | None = None,
                     ttl: float = DEFAULT_TTL, env: dict[str, str] | None = None,
                     labels: dict[str, str] | None = None, timeout: float = DEFAULT_CREATE_TIMEOUT,
                     priority: str = "latency", burst: bool | None = None,
                     on_queued=None, workspace: str | None = None, toolkit: str | None = None,
                     from_snapshot: SnapshotRecord | str | None = None, privileged: bool = False,
                     memory: bool | None = None, network: "Network | str | None" = None,
                     cpu_class: str | None = None, on_timeout: str = "destroy") -> AsyncSandbox:
        """Create one sandbox and wait until it runs.

        image is the base layer (name or name@version; name = its latest version); workspace and toolkit,
        when given, are layers of those kinds stacked over it (overlayfs, base lowest, toolkit on top).

        priority: "latency" (default) requests are placed ahead of queued "batch" ones. burst: may run on
        the cloud pool when the local pool passes its threshold (default: batch yes, latency no).
        When nothing has room the request waits; on_queued(reason) is called once if it does.
        Raises CapacityUnavailable after `timeout` (the request is then cancelled: it never starts later),
        QuotaExceeded at once when the tenant's quota would be passed.

        backend is the kind (container by default; gvisor, microvm, ...: bus/kinds.py): InvalidRequest for one that does not
        exist, Unsupported for an operation it lacks (e.g. from_snapshot on a kind without fork), both
        raised before anything is sent; CapacityUnavailable at once when no live node runs it.

        privileged=True (VM kinds only, else Unsupported): its commands keep every capability of the guest's
        own kernel (load modules, sysrq, mount...); the only promise is that the host and every other
        sandbox are untouched. Never claimed from a warm pool.

        memory (from a snapshot taken with memory=True): go on from its memory, every process where it was,
        on the node that holds it, of its kind and resources (the defaults then). None (default): when the
        snapshot has memory and backend is not given or is its kind; False: from its files only, anywhere.

        network: "none" (default: loopback only), "mirror-only" (the node's package mirrors) or
        libdsec.Network(allow=[...]) (proxied; bus/network.py says what an entry may be). A bad policy
        raises InvalidRequest; one other than none on a kind without the network capability (fncall),
        Unsupported, both before anything is sent.

        cpu_class: "latency" or "batch" (default: the priority's). A batch sandbox's every process runs at
        SCHED_IDLE under low cgroup cpu shares, so latency sandboxes keep their CPU when the node is busy; it
        cannot raise its own class.

        on_timeout: what its ttl does: "destroy" (default) or "suspend" (kinds with the suspend capability:
        its processes stop and its memory stays; resume() goes on, set_timeout() gives it time again).
        """
        if on_timeout not in ("destroy", "suspend"):
            raise InvalidRequest(f"on_timeout must be 'destroy' or 'suspend', got {on_timeout!r}")
        if cpu_class not in (None, "latency", "batch"):
            raise InvalidRequest(f"cpu_class must be 'latency' or 'batch', got {cpu_class!r}")
        wire_network = network_policy(network)
        if backend is not None:   # a kind that does not exist or cannot do it: refused before anything is sent
            check_create_kind(backend, from_snapshot is not None, privileged, wire_network.mode != "none")
        snap = None
        if from_snapshot is not None:
            snap = await self.snapshot(from_snapshot)
            if memory is None:
                memory = bool(snap.memory_node) and backend in (None, snap.memory_kind)
            if memory and not snap.memory_node:
                raise InvalidRequest(f"snapshot {snap.id} has no memory (take one with snapshot(memory=True))")
            if memory:
                backend = backend or snap.memory_kind
        elif memory:
            raise InvalidRequest("memory=True needs from_snapshot")
        backend = backend or kinds.CONTAINER
        check_create_kind(backend, snap is not None, privileged, wire_network.mode != "none")
        if snap is not None:   # its layers; its env, resources and labels unless given here
            env = {**snap.env, **(env or {})}
            labels = dict(snap.labels) if labels is None else labels
            resources = resources or Resources(cpu=snap.resources.cpu, memory=snap.resources.memory,
                                               pids=snap.resources.pids, disk=snap.resources.disk)
        req = self._request(image, backend, resources, ttl, env, labels, timeout, priority, burst, workspace, toolkit)
        if snap is not None:
            req = msgspec.structs.replace(req, snapshot=snap.id, image=snap.image, memory=bool(memory),
                                          cwd=snap.cwd if snap.cwd != "/" else "", user=snap.user)
        if privileged:
            req = msgspec.structs.replace(req, privileged=True)
        if cpu_class is not None:
            req = msgspec.structs.replace(req, cpu_class=cpu_class)
        if on_timeout != "destroy":
            kinds.require(backend, "suspend", "on_timeout='suspend'")
            req = msgspec.structs.replace(req, on_timeout=on_timeout)
        if wire_network.mode != "none":
            req = msgspec.structs.replace(req, network=wire_network)
        return await self._create(req, timeout, on_queued)

    async def fork(self, snapshot: SnapshotRecord | str, n: int = 1, **kwargs: Any) -> list[AsyncSandbox]:
        """n independent sandboxes started from a snapshot, on any nodes (all or none)."""
        if isinstance(snapshot, str) and isinstance(n, int) and n > 1:   # (looked up once, not n times)
            snapshot = await self.snapshot(snapshot)
        return await self.create_many(n, from_snapshot=snapshot, **kwargs)

    # ---- stateless calls (fncall) ---------------------------------------------------------------

    async def call(self, cmd, *, stdin: bytes | str = b"", files: dict | None = None, image: str = "busybox",
                   timeout: float = 10.0, resources: Resources | None = None, read_back=None,
                   env: dict[str, str] | None = None, cwd: str = "/tmp", priority: str = "latency",
                   labels: dict[str, str] | None = None, max_output: int = calls.validate.MAX_CALL_OUTPUT,
                   wait: float = 30.0) -> calls.CallResult:
        """Run one stateless call on a pre-started worker (backend kind fncall) and return its CallResult
        (exit code, stdout, stderr, duration, cpu time, peak memory, timed_out, files read back, worker).

        cmd is a string (run by the trusted shell) or an argv list; files {path: bytes} are written first
        (under /tmp, the default cwd, or /dev/shm: the image's own files are read-only), read_back
        [paths] are read after it. Nothing of one call is seen by the next (see docs/backends.md). It
        waits up to `wait` seconds for a free worker, then raises CapacityUnavailable (it never runs
        later); bad input raises InvalidRequest before anything is sent; a command that cannot start
        raises ExecFailed."""
        return await calls.call(self, cmd, stdin=stdin, files=files, image=image, timeout=timeout,
                                resources=resources, read_back=read_back, env=env, cwd=cwd, priority=priority,
                                labels=labels, max_output=max_output, wait=wait)

    async def call_many(self, calls_: list[dict[str, Any]]) -> list[calls.CallResult]:
        """Many calls at once (dicts of call()'s arguments, each with a 'cmd'); results in input order, a
        failed call as its own result (.error set), never aborting the batch."""
        return await calls.call_many(self, calls_)

    # ---- snapshots ----------------------------------------------------------------------------

    async def snapshot(self, ref: SnapshotRecord | str) -> SnapshotRecord:
        """A snapshot of this tenant by id (or by tag: the newest with it); ImageNotFound if none."""
        if isinstance(ref, SnapshotRecord):
            return ref
        return await self._ask(GetSnapshot(ref=ref), SnapshotRecord)

    async def snapshots(self, tag: str | None = None) -> list[SnapshotRecord]:
        """This tenant's snapshots, oldest first (only those with `tag` when given)."""
        return (await self._ask(ListSnapshots(tag=tag or ""), SnapshotList)).snapshots

    async def delete_snapshot(self, ref: SnapshotRecord | str) -> None:
        """Delete a snapshot (by id, tag or record); refused (InvalidRequest) while another snapshot is
        built on it or a running sandbox uses its layer. Its bytes go when nothing else holds them."""
        await self._ask(DeleteSnapshot(ref=ref.id if isinstance(ref, SnapshotRecord) else ref), Done)

    # ---- warm pools --------------------------------------------------------------------------

    async def set_warm_pool(self, name: str, image: str = "busybox", *, workspace: str | None = None,
                            toolkit: str | None = None, resources: Resources | None = None, min: int = 0,
                            max: int = 4, node_pool: str = "local", backend: str = "container") -> WarmPool:
        """Keep ready sandboxes of this kind, layers and resources on every edge of node_pool: between min
        and max per edge, sized by the recent rate of matching creates. A create with the same kind, layers
        and resources then claims one (its own id, hostname, env and labels; nothing of anyone before).
        The pool is this tenant's: another tenant can neither see nor change it."""
        spec = warmpools.spec(name, image, workspace, toolkit, resources, min, max, node_pool, backend)
        return await self._ask(SetWarmPool(pool=spec), WarmPool)

    async def warm_pools(self) -> list[warmpools.WarmPoolStatus]:
        """This tenant's warm pools with their ready sandboxes per node."""
        return [warmpools.WarmPoolStatus(p.spec, dict(p.ready), p.error)
                for p in (await self._ask(ListWarmPools(), WarmPoolList)).pools]

    async def delete_warm_pool(self, name: str) -> None:
        """Remove a warm pool; its ready sandboxes are destroyed (claimed ones live on)."""
        await self._ask(DeleteWarmPool(name=name), Done)

    async def quota(self) -> QuotaState:
        """This tenant's quota (`.quota`: max_sandboxes, max_cpu, max_memory, rate; 0 is no limit) and what
        its live sandboxes hold now (`.sandboxes`, `.cpu`, `.memory`)."""
        return await self._ask(GetQuota(), QuotaState)

    async def _ask(self, request, expect: type, timeout: float = control.ASK_TIMEOUT):
        """One control API request of this tenant (libdsec/control.py)."""
        return await control.ask(self._need_bus(), self.tenant, request, expect, timeout)

    async def _create(self, req: CreateRequest, timeout: float, on_queued=None) -> AsyncSandbox:
        return await creating.wait_ready(self, req, timeout, on_queued)

    async def _record_quiet(self, sandbox_id: str):
        """The sandbox's record, or None (also when the bus does not answer now)."""
        rec = await creating.read_record(self._record, sandbox_id)
        return None if rec is creating.UNKNOWN else rec

    async def _destroy_given_up(self, sandbox_id: str, node: str) -> None:
        await AsyncSandbox(self, sandbox_id, node).destroy(timeout=10)

    async def create_many(self, n: int, image: str = "busybox", **kwargs: Any) -> list[AsyncSandbox]:
        """Create n sandboxes in one round; all are returned, or none survive and the first error is raised."""
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_MANY:
            raise InvalidRequest(f"n must be an integer from 1 to {MAX_MANY:,} (more: several calls), got {n!r}")
        results = await asyncio.gather(*(self.create(image, **kwargs) for _ in range(n)), return_exceptions=True)
        ok = [r for r in results if isinstance(r, AsyncSandbox)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(sb.destroy() for sb in ok), return_exceptions=True)
            raise errors[0]
        return ok

    # ---- attach and list ----------------------------------------------------------------------

    async def get(self, sandbox_id: str, *, timeout: float = DEFAULT_CREATE_TIMEOUT) -> AsyncSandbox:
        """Attach to a sandbox by id; SandboxNotFound (with the reason) when it does not run. One still
        starting is waited for, up to timeout seconds (it was "not found (starting)", though it came up)."""
        rec = await self._record(sandbox_id)
        until = time.monotonic() + timeout
        while rec is not None and rec.state == "starting" and time.monotonic() < until:
            await asyncio.sleep(creating.SETTLE_EVERY)
            rec = await self._record(sandbox_id)
        if rec is not None and rec.state == "starting":
            raise SandboxError(f"sandbox {sandbox_id} is still starting after {timeout:.0f}s", sandbox_id=sandbox_id)
        if rec is None:
            raise SandboxNotFound.ended(sandbox_id, "never_existed")
        if rec.state != "ready":
            raise SandboxNotFound.ended(sandbox_id, rec.state, rec.reason)
        if rec.tenant != self.tenant:   # a tenant sees its projects' sandboxes; each project acts on its own
            raise PermissionDenied(f"sandbox {sandbox_id} is project {subjects.display_name(rec.tenant)}'s: act on "
                                   f"it with that project's credential")
        return AsyncSandbox(self, rec.sandbox_id, rec.node, rec.backend, rec.network)

    async def _record(self, sandbox_id: str):
        """This tenant's record of a sandbox (any state), or None when it has none."""
        try:
            subjects.token(sandbox_id, "sandbox_id")
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        try:
            return await self._ask(GetSandbox(sandbox_id=sandbox_id), SandboxRecord)
        except SandboxNotFound:
            return None

    # ---- suspend and resume by group ------------------------------------------------------------

    async def suspend(self, *, labels: dict[str, str] | None = None, ids: list[str] | None = None,
                      timeout: float = 30.0) -> list[str]:
        """Freeze every running sandbox of this tenant that has all these labels (or these ids), on
        whatever node: processes stop where they are, use no CPU and keep their memory; their TTL stops.
        Execs on a suspended sandbox fail with SandboxSuspended; execs already running are paused (their
        timeouts do not count the suspended time). Returns the ids suspended now."""
        return await self._suspend_group(labels, ids, timeout, freeze=True)

    async def resume(self, *, labels: dict[str, str] | None = None, ids: list[str] | None = None,
                     timeout: float = 30.0) -> list[str]:
        """Thaw the suspended sandboxes with all these labels (or these ids): their processes continue
        where they were. Returns the ids resumed now."""
        return await self._suspend_group(labels, ids, timeout, freeze=False)

    async def _suspend_group(self, labels, ids, timeout: float, freeze: bool) -> list[str]:
        if not labels and not ids:
            raise InvalidRequest("give labels={...} or ids=[...]: suspend/resume never applies to every sandbox")
        wanted = set(ids or [])
        chosen = [rec for rec in await self.list(labels=labels)
                  if rec.tenant == self.tenant and rec.suspended != freeze and (not wanted or rec.sandbox_id in wanted)]
        make = SuspendRequest if freeze else ResumeRequest
        for rec in chosen:   # every one of them can, or none is touched
            kinds.require(rec.backend, "suspend", "suspend" if freeze else "resume")

        async def one(rec) -> str | None:
            try:
                await self._op(rec.node, rec.sandbox_id, lambda rid, to, dl: make(
                    request_id=rid, sandbox_id=rec.sandbox_id, reply_to=to, deadline=dl), timeout)
            except SandboxNotFound:
                return None   # gone meanwhile: nothing to freeze or thaw
            return rec.sandbox_id

        done = await asyncio.gather(*(one(rec) for rec in chosen), return_exceptions=True)
        errors = [d for d in done if isinstance(d, BaseException)]
        if errors:
            raise errors[0]
        return [d for d in done if d]

    async def list(self, all_states: bool = False, *, labels: dict[str, str] | None = None) -> list[SandboxRecord]:
        """Sandbox records of this tenant, oldest first (running only unless all_states; with all these
        labels when given), filtered on the server and read page by page. A tenant's credential lists its
        projects' sandboxes too (`.tenant` names the project's account, `<tenant>__<project>`)."""
        if labels is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise InvalidRequest("labels must map str to str")
        out: dict[str, SandboxRecord] = {}
        token = ""
        while True:
            page = await self._ask(ListSandboxes(states=[] if all_states else ["ready"], labels=dict(labels or {}),
                                                 next_token=token), SandboxPage)
            for r in page.records:   # (a record that changed while the pages were read comes again: the later wins)
                out[r.sandbox_id] = r
            if not page.next_token:
                return sorted(out.values(), key=lambda r: (r.created_at, r.sandbox_id))
            token = page.next_token

    # ---- trajectories -----------------------------------------------------------------------------

    def trajectories(self, *, job: str | None = None, sandbox: str | None = None, since=None,
                     durable: str | None = None, follow: bool = True, ack_wait: float = 30.0):
        """This tenant's trajectory records (every exec and lifecycle step), in order, as an async iterator
        of Trajectory (`.record`, `.seq`, `await .ack()`).

        job / sandbox narrow it; since is a datetime or a DSEC_TRAJ sequence (default: the beginning).
        With durable="name" the position is kept on the server: a consumer restarted later resumes
        after the last record it acked (at-least-once: records not acked within ack_wait come again;
        de-duplicate on record.id). follow=False stops when caught up."""
        from libdsec.trajectories import fetch_request, read
        request = fetch_request(job, sandbox, since, durable, ack_wait)
        return read(self._need_bus(), self.tenant, request, follow)

    async def drop_trajectory_reader(self, durable: str) -> None:
        """Forget the durable trajectory reader `durable` (its position goes; reading under the name again
        starts afresh). A tenant holds at most 64 readers on the server at once."""
        from bus.apiwire import CloseTrajectories, Done
        try:
            name = subjects.token(durable, "durable")
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        await control.ask(self._need_bus(), self.tenant, CloseTrajectories(reader=name), Done)

    # ---- ops (used by AsyncSandbox) -------------------------------------------------------------

    async def _op(self, node: str, sandbox_id: str, make, timeout: float, recheck=None) -> bytes:
        """Send one op and wait for its reply. Every RECHECK_EVERY s of silence the sandbox's record is read
        instead (a reply lost while the connection moved, a node that died with the op on its lane): a
        final state ends the wait, as recheck(record) says (None: SandboxNotFound with the state)."""
        bus, replies = self._need_bus(), self._replies
        assert replies is not None
        rid = new_id("o")
        reply_to, q = replies.register(rid)
        try:
            op = make(rid, reply_to, time.time() + timeout)
            await bus.publish(subjects.node_ops(node, self.tenant, sandbox_id), encode(op), msg_id=rid, timeout=PUBLISH_TRY,
                              retries=PUBLISH_RETRIES, retry_for=PUBLISH_RETRY_FOR)
            give_up = time.monotonic() + timeout
            while True:
                left = give_up - time.monotonic()
                data = await creating.next_reply(q, min(left, creating.RECHECK_EVERY))
                if data is None:
                    if left > creating.RECHECK_EVERY:
                        rec = await self._record_quiet(sandbox_id)
                        if rec is not None and rec.state in creating.FINAL:
                            answer = recheck(rec) if recheck is not None else None
                            if answer is not None:
                                return answer
                            raise SandboxNotFound.ended(sandbox_id, rec.state, rec.reason)
                        continue
                    raise SandboxError(f"node {node} did not answer within {timeout:.0f}s")
                try:
                    reply = op_reply_decoder.decode(data)
                    break
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
        finally:
            replies.forget(rid)
        if isinstance(reply, ErrorReply):
            raise from_code(reply.code, reply.message, reason=reply.reason)
        return reply.data


__all__ = ["AsyncClient", "DsecError"]

"""Wire messages: frozen msgspec structs, JSON, tagged by `kind`, version field `v` on every one."""
from __future__ import annotations

import hashlib
from typing import Any, Literal, Union

import msgspec

from bus.network import Network

WIRE_VERSION = 1


class Wire(msgspec.Struct, frozen=True, tag_field="kind", forbid_unknown_fields=False):
    """Base of every message on the bus."""

    v: int = WIRE_VERSION


class Resources(msgspec.Struct, frozen=True):
    """Normalised resources: cores and bytes."""

    cpu: float = 1.0
    memory: int = 256 << 20
    pids: int = 256
    disk: int = 256 << 20


class LayerRef(msgspec.Struct, frozen=True):
    """One resolved read-only layer: name, version and content digest."""

    name: str
    version: int
    digest: str
    size: int = 0


# ---- create lane -------------------------------------------------------------------------------

class CreateRequest(Wire, tag="create"):
    """libdsec -> placement -> edge: start a sandbox. request_id is the Nats-Msg-Id."""

    request_id: str = ""
    sandbox_id: str = ""
    tenant: str = "default"
    image: str = "busybox"
    backend: str = "container"
    resources: Resources = Resources()
    ttl: float = 600.0
    env: dict[str, str] = {}
    labels: dict[str, str] = {}
    deadline: float = 0.0            # absolute unix time; passed -> ends as expired
    reply_to: str = ""               # core subject of the requester's inbox
    sent_at: float = 0.0             # unix time the client sent it (for latency figures)
    priority: Literal["latency", "batch"] = "latency"   # latency requests jump ahead of queued batch ones
    burst: bool | None = None        # may run on the cloud pool past the threshold; None: only batch may
    attempt: int = 0                 # bumped when a lost node's queued creates are placed again
    avoid: list[str] = []            # nodes where its environment failed (placed elsewhere when it can be)
    node: str = ""                   # set by placement
    pool: str = ""                   # set by placement when routed to a pool instead of a node
    layers: list[LayerRef] = []      # set by placement: resolved layers, lowest first (base, workspace, toolkit)
    snapshot: str = ""               # start from this snapshot's layers (client.create(from_snapshot=...))
    workspace: str = ""              # name[@version] of a workspace layer over the base image (optional)
    toolkit: str = ""                # name[@version] of a toolkit layer on top (optional)
    privileged: bool = False         # a VM whose commands keep every guest capability (kinds: "privileged")
    memory: bool = False             # start from the snapshot's memory too (its processes run on): only on the
                                     # node that holds it (SnapshotRecord.memory_node), of its kind and size
    network: Network = Network()     # what it may reach (bus/network.py); kinds without "network": none only
    cwd: str = ""                    # set by placement from the image's config: every exec's default cwd...
    user: str = ""                   # ...and user (its env goes under env)...
    command: list[str] = []          # ...and its Entrypoint + Cmd (shown in the record: `dsec run` without one)
    cpu_class: Literal["", "latency", "batch"] = ""   # "": by priority; batch runs at SCHED_IDLE, low cpu shares
    on_timeout: Literal["destroy", "suspend"] = "destroy"   # at its TTL: destroyed, or suspended (resume to go on)

    def effective_cpu_class(self) -> str:
        """Its CPU class: its own, else its priority's."""
        return self.cpu_class or ("batch" if self.priority == "batch" else "latency")

    def may_burst(self) -> bool:
        """Whether this request may be routed to the burst pool (default: batch yes, latency no)."""
        return self.priority == "batch" if self.burst is None else self.burst


class SandboxReady(Wire, tag="ready"):
    """edge -> requester: the sandbox runs."""

    request_id: str = ""
    sandbox_id: str = ""
    node: str = ""


class Queued(Wire, tag="queued"):
    """placement -> requester: nothing has room yet; the request waits in JetStream."""

    request_id: str = ""
    reason: str = ""


class ErrorReply(Wire, tag="error"):
    """Any service -> requester: the request failed; code maps to a DsecError class."""

    request_id: str = ""
    code: str = "internal"
    message: str = ""
    reason: str = ""


CreateReply = Union[SandboxReady, Queued, ErrorReply]


# ---- sandbox op lane (dsec.node.<node>.exec.<tenant>.<sandbox>) -------------------------------

class ExecRequest(Wire, tag="exec"):
    """libdsec -> edge: run a command; output goes to dsec.out.<tenant>.<node>.<sandbox>.<exec_id>."""

    exec_id: str = ""
    sandbox_id: str = ""
    tenant: str = ""                 # set by the node from the lane's subject (whatever a sender put here)
    argv: list[str] = []             # run as is (resolved inside the sandbox)...
    shell: str = ""                  # ...or a script for the edge's trusted shell (never the image's /bin/sh)
    env: dict[str, str] = {}
    cwd: str = ""                    # "": the sandbox's default (its image's WorkingDir, else /)
    user: str = ""                   # "": the sandbox's default (its image's User, else root); name or uid[:gid]
    stdin: bytes = b""
    timeout: float = 30.0
    deadline: float = 0.0
    max_output: int = 16 << 20
    live_stdin: bool = False         # more stdin comes on dsec.in.<node>.<tenant>.<sandbox>.<exec_id> (ExecInput)
    background: bool = False         # the client does not wait for it: the node acks it once started
    pty_rows: int = 0                # > 0: the command runs on a terminal of this size (its stdin, stdout and
    pty_cols: int = 0                # stderr; its output one stream, stdout); resized with ExecResize
    watch: str = ""                  # instead of a command: this directory's changes, a JSON line each on
    recursive: bool = False          # stdout (edge/backends/watcher.py), until signalled or its timeout


class DestroyRequest(Wire, tag="destroy"):
    """libdsec -> edge: destroy a sandbox."""

    request_id: str = ""
    sandbox_id: str = ""
    reply_to: str = ""
    deadline: float = 0.0


class SuspendRequest(Wire, tag="suspend"):
    """libdsec -> edge: freeze every process of a sandbox (client.suspend)."""

    request_id: str = ""
    sandbox_id: str = ""
    reply_to: str = ""
    deadline: float = 0.0


class ResumeRequest(Wire, tag="resume"):
    """libdsec -> edge: thaw a suspended sandbox (client.resume)."""

    request_id: str = ""
    sandbox_id: str = ""
    reply_to: str = ""
    deadline: float = 0.0


class SnapshotRequest(Wire, tag="snapshot"):
    """libdsec -> edge: pack the sandbox's writable layer as a new layer over its own (sb.snapshot)."""

    request_id: str = ""
    sandbox_id: str = ""
    tag: str = ""
    reply_to: str = ""
    deadline: float = 0.0
    memory: bool = False             # the VM's memory too (kinds: "memory_snapshot"), held on its node


class RollbackRequest(Wire, tag="rollback"):
    """libdsec -> edge: restart a sandbox on a snapshot's layers with a fresh writable layer (sb.rollback)."""

    request_id: str = ""
    sandbox_id: str = ""
    snapshot_id: str = ""
    reply_to: str = ""
    deadline: float = 0.0


class SetNetworkRequest(Wire, tag="set_network"):
    """libdsec -> edge: change a running sandbox's network policy (sb.set_network); answered once the policy
    is in force for every connection it opens after."""

    request_id: str = ""
    sandbox_id: str = ""
    network: Network = Network()
    reply_to: str = ""
    deadline: float = 0.0


class SetTimeoutRequest(Wire, tag="set_timeout"):
    """libdsec -> edge: the sandbox now expires `timeout` seconds from now (shorter or longer; 0: at once).
    A suspended sandbox's count starts again when it is resumed."""

    request_id: str = ""
    sandbox_id: str = ""
    timeout: float = 0.0
    reply_to: str = ""
    deadline: float = 0.0


class ListProcesses(Wire, tag="list_processes"):
    """libdsec -> edge: the sandbox's running execs; answered OkReply(data=bus.execwire.ProcessList)."""

    request_id: str = ""
    sandbox_id: str = ""
    reply_to: str = ""
    deadline: float = 0.0


class WriteFile(Wire, tag="write_file"):
    """libdsec -> edge: write a file inside the sandbox."""

    request_id: str = ""
    sandbox_id: str = ""
    path: str = ""
    data: bytes = b""
    mode: int = 0o644
    reply_to: str = ""
    deadline: float = 0.0


class ReadFile(Wire, tag="read_file"):
    """libdsec -> edge: read a file inside the sandbox."""

    request_id: str = ""
    sandbox_id: str = ""
    path: str = ""
    limit: int = 16 << 20
    reply_to: str = ""
    deadline: float = 0.0


class OkReply(Wire, tag="ok"):
    """edge -> requester: the op succeeded (data for read_file)."""

    request_id: str = ""
    data: bytes = b""


FILE_OPS = ("stat", "list", "mkdir", "remove", "rename", "read", "write")
FILE_PIECE = 512 << 10   # bytes per read or write piece of a file op (a 100 MiB file is 200 requests)


class FileOp(Wire, tag="file_op"):
    """libdsec -> edge: one file-tree operation in the sandbox's root (edge/backends/treeops.py).

    stat/list/mkdir/remove name `path` (list goes `depth` levels down); rename moves path to `dest`; read
    returns up to `length` bytes from `offset`; write puts `data` at `offset` (0 creates or truncates,
    with `mode`; later pieces must start where the file ends)."""

    request_id: str = ""
    sandbox_id: str = ""
    op: str = "stat"
    path: str = ""
    dest: str = ""
    depth: int = 1
    offset: int = 0
    length: int = FILE_PIECE
    data: bytes = b""
    mode: int = 0o644
    metadata: dict[str, str] = {}   # write at offset 0: stored as the file's user.<key> xattrs
    user: str = ""                  # as whom (permissions checked as, owner of what it makes); "": the
    reply_to: str = ""              # sandbox's default user (its image's User, else root)
    deadline: float = 0.0


class FileEntry(msgspec.Struct, frozen=True):
    """One entry of a sandbox's file tree, owners as the sandbox sees them."""

    name: str
    path: str
    type: str               # file, dir, symlink or other
    size: int = 0
    mode: int = 0           # permission bits
    permissions: str = ""   # as ls shows them: rwxr-xr-x
    uid: int = 0
    gid: int = 0
    mtime: float = 0.0
    symlink_target: str = ""
    metadata: dict[str, str] = {}   # its user.* xattrs, "user." taken off


class FileOpResult(msgspec.Struct, frozen=True):
    """What a file op returns (in OkReply.data): the fields its op fills."""

    entry: FileEntry | None = None
    entries: list[FileEntry] = []
    made: bool = False
    data: bytes = b""
    size: int = 0


SandboxOp = Union[ExecRequest, DestroyRequest, WriteFile, ReadFile, SuspendRequest, ResumeRequest, SnapshotRequest,
                  RollbackRequest, SetNetworkRequest, FileOp, SetTimeoutRequest, ListProcesses]
OpReply = Union[OkReply, ErrorReply]


# ---- state: KV values and events ---------------------------------------------------------------

class Booking(msgspec.Struct, frozen=True):
    """A placement's reservation on a node, until the edge takes the create (or its deadline passes)."""

    resources: Resources = Resources()   # what the create asked for plus its kind's overhead
    deadline: float = 0.0
    tenant: str = ""
    kind: str = "container"              # counted against the node's slots of this kind
    at: float = 0.0                      # when it was written (tells one write of a request's booking from another)


class NodeInfo(Wire, tag="node"):
    """KV dsec-nodes: a node's capacity, usage and reservations. The one record both sides update with
    compare-and-set on its revision: the edge writes capacity, usage and heartbeat and removes the
    bookings it took; placement adds bookings; `dsec node drain` sets draining; the reaper sets lost."""

    node: str = ""
    pool: str = "local"
    slots: int = 0
    cpu: float = 0.0                 # schedulable cores (overcommitted)
    memory: int = 0                  # schedulable bytes
    disk: int = 0
    used_slots: int = 0
    used_cpu: float = 0.0
    used_memory: int = 0
    used_disk: int = 0
    max_cpu: float = 0.0             # largest single request it accepts
    max_memory: int = 0
    max_disk: int = 0
    max_pids: int = 0
    draining: bool = False
    heartbeat: float = 0.0           # unix time
    backends: list[str] = msgspec.field(default_factory=lambda: ["container"])   # the kinds it runs
    kind_slots: dict[str, int] = {}  # kind -> sandboxes of that kind it may hold (within `slots` in all)
    kind_used: dict[str, int] = {}   # kind -> sandboxes of that kind it runs
    accel: dict[str, str] = {}       # VM kind -> the accelerator it runs with (kvm, or tcg where KVM does not boot)
    bookings: dict[str, Booking] = {}   # request id -> reservation not yet taken by the edge
    lost: bool = False               # heartbeat stopped: declared lost by a placement engine
    lost_at: float = 0.0
    lost_handled: bool = False       # its sandboxes reported node_lost, its lanes emptied
    started_at: float = 0.0          # when this run of the edge started
    warm: dict[str, int] = {}        # pool_key -> ready warm sandboxes (placement prefers such a node)
    layers: list[str] = []           # layer_mark of layers in its cache, most recently used first (bounded)


class Heartbeat(Wire, tag="hb"):
    """dsec.hb.<node> (core, every HEARTBEAT_EVERY): the node is alive, even while KV dsec-nodes has no
    leader. Placement stops booking a node whose heartbeats stop, and declares it lost only when
    neither these nor its record's heartbeat were heard for NODE_LOST_AFTER."""

    node: str = ""
    started_at: float = 0.0          # the edge run (a restart is a new one)
    seq: int = 0
    at: float = 0.0


class Quota(Wire, tag="quota"):
    """KV dsec-quotas: one tenant's limits; 0 means unlimited."""

    tenant: str = ""
    max_sandboxes: int = 0
    max_cpu: float = 0.0
    max_memory: int = 0
    rate: float = 0.0                # control API requests/s (0: the engines' default)


class Hold(msgspec.Struct, frozen=True):
    """One sandbox counted against its tenant's quota (and its project's, when `account` names one)."""

    request_id: str = ""
    resources: Resources = Resources()
    deadline: float = 0.0
    account: str = ""     # the project account whose sandbox it is ("": the tenant's own)


class TenantUsage(Wire, tag="usage"):
    """KV dsec-tenants: what a tenant with a quota holds, its projects' sandboxes with it (sandbox id ->
    hold), updated by compare-and-set."""

    tenant: str = ""
    holds: dict[str, Hold] = {}


class EngineStats(Wire, tag="engine"):
    """KV dsec-engines: one placement engine's figures, refreshed every second (for `dsec top`)."""

    engine: str = ""
    placed: int = 0
    bursted: int = 0
    rejected: int = 0
    queued: int = 0                  # requests this engine holds waiting for room now
    conflicts: int = 0               # compare-and-set retries on node records
    latency_p50: float = 0.0         # seconds from client send to routed, over the last window
    latency_p99: float = 0.0
    utilization: float = 0.0         # local pool, booked share of the tightest dimension
    threshold: float = 0.8
    burst_min_utilization: float = 1.0   # lowest local utilization at which it routed a create to the burst pool
    taken_back: int = 0              # creates taken back from a node that did not take them (placed again)
    take_back_max: float = 0.0       # the longest a create sat on such a node before (seconds, latest 64)
    at: float = 0.0


class SandboxRecord(Wire, tag="sandbox"):
    """edge -> KV dsec-sandboxes: a sandbox's current state."""

    sandbox_id: str = ""
    tenant: str = "default"
    node: str = ""
    # starting: claimed by the edge named in `node` (compare-and-set), so one request starts one sandbox
    state: Literal["starting", "ready", "destroyed", "expired", "failed", "node_lost"] = "ready"
    image: str = ""
    backend: str = "container"       # its kind (bus/kinds.py): what operations it offers
    labels: dict[str, str] = {}
    resources: Resources = Resources()
    created_at: float = 0.0
    expires_at: float = 0.0
    updated_at: float = 0.0
    reason: str = ""
    request_id: str = ""             # the create request that made it (redeliveries are recognised by it)
    layers: list[str] = []           # digests of its layers, lowest first (an image in use is not removed)
    suspended: bool = False          # frozen by client.suspend (state stays ready: it holds its resources)
    suspended_at: float = 0.0
    version: int = 0                 # writes of this record so far: an older state never overwrites a newer one
    epoch: float = 0.0               # started_at of the edge run that made it (the reaper marks only a lost run's)
    network: Network = Network()     # its network policy (bus/network.py)
    command: list[str] = []          # its image's Entrypoint + Cmd (an imported image's; `dsec run` runs it)
    cpu_class: str = ""              # latency or batch (edge/backends/cgroups.py: CPU classes)
    user: str = ""                   # its execs' default user and cwd ("": root, /): an imported image's
    cwd: str = ""
    on_timeout: str = "destroy"      # what its TTL does: destroy it, or suspend it (CreateRequest.on_timeout)


class Event(Wire, tag="event"):
    """Lifecycle event on dsec.evt.<tenant>.<sandbox>."""

    type: str = ""                   # queued, created, destroyed, expired, failed, rejected, node_lost, suspended,
                                     # resumed, retried (an environment failure, placed again), task_failed,
                                     # timeout_set (its expiry rewritten)
    sandbox_id: str = ""
    tenant: str = "default"
    node: str = ""
    request_id: str = ""
    at: float = 0.0
    detail: str = ""
    failure_class: str = ""          # on failures: environment (retried elsewhere, up to a bound) or task (never)


class TrajRecord(Wire, tag="traj"):
    """dsec.traj.<tenant>.<job>.<sandbox>: one step of a sandbox's episode (see docs/streams.md).

    type "exec": a command and its outcome; type created/destroyed/expired/failed/node_lost: lifecycle.
    `id` is unique per record (exec id, or sandbox id + type): consumers de-duplicate on it."""

    id: str = ""
    type: str = ""
    sandbox_id: str = ""
    tenant: str = ""
    job: str = ""
    node: str = ""
    at: float = 0.0                  # when the record was written (unix time)
    exec_id: str = ""
    argv: list[str] = []
    shell: str = ""
    cwd: str = ""
    env_keys: list[str] = []
    started_at: float = 0.0
    ended_at: float = 0.0
    exit_code: int = 0
    timed_out: bool = False
    truncated: bool = False
    cpu_time: float = 0.0
    peak_memory: int = 0
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_sha256: str = ""
    stderr_sha256: str = ""
    stdout: bytes = b""              # the first TRAJ_OUTPUT bytes of each stream (all of it: dsec.out)
    stderr: bytes = b""
    failure_class: str = ""          # environment or task, on failures (see Event)
    background: bool = False         # started with background=True (the client did not wait for it)
    live_stdin: bool = False         # its stdin was streamed while it ran (not kept in the trajectory)
    pid: int = 0                     # its process id in the sandbox (0: its backend does not say)
    watch: str = ""                  # a directory watch (files.watch), not a command
    error_code: str = ""
    detail: str = ""
    decisions: list[dict[str, Any]] = []   # type network: the proxy's decisions (verdict, name, address, port,
    suppressed: dict[str, int] = {}        # bytes, reason), at most 20 per 10 s; past them only counted here


class ImageConfig(msgspec.Struct, frozen=True, omit_defaults=True):
    """An imported image's defaults (its OCI config): env under every create's, the default cwd and user of
    every exec, and what `dsec run --image` runs given no command (entrypoint + cmd)."""

    env: dict[str, str] = {}
    cwd: str = ""
    user: str = ""
    entrypoint: list[str] = []
    cmd: list[str] = []


class ImageRecord(Wire, tag="image"):
    """KV dsec-images: one version of a named layer, stored in object store dsec-layers."""

    name: str = ""
    version: int = 0
    layer_kind: Literal["base", "workspace", "toolkit"] = "base"
    digest: str = ""
    size: int = 0
    created_at: float = 0.0
    config: ImageConfig = ImageConfig()   # an imported image's defaults (none for a built one)


class SnapshotRecord(Wire, tag="snapshot"):
    """KV dsec-snapshots/<tenant>.<id>: a sandbox's filesystem at one point, as layers (its own on top)."""

    id: str = ""
    tag: str = ""
    tenant: str = "default"
    sandbox_id: str = ""             # the sandbox it was taken of
    layers: list[LayerRef] = []      # lowest first; the last is this snapshot's own (the writable layer's diff)
    image: str = ""
    env: dict[str, str] = {}
    resources: Resources = Resources()
    labels: dict[str, str] = {}
    cwd: str = "/"                   # its execs' default cwd and user (an imported image's; forks keep them)
    user: str = ""
    size: int = 0                    # bytes of its own layer
    created_at: float = 0.0
    memory_node: str = ""            # a memory snapshot: the node holding its RAM and device state ("" none);
    memory_kind: str = ""            # its forks with memory run there, of this kind, at these resources


class WarmPool(Wire, tag="warmpool"):
    """KV dsec-warm-pools: every edge of a node pool keeps between `min` and `max` ready sandboxes of one
    (layers, resources) key, sized by the recent rate of creates that match it; a matching create
    claims one. Names (image, workspace, toolkit) are resolved by each edge, so a new version of a
    layer turns the pool over to it."""

    name: str = ""
    image: str = "busybox"
    workspace: str = ""
    toolkit: str = ""
    backend: str = "container"       # the kind of its sandboxes (a create of another kind never claims one)
    resources: Resources = Resources()
    min: int = 0
    max: int = 4
    node_pool: str = "local"         # the edges of this node pool keep it
    updated_at: float = 0.0
    owner: str = ""                  # the tenant that set it (only it changes or removes it; "" = default)


def pool_key(layers: list[LayerRef], r: Resources, kind: str = "container", owner: str = "default") -> str:
    """What a warm sandbox and a create must share: the pool's owner (a create claims only its own tenant's
    stock), the kind, the layer digests and the resources (a short hash, as edges advertise their warm
    stock in their node record and placement looks for it there)."""
    text = f"{owner}|{kind}|" + ",".join(la.digest for la in layers) + f"|{r.cpu}|{r.memory}|{r.pids}|{r.disk}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def layer_mark(digest: str) -> str:
    """A layer as node records list it (held in an edge's cache): a short, still unambiguous prefix."""
    return digest.rpartition(":")[2][:16]


def encode(msg: msgspec.Struct) -> bytes:
    """Encode any wire message (or a struct carried in one) to JSON."""
    return _ENCODER.encode(msg)


_ENCODER = msgspec.json.Encoder()

# One typed decoder per family, built once.
create_decoder = msgspec.json.Decoder(CreateRequest)
create_reply_decoder = msgspec.json.Decoder(CreateReply)
op_decoder = msgspec.json.Decoder(SandboxOp)
op_reply_decoder = msgspec.json.Decoder(OpReply)
file_result_decoder = msgspec.json.Decoder(FileOpResult)
node_decoder = msgspec.json.Decoder(NodeInfo)
sandbox_decoder = msgspec.json.Decoder(SandboxRecord)
event_decoder = msgspec.json.Decoder(Event)
snapshot_decoder = msgspec.json.Decoder(SnapshotRecord)
warm_pool_decoder = msgspec.json.Decoder(WarmPool)
image_decoder = msgspec.json.Decoder(ImageRecord)
traj_decoder = msgspec.json.Decoder(TrajRecord)
quota_decoder = msgspec.json.Decoder(Quota)
usage_decoder = msgspec.json.Decoder(TenantUsage)
engine_decoder = msgspec.json.Decoder(EngineStats)
heartbeat_decoder = msgspec.json.Decoder(Heartbeat)


class _Envelope(msgspec.Struct):
    """Lenient view of a malformed request: just enough to answer it."""

    request_id: str = ""
    exec_id: str = ""
    sandbox_id: str = ""
    reply_to: str = ""


_envelope_decoder = msgspec.json.Decoder(_Envelope)


def salvage(data: bytes) -> _Envelope:
    """Best-effort read of who to answer for a message that failed to decode."""
    try:
        return _envelope_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _Envelope()

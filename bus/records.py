"""State records: what the KV buckets and event streams hold (nodes and their heartbeats, quotas and usage,
engine stats, sandbox records and events, trajectory records, images, snapshots, warm pools). Frozen msgspec
structs, JSON, tagged by `kind` like every wire message (bus/messages.py)."""
from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgspec

from bus.messages import LayerRef, Resources, Wire
from bus.network import Network


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
    stopping: bool = False           # draining because its edge was stopping (not an operator's drain)
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
                                     # environment_failed (a command failed under a failing environment),
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
    cwd: str = ""                    # as asked ("": the sandbox's default)
    user: str = ""                   # as asked ("": the sandbox's default: its image's User, else root)
    env_keys: list[str] = []
    command_cut: bool = False        # argv/shell keep only the first 64 KiB of the command (chronus/trajfit.py)...
    command_bytes: int = 0           # ...which was this many bytes (argv words each ended by a NUL, or the script)
    command_sha256: str = ""         # ...with this digest
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
    """KV dsec-warm-pools, under `<owner>.<name>` (warm_pool_key: each tenant names its pools in a space of its
    own): every edge of a node pool keeps between `min` and `max` ready sandboxes of one (layers, resources)
    key, sized by the recent rate of creates that match it; a matching create claims one. Names (image,
    workspace, toolkit) are resolved by each edge, so a new version of a layer turns the pool over to it."""

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


def warm_pool_key(owner: str, name: str) -> str:
    """A warm pool's key in KV dsec-warm-pools: its owner's, then its name (one key space for every tenant
    told a tenant another's pool names, "taken by another tenant", and let it squat them: helper A3)."""
    return f"{owner or 'default'}.{name}"


def pool_key(layers: list[LayerRef], r: Resources, kind: str = "container", owner: str = "default") -> str:
    """What a warm sandbox and a create must share: the pool's owner (a create claims only its own tenant's
    stock), the kind, the layer digests and the resources (a short hash, as edges advertise their warm
    stock in their node record and placement looks for it there)."""
    text = f"{owner}|{kind}|" + ",".join(la.digest for la in layers) + f"|{r.cpu}|{r.memory}|{r.pids}|{r.disk}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def layer_mark(digest: str) -> str:
    """A layer as node records list it (held in an edge's cache): a short, still unambiguous prefix."""
    return digest.rpartition(":")[2][:16]


# One typed decoder per record, built once.
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

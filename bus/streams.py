"""Every stream, consumer, KV bucket and object store of DSec, defined once, provisioned idempotently."""
from __future__ import annotations

from dataclasses import dataclass

from nats.js import api

from bus import subjects

HOUR = 3600.0
DAY = 24 * HOUR

REQ_STREAM = "DSEC_REQ"
NODE_STREAM = "DSEC_NODE"
OUT_STREAM = "DSEC_OUT"
EVT_STREAM = "DSEC_EVT"
TRAJ_STREAM = "DSEC_TRAJ"
CALL_STREAM = "DSEC_CALL"

NODES_KV = "dsec-nodes"
SANDBOXES_KV = "dsec-sandboxes"
IMAGES_KV = "dsec-images"
SNAPSHOTS_KV = "dsec-snapshots"
QUOTAS_KV = "dsec-quotas"
TENANTS_KV = "dsec-tenants"
ENGINES_KV = "dsec-engines"
WARM_POOLS_KV = "dsec-warm-pools"
LAYERS_OBJ = "dsec-layers"
KV_BUCKETS = (NODES_KV, SANDBOXES_KV, IMAGES_KV, SNAPSHOTS_KV, QUOTAS_KV, TENANTS_KV, ENGINES_KV, WARM_POOLS_KV)

PLACEMENT_CONSUMER = "placement"
LEGACY_CONSUMERS = [(REQ_STREAM, "placement")]   # removed at provisioning (its filter overlaps the new ones)
# Unlimited redelivery: every request carries a deadline after which it ends as `expired`, and
# undecodable ones are terminated at once, so nothing loops forever. A cap would silently drop
# requests that merely wait for room.
MAX_DELIVER = -1
NODE_LOST_AFTER = 10.0     # seconds without any heartbeat (core or record) before a node is declared lost
HEARTBEAT_EVERY = 0.25     # seconds between two core heartbeats of an edge (dsec.hb.<node>)
SUSPECT_AFTER = 0.5        # seconds without a core heartbeat (2 beats) before placement books a node no more
NODE_ENTRY_TTL = 3600.0    # a dead node's record (kept as `lost` for `dsec top`) is dropped after this
ENGINE_STATS_TTL = 5.0     # an engine's figures vanish this long after it stops
ACK_WAIT = 30.0            # seconds a consumer waits for an ack; long work extends it (pull.Lease)
# Placement handles a request in milliseconds, or holds it (leased) while it waits for room, so a dead
# engine's requests go to a surviving engine after this, not after ACK_WAIT.
PLACEMENT_ACK_WAIT = 5.0
PLACEMENT_LEASE_EVERY = 1.5
POOL_ACK_WAIT = 10.0       # a pool's shared create lane: a dead edge's pulls go to its peers after this
CALL_ACK_WAIT = 10.0       # a call's lane: a dead node's calls go to another node after this (calls are leased)
# The work queues tenants publish into (creates, calls, node ops) hold at most this, oldest dropped first. A
# message no consumer takes (an op for a node that does not exist, a call where no node runs fncall) stayed
# an hour: a tenant so filled the server's whole store, 250 MB/s, for every tenant (helper S). Served lanes
# hold milliseconds of work; but a flood also pushes out other tenants' work still waiting in the same
# stream (an edge at its credit, a node restarting): their requesters then time out (docs/streams.md).
LANE_MAX_BYTES = 1 << 30


@dataclass(frozen=True)
class Retention:
    """Tunable ages (seconds) of the limit streams."""

    output_max_age: float = 6 * HOUR
    output_max_bytes: int = 16 << 30   # oldest output is dropped first beyond this
    events_max_age: float = 7 * DAY
    events_max_bytes: int = 2 << 30
    trajectories_max_age: float = 30 * DAY
    # (helper S2's soak wrote about 100 MB of trajectories an hour: 70 GiB in 30 days, past the server's whole
    # 64 GB store, which every stream shares; the oldest records go first beyond this). The bounds together
    # (37 GiB) leave the store room to reserve the largest again: nats-server refuses an update of a stream
    # whose bound it cannot reserve a second time (nats-server #3321).
    trajectories_max_bytes: int = 16 << 30
    sandboxes_max_age: float = 2 * DAY


def stream_configs(ret: Retention, replicas: int = 1) -> list[api.StreamConfig]:
    """The streams: requests and node lanes are work queues; output and events are limits streams."""
    common = dict(storage=api.StorageType.FILE, num_replicas=replicas, max_msg_size=1 << 20,
                  duplicate_window=120.0)
    lane = dict(retention=api.RetentionPolicy.WORK_QUEUE, max_age=HOUR, max_bytes=LANE_MAX_BYTES,
                discard=api.DiscardPolicy.OLD, **common)
    return [
        api.StreamConfig(name=REQ_STREAM, subjects=[subjects.create_requests(p) for p in subjects.PRIORITIES], **lane),
        api.StreamConfig(name=NODE_STREAM, subjects=["dsec.node.>", "dsec.pool.>"], **lane),
        api.StreamConfig(name=CALL_STREAM, subjects=[subjects.call_requests(p) for p in subjects.PRIORITIES], **lane),
        api.StreamConfig(name=OUT_STREAM, subjects=["dsec.out.>"], retention=api.RetentionPolicy.LIMITS,
                         max_age=ret.output_max_age, max_bytes=ret.output_max_bytes,
                         discard=api.DiscardPolicy.OLD, **common),
        api.StreamConfig(name=EVT_STREAM, subjects=["dsec.evt.>"], retention=api.RetentionPolicy.LIMITS,
                         max_age=ret.events_max_age, max_bytes=ret.events_max_bytes, discard=api.DiscardPolicy.OLD,
                         **common),
        api.StreamConfig(name=TRAJ_STREAM, subjects=["dsec.traj.>"], retention=api.RetentionPolicy.LIMITS,
                         max_age=ret.trajectories_max_age, max_bytes=ret.trajectories_max_bytes,
                         discard=api.DiscardPolicy.OLD, **common),
    ]


def kv_configs(ret: Retention, replicas: int = 1) -> list[api.KeyValueConfig]:
    """The KV buckets: node inventory (TTL = heartbeat), sandbox states, image versions."""
    return [
        api.KeyValueConfig(bucket=NODES_KV, history=1, ttl=NODE_ENTRY_TTL, replicas=replicas),
        api.KeyValueConfig(bucket=SANDBOXES_KV, history=1, ttl=ret.sandboxes_max_age, replicas=replicas),
        api.KeyValueConfig(bucket=IMAGES_KV, history=64, replicas=replicas),
        api.KeyValueConfig(bucket=SNAPSHOTS_KV, history=1, replicas=replicas),
        api.KeyValueConfig(bucket=QUOTAS_KV, history=1, replicas=replicas),
        api.KeyValueConfig(bucket=TENANTS_KV, history=1, replicas=replicas),
        api.KeyValueConfig(bucket=ENGINES_KV, history=1, ttl=ENGINE_STATS_TTL, replicas=replicas),
        api.KeyValueConfig(bucket=WARM_POOLS_KV, history=1, replicas=replicas),
    ]


def object_configs(replicas: int = 1) -> list[api.ObjectStoreConfig]:
    """The object stores: EROFS layers."""
    return [api.ObjectStoreConfig(bucket=LAYERS_OBJ, replicas=replicas)]


def _pull(durable: str, filter_subject: str, ack_wait: float) -> api.ConsumerConfig:
    # name set: created on $JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>, a subject that names the
    # filter (the server refuses a body whose filter differs), so a permission can scope who creates what
    return api.ConsumerConfig(name=durable, durable_name=durable, filter_subject=filter_subject,
                              ack_policy=api.AckPolicy.EXPLICIT, ack_wait=ack_wait,
                              max_deliver=MAX_DELIVER, max_ack_pending=10_000, max_waiting=512,
                              deliver_policy=api.DeliverPolicy.ALL)


def placement_consumer(priority: str) -> tuple[str, api.ConsumerConfig]:
    """The durable pull consumer all placement engines share, one per priority."""
    return REQ_STREAM, _pull(f"{PLACEMENT_CONSUMER}-{priority}", subjects.create_requests(priority),
                             ack_wait=PLACEMENT_ACK_WAIT)


def pool_create_consumer(pool: str) -> tuple[str, api.ConsumerConfig]:
    """A pool's shared create lane: every edge of the pool pulls it (competing consumers)."""
    return NODE_STREAM, _pull(f"pool-{pool}-create", subjects.pool_create(pool), ack_wait=POOL_ACK_WAIT)


def call_consumer(priority: str) -> tuple[str, api.ConsumerConfig]:
    """The calls of one priority: every node running fncall workers pulls it (competing consumers)."""
    return CALL_STREAM, _pull(f"calls-{priority}", subjects.call_requests(priority), ack_wait=CALL_ACK_WAIT)


def edge_create_consumer(node: str) -> tuple[str, api.ConsumerConfig]:
    """An edge's create lane: only its own subject."""
    return NODE_STREAM, _pull(f"edge-{node}-create", subjects.node_create(node), ack_wait=ACK_WAIT)


def edge_ops_consumer(node: str) -> tuple[str, api.ConsumerConfig]:
    """An edge's op lane (exec, destroy, files): apart from creates, so a full node still serves execs."""
    return NODE_STREAM, _pull(f"edge-{node}-ops", subjects.node_ops_all(node), ack_wait=ACK_WAIT)

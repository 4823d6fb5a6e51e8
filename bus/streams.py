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

NODES_KV = "dsec-nodes"
SANDBOXES_KV = "dsec-sandboxes"
IMAGES_KV = "dsec-images"
LAYERS_OBJ = "dsec-layers"

PLACEMENT_CONSUMER = "placement"
# Unlimited redelivery: every request carries a deadline after which it ends as `expired`, and
# undecodable ones are terminated at once, so nothing loops forever. A cap would silently drop
# requests that merely wait for room.
MAX_DELIVER = -1
NODE_HEARTBEAT_TTL = 10.0  # seconds a node entry lives without a heartbeat
ACK_WAIT = 30.0            # seconds a consumer waits for an ack; long work extends it (pull.Lease)


@dataclass(frozen=True)
class Retention:
    """Tunable ages (seconds) of the limit streams."""

    output_max_age: float = 6 * HOUR
    output_max_bytes: int = 16 << 30   # oldest output is dropped first beyond this
    events_max_age: float = 7 * DAY
    sandboxes_max_age: float = 2 * DAY


def stream_configs(ret: Retention, replicas: int = 1) -> list[api.StreamConfig]:
    """The streams: requests and node lanes are work queues; output and events are limits streams."""
    common = dict(storage=api.StorageType.FILE, num_replicas=replicas, max_msg_size=1 << 20,
                  duplicate_window=120.0)
    return [
        api.StreamConfig(name=REQ_STREAM, subjects=["dsec.req.>"], retention=api.RetentionPolicy.WORK_QUEUE,
                         max_age=HOUR, **common),
        api.StreamConfig(name=NODE_STREAM, subjects=["dsec.node.>", "dsec.pool.>"],
                         retention=api.RetentionPolicy.WORK_QUEUE, max_age=HOUR, **common),
        api.StreamConfig(name=OUT_STREAM, subjects=["dsec.out.>"], retention=api.RetentionPolicy.LIMITS,
                         max_age=ret.output_max_age, max_bytes=ret.output_max_bytes,
                         discard=api.DiscardPolicy.OLD, **common),
        api.StreamConfig(name=EVT_STREAM, subjects=["dsec.evt.>"], retention=api.RetentionPolicy.LIMITS,
                         max_age=ret.events_max_age, **common),
    ]


def kv_configs(ret: Retention, replicas: int = 1) -> list[api.KeyValueConfig]:
    """The KV buckets: node inventory (TTL = heartbeat), sandbox states, image versions."""
    return [
        api.KeyValueConfig(bucket=NODES_KV, history=1, ttl=NODE_HEARTBEAT_TTL, replicas=replicas),
        api.KeyValueConfig(bucket=SANDBOXES_KV, history=1, ttl=ret.sandboxes_max_age, replicas=replicas),
        api.KeyValueConfig(bucket=IMAGES_KV, history=64, replicas=replicas),
    ]


def object_configs(replicas: int = 1) -> list[api.ObjectStoreConfig]:
    """The object stores: EROFS layers."""
    return [api.ObjectStoreConfig(bucket=LAYERS_OBJ, replicas=replicas)]


def _pull(durable: str, filter_subject: str, ack_wait: float) -> api.ConsumerConfig:
    return api.ConsumerConfig(durable_name=durable, filter_subject=filter_subject,
                              ack_policy=api.AckPolicy.EXPLICIT, ack_wait=ack_wait,
                              max_deliver=MAX_DELIVER, max_ack_pending=10_000, max_waiting=512,
                              deliver_policy=api.DeliverPolicy.ALL)


def placement_consumer() -> tuple[str, api.ConsumerConfig]:
    """The one durable pull consumer all placement engines share."""
    return REQ_STREAM, _pull(PLACEMENT_CONSUMER, subjects.CREATE_REQUESTS, ack_wait=ACK_WAIT)


def edge_create_consumer(node: str) -> tuple[str, api.ConsumerConfig]:
    """An edge's create lane: only its own subject."""
    return NODE_STREAM, _pull(f"edge-{node}-create", subjects.node_create(node), ack_wait=ACK_WAIT)


def edge_ops_consumer(node: str) -> tuple[str, api.ConsumerConfig]:
    """An edge's op lane (exec, destroy, files): apart from creates, so a full node still serves execs."""
    return NODE_STREAM, _pull(f"edge-{node}-ops", subjects.node_ops_all(node), ack_wait=ACK_WAIT)

"""Bring stored state of an earlier version to the current layout, at provisioning; idempotent, and safe to
run from several processes at once (each move is create-if-absent, then delete)."""
from __future__ import annotations

import logging

import msgspec

from bus import streams, subjects
from bus.errors import BusError

log = logging.getLogger(__name__)


async def record_keys(bus) -> int:
    """Sandbox and snapshot records stored under their bare id move to <tenant>.<id> (the layout a reader,
    and a server permission, can take one tenant's records from). Returns how many moved."""
    moved = 0
    for bucket in (streams.SANDBOXES_KV, streams.SNAPSHOTS_KV):
        for key, raw in await bus.kv_items(bucket):
            if "." in key:
                continue
            try:
                tenant = msgspec.json.decode(raw).get("tenant") or "default"
            except (msgspec.DecodeError, AttributeError):
                continue   # junk stays where it is (readers skip it)
            if not subjects.is_token(tenant):
                continue
            new = subjects.record_key(tenant, key)
            try:
                value, revision = await bus.kv_entry(bucket, new)
                if value is None:   # absent, or a tombstone (a claim freed under the new key): take its place
                    await bus.kv_cas(bucket, new, raw, revision)
                value, _ = await bus.kv_entry(bucket, new)
                if value is not None:   # the new key holds a live record (this one, or a newer write): done
                    await bus.kv_delete(bucket, key)
                    moved += 1
            except BusError as exc:
                log.warning("moving %s/%s to its tenant's key failed: %s", bucket, key, exc)
    if moved:
        log.info("moved %d records to <tenant>.<id> keys", moved)
    return moved

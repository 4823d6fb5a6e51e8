"""Provisioning: every stream, KV bucket and object store DSec uses, made or brought up to date (a mixin of
bus.conn.Bus)."""
from __future__ import annotations

import nats.js.errors
from nats.js import api

from bus import migrations, streams
from bus.errors import BusError
from bus.nats_errors import mapped_errors


class Provisioning:
    """Bus.provision."""

    async def provision(self, retention: streams.Retention | None = None, replicas: int = 1) -> None:
        """Create or update every stream, KV bucket and object store; safe to run any number of times.
        Existing limit streams keep their ages and sizes unless a retention is given (`dsec up` gives one; an
        edge or engine joining provisions without, so it never undoes the operator's choice)."""
        ret = retention or streams.Retention()
        for stream, durable in streams.LEGACY_CONSUMERS:
            try:
                await self.delete_consumer(stream, durable)
            except BusError:
                pass   # no such stream yet
        for cfg in streams.stream_configs(ret, replicas):
            with mapped_errors(f"stream {cfg.name}"):
                # one that exists is looked at first: a create of it, even as it is, and an update to the same
                # bound are refused when the store cannot reserve its bound a second time (nats-server #3321)
                try:
                    have = (await self.admin.stream_info(cfg.name)).config
                except nats.js.errors.NotFoundError:
                    try:
                        await self.admin.add_stream(cfg)
                        continue
                    except nats.js.errors.BadRequestError:   # made meanwhile (by an edge joining)
                        have = (await self.admin.stream_info(cfg.name)).config
                # bring limits up to date, but never scale a replicated stream down (an edge joining a cluster
                # provisions too)
                cfg.num_replicas = max(cfg.num_replicas or 1, have.num_replicas or 1)
                if retention is None and cfg.retention != api.RetentionPolicy.WORK_QUEUE:   # (lanes: ours)
                    # the operator's age and bound stay; a stream made before it had a bound takes the default
                    cfg.max_age = have.max_age
                    cfg.max_bytes = have.max_bytes if (have.max_bytes or -1) > 0 else cfg.max_bytes
                if _differs(cfg, have):
                    await self.admin.update_stream(cfg)
        for kcfg in streams.kv_configs(ret, replicas):
            with mapped_errors(f"kv {kcfg.bucket}"):
                try:
                    await self.admin.create_key_value(kcfg)
                except nats.js.errors.BadRequestError:   # exists: keep it, but bring its TTL up to date
                    have = (await self.admin.stream_info(f"KV_{kcfg.bucket}")).config
                    if (have.max_age or 0) != (kcfg.ttl or 0):
                        have.max_age = kcfg.ttl
                        await self.admin.update_stream(have)
        for ocfg in streams.object_configs(replicas):
            with mapped_errors(f"object store {ocfg.bucket}"):
                try:
                    await self.admin.create_object_store(ocfg.bucket, config=ocfg)
                except nats.js.errors.BadRequestError:
                    await self.admin.object_store(ocfg.bucket)
        await migrations.record_keys(self)


def _differs(want: api.StreamConfig, have: api.StreamConfig) -> bool:
    """Whether a stream's config lacks what provisioning sets."""
    return any(getattr(want, f) != getattr(have, f) for f in (
        "subjects", "retention", "max_age", "max_bytes", "discard", "num_replicas", "max_msg_size", "duplicate_window",
        "storage"))

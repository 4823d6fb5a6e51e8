"""Provisioning: every stream, KV bucket and object store DSec uses, made or brought up to date (a mixin of
bus.conn.Bus)."""
from __future__ import annotations

import asyncio
import time

import nats.js.errors
from nats.js import api

from bus import migrations, streams
from bus.errors import BusError
from bus.nats_errors import mapped_errors, timed_out


PROVISION_WAIT = 30.0   # seconds provisioning waits for the server to answer for each stream (leaders elected)


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
            await self._patiently(f"stream {cfg.name}", lambda cfg=cfg: self._stream(cfg, retention))
        for kcfg in streams.kv_configs(ret, replicas):
            await self._patiently(f"kv {kcfg.bucket}", lambda kcfg=kcfg: self._bucket(kcfg))
        for ocfg in streams.object_configs(replicas):
            await self._patiently(f"object store {ocfg.bucket}", lambda ocfg=ocfg: self._objects(ocfg))
        await migrations.record_keys(self)

    async def _patiently(self, what: str, make):
        """make() until the server answers it, for PROVISION_WAIT seconds: after a cluster's restart its
        streams' leaders are elected seconds after the meta leader, and one try each left `dsec up --servers 3`
        unable to start again on its own state ("stream DSEC_EVT: NATS did not answer in time", helper F3)."""
        give_up, delay = time.monotonic() + PROVISION_WAIT, 0.25
        while True:
            try:
                with mapped_errors(what):
                    return await make()
            except BusError as exc:
                if not _unanswered(exc) or time.monotonic() + delay >= give_up:
                    raise
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)

    async def _stream(self, cfg: api.StreamConfig, retention: streams.Retention | None) -> None:
        # one that exists is looked at first: a create of it, even as it is, and an update to the same
        # bound are refused when the store cannot reserve its bound a second time (nats-server #3321)
        try:
            have = (await self.admin.stream_info(cfg.name)).config
        except nats.js.errors.NotFoundError:
            try:
                await self.admin.add_stream(cfg)
                return
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

    async def _bucket(self, kcfg) -> None:
        try:
            await self.admin.create_key_value(kcfg)
        except nats.js.errors.BadRequestError:   # exists: keep it, but bring its TTL up to date
            have = (await self.admin.stream_info(f"KV_{kcfg.bucket}")).config
            if (have.max_age or 0) != (kcfg.ttl or 0):
                have.max_age = kcfg.ttl
                await self.admin.update_stream(have)

    async def _objects(self, ocfg) -> None:
        try:
            await self.admin.create_object_store(ocfg.bucket, config=ocfg)
        except nats.js.errors.BadRequestError:
            await self.admin.object_store(ocfg.bucket)


def _unanswered(exc: BusError) -> bool:
    """A request nobody answered in time (no stream leader yet), or JetStream saying it is not ready: not a
    refusal. (No responders at all, JetStream off, is a refusal: raised at once.)"""
    return timed_out(exc) or isinstance(exc.__cause__, nats.js.errors.ServiceUnavailableError)


def _differs(want: api.StreamConfig, have: api.StreamConfig) -> bool:
    """Whether a stream's config lacks what provisioning sets."""
    return any(getattr(want, f) != getattr(have, f) for f in (
        "subjects", "retention", "max_age", "max_bytes", "discard", "num_replicas", "max_msg_size", "duplicate_window",
        "storage"))

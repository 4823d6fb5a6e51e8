"""The placement engine: pulls create requests from the shared durable consumer and routes each to a node."""
from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from bus import streams, subjects
from bus.conn import Bus, kv_watch
from bus.errors import CapacityUnavailable, DsecError, RequestExpired
from bus.messages import (CreateRequest, ErrorReply, Event, Queued, create_decoder, encode,
                          node_decoder, salvage)
from bus.pull import Delivery, Verdict
from placement import admission, scoring
from placement.images import ImageRegistry

log = logging.getLogger(__name__)

WAIT_RETRY = 0.25   # seconds between tries while no live node exists yet


class PlacementEngine:
    """One engine; any number may run against the same consumer."""

    def __init__(self, bus: Bus, *, max_in_flight: int = 64) -> None:
        self.bus = bus
        self.images = ImageRegistry(bus)
        self.nodes: dict[str, scoring.NodeView] = {}
        self.max_in_flight = max_in_flight
        self._worker = None
        self._watch: asyncio.Task | None = None
        self.placed = 0
        self.rejected = 0

    async def start(self) -> None:
        """Watch the node inventory, then start pulling requests."""
        self._watch = await kv_watch(self.bus, streams.NODES_KV, self._on_node)
        self._worker = await self.bus.pull_worker(streams.placement_consumer(), self._handle,
                                                  credit=lambda: self.max_in_flight)

    async def stop(self) -> None:
        """Stop pulling; requests in flight finish."""
        if self._worker:
            await self._worker.stop()
        if self._watch:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)

    def _on_node(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.nodes.pop(key, None)
            return
        try:
            info = node_decoder.decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return    # junk in the inventory is skipped, never fatal
        if info.node != key:
            return    # an entry must describe the node it is filed under, or creates go nowhere
        self.nodes[key] = scoring.NodeView(info)

    async def _reply(self, reply_to: str, msg) -> None:
        if subjects.is_reply_subject(reply_to):
            try:
                await self.bus.send(reply_to, msg)
            except DsecError as exc:
                log.warning("reply to %s lost: %s", reply_to, exc)

    async def _reject(self, req: CreateRequest, err: DsecError) -> Verdict:
        self.rejected += 1
        await self._reply(req.reply_to, ErrorReply(request_id=req.request_id, code=err.code, message=str(err)))
        try:
            subjects.token(req.sandbox_id, "sandbox_id"), subjects.token(req.tenant, "tenant")
            await self.bus.send(subjects.event(req.tenant, req.sandbox_id),
                                Event(type="rejected", sandbox_id=req.sandbox_id, tenant=req.tenant,
                                      request_id=req.request_id, at=time.time(), detail=str(err)))
        except (DsecError, ValueError):
            pass   # no valid subject to file the event under, or the bus hiccuped: the reply was sent
        return Verdict.ACK

    async def _handle(self, d: Delivery) -> Verdict:
        try:
            req = create_decoder.decode(d.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            env = salvage(d.data)
            await self._reply(env.reply_to, ErrorReply(request_id=env.request_id, code="invalid_request",
                                                       message=f"bad create request: {exc}"))
            return Verdict.TERM
        try:
            admission.check_create(req)
            if admission.expired(req.deadline):
                raise RequestExpired("create request expired before it was placed")
            layers = await self.images.resolve(req.image)
            node, can_fit = scoring.pick(self.nodes, req.resources)
            if node is None and not can_fit:
                raise CapacityUnavailable(f"no node can ever fit resources {msgspec.structs.asdict(req.resources)}")
        except DsecError as err:
            return await self._reject(req, err)
        if node is None:
            if d.num_delivered == 1:
                await self._reply(req.reply_to, Queued(request_id=req.request_id, reason="no live node"))
            d.nak_delay = WAIT_RETRY
            return Verdict.NAK
        placed = msgspec.structs.replace(req, node=node, layers=layers)
        await self.bus.publish(subjects.node_create(node), encode(placed), msg_id=req.request_id)
        self.placed += 1
        return Verdict.ACK

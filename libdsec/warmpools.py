"""Warm pools from the SDK: set, list and delete the settings in KV dsec-warm-pools (every edge of the
node pool watches them), and count the ready sandboxes the edges report in their node records."""
from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from bus import streams
from bus.conn import Bus
from bus.errors import DsecError, InvalidRequest
from bus.messages import WarmPool, node_decoder, pool_key, warm_pool_decoder
from libdsec.resources import Resources
from bus.validate import check_warm_pool
from bus.images import ImageRegistry


@dataclass(frozen=True)
class WarmPoolStatus:
    """A pool's settings and how many sandboxes are ready for it now, per node."""

    spec: WarmPool
    ready: dict[str, int]      # node -> ready warm sandboxes
    error: str = ""            # why its layers do not resolve now, if they do not

    @property
    def total(self) -> int:
        """Ready on all nodes."""
        return sum(self.ready.values())


async def set_pool(bus: Bus, name: str, image: str, workspace: str | None, toolkit: str | None,
                   resources: Resources | None, min: int, max: int, node_pool: str,
                   backend: str = "container") -> WarmPool:
    """Create or change a pool; its layers must resolve now (ImageNotFound otherwise), its kind must keep
    warm sandboxes (Unsupported otherwise)."""
    spec = WarmPool(name=name, image=image, workspace=workspace or "", toolkit=toolkit or "", backend=backend,
                    resources=(resources or Resources()).to_wire(), min=int(min), max=int(max), node_pool=node_pool,
                    updated_at=time.time())
    check_warm_pool(spec)
    await ImageRegistry(bus).compose(spec.image, spec.workspace, spec.toolkit)
    await bus.kv_put(streams.WARM_POOLS_KV, name, spec)
    return spec


async def delete_pool(bus: Bus, name: str) -> None:
    """Remove a pool: every edge destroys its ready sandboxes (claimed ones live on)."""
    if await bus.kv_get(streams.WARM_POOLS_KV, name) is None:
        raise InvalidRequest(f"no warm pool named {name!r}")
    await bus.kv_delete(streams.WARM_POOLS_KV, name)


async def pools(bus: Bus) -> list[WarmPoolStatus]:
    """Every pool, by name, with its ready sandboxes per node."""
    nodes = []
    for _, raw in await bus.kv_items(streams.NODES_KV):
        try:
            nodes.append(node_decoder.decode(raw))
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    out = []
    registry = ImageRegistry(bus)
    for _, raw in await bus.kv_items(streams.WARM_POOLS_KV):
        try:
            spec = warm_pool_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        try:
            layers = await registry.compose(spec.image, spec.workspace, spec.toolkit)
            key, error = pool_key(layers, spec.resources, spec.backend), ""
        except DsecError as exc:
            key, error = "", str(exc)
        ready = {n.node: n.warm.get(key, 0) for n in nodes if n.pool == spec.node_pool and not n.lost}
        out.append(WarmPoolStatus(spec, ready, error))
    return sorted(out, key=lambda s: s.spec.name)

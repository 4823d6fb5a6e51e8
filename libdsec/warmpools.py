"""Warm pools from the SDK: the settings sent to the control API (placement/warmpools.py serves them) and
the status it returns."""
from __future__ import annotations

import time
from dataclasses import dataclass

from bus.records import WarmPool
from bus.validate import check_warm_pool
from libdsec.resources import Resources


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


def spec(name: str, image: str, workspace: str | None, toolkit: str | None, resources: Resources | None,
         min: int, max: int, node_pool: str, backend: str = "container") -> WarmPool:
    """A pool's settings, range-checked here (InvalidRequest before anything is sent) and again by the server."""
    out = WarmPool(name=name, image=image, workspace=workspace or "", toolkit=toolkit or "", backend=backend,
                   resources=Resources.of(resources).to_wire(), min=int(min), max=int(max), node_pool=node_pool,
                   updated_at=time.time())
    check_warm_pool(out)
    return out

"""The node's layer cache: fetch a layer from the object store on first use, verify its digest, keep it."""
from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

from bus import streams, subjects
from bus.conn import Bus
from bus.errors import BusError, EnvironmentFailure
from bus.messages import LayerRef


class LayerCache:
    """Local EROFS files by digest; concurrent first uses of one layer fetch it once."""

    def __init__(self, bus: Bus, root: Path) -> None:
        self.bus = bus
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._fetching: dict[str, asyncio.Future] = {}
        self.hits = 0
        self.misses = 0
        self.bytes_fetched = 0

    def path(self, layer: LayerRef) -> Path:
        """Where a layer's file lives on this node."""
        return self.root / (layer.digest.replace(":", "-") + ".erofs")

    async def ensure(self, layers: list[LayerRef]) -> list[str]:
        """Local paths of the layers (lowest first), fetching any that are missing."""
        return [str(await self._one(layer)) for layer in layers]

    async def _one(self, layer: LayerRef) -> Path:
        if not subjects.is_digest(layer.digest):
            raise EnvironmentFailure(f"layer {layer.name}@{layer.version} has an invalid digest")
        path = self.path(layer)
        if path.exists():
            self.hits += 1
            return path
        fut = self._fetching.get(layer.digest)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._fetching[layer.digest] = fut
            try:
                await self._fetch(layer, path)
                fut.set_result(path)
            except BaseException as exc:
                fut.set_exception(exc)
                fut.exception()   # retrieved: waiters re-raise it
                raise
            finally:
                del self._fetching[layer.digest]
        return await asyncio.shield(fut)

    def adopt(self, layer: LayerRef, file: Path) -> None:
        """Keep a layer made on this node (a snapshot) as if fetched: move its file into the cache."""
        path = self.path(layer)
        if not path.exists():
            os.replace(file, path)

    def evict(self, layers: list[LayerRef]) -> None:
        """Drop these layers' files (one would not mount): the next use fetches and verifies them again.
        Mounts made from them before keep their open file."""
        for layer in layers:
            if subjects.is_digest(layer.digest):
                self.path(layer).unlink(missing_ok=True)

    async def _fetch(self, layer: LayerRef, path: Path) -> None:
        self.misses += 1
        try:
            data = await self.bus.obj_get(streams.LAYERS_OBJ, layer.digest)
        except BusError as exc:
            raise EnvironmentFailure(f"layer {layer.name}@{layer.version} could not be fetched: {exc}") from exc
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if digest != layer.digest:
            raise EnvironmentFailure(f"layer {layer.name}@{layer.version} is corrupt (digest mismatch)")
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        await asyncio.to_thread(tmp.write_bytes, data)
        os.replace(tmp, path)
        self.bytes_fetched += len(data)

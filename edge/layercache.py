"""The node's layer cache: fetch a layer from the object store on first use, verify its digest, keep it."""
from __future__ import annotations

import asyncio
import collections
import itertools
import os
import time
from pathlib import Path
from typing import Callable

from bus import chunks, streams, subjects
from bus.conn import Bus
from bus.errors import BusError, EnvironmentFailure
from bus.messages import LayerRef
from edge.erofs import file_digest
from edge.lazylayers import LazyLayers, link_into


KEEP_RECENT = 60.0   # seconds a layer just used is never evicted (a create may be about to mount it)


class LayerCache:
    """Local EROFS files by digest; concurrent first uses of one layer fetch it once. Past max_bytes,
    the least recently used layers that no running sandbox uses are dropped (fetched again if needed)."""

    def __init__(self, bus: Bus, root: Path, max_bytes: int = 0,
                 in_use: Callable[[], set[str]] = lambda: set(), on_change: Callable[[], None] = lambda: None,
                 lazy: bool = False, lazy_fill: bool = True) -> None:
        self.bus = bus
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes   # 0: no cap
        self.in_use = in_use         # digests running sandboxes use
        self.on_change = on_change   # a layer came or went (the node record lists what it holds)
        self._fetching: dict[str, asyncio.Future] = {}
        self._dropped: set[str] = set()   # deleted layers whose file goes once no sandbox uses it
        self._lru: collections.OrderedDict[Path, tuple[int, float]] = collections.OrderedDict()  # size, last use
        for f in sorted(self.root.glob("*.erofs"), key=lambda f: f.stat().st_mtime):   # kept across restarts
            self._lru[f] = (f.stat().st_size, 0.0)
        self.hits = 0
        self.misses = 0
        self.whole_bytes = 0
        self.evictions = 0
        # layers not held yet served from their chunks as read (issue 17, part B); None: fetched whole
        self.lazy = LazyLayers(bus, self.root / "lazy", lazy_fill, self._completed) if lazy else None

    @property
    def bytes_fetched(self) -> int:
        """Bytes fetched from the object store: whole layers and lazy layers' chunks."""
        return self.whole_bytes + (self.lazy.bytes_fetched if self.lazy is not None else 0)

    def faults_since(self, digests: list[str], since: float) -> list[str]:
        """Chunk failures of these layers (served lazily) since time.monotonic() `since`."""
        return self.lazy.faults_since(digests, since) if self.lazy is not None else []

    def reconcile(self) -> None:
        """At start: unmount what a dead run's lazy layers left."""
        if self.lazy is not None:
            self.lazy.reconcile()

    async def stop(self) -> None:
        if self.lazy is not None:
            await self.lazy.stop()

    def _completed(self, digest: str, data: Path) -> None:
        """A lazy layer is whole and matches its digest: later sandboxes mount it from the cache directly."""
        path = self._path_of(digest)
        if not path.exists():
            link_into(data, path)
            self._used(path)
            self.on_change()

    @property
    def size(self) -> int:
        """Bytes of layers held."""
        return sum(size for size, _ in self._lru.values())

    def _used(self, path: Path) -> None:
        size = self._lru[path][0] if path in self._lru else path.stat().st_size   # no stat on a hit
        self._lru[path] = (size, time.monotonic())
        self._lru.move_to_end(path)

    def _trim(self) -> None:
        """Drop least recently used layers nobody runs on until under the cap (or none can go)."""
        if not self.max_bytes:
            return
        total, busy, now = self.size, self.in_use(), time.monotonic()
        for path, (size, last) in list(self._lru.items()):
            if total <= self.max_bytes:
                return
            digest = path.name.removesuffix(".erofs").replace("-", ":", 1)
            if digest in busy or digest in self._fetching or now - last < KEEP_RECENT:
                continue
            path.unlink(missing_ok=True)
            del self._lru[path]
            total -= size
            self.evictions += 1

    def held(self, n: int = 64) -> list[str]:
        """layer_mark of the n most recently used layers held (for the node record: placement prefers
        a node that needs no fetch)."""
        return [path.name.removesuffix(".erofs").rpartition("-")[2][:16]
                for path in itertools.islice(reversed(self._lru), n)]

    def path(self, layer: LayerRef) -> Path:
        """Where a layer's file lives on this node."""
        return self._path_of(layer.digest)

    def _path_of(self, digest: str) -> Path:
        return self.root / (digest.replace(":", "-") + ".erofs")

    async def ensure(self, layers: list[LayerRef]) -> list[str]:
        """Local paths of the layers (lowest first), fetching any that are missing."""
        return [str(await self._one(layer)) for layer in layers]

    async def _one(self, layer: LayerRef) -> Path:
        if not subjects.is_digest(layer.digest):
            raise EnvironmentFailure(f"layer {layer.name}@{layer.version} has an invalid digest")
        path = self.path(layer)
        if path.exists():
            self.hits += 1
            self._used(path)
            return path
        if self.lazy is not None:
            served = self.lazy.layers.get(layer.digest)
            if served is not None and served.ready is not None and served.ready.done() and not served.ready.exception():
                self.hits += 1
                return served.file
            manifest = await chunks.manifest(self.bus, layer.digest)
            if manifest is not None and (not layer.size or manifest.size == layer.size):
                self.misses += served is None
                return await self.lazy.open(layer, manifest)
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
            self._used(path)
            self._trim()
            self.on_change()

    def drop(self, digest: str) -> bool:
        """A deleted snapshot's layer: its file goes now, or when the last sandbox using it ends (sweep)."""
        if not subjects.is_digest(digest):
            return False
        self._dropped.add(digest)
        return self.sweep() > 0

    def sweep(self) -> int:
        """Remove the files of dropped layers no sandbox uses (a sandbox just ended); how many went."""
        if not self._dropped:
            return 0
        busy, gone = self.in_use(), 0
        for digest in [d for d in self._dropped if d not in busy and d not in self._fetching]:
            self._dropped.discard(digest)
            path = self._path_of(digest)
            if path.exists() or path in self._lru:
                path.unlink(missing_ok=True)
                self._lru.pop(path, None)
                gone += 1
        if gone:
            self.on_change()
        return gone

    def evict(self, layers: list[LayerRef]) -> None:
        """Drop these layers' files (one would not mount): the next use fetches and verifies them again.
        Mounts made from them before keep their open file."""
        for layer in layers:
            if subjects.is_digest(layer.digest):
                self.path(layer).unlink(missing_ok=True)
                self._lru.pop(self.path(layer), None)

    async def _fetch(self, layer: LayerRef, path: Path) -> None:
        self.misses += 1
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            try:   # into a file, a chunk at a time: a layer is never held whole in memory
                await self.bus.obj_get_file(streams.LAYERS_OBJ, layer.digest, tmp)
            except BusError as exc:
                raise EnvironmentFailure(f"layer {layer.name}@{layer.version} could not be fetched: {exc}") from exc
            if await asyncio.to_thread(file_digest, tmp) != layer.digest:
                raise EnvironmentFailure(f"layer {layer.name}@{layer.version} is corrupt (digest mismatch)")
            size = tmp.stat().st_size
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self.whole_bytes += size
        self._used(path)
        self._trim()
        self.on_change()

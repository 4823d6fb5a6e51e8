"""The image registry: named, versioned EROFS layers recorded in KV dsec-images, bytes in object store dsec-layers."""
from __future__ import annotations

import re
import time
from pathlib import Path

import msgspec

from bus import streams, subjects
from bus.conn import Bus
from bus.errors import ImageNotFound, InvalidRequest
from bus.messages import ImageRecord, LayerRef, image_decoder

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


def parse_ref(ref: str) -> tuple[str, int | None]:
    """'name' or 'name@version' -> (name, version or None); InvalidRequest naming `image` otherwise."""
    name, _, ver = ref.partition("@")
    if not _NAME.match(name):
        raise InvalidRequest(f"image: {ref!r} is not a valid image name (lowercase letters, digits, - and _)")
    if not ver:
        return name, None
    if not ver.isdigit() or int(ver) < 1:
        raise InvalidRequest(f"image: version in {ref!r} must be a positive integer")
    return name, int(ver)


class ImageRegistry:
    """Resolve, publish and list images."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._cache: dict[str, tuple[float, LayerRef]] = {}

    async def _record(self, key: str) -> ImageRecord | None:
        raw = await self.bus.kv_get(streams.IMAGES_KV, key)
        if raw is None:
            return None
        try:
            return image_decoder.decode(raw)
        except msgspec.DecodeError:
            return None   # junk in the bucket never blocks resolution: treat as absent

    async def resolve(self, ref: str, cache_for: float = 2.0) -> list[LayerRef]:
        """The layers (lowest first) of an image reference; ImageNotFound when it is not stored."""
        name, version = parse_ref(ref)
        hit = self._cache.get(ref)
        if hit and time.monotonic() - hit[0] < cache_for:
            return [hit[1]]
        rec = await self._record(name if version is None else f"{name}.{version}")
        if rec is None and version is None:
            rec = await self._latest_version(name)   # the latest pointer is missing or junk: scan versions
        if rec is None or not subjects.is_digest(rec.digest):
            raise ImageNotFound(f"image {ref!r} not found (see `dsec image ls`)")
        layer = LayerRef(name=rec.name, version=rec.version, digest=rec.digest, size=rec.size)
        self._cache[ref] = (time.monotonic(), layer)
        return [layer]

    async def _latest_version(self, name: str) -> ImageRecord | None:
        versions = [r for r in await self.list() if r.name == name]
        return versions[-1] if versions else None

    async def publish(self, name: str, layer_file: Path, digest: str,
                      kind: str = "base") -> ImageRecord:
        """Store a packed layer file as the next version of `name`."""
        parse_ref(name)
        latest = await self._record(name) or await self._latest_version(name)
        version = (latest.version if latest else 0) + 1
        data = Path(layer_file).read_bytes()
        await self.bus.obj_put(streams.LAYERS_OBJ, digest, data)
        rec = ImageRecord(name=name, version=version, layer_kind=kind, digest=digest, size=len(data),
                          created_at=time.time())
        await self.bus.kv_put(streams.IMAGES_KV, f"{name}.{version}", rec)
        await self.bus.kv_put(streams.IMAGES_KV, name, rec)
        return rec

    async def list(self) -> list[ImageRecord]:
        """Every stored version, by name then version; undecodable entries are skipped."""
        out = []
        for key, raw in await self.bus.kv_items(streams.IMAGES_KV):
            if "." not in key:
                continue
            try:
                out.append(image_decoder.decode(raw))
            except msgspec.DecodeError:
                continue
        return sorted(out, key=lambda r: (r.name, r.version))

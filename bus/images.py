"""The image registry: named, versioned EROFS layers recorded in KV dsec-images, bytes in object store dsec-layers."""
from __future__ import annotations

import re
import time
from pathlib import Path

import msgspec

from bus import chunks, streams, subjects
from bus.conn import Bus
from bus.errors import ImageNotFound, InvalidRequest
from bus.messages import LayerRef, encode
from bus.records import ImageConfig, ImageRecord, SnapshotRecord, image_decoder, snapshot_decoder

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


def _decoded(raw: bytes | None) -> ImageRecord | None:
    try:
        return image_decoder.decode(raw) if raw is not None else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class ImageRegistry:
    """Resolve, publish and list images."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._cache: dict[str, tuple[float, ImageRecord]] = {}

    def on_change(self, key: str, raw: bytes | None, revision: int) -> None:
        """KV watch callback: a new, changed or removed version is seen by the next resolve at once."""
        name = key.split(".", 1)[0]
        for ref in [r for r in self._cache if r.partition("@")[0] == name]:
            del self._cache[ref]

    async def _record(self, key: str) -> ImageRecord | None:
        raw = await self.bus.kv_get(streams.IMAGES_KV, key)
        if raw is None:
            return None
        try:
            return image_decoder.decode(raw)
        except msgspec.DecodeError:
            return None   # junk in the bucket never blocks resolution: treat as absent

    async def resolve(self, ref: str, cache_for: float = 5.0, kind: str = "base") -> list[LayerRef]:
        """The layer of a reference to a `kind` layer (base, workspace, toolkit); ImageNotFound when it is
        not stored, InvalidRequest when it is a layer of another kind."""
        rec = await self.lookup(ref, cache_for, kind)
        return [LayerRef(name=rec.name, version=rec.version, digest=rec.digest, size=rec.size)]

    async def config(self, ref: str, cache_for: float = 5.0) -> ImageConfig:
        """A base image's defaults (its OCI config when imported; empty for a built one)."""
        return (await self.lookup(ref, cache_for)).config

    async def lookup(self, ref: str, cache_for: float = 5.0, kind: str = "base") -> ImageRecord:
        """The record a reference names (cached for cache_for seconds; see resolve)."""
        name, version = parse_ref(ref)
        hit = self._cache.get(ref)
        if hit and time.monotonic() - hit[0] < cache_for:
            rec = hit[1]
        else:
            rec = await self._record(name if version is None else f"{name}.{version}")
            if rec is None and version is None:
                rec = await self._latest_version(name)   # the latest pointer is missing or junk: scan versions
            if rec is None or not subjects.is_digest(rec.digest):
                raise ImageNotFound(f"{kind} {ref!r} not found (see `dsec image ls`)")
            self._cache[ref] = (time.monotonic(), rec)
        if rec.layer_kind != kind:
            raise InvalidRequest(f"{ref!r} is a {rec.layer_kind} layer, not a {kind} one")
        return rec

    async def snapshot(self, snapshot_id: str, tenant: str) -> SnapshotRecord:
        """A tenant's snapshot record; ImageNotFound when absent (or another tenant's)."""
        raw = (await self.bus.kv_get(streams.SNAPSHOTS_KV, subjects.record_key(tenant, snapshot_id))
               if subjects.is_token(snapshot_id) and subjects.is_token(tenant) else None)
        try:
            rec = snapshot_decoder.decode(raw) if raw is not None else None
        except (msgspec.DecodeError, msgspec.ValidationError):
            rec = None
        if rec is None or rec.tenant != tenant or not all(subjects.is_digest(la.digest) for la in rec.layers):
            raise ImageNotFound(f"snapshot {snapshot_id!r} not found")
        return rec

    async def compose(self, image: str, workspace: str = "", toolkit: str = "") -> list[LayerRef]:
        """A sandbox's layers, lowest first: the base image, then its workspace and toolkit when given."""
        layers = await self.resolve(image)
        if workspace:
            layers += await self.resolve(workspace, kind="workspace")
        if toolkit:
            layers += await self.resolve(toolkit, kind="toolkit")
        return layers

    async def _latest_version(self, name: str) -> ImageRecord | None:
        versions = [r for r in await self.list() if r.name == name]
        return versions[-1] if versions else None

    async def publish(self, name: str, layer_file: Path, digest: str, kind: str = "base",
                      config: ImageConfig = ImageConfig()) -> tuple[ImageRecord, bool]:
        """Store a packed layer file as the next version of `name`: (its record, whether it is new). A
        layer identical to the latest version, with the same config, is not stored again (same record,
        False); bytes already in the object store under their digest (content-addressed) are not uploaded
        again."""
        parse_ref(name)
        size = Path(layer_file).stat().st_size
        probe = encode(ImageRecord(name=name, version=1 << 40, layer_kind=kind, digest=digest, size=size,
                                   created_at=time.time(), config=config))
        limit = getattr(self.bus.nc, "max_payload", 0)
        if limit and len(probe) + 256 > limit:   # (refused before its bytes are uploaded, not after: helper I)
            raise InvalidRequest(f"{name}: the image's config (env, entrypoint, cmd) makes a record of {len(probe):,} "
                                 f"bytes, more than the bus takes ({limit:,})")
        uploaded = False
        version = 0
        for _ in range(64):
            raw, revision = await self.bus.kv_entry(streams.IMAGES_KV, name)   # the latest pointer: compare-and-set
            latest = _decoded(raw) or await self._latest_version(name)
            if latest is not None and latest.layer_kind != kind:
                raise InvalidRequest(f"{name} is a {latest.layer_kind} layer: a new version cannot be a {kind} one")
            if latest is not None and latest.digest == digest and latest.config == config:
                return latest, False
            version = max(version, latest.version if latest else 0) + 1
            if not uploaded:   # (once: content-addressed, so a publisher that lost a race uploaded nothing new)
                if not await self.bus.obj_has(streams.LAYERS_OBJ, digest):
                    await self.bus.obj_put_file(streams.LAYERS_OBJ, digest, layer_file)   # a chunk at a time
                if not await self.bus.obj_has(streams.LAYERS_OBJ, chunks.manifest_name(digest)):
                    await chunks.publish(self.bus, Path(layer_file), digest)   # for nodes that load it lazily
                uploaded = True
            rec = ImageRecord(name=name, version=version, layer_kind=kind, digest=digest, size=size,
                              created_at=time.time(), config=config)
            taken, at = await self.bus.kv_entry(streams.IMAGES_KV, f"{name}.{version}")
            if taken is not None:   # (a record there, even one that does not decode: never written over)
                continue
            if await self.bus.kv_cas(streams.IMAGES_KV, f"{name}.{version}", encode(rec), at) is None:
                continue            # another publisher took this version first: the next one
            if await self.bus.kv_cas(streams.IMAGES_KV, name, encode(rec), revision) is None:
                await self.bus.kv_update(streams.IMAGES_KV, name, lambda cur: None if (
                    (now := _decoded(cur)) is not None and now.version > version) else encode(rec))
            return rec, True
        raise InvalidRequest(f"{name}: could not take a version after 64 tries (publishers racing)")

    async def remove(self, ref: str, in_use: dict[str, str]) -> ImageRecord:
        """Remove one version (name@version); refused while a live sandbox uses its layer (digests in
        in_use, each with who uses it, said in the refusal). Its bytes go when no other version holds the
        same digest."""
        name, version = parse_ref(ref)
        if version is None:
            raise InvalidRequest(f"image rm takes NAME@VERSION, got {ref!r}")
        rec = await self._record(f"{name}.{version}")
        if rec is None:
            raise ImageNotFound(f"{ref!r} not found (see `dsec image ls`)")
        if rec.digest in in_use:
            raise InvalidRequest(f"{ref} is in use by {in_use[rec.digest]}")
        await self.bus.kv_delete(streams.IMAGES_KV, f"{name}.{version}")
        rest = await self.list()
        if not any(r.digest == rec.digest for r in rest):
            await self.bus.obj_delete(streams.LAYERS_OBJ, rec.digest)
        mine = [r for r in rest if r.name == name]
        if mine:
            await self.bus.kv_put(streams.IMAGES_KV, name, mine[-1])   # latest is the newest version left
        else:
            await self.bus.kv_delete(streams.IMAGES_KV, name)
        self._cache.clear()
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

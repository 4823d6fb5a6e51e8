"""Reading an OCI layout (a directory, or an OCI archive of one) or a `docker save` archive: its layers
(files, lowest first) and its config's defaults (Env, WorkingDir, User, Entrypoint, Cmd). Every field is
checked for its shape as read (a config `User` of 1000, a `Cmd` given as a string, an index of indexes):
a malformed image is refused with one line naming the field, never imported as something else."""
from __future__ import annotations

import hashlib
import json
import os
import tarfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
INDEX_DEPTH = 4   # indexes inside indexes followed at most
MAX_IMAGE_BYTES = 16 << 30          # bytes an image's files may add up to (its layers applied), by default
MAX_ENTRIES = 4_000_000             # tar members an image's layers may hold in all
FREE_RESERVE = 1 << 30              # an import stops before it leaves less than this free where it unpacks


class OciError(Exception):
    """An image could not be imported; the message is one clear line."""


@dataclass
class Image:
    """What an archive holds: its layers (files, lowest first) and its config's defaults."""

    layers: list[Path]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    user: str = ""
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)


class Budget:
    """What applying an image may take: bytes of files (their apparent size: a sparse 16 GiB file counts
    16 GiB), members, and the disk's free space; `stop` (set from another thread: Ctrl-C) ends it between
    two blocks. A decompression bomb of a few kB ends in one line, not a full disk."""

    def __init__(self, max_bytes: int = MAX_IMAGE_BYTES, max_entries: int = MAX_ENTRIES) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.bytes = self.entries = 0
        self.stop = threading.Event()

    def look(self, seen: int) -> None:
        """Between two members of a layer: stopped (Ctrl-C), or past the entries one layer may hold."""
        if self.stop.is_set():
            raise OciError("interrupted")
        if seen > self.max_entries:
            raise OciError(f"the image's layers hold more than {self.max_entries:,} entries")

    def entry(self, size: int) -> None:
        """One more member of size bytes, counted for the whole image."""
        self.entries += 1
        self.bytes += max(0, size)
        self.look(self.entries)
        if self.bytes > self.max_bytes:
            raise OciError(f"the image's files add up to more than {self.max_bytes:,} bytes (--max-size)")

    def room(self, fd: int, size: int) -> None:
        """size more bytes may be written where fd is; else OciError (the disk would fill)."""
        if self.stop.is_set():
            raise OciError("interrupted")
        st = os.fstatvfs(fd)
        if st.f_bavail * st.f_frsize - size < FREE_RESERVE:
            raise OciError(f"the disk it unpacks on would have less than {FREE_RESERVE >> 30} GiB free "
                           f"({st.f_bavail * st.f_frsize:,} bytes free; TMPDIR chooses where it unpacks)")


def _shaped(value, kind: type, what: str):
    """value when it is a kind (None: the kind's empty value); OciError naming the field otherwise."""
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise OciError(f"{what} must be a {'JSON object' if kind is dict else 'JSON ' + kind.__name__}, got "
                       f"{json.dumps(value)[:60]}")
    return value


def _strings(value, what: str) -> list[str]:
    items = _shaped(value, list, what)
    if not all(isinstance(v, str) for v in items):
        raise OciError(f"{what} must be a list of strings, got {json.dumps(items)[:60]}")
    return items


def _json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise OciError(f"cannot read {path.name}: {exc}") from None


def _blob(layout: Path, digest: str) -> Path:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or not all(c in "0123456789abcdef" for c in hexpart):
        raise OciError(f"bad blob digest: {digest!r}")
    path = layout / "blobs" / "sha256" / hexpart
    if not path.is_file():
        raise OciError(f"blob {digest} is missing from the image")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != hexpart:
        raise OciError(f"blob {digest[:19]} does not match its digest (truncated or corrupt)")
    return path


def read_oci_layout(layout: Path, ref: str = "") -> Image:
    """An OCI image layout directory: index.json's manifest (the one named ref, or the only one; an index
    inside it picks linux/amd64)."""
    if not (layout / "oci-layout").is_file() or not (layout / "index.json").is_file():
        raise OciError(f"{layout} is not an OCI image layout (no oci-layout and index.json)")
    manifests = _descriptors(_shaped(_json(layout / "index.json"), dict, "index.json").get("manifests"),
                             "index.json manifests")
    if ref:
        manifests = [m for m in manifests if _shaped(m.get("annotations"), dict, "annotations").get(
            "org.opencontainers.image.ref.name") == ref]
    if len(manifests) != 1:
        raise OciError(f"{layout}: {len(manifests)} manifests{f' named {ref!r}' if ref else ''}; "
                           "name one with --ref" if manifests else f"{layout}: no manifest"
                           + (f" named {ref!r}" if ref else ""))
    desc = manifests[0]
    manifest = _shaped(_json(_blob(layout, _digest(desc))), dict, "the manifest")
    for _ in range(INDEX_DEPTH):                     # an index of platforms: this machine's
        if desc.get("mediaType") not in INDEX_TYPES and manifest.get("mediaType") not in INDEX_TYPES:
            break
        inner = _descriptors(manifest.get("manifests"), "the image index's manifests")
        mine = [m for m in inner if _shaped(m.get("platform"), dict, "platform").get("os") == "linux"
                and m["platform"].get("architecture") == "amd64"]
        if not mine:
            raise OciError("the image index has no linux/amd64 manifest")
        desc = mine[0]
        manifest = _shaped(_json(_blob(layout, _digest(desc))), dict, "the manifest")
    else:
        raise OciError(f"image indexes nested more than {INDEX_DEPTH} deep: not an image")
    if "fsLayers" in manifest:
        raise OciError("a Docker schema 1 manifest (fsLayers): not supported; convert it with `skopeo copy`")
    if not isinstance(manifest.get("layers"), list) or not manifest["layers"]:
        raise OciError("the manifest has no layers: not an image manifest")
    layers = []
    for layer in _descriptors(manifest["layers"], "the manifest's layers"):
        media = _shaped(layer.get("mediaType"), str, "a layer's mediaType")
        if "zstd" in media:
            raise OciError(f"layer {layer.get('digest')} is zstd-compressed ({media}): not supported here; "
                               "convert it with `skopeo copy --dest-compress-format gzip`")
        if "foreign" in media or "nondistributable" in media:
            raise OciError(f"layer {layer.get('digest')} is not distributable ({media}): not in the archive")
        layers.append(_blob(layout, _digest(layer)))
    config = manifest.get("config")
    return _with_config(layers, _json(_blob(layout, _digest(config))) if config else {})


def _descriptors(value, what: str) -> list[dict]:
    items = _shaped(value, list, what)
    if not all(isinstance(d, dict) for d in items):
        raise OciError(f"{what} must be a list of descriptors (JSON objects)")
    return items


def _digest(desc) -> str:
    digest = _shaped(desc, dict, "a descriptor").get("digest")
    if not isinstance(digest, str):
        raise OciError(f"a descriptor has no digest: {json.dumps(desc)[:80]}")
    return digest


def read_docker_archive(root: Path) -> Image:
    """An unpacked `docker save` archive: manifest.json's one image (its config file and layer tars)."""
    if not (root / "manifest.json").is_file():
        raise OciError("not a docker save archive (no manifest.json)")
    entries = _json(root / "manifest.json")
    if not isinstance(entries, list) or len(entries) != 1:
        raise OciError(f"the archive holds {len(entries) if isinstance(entries, list) else 0} images; "
                           "import an archive of one")
    entry = _shaped(entries[0], dict, "manifest.json's image")
    layers = [_member(root, name) for name in _strings(entry.get("Layers"), "manifest.json Layers")]
    if not layers:
        raise OciError("manifest.json names no layers: not an image")
    config = entry.get("Config")
    if not isinstance(config, str):
        raise OciError("manifest.json names no Config file")
    return _with_config(layers, _json(_member(root, config)))


def _member(root: Path, name: str) -> Path:
    path = (root / name).resolve()
    if not path.is_relative_to(root.resolve()) or not path.is_file():
        raise OciError(f"the archive's manifest names {name!r}, which it does not hold")
    return path


def _with_config(layers: list[Path], config) -> Image:
    c = _shaped(_shaped(config, dict, "the image config").get("config"), dict, "the image config's config")
    env = {}
    for item in _strings(c.get("Env"), "config Env"):
        key, sep, value = item.partition("=")
        if sep and key and "\0" not in item:   # (a NUL would break every exec)
            env[key] = value
    cwd = _shaped(c.get("WorkingDir"), str, "config WorkingDir")
    if cwd and not cwd.startswith("/"):
        raise OciError(f"the image's WorkingDir is not absolute: {cwd!r}")
    return Image(layers=layers, env=env, cwd=cwd, user=_shaped(c.get("User"), str, "config User"),
                 entrypoint=_strings(c.get("Entrypoint"), "config Entrypoint"), cmd=_strings(c.get("Cmd"), "config Cmd"))


def unpack_archive(archive: Path, into: Path, budget: Budget | None = None) -> None:
    """An OCI or docker archive (a plain tar of its files) unpacked as it is: regular files and directories
    only, every name inside into, within budget (the archive may be compressed: its files count as the
    image's do)."""
    budget = budget or Budget()
    into.mkdir(parents=True, exist_ok=True)
    fd = os.open(into, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with tarfile.open(archive) as tar:
            while (m := tar.next()) is not None:
                tar.members.clear()
                budget.entry(m.size if m.isfile() else 0)
                if not (m.isfile() or m.isdir()):
                    continue      # (symlinks of old docker saves' layer dirs are not needed: manifest.json names files)
                budget.room(fd, m.size)
                tar.extract(m, into, filter="data")
    except tarfile.TarError as exc:
        raise OciError(f"cannot read {archive.name}: {exc}") from None
    except OSError as exc:
        raise OciError(f"cannot unpack {archive.name}: {str(exc)[:300]}") from None
    finally:
        os.close(fd)

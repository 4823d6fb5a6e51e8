"""`dsec image build|ls`: EROFS layers in the object store."""
from __future__ import annotations

import asyncio
import datetime
from pathlib import Path

import click
import msgspec

from bus import streams
from bus.records import ImageConfig, sandbox_decoder, snapshot_decoder
from edge import debootstrap, e2bbase
from cli.main import connect, main, nats_option, run_async
from edge.erofs import LayerBuildError, pack_dir
from edge.backends.treeops import scratch_dir
from bus.errors import InvalidRequest
from bus.images import ImageRegistry, parse_ref


@main.group()
def image() -> None:
    """Build and list images (read-only EROFS layers). Operator commands: they need an admin's or ops'
    credential (STATE_DIR/creds/admin.creds), not a tenant's."""


@image.command()
@nats_option
@click.argument("name")
@click.option("--from-dir", "from_dir", default=None, type=click.Path(path_type=Path),
              help="Directory to pack as the layer's root.")
@click.option("--from-tar", "from_tar", default=None, type=click.Path(path_type=Path),
              help="Tar archive (optionally compressed) to unpack and pack as the layer's root.")
@click.option("--debootstrap", "suite", default=None, metavar="SUITE",
              help="Make a Debian root with debootstrap (e.g. bookworm; minbase variant), cached by its settings.")
@click.option("--packages", default="", metavar="A,B,...",
              help="With --debootstrap: Debian packages to include (e.g. python3,git).")
@click.option("--mirror", default=None, metavar="URL",
              help="With --debootstrap: the Debian archive (default: the one this machine's apt uses).")
@click.option("--e2b-base", "e2b_base", is_flag=True,
              help="E2B's default template: a Debian (bookworm, debootstrapped and cached) with bash, python3, pip, "
                   "curl, git and sudo, and the user `user` (home /home/user, passwordless sudo) its commands run "
                   "as by default (docs/e2b.md).")
@click.option("--kind", type=click.Choice(["base", "workspace", "toolkit"]), default="base", show_default=True,
              help="Layer kind: a base image, or a workspace or toolkit layer that sandboxes stack over a base "
                   "(create --workspace/--toolkit).")
@run_async
async def build(nats_url: str, name: str, from_dir: Path | None, from_tar: Path | None, suite: str | None,
                packages: str, mirror: str | None, kind: str, e2b_base: bool) -> None:
    """Pack a directory, a tar or a debootstrapped Debian root into an EROFS layer and store it as the next
    version of NAME. Only this layer is built and uploaded; an unchanged layer makes no new version."""
    name_only, version = parse_ref(name)
    if version is not None:
        raise InvalidRequest("image build takes a NAME without @version (versions are assigned)")
    config = ImageConfig()
    if e2b_base:
        if from_dir is not None or from_tar is not None or suite is not None or packages or mirror or kind != "base":
            raise InvalidRequest("--e2b-base makes the whole image: no --from-dir, --from-tar, --debootstrap, "
                                 "--packages, --mirror or --kind with it")
        try:
            from_dir = await asyncio.to_thread(e2bbase.root, lambda line: click.echo(line, err=True))
        except (LayerBuildError, OSError) as exc:
            raise InvalidRequest(f"cannot build {name_only}: {exc}") from None
        config = e2bbase.CONFIG
    if [from_dir, from_tar, suite].count(None) != 2:
        raise InvalidRequest("give exactly one of --from-dir DIR, --from-tar FILE or --debootstrap SUITE")
    if (packages or mirror) and suite is None:
        raise InvalidRequest("--packages and --mirror go with --debootstrap")
    if from_dir is not None and not from_dir.is_dir():
        raise InvalidRequest(f"--from-dir: not a directory: {from_dir}")
    if from_tar is not None and not from_tar.is_file():
        raise InvalidRequest(f"--from-tar: not a file: {from_tar}")
    if suite is not None:
        names = debootstrap.parse_packages(packages)
        try:
            from_dir = await asyncio.to_thread(debootstrap.root_for, suite, names, mirror or debootstrap.apt_mirror(),
                                               lambda line: click.echo(line, err=True))
        except (LayerBuildError, OSError) as exc:
            raise InvalidRequest(f"cannot build {name_only}: {exc}") from None
    with scratch_dir(prefix="dsec-build-") as tmp:   # (a tar's tree of any depth)
        layer = Path(tmp) / "layer.erofs"
        try:
            if from_tar is not None:
                from_dir = Path(tmp) / "root"
                await asyncio.to_thread(unpack_tar, from_tar, from_dir)
            digest = await asyncio.to_thread(pack_dir, from_dir, layer)
        except (LayerBuildError, OSError) as exc:
            raise InvalidRequest(f"cannot build {name_only}: {exc}") from None
        bus = await connect(nats_url, "dsec-image", "admin")
        try:
            rec, new = await ImageRegistry(bus).publish(name_only, layer, digest, kind, config)
        finally:
            await bus.close()
    click.echo(f"{rec.name}@{rec.version} {rec.layer_kind} {rec.digest} {rec.size} bytes"
               + ("" if new else " (unchanged: same as the latest version)"))


def unpack_tar(archive: Path, root: Path) -> None:
    """Unpack a tar (optionally compressed) into root as an image layer is applied (edge/oci.py): every
    name, hard link and parent resolves inside root through fds (a symlink of the archive's own, even one
    replaced later, is followed inside it, never out), modes and owners are kept, device nodes and paths
    leaving root are refused. Raises LayerBuildError saying why. tarfile's filters are not enough here:
    they check names with realpath, which a later member can make stale (a symlink re-pointed) and long
    names can defeat (CVE-2025-4517), and the "tar" one let any hard link through."""
    from edge import oci
    try:
        oci.apply_layers([archive], root)
    except oci.OciError as exc:
        raise LayerBuildError(str(exc)) from None


@image.command(name="rm")
@nats_option
@click.argument("ref", metavar="NAME@VERSION")
@run_async
async def rm_image(nats_url: str, ref: str) -> None:
    """Remove one version of a layer; refused while a running sandbox or a snapshot uses it."""
    bus = await connect(nats_url, "dsec-image", "admin")
    try:
        in_use: dict[str, str] = {}   # digest -> who uses it (the first found), for the refusal
        for _, raw in await bus.kv_items(streams.SANDBOXES_KV):
            try:
                rec = sandbox_decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if rec.state in ("starting", "ready"):
                for digest in rec.layers:
                    in_use.setdefault(digest, f"sandbox {rec.sandbox_id} ({rec.state}); destroy it first")
        for _, raw in await bus.kv_items(streams.SNAPSHOTS_KV):   # snapshots are built on their layers too
            try:
                snap = snapshot_decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            for layer in snap.layers:
                in_use.setdefault(layer.digest, f"snapshot {snap.id}{' (' + snap.tag + ')' if snap.tag else ''}; "
                                                 f"delete it first (dsec snapshot rm)")
        gone = await ImageRegistry(bus).remove(ref, in_use)
    finally:
        await bus.close()
    click.echo(f"removed {gone.name}@{gone.version} ({gone.digest})")


@image.command(name="ls")
@nats_option
@run_async
async def ls_images(nats_url: str) -> None:
    """List images and their versions."""
    bus = await connect(nats_url, "dsec-image", "admin")
    try:
        recs = await ImageRegistry(bus).list()
    finally:
        await bus.close()
    click.echo(f"{'NAME':<20} {'VERSION':>7} {'KIND':<10} {'SIZE':>10}  {'CREATED':<20} DIGEST")
    for r in recs:
        created = datetime.datetime.fromtimestamp(r.created_at).strftime("%Y-%m-%d %H:%M:%S")
        click.echo(f"{r.name:<20} {r.version:>7} {r.layer_kind:<10} {r.size:>10}  {created:<20} {r.digest[:19]}")


@image.command(name="gc")
@nats_option
@click.option("--min-age", default=3600.0, show_default=True, type=click.FloatRange(min=0), metavar="SECONDS",
              help="Leave chunks stored less than this long ago (an import under way stores its chunks first).")
@run_async
async def gc_images(nats_url: str, min_age: float) -> None:
    """Free the object store of what no image needs any more: `image rm` removes a version's layer, but its
    lazy-loading chunks, chunk manifest and read trace stay until this runs (chunks are shared by layers
    holding the same bytes: only those no remaining layer names go)."""
    from bus import chunks
    bus = await connect(nats_url, "dsec-image", "admin")
    try:
        dropped, freed = await chunks.collect(bus, min_age)
    finally:
        await bus.close()
    click.echo(f"removed {dropped} objects (about {freed >> 20} MiB of chunks)")

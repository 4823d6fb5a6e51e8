"""`dsec image build|ls`: EROFS layers in the object store."""
from __future__ import annotations

import datetime
import tempfile
from pathlib import Path

import click

from bus.conn import Bus
from cli.main import main, nats_option, run_async
from edge.erofs import LayerBuildError, pack_dir
from bus.errors import InvalidRequest
from placement.images import ImageRegistry, parse_ref


@main.group()
def image() -> None:
    """Build and list images (read-only EROFS layers)."""


@image.command()
@nats_option
@click.argument("name")
@click.option("--from-dir", "from_dir", required=True, type=click.Path(path_type=Path),
              help="Directory to pack as the layer's root.")
@click.option("--kind", type=click.Choice(["base", "workspace", "toolkit"]), default="base", show_default=True,
              help="Layer kind.")
@run_async
async def build(nats_url: str, name: str, from_dir: Path, kind: str) -> None:
    """Pack DIR into an EROFS layer and store it as the next version of NAME."""
    name_only, version = parse_ref(name)
    if version is not None:
        raise InvalidRequest("image build takes a NAME without @version (versions are assigned)")
    if not from_dir.is_dir():
        raise InvalidRequest(f"--from-dir: not a directory: {from_dir}")
    with tempfile.TemporaryDirectory() as tmp:
        layer = Path(tmp) / "layer.erofs"
        try:
            digest = pack_dir(from_dir, layer)
        except LayerBuildError as exc:
            raise InvalidRequest(str(exc)) from None
        bus = await Bus.connect(nats_url, name="dsec-image")
        try:
            rec = await ImageRegistry(bus).publish(name_only, layer, digest, kind)
        finally:
            await bus.close()
    click.echo(f"{rec.name}@{rec.version} {rec.digest} {rec.size} bytes")


@image.command(name="ls")
@nats_option
@run_async
async def ls_images(nats_url: str) -> None:
    """List images and their versions."""
    bus = await Bus.connect(nats_url, name="dsec-image")
    try:
        recs = await ImageRegistry(bus).list()
    finally:
        await bus.close()
    click.echo(f"{'NAME':<20} {'VERSION':>7} {'KIND':<10} {'SIZE':>10}  {'CREATED':<20} DIGEST")
    for r in recs:
        created = datetime.datetime.fromtimestamp(r.created_at).strftime("%Y-%m-%d %H:%M:%S")
        click.echo(f"{r.name:<20} {r.version:>7} {r.layer_kind:<10} {r.size:>10}  {created:<20} {r.digest[:19]}")

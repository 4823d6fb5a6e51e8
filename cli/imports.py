"""`dsec image import`: an OCI or Docker image (a layout, an archive, or a registry through skopeo) made
one EROFS layer, its config kept as the image's defaults (edge/oci.py)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import click

from bus.errors import InvalidRequest
from bus.images import ImageRegistry, parse_ref
from bus.records import ImageConfig
from cli.image import image
from cli.main import Size, connect, nats_option, run_async
from edge import oci
from edge.backends.treeops import remove_path, scratch_dir
from edge.erofs import LayerBuildError, pack_dir


@image.command(name="import")
@nats_option
@click.argument("name")
@click.option("--oci-layout", "layout", default=None, type=click.Path(path_type=Path),
              help="An OCI image layout directory (oci-layout, index.json, blobs/).")
@click.option("--oci-archive", "oci_archive", default=None, type=click.Path(path_type=Path),
              help="A tar of an OCI image layout (`skopeo copy ... oci-archive:FILE`, `docker save` of Docker 25+).")
@click.option("--docker-archive", "docker_archive", default=None, type=click.Path(path_type=Path),
              help="A `docker save` archive (manifest.json and layer tars).")
@click.option("--from", "source", default=None, metavar="docker://HOST/REPO:TAG",
              help="A registry image, copied by skopeo (needs the skopeo package and access to the registry).")
@click.option("--ref", default="", metavar="TAG",
              help="With an OCI layout or archive holding several images: the one whose ref.name is TAG.")
@click.option("--tls-verify/--no-tls-verify", default=True, show_default=True,
              help="With --from: verify the registry's TLS certificate (off for a plain-HTTP registry).")
@click.option("--kind", type=click.Choice(["base", "workspace", "toolkit"]), default="base", show_default=True,
              help="Layer kind (as `image build`).")
@click.option("--max-size", default="16Gi", show_default=True, type=Size(),
              help="The most the image's files may add up to, applied (a decompression bomb stops here; it also "
                   "stops before the disk it unpacks on, TMPDIR, has less than 1 GiB free).")
@run_async
async def import_image(nats_url: str, name: str, layout: Path | None, oci_archive: Path | None,
                       docker_archive: Path | None, source: str | None, ref: str, tls_verify: bool, kind: str,
                       max_size: int) -> None:
    """Import an OCI or Docker image as the next version of NAME: its layers applied in order (whiteouts,
    opaque directories, hard links, xattrs and file capabilities kept; device nodes refused) into one EROFS
    layer, and its config's Env, WorkingDir, User, Entrypoint and Cmd kept as the image's defaults (every
    exec's env, cwd and user; what `dsec run --image NAME` runs given no command). Content-addressed: the
    same image imported again makes no new version."""
    name_only, version = parse_ref(name)
    if version is not None:
        raise InvalidRequest("image import takes a NAME without @version (versions are assigned)")
    given = [p for p in (layout, oci_archive, docker_archive, source) if p is not None]
    if len(given) != 1:
        raise InvalidRequest("give exactly one of --oci-layout DIR, --oci-archive FILE, --docker-archive FILE "
                             "or --from docker://...")
    for path, what in ((layout, "--oci-layout"), (oci_archive, "--oci-archive"), (docker_archive, "--docker-archive")):
        if path is not None and not (path.is_dir() if what == "--oci-layout" else path.is_file()):
            raise InvalidRequest(f"{what}: no such {'directory' if what == '--oci-layout' else 'file'}: {path}")
    budget = oci.Budget(max_bytes=max_size)
    _sweep_stale()
    with scratch_dir(prefix=f"{PREFIX}{os.getpid()}-") as tmp:
        work = Path(tmp)
        try:
            img = await _stoppable(budget, _read, work, layout, oci_archive, docker_archive, source, ref, tls_verify,
                                   budget)
            root = work / "root"
            await _stoppable(budget, oci.apply_layers, img.layers, root, lambda line: click.echo(line, err=True),
                             budget)
            fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
            try:   # (the packed layer holds every byte: a sparse file's holes too)
                budget.room(fd, budget.bytes)
            finally:
                os.close(fd)
            layer = work / "layer.erofs"
            digest = await _stoppable(budget, pack_dir, root, layer)
        except (oci.OciError, LayerBuildError) as exc:
            raise InvalidRequest(f"cannot import {name_only}: {exc}") from None
        config = ImageConfig(env=img.env, cwd=img.cwd, user=img.user, entrypoint=img.entrypoint, cmd=img.cmd)
        bus = await connect(nats_url, "dsec-image", "admin")
        try:
            rec, new = await ImageRegistry(bus).publish(name_only, layer, digest, kind, config)
        finally:
            await bus.close()
    click.echo(f"{rec.name}@{rec.version} {rec.layer_kind} {rec.digest} {rec.size} bytes"
               + ("" if new else " (unchanged: same as the latest version)"))


PREFIX = "dsec-import-"
STALE_AFTER = 3600.0   # seconds a dead import's temporary directory is left before the next import removes it


async def _stoppable(budget: oci.Budget, fn, *args):
    """fn(*args) in a thread; cancelled (Ctrl-C), the thread is told to stop and waited for, so nothing
    goes on writing into a temporary directory already removed (helper I: the disk filled on after Ctrl-C)."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        budget.stop.set()
        with contextlib.suppress(Exception):
            await task
        raise


def _sweep_stale() -> None:
    """Remove what imports killed (SIGKILL) left in the temporary directory: theirs, by a pid that is gone."""
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        pid = path.name[len(PREFIX):].split("-", 1)[0]
        try:
            idle = time.time() - path.stat().st_mtime
        except OSError:
            continue
        if pid.isdigit() and not Path(f"/proc/{pid}").exists() and idle > STALE_AFTER:   # (an hour: an import in
            with contextlib.suppress(OSError):                                           # another pid namespace)
                remove_path(path)


def _read(work: Path, layout: Path | None, oci_archive: Path | None, docker_archive: Path | None,
          source: str | None, ref: str, tls_verify: bool, budget: oci.Budget) -> oci.Image:
    outer = oci.Budget(max_bytes=budget.max_bytes)   # (the archive's own files: a limit of their own, one stop)
    outer.stop = budget.stop
    if source is not None:
        layout = work / "pulled"
        _skopeo(source, layout, tls_verify)
    if oci_archive is not None:
        layout = work / "archive"
        oci.unpack_archive(oci_archive, layout, outer)
    if docker_archive is not None:
        oci.unpack_archive(docker_archive, work / "archive", outer)
        return oci.read_docker_archive(work / "archive")
    return oci.read_oci_layout(layout, ref)


def _skopeo(source: str, into: Path, tls_verify: bool) -> None:
    """skopeo copy SOURCE oci:INTO (layers gzip: this machine has no zstd reader)."""
    if not source.startswith("docker://"):
        raise oci.OciError(f"--from takes docker://HOST/REPO[:TAG], got {source!r}")
    skopeo = shutil.which("skopeo")
    if skopeo is None:
        raise oci.OciError("skopeo not found: install it (apt-get install skopeo; make setup does)")
    cmd = [skopeo, "copy", "--quiet", "--dest-compress-format", "gzip",
           *([] if tls_verify else ["--src-tls-verify=false"]), source, f"oci:{into}:image"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise oci.OciError(f"skopeo copy {source} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")


@image.command(name="export")
@nats_option
@click.option("--snapshot", "snapshot_ref", default=None, metavar="ID|TAG",
              help="A snapshot of this project (dsec snapshot ls): its layers, env, cwd and user.")
@click.option("--image", "image_ref", default=None, metavar="NAME[@VERSION]",
              help="A base image: its layer and config (env, cwd, user, entrypoint, cmd).")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="The OCI archive to write.")
@run_async
async def export_image(nats_url: str, snapshot_ref: str | None, image_ref: str | None, output: Path) -> None:
    """Write a snapshot (a sandbox's forked state) or an image as an OCI archive: its layers merged into one,
    owners, modes, links, xattrs and file capabilities kept; its env, cwd and user (and an image's entrypoint
    and cmd) as the config. Import it anywhere (`dsec image import --oci-archive`, `skopeo copy
    oci-archive:FILE ...`)."""
    import json
    import sys

    import libdsec
    from bus import streams
    if (snapshot_ref is None) == (image_ref is None):
        raise InvalidRequest("give exactly one of --snapshot ID|TAG or --image NAME[@VERSION]")
    if not output.parent.is_dir():
        raise InvalidRequest(f"-o: no such directory: {output.parent}")
    if str(output) == "-":
        raise InvalidRequest("-o: give a file to write (an archive is not written to standard output)")
    if output.is_dir():
        raise InvalidRequest(f"-o: {output} is a directory: name the archive file to write")
    bus = await connect(nats_url, "dsec-image", "admin")
    try:
        if snapshot_ref is not None:
            async with libdsec.AsyncClient(nats_url) as client:     # the project's own snapshot
                snap = await client.snapshot(snapshot_ref)
            digests = [layer.digest for layer in snap.layers]
            config = {"Env": [f"{k}={v}" for k, v in snap.env.items()], "WorkingDir": snap.cwd or "/",
                      "User": snap.user}
        else:
            rec = await ImageRegistry(bus).lookup(image_ref)
            digests = [rec.digest]
            c = rec.config
            config = {"Env": [f"{k}={v}" for k, v in c.env.items()], "WorkingDir": c.cwd, "User": c.user,
                      "Entrypoint": c.entrypoint or None, "Cmd": c.cmd or None}
        with tempfile.TemporaryDirectory(prefix="dsec-export-") as tmp:
            files = []
            for i, digest in enumerate(digests):
                path = Path(tmp) / f"{i}.erofs"
                await bus.obj_get_file(streams.LAYERS_OBJ, digest, path)
                files.append(str(path))
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "edge.ociexport", "--out", str(output.resolve()),
                "--config", json.dumps({k: v for k, v in config.items() if v}), *files,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            _, err = await proc.communicate()
            if proc.returncode != 0:
                raise InvalidRequest(f"cannot export: {err.decode(errors='replace').strip()[-300:]}")
    finally:
        await bus.close()
    click.echo(f"{output} ({output.stat().st_size} bytes)")

"""`dsec replay`: print a sandbox's (or a job's) episode from the trajectory stream, after the fact."""
from __future__ import annotations

import shlex
import sys
import time

import click
import msgspec

from bus import streams, subjects
from bus.conn import Bus
from bus.messages import OutputChunk, TrajRecord, output_decoder, traj_decoder
from cli.main import fail, main, nats_option, run_async


async def _output(bus: Bus, rec: TrajRecord) -> list[OutputChunk]:
    """The exec's full output, in order, from dsec.out (byte-identical to what the SDK saw); when that
    has aged out, the part kept in the trajectory record."""
    chunks: dict[int, OutputChunk] = {}
    async for data in bus.read_subject(streams.OUT_STREAM, subjects.output(rec.sandbox_id, rec.exec_id)):
        try:
            r = output_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if isinstance(r, OutputChunk):
            chunks.setdefault(r.seq, r)
    if chunks or not (rec.stdout or rec.stderr):
        return [chunks[k] for k in sorted(chunks)]
    return [c for c in (OutputChunk(seq=1, stream="stdout", data=rec.stdout),
                        OutputChunk(seq=2, stream="stderr", data=rec.stderr)) if c.data]


def _command(rec: TrajRecord) -> str:
    return rec.shell if rec.shell else shlex.join(rec.argv)


def _write(stream: str, data: bytes) -> None:
    out = sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer
    out.write(data)
    out.flush()


@main.command()
@nats_option
@click.option("--sandbox", "sandbox_id", default=None, help="Replay one sandbox's episode.")
@click.option("--job", default=None, help="Replay every sandbox of a job (its `job` label).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="text: commands, then their output (stdout to stdout, stderr to stderr) and exit codes; "
                   "json: one trajectory record per line.")
@click.option("--speed", type=click.Choice(["instant", "original"]), default="instant", show_default=True,
              help="original: wait between records as long as they were apart when they happened.")
@run_async
async def replay(nats_url: str, sandbox_id: str | None, job: str | None, fmt: str, speed: str) -> None:
    """Print an episode exactly as it happened: lifecycle, commands, their output byte for byte (from
    dsec.out while it is kept, else the part kept in the trajectory) and exit codes. Works after the
    sandbox is gone and after a restart (the streams are on disk)."""
    if bool(sandbox_id) == bool(job):
        fail("give exactly one of --sandbox ID or --job J")
    try:
        subject = (subjects.trajectory("*", "*", subjects.token(sandbox_id, "--sandbox")) if sandbox_id
                   else f"dsec.traj.*.{subjects.token(job, '--job')}.*")
    except ValueError as exc:
        fail(str(exc))
    bus = await Bus.connect(nats_url, name="dsec-replay", reconnect=False)
    try:
        previous = None
        count = 0
        async for data in bus.read_subject(streams.TRAJ_STREAM, subject):
            try:
                rec = traj_decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            count += 1
            if speed == "original" and previous is not None and rec.at > previous:
                time.sleep(min(rec.at - previous, 60.0))
            previous = rec.at
            if fmt == "json":
                click.echo(data.decode())
                continue
            stamp = time.strftime("%H:%M:%S", time.localtime(rec.at))
            if rec.type != "exec":
                click.echo(f"# {stamp} {rec.sandbox_id} {rec.type}{': ' + rec.detail if rec.detail else ''}")
                continue
            click.echo(f"$ {_command(rec)}")
            for chunk in await _output(bus, rec):
                _write(chunk.stream, chunk.data)
            status = f"exit {rec.exit_code}" + (" (timed out)" if rec.timed_out else "") + \
                (" (output truncated)" if rec.truncated else "") + (f" [{rec.error_code}: {rec.detail}]"
                                                                     if rec.error_code else "")
            click.echo(f"# {status}, {rec.ended_at - rec.started_at:.3f}s, cpu {rec.cpu_time:.3f}s")
        if count == 0:
            fail(f"no trajectory records for {'sandbox ' + sandbox_id if sandbox_id else 'job ' + str(job)}")
    finally:
        await bus.close()

"""`dsec snapshot take|ls|rm` and `dsec fork`: a sandbox's filesystem (and a VM's memory) as a snapshot, and
sandboxes started from one."""
from __future__ import annotations

import datetime

import click

import libdsec
from cli.main import client_options, main, run_async
from cli.termsafe import field


@main.group()
def snapshot() -> None:
    """Snapshots of sandboxes: take, list, remove (start sandboxes from one with `dsec fork`)."""


@snapshot.command(name="take")
@client_options
@click.argument("sandbox_id")
@click.option("--tag", default="", help="A name to find it by (the newest snapshot with a tag wins).")
@click.option("--memory", is_flag=True,
              help="VM kinds: its memory too, so forks go on with its processes running (on its node only).")
@click.option("--timeout", default=120.0, show_default=True, help="Seconds to wait for the snapshot.")
@run_async
async def take(nats_url, sandbox_id, tag, memory, timeout) -> None:
    """Snapshot SANDBOX_ID: its writable layer packed as a layer (the sandbox is frozen meanwhile); prints the
    snapshot's id."""
    async with libdsec.AsyncClient(nats_url) as client:
        sb = await client.get(sandbox_id)
        snap = await sb.snapshot(tag=tag, memory=memory, timeout=timeout)
    click.echo(snap.id)


@snapshot.command(name="ls")
@client_options
@click.option("--tag", default=None, help="Only snapshots with this tag.")
@run_async
async def ls_snapshots(nats_url, tag) -> None:
    """This project's snapshots, oldest first; MEMORY names the node holding a memory snapshot's memory."""
    async with libdsec.AsyncClient(nats_url) as client:
        snaps = await client.snapshots(tag)
    click.echo(f"{'ID':<22} {'TAG':<16} {'SANDBOX':<20} {'IMAGE':<14} {'SIZE':>10} {'MEMORY':<14} CREATED")
    for s in snaps:
        created = datetime.datetime.fromtimestamp(s.created_at).strftime("%Y-%m-%d %H:%M:%S")
        memory = f"{field(s.memory_node)}" if s.memory_node else "-"
        click.echo(f"{field(s.id):<22} {field(s.tag) or '-':<16} {field(s.sandbox_id):<20} {field(s.image):<14} "
                   f"{s.size >> 10:>8}Ki {memory:<14} {created}")


@snapshot.command(name="rm")
@client_options
@click.argument("refs", nargs=-1, required=True)
@run_async
async def rm_snapshots(nats_url, refs) -> None:
    """Remove snapshots by id or tag (a tag names its newest snapshot, as `dsec fork` takes it); prints the id
    of each one removed. Refused while another is built on one or a running sandbox uses it."""
    async with libdsec.AsyncClient(nats_url) as client:
        snaps = await client.snapshots()
        for ref in refs:
            tagged = [s.id for s in snaps if s.tag == ref]
            target = ref if any(s.id == ref for s in snaps) or not tagged else tagged[-1]
            await client.delete_snapshot(target)   # (by its id: what was shown is what goes)
            click.echo(target)
            snaps = [s for s in snaps if s.id != target]
            if target != ref and len(tagged) > 1:
                click.echo(f"dsec: {len(tagged) - 1} older snapshot(s) tagged {field(ref)} remain "
                           f"({', '.join(tagged[:-1])}); `dsec fork {field(ref)}` now takes {tagged[-2]}", err=True)


@main.command()
@client_options
@click.argument("ref")
@click.option("-n", "count", default=1, show_default=True, type=click.IntRange(1, 10_000),
              help="Sandboxes to start (all or none), 1 to 10,000.")
@click.option("--memory/--no-memory", default=None,
              help="From a memory snapshot's memory (default when it has one: on its node, its kind and size) "
                   "or only from its files (anywhere).")
@click.option("--backend", default=None, metavar="KIND", help="Kind of the forks (default: container, or the "
                                                                "memory snapshot's).")
@click.option("--ttl", default=600.0, show_default=True, help="Seconds before each is destroyed.")
@click.option("--timeout", default=120.0, show_default=True, help="Seconds to wait for them.")
@run_async
async def fork(nats_url, ref, count, memory, backend, ttl, timeout) -> None:
    """Start sandboxes from snapshot REF (an id or a tag); prints their ids."""
    async with libdsec.AsyncClient(nats_url) as client:
        forks = await client.fork(ref, count, memory=memory, backend=backend, ttl=ttl, timeout=timeout)
    for sb in forks:
        click.echo(sb.id)

"""`dsec warm set|ls|rm`: warm pools, ready sandboxes every edge keeps for one (layers, resources) key."""
from __future__ import annotations

import click

import libdsec
from cli.main import Size, client_options, main, run_async


@main.group()
def warm() -> None:
    """Warm pools: ready sandboxes a matching create claims (create→ready in a few ms)."""


@warm.command(name="set")
@client_options
@click.argument("name")
@click.option("--image", default="busybox", show_default=True, help="Base image name[@version].")
@click.option("--workspace", default=None, metavar="NAME[@VERSION]", help="Workspace layer over the base.")
@click.option("--toolkit", default=None, metavar="NAME[@VERSION]", help="Toolkit layer on top.")
@click.option("--cpu", default=1.0, show_default=True, help="Cores (creates must ask the same to match).")
@click.option("--memory", default="256Mi", show_default=True, type=Size(), help="Memory (creates must ask the same).")
@click.option("--pids", default=256, show_default=True, help="Max processes (creates must ask the same).")
@click.option("--disk", default="256Mi", show_default=True, type=Size(), help="Writable layer size (creates must ask the same).")
@click.option("--min", "min_", default=0, show_default=True, help="Ready sandboxes per edge, at least.")
@click.option("--max", "max_", default=4, show_default=True,
              help="Ready sandboxes per edge, at most (up to 64); between the two the recent create rate decides.")
@click.option("--node-pool", default="local", show_default=True, help="The node pool whose edges keep it.")
@run_async
async def set_pool(nats_url, name, image, workspace, toolkit, cpu, memory, pids, disk, min_, max_, node_pool) -> None:
    """Create or change warm pool NAME. A name without @version follows the latest version of a layer."""
    async with libdsec.AsyncClient(nats_url) as client:
        spec = await client.set_warm_pool(name, image, workspace=workspace, toolkit=toolkit,
                                          resources=libdsec.Resources(cpu=cpu, memory=memory, pids=pids, disk=disk),
                                          min=min_, max=max_, node_pool=node_pool)
    click.echo(f"warm pool {spec.name}: {_layers(spec)}, {min_}..{max_} per edge of pool {spec.node_pool}")


@warm.command(name="ls")
@client_options
@run_async
async def ls_pools(nats_url) -> None:
    """Warm pools, their bounds and how many sandboxes are ready now."""
    async with libdsec.AsyncClient(nats_url) as client:
        pools = await client.warm_pools()
    click.echo(f"{'NAME':<16} {'LAYERS':<40} {'CPU':>5} {'MEMORY':>10} {'MIN':>4} {'MAX':>4} {'READY':>6}  NODES")
    for p in pools:
        s = p.spec
        nodes = ", ".join(f"{n}={c}" for n, c in sorted(p.ready.items())) or "-"
        click.echo(f"{s.name:<16} {_layers(s):<40} {s.resources.cpu:>5g} {s.resources.memory >> 20:>8}Mi "
                   f"{s.min:>4} {s.max:>4} {p.total:>6}  {nodes}" + (f"  ({p.error})" if p.error else ""))


@warm.command(name="rm")
@client_options
@click.argument("name")
@run_async
async def rm_pool(nats_url, name) -> None:
    """Remove warm pool NAME: its ready sandboxes are destroyed (claimed ones live on)."""
    async with libdsec.AsyncClient(nats_url) as client:
        await client.delete_warm_pool(name)
    click.echo(f"warm pool {name} removed")


def _layers(spec) -> str:
    return "+".join(x for x in (spec.image, spec.workspace, spec.toolkit) if x)

"""Operator commands: `dsec node ls|drain|undrain`, `dsec quota set|ls|rm`."""
from __future__ import annotations

import asyncio
import time

import click

from bus import streams, subjects
from bus.conn import Bus
from bus.errors import AuthenticationFailed, BusError, BusUnavailable, PermissionDenied
from bus.records import quota_decoder
from cli.main import Size, connect, fail, main, nats_option, run_async
from bus import nodes
from placement import quota as quotas


async def _bus(url: str) -> Bus:
    return await connect(url, "dsec-admin", "admin", reconnect=False)


def _size(n: float) -> str:
    for unit in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(n) < 1024 or unit == "Ti":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def node_rows(records) -> list[str]:
    """One line per node: pool, state, used/capacity per dimension, bookings, ready warm sandboxes (every
    pool's), heartbeat age."""
    now = time.time()
    out = [f"{'NODE':<16} {'POOL':<7} {'STATE':<9} {'SLOTS':>9} {'CPU':>13} {'MEMORY':>19} {'BOOKED':>6} {'WARM':>5} "
           f"{'HB AGE':>7}  KINDS (used/slots)"]
    for i in sorted(records, key=lambda r: (r.pool, r.node)):
        state = "lost" if i.lost else "draining" if i.draining else "stale" if now - i.heartbeat > 5 else "up"
        kinds = ",".join(f"{k}={i.kind_used.get(k, 0)}/{i.kind_slots.get(k, i.slots)}" for k in i.backends)
        out.append(f"{i.node:<16} {i.pool:<7} {state:<9} {f'{i.used_slots}/{i.slots}':>9} "
                   f"{f'{i.used_cpu:g}/{i.cpu:g}':>13} {f'{_size(i.used_memory)}/{_size(i.memory)}':>19} "
                   f"{len(i.bookings):>6} {sum(i.warm.values()):>5} {now - i.heartbeat:>6.1f}s  {kinds}")
    return out


READ_FOR = 10.0   # seconds a read of the node records is tried again when the bus times out


async def read_nodes(bus: Bus, read_for: float = READ_FOR):
    """Every node record (junk skipped). A read the bus did not answer (a server of the cluster killed: the
    bucket's leader moving) is tried again for read_for seconds (helper F3: `dsec node ls` failed "kv list
    ... did not answer in time" once)."""
    until = time.monotonic() + read_for
    while True:
        try:
            items = await bus.kv_items(streams.NODES_KV)
            break
        except (BusUnavailable, AuthenticationFailed, PermissionDenied):
            raise
        except BusError:
            if time.monotonic() >= until:
                raise
            await asyncio.sleep(0.5)
    out = []
    for key, raw in items:
        info = nodes.decode_node(key, raw)
        if info is not None:
            out.append(info)
    return out


@main.group()
def node() -> None:
    """Nodes: list them, drain one (no new sandboxes; running ones finish), undrain it."""


@node.command("ls")
@nats_option
@run_async
async def node_ls(nats_url: str) -> None:
    """List nodes with usage per dimension and heartbeat age."""
    bus = await _bus(nats_url)
    try:
        click.echo("\n".join(node_rows(await read_nodes(bus))))
    finally:
        await bus.close()


async def _set_draining(nats_url: str, node_id: str, draining: bool) -> Bus:
    try:
        subjects.token(node_id, "node id")
    except ValueError as exc:
        fail(str(exc))
    bus = await _bus(nats_url)
    if await bus.kv_get(streams.NODES_KV, node_id) is None:
        await bus.close()
        fail(f"no node {node_id!r} (see `dsec node ls`)")
    await nodes.set_flag(bus, node_id, draining=draining)
    return bus


@node.command()
@click.argument("node_id")
@nats_option
@click.option("--wait", is_flag=True, help="Wait until its last sandbox has ended.")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds --wait waits at most.")
@run_async
async def drain(node_id: str, nats_url: str, wait: bool, timeout: float) -> None:
    """Stop placing sandboxes on NODE_ID; the ones it runs go on until destroyed or their TTL."""
    bus = await _set_draining(nats_url, node_id, True)
    try:
        click.echo(f"dsec: node {node_id} draining")
        deadline = time.monotonic() + timeout
        while wait:
            raw = await bus.kv_get(streams.NODES_KV, node_id)
            info = nodes.decode_node(node_id, raw)
            if info is None or (info.used_slots == 0 and not info.bookings):
                click.echo(f"dsec: node {node_id} drained")
                return
            if time.monotonic() > deadline:
                fail(f"node {node_id} still runs {info.used_slots} sandboxes after {timeout:.0f}s")
            await asyncio.sleep(0.5)
    finally:
        await bus.close()


@node.command()
@click.argument("node_id")
@nats_option
@run_async
async def undrain(node_id: str, nats_url: str) -> None:
    """Let NODE_ID take new sandboxes again."""
    bus = await _set_draining(nats_url, node_id, False)
    await bus.close()
    click.echo(f"dsec: node {node_id} accepting work")


@main.group()
def quota() -> None:
    """Per-tenant quotas (checked at admission: over quota fails at once with QuotaExceeded)."""


@quota.command("set")
@click.argument("tenant")
@nats_option
@click.option("--sandboxes", default=None, type=click.IntRange(min=0), help="Max concurrent sandboxes (0: no limit).")
@click.option("--cpu", default=None, type=click.FloatRange(min=0), help="Max cores in total (0: no limit).")
@click.option("--memory", default=None, type=Size(zero_ok=True), help="Max memory in total, e.g. 64Gi (0: no limit).")
@click.option("--rate", default=None, type=click.FloatRange(min=0),
              help="Control API requests/s over all engines (0: the default, 200); past it requests get RateLimited.")
@run_async
async def quota_set(tenant: str, nats_url: str, sandboxes: int | None, cpu: float | None, memory: int | None,
                    rate: float | None) -> None:
    """Set TENANT's quota: the limits given change, the others stay as they are."""
    try:
        subjects.token(tenant, "tenant")
    except ValueError as exc:
        fail(str(exc))
    changes = {k: v for k, v in (("max_sandboxes", sandboxes), ("max_cpu", cpu), ("rate", rate)) if v is not None}
    if memory is not None:
        changes["max_memory"] = memory
    if not changes:
        fail("give at least one of --sandboxes, --cpu, --memory, --rate")
    bus = await _bus(nats_url)
    try:
        q = await quotas.change_quota(bus, tenant, **changes)
    finally:
        await bus.close()
    click.echo(f"dsec: quota of {tenant}: sandboxes={q.max_sandboxes or '-'} cpu={q.max_cpu or '-'} "
               f"memory={_size(q.max_memory) if q.max_memory else '-'} rate={q.rate or 'default'}")


@quota.command("ls")
@nats_option
@run_async
async def quota_ls(nats_url: str) -> None:
    """List quotas and what each tenant (with its projects) or project holds."""
    bus = await _bus(nats_url)
    try:
        click.echo(f"{'TENANT':<20} {'SANDBOXES':>10} {'CPU':>8} {'MEMORY':>10} {'HELD':>6}")
        for key, raw in sorted(await bus.kv_items(streams.QUOTAS_KV)):
            try:
                q = quota_decoder.decode(raw)
            except Exception:
                continue
            root = subjects.tenant_root(key)   # a tenant's usage record holds its projects' too
            holds = (await quotas.usage(bus, root)).holds.values()
            held = sum(1 for h in holds if key == root or h.account == key)
            click.echo(f"{subjects.display_name(q.tenant):<20} {q.max_sandboxes or '-':>10} {q.max_cpu or '-':>8} "
                       f"{_size(q.max_memory) if q.max_memory else '-':>10} {held:>6}")
    finally:
        await bus.close()


@quota.command("rm")
@click.argument("tenant")
@nats_option
@run_async
async def quota_rm(tenant: str, nats_url: str) -> None:
    """Remove TENANT's quota (no limit). A tenant with no quota is refused (a misspelt name is not "removed")."""
    bus = await _bus(nats_url)
    try:
        if await bus.kv_get(streams.QUOTAS_KV, tenant) is None:
            fail(f"tenant {tenant!r} has no quota to remove (`dsec quota ls` lists the quotas)")
        await bus.kv_delete(streams.QUOTAS_KV, tenant)
    finally:
        await bus.close()
    click.echo(f"dsec: quota of {tenant} removed")

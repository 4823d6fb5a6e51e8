"""`dsec iam`: tenants, credentials and their limits (bus/iam.py), with the server reloaded after each change."""
from __future__ import annotations

from pathlib import Path

import click

from bus import iam as identities
from cli.main import connect, fail, main, nats_option, run_async
from cli.up import state_dir_option


def _load(state_dir: Path) -> identities.Iam:
    found = identities.Iam.load(state_dir)
    if not found.exists:
        fail(f"no identities under {state_dir} (`dsec up --state-dir {state_dir}` makes them)")
    return found


def _apply(found: identities.Iam, what: str) -> None:
    """Save, reload every running server of this state dir, and say so."""
    found.save()
    n = identities.reload(found)
    click.echo(f"dsec: {what}" + (" (server reloaded)" if n else " (no server running: the next `dsec up` uses it)"))


@main.group()
def iam() -> None:
    """Identities on the bus: tenants (one NATS account each), credentials, revocation, limits.

    The NATS server enforces them (config-file accounts with nkey users; see docs/iam.md). `dsec up`
    makes admin, placement, ops, edge and default-tenant credentials under its state dir (.dsec/creds/).
    """


@iam.command("ls")
@state_dir_option
def iam_ls(state_dir: Path) -> None:
    """List tenants and platform credentials."""
    found = _load(state_dir)
    click.echo(f"{'PRINCIPAL':<28} {'KIND':<9} {'RATE':>8}  CREDENTIAL")
    for role in sorted(found.platform):
        click.echo(f"{role:<28} {'platform':<9} {'-':>8}  {found.creds_path(role)}")
    for name, tenant in sorted(found.tenants.items()):
        creds = found.creds_path(f"tenant:{name}") if tenant.users else "(revoked)"
        click.echo(f"{name:<28} {'tenant':<9} {tenant.rate or 'default':>8}  {creds}")


@iam.group()
def tenant() -> None:
    """Add or remove tenants."""


@tenant.command("add")
@click.argument("name")
@state_dir_option
@click.option("--rate", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Control API requests/s (0: the default, 200); set it on the bus with `dsec iam set`.")
def tenant_add(name: str, state_dir: Path, rate: float) -> None:
    """Add tenant NAME (its own NATS account) and write its credential."""
    found = _load(state_dir)
    path = found.add_tenant(name, rate=rate)
    _apply(found, f"tenant {name} added; its credential: {path}")


@tenant.command("rm")
@click.argument("name")
@state_dir_option
@nats_option
@click.option("--force", is_flag=True, help="Destroy its live sandboxes first.")
@run_async
async def tenant_rm(name: str, state_dir: Path, nats_url: str, force: bool) -> None:
    """Remove tenant NAME: refused while it has live sandboxes, unless --force (which destroys them)."""
    import libdsec
    found = _load(state_dir)
    found.tenant(name)
    creds = found.creds_path(f"tenant:{name}")
    if creds.exists():
        async with libdsec.AsyncClient(nats_url, tenant=name, creds=str(creds)) as client:
            live = await client.list()
            if live and not force:
                fail(f"tenant {name} has {len(live)} live sandbox(es) ({', '.join(r.sandbox_id for r in live[:5])}"
                     f"{' ...' if len(live) > 5 else ''}): destroy them, or pass --force")
            for rec in live:
                await (await client.get(rec.sandbox_id)).destroy()
    found.remove_tenant(name)
    _apply(found, f"tenant {name} removed")


@iam.group()
def creds() -> None:
    """Issue and revoke credentials (PRINCIPAL: tenant:NAME, admin, placement, ops or edge-NODE)."""


@creds.command("issue")
@click.argument("principal")
@state_dir_option
@click.option("--pool", default=None, help="For edge-NODE: the pool its edge serves (default local).")
def creds_issue(principal: str, state_dir: Path, pool: str | None) -> None:
    """Write a new credential for PRINCIPAL; its earlier one stops working now."""
    found = _load(state_dir)
    if principal.startswith("tenant:"):
        path = found.issue_tenant(principal[7:])
    else:
        path = found.issue_platform(principal)
        if principal.startswith("edge-"):
            found.pools[principal[5:]] = identities.check_name(pool or found.pools.get(principal[5:], "local"), "pool")
    _apply(found, f"credential for {principal}: {path}")


@creds.command("revoke")
@click.argument("principal")
@state_dir_option
def creds_revoke(principal: str, state_dir: Path) -> None:
    """Revoke PRINCIPAL's credential: its open connections are closed, its next ones refused."""
    found = _load(state_dir)
    found.revoke(principal)
    _apply(found, f"credential of {principal} revoked")


@iam.command("set")
@click.argument("name")
@state_dir_option
@nats_option
@click.option("--rate", default=None, type=click.FloatRange(min=0),
              help="Control API requests/s per engine (0: the default, 200); past it: RateLimited.")
@click.option("--sandboxes", default=None, type=click.IntRange(min=0), help="Max concurrent sandboxes (0: none).")
@click.option("--cpu", default=None, type=click.FloatRange(min=0), help="Max cores in total (0: no limit).")
@click.option("--memory", default=None, help="Max memory in total, e.g. 64Gi (0: no limit).")
@run_async
async def iam_set(name: str, state_dir: Path, nats_url: str, rate: float | None, sandboxes: int | None,
                  cpu: float | None, memory: str | None) -> None:
    """Set tenant NAME's limits (kept in its quota record, read by every placement engine)."""
    from bus import streams
    from bus.messages import Quota, quota_decoder
    from libdsec.resources import parse_size
    from placement import quota as quotas
    found = _load(state_dir)
    found.tenant(name)
    bus = await connect(nats_url, "dsec-iam", "admin", reconnect=False)
    try:
        raw = await bus.kv_get(streams.QUOTAS_KV, name)
        q = quota_decoder.decode(raw) if raw is not None else Quota(tenant=name)
        changes = {k: v for k, v in (("rate", rate), ("max_sandboxes", sandboxes), ("max_cpu", cpu)) if v is not None}
        if memory is not None:
            changes["max_memory"] = 0 if memory.strip() == "0" else parse_size(memory, "--memory")
        q = Quota(**{**{f: getattr(q, f) for f in q.__struct_fields__}, **changes, "tenant": name})
        await quotas.set_quota(bus, q)
    finally:
        await bus.close()
    if rate is not None:
        found.tenants[name].rate = rate
        found.save()
    click.echo(f"dsec: limits of {name}: sandboxes={q.max_sandboxes or '-'} cpu={q.max_cpu or '-'} "
               f"memory={q.max_memory or '-'} rate={q.rate or 'default'}")

"""`dsec iam`: tenants, their projects, credentials and their limits (bus/iam.py), with the server reloaded after each change."""
from __future__ import annotations

from pathlib import Path

import click

from bus import iam as identities, iamserver, subjects
from bus.creds import expired, iso_time
from bus.errors import DsecError
from cli.main import Size, connect, fail, main, nats_option, run_async
from cli.up import state_dir_option


class Duration(click.ParamType):
    """A duration: 90, 90s, 30m, 12h or 7d (seconds when bare)."""

    name = "duration"
    UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

    def convert(self, value, param, ctx) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        text = str(value).strip().lower()
        unit = self.UNITS.get(text[-1:], None)
        try:
            seconds = float(text[:-1] if unit else text) * (unit or 1)
        except ValueError:
            seconds = -1
        if seconds <= 0:
            self.fail(f"{value!r} is not a duration (90, 90s, 30m, 12h, 7d)", param, ctx)
        return seconds


ttl_option = click.option("--ttl", default=None, type=Duration(),
                          help="The credential expires after this long (90s, 30m, 12h, 7d): the server refuses it "
                               "then and closes its connections. Default: it does not expire.")


def _load(state_dir: Path) -> identities.Iam:
    found = identities.Iam.load(state_dir)
    if not found.exists:
        fail(f"no identities under {state_dir} (`dsec up --state-dir {state_dir}` makes them)")
    return found


def _apply(found: identities.Iam, what: str) -> None:
    """Save, reload every running server of this state dir, and say so."""
    found.save()
    n = iamserver.reload(found)
    click.echo(f"dsec: {what}" + (" (server reloaded)" if n else " (no server running: the next `dsec up` uses it)"))


class _Commands(click.Group):
    """Every `dsec iam` command's refusal (a bad name, an unknown tenant) is one line and exit 1, never a
    traceback (the async ones' through run_async too)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DsecError as exc:
            fail(str(exc))


@main.group(cls=_Commands)
def iam() -> None:
    """Identities on the bus: tenants and their projects (one NATS account each), credentials, revocation,
    limits.

    The NATS server enforces them (config-file accounts with nkey users; see docs/iam.md). `dsec up`
    makes admin, placement, ops, edge and default-tenant credentials under its state dir (.dsec/creds/).
    """


@iam.command("ls")
@state_dir_option
def iam_ls(state_dir: Path) -> None:
    """List tenants, their projects and platform credentials."""
    found = _load(state_dir)
    click.echo(f"{'PRINCIPAL':<28} {'KIND':<9} {'RATE':>8}  {'EXPIRES':<20}  CREDENTIAL")

    def expires(principal: str) -> str:
        at = found.expires.get(principal)
        if not at:
            return "-"
        return ("expired " if not found.live(principal) else "") + iso_time(at)
    for role in sorted(found.platform):
        click.echo(f"{role:<28} {'platform':<9} {'-':>8}  {expires(role):<20}  {found.creds_path(role)}")
    for name, tenant in sorted(found.tenants.items()):
        creds = found.creds_path(f"tenant:{name}") if tenant.users else "(revoked)"
        kind = "project" if tenant.parent else "tenant"
        click.echo(f"{subjects.display_name(name):<28} {kind:<9} {tenant.rate or 'default':>8}  "
                   f"{expires(f'tenant:{name}'):<20}  {creds}")


async def _clear(found: identities.Iam, accounts: list[str], nats_url: str, force: bool) -> None:
    """Refuse (exit 1) while these accounts hold live sandboxes, unless force: then destroy them and remove
    their warm pools (their ready sandboxes go with them; a pool left behind kept its name), each account
    acted for by the platform's admin (its subjects name the account; without the admin's credential, by the
    account's own). An expired or revoked account's own was refused, so its sandboxes ran on, holding quota,
    after a forced removal (helper S)."""
    import libdsec
    admin = found.creds_path("admin")
    for account in accounts:
        creds = admin if admin.exists() and not expired(str(admin)) else found.creds_path(f"tenant:{account}")
        if not creds.exists():
            continue
        async with libdsec.AsyncClient(nats_url, tenant=account, creds=str(creds)) as client:
            live = [r for r in await client.list() if r.tenant == account]
            if live and not force:
                fail(f"{subjects.describe(account)} has {len(live)} live sandbox(es) "
                     f"({', '.join(r.sandbox_id for r in live[:5])}{' ...' if len(live) > 5 else ''}): "
                     f"destroy them, or pass --force")
            for rec in live:
                await (await client.get(rec.sandbox_id)).destroy()
            for pool in await client.warm_pools():   # (they kept their ready sandboxes and their names: T2)
                await client.delete_warm_pool(pool.spec.name)


@iam.group()
def tenant() -> None:
    """Add or remove tenants."""


@tenant.command("add")
@click.argument("name")
@state_dir_option
@click.option("--rate", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Control API requests/s (0: the default, 200); set it on the bus with `dsec iam set`.")
@ttl_option
def tenant_add(name: str, state_dir: Path, rate: float, ttl: float | None) -> None:
    """Add tenant NAME (its own NATS account) and write its credential."""
    found = _load(state_dir)
    path = found.add_tenant(name, rate=rate, ttl=ttl or 0.0)
    _apply(found, f"tenant {name} added; its credential: {path}")


@tenant.command("rm")
@click.argument("name")
@state_dir_option
@nats_option
@click.option("--force", is_flag=True, help="Destroy its live sandboxes (and its projects') first.")
@run_async
async def tenant_rm(name: str, state_dir: Path, nats_url: str, force: bool) -> None:
    """Remove tenant NAME and its projects: refused while any has live sandboxes, unless --force (which
    destroys them)."""
    found = _load(state_dir)
    found.tenant(name)
    await _clear(found, [*found.projects(name), name], nats_url, force)
    found.remove_tenant(name)
    _apply(found, f"tenant {name} removed")


@iam.group()
def project() -> None:
    """Add or remove IAM projects under a tenant (TENANT/PROJECT): each has its own credential and quota,
    counted against its tenant's, and sees only its own sandboxes; the tenant's credential sees them all."""


@project.command("add")
@click.argument("name", metavar="TENANT/PROJECT")
@state_dir_option
@click.option("--rate", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Control API requests/s (0: the default, 200), also taken from its tenant's rate.")
@ttl_option
def project_add(name: str, state_dir: Path, rate: float, ttl: float | None) -> None:
    """Add project PROJECT under TENANT (its own NATS account) and write its credential."""
    if name.count("/") != 1:
        fail(f"a project is named TENANT/PROJECT, got {name!r}")
    found = _load(state_dir)
    path = found.add_project(*name.split("/"), rate=rate, ttl=ttl or 0.0)
    _apply(found, f"project {name} added; its credential: {path}")


@project.command("rm")
@click.argument("name", metavar="TENANT/PROJECT")
@state_dir_option
@nats_option
@click.option("--force", is_flag=True, help="Destroy its live sandboxes first.")
@run_async
async def project_rm(name: str, state_dir: Path, nats_url: str, force: bool) -> None:
    """Remove project TENANT/PROJECT: refused while it has live sandboxes, unless --force (which destroys them)."""
    found = _load(state_dir)
    account = subjects.account_name(name)
    if "/" not in name or not found.tenant(account).parent:
        fail(f"no project {name!r} (a project is named TENANT/PROJECT; see `dsec iam ls`)")
    await _clear(found, [account], nats_url, force)
    found.remove_tenant(account)
    _apply(found, f"project {name} removed")


@iam.group()
def creds() -> None:
    """Issue and revoke credentials (PRINCIPAL: tenant:NAME, project:TENANT/PROJECT, admin, placement, ops or
    edge-NODE)."""


@creds.command("issue")
@click.argument("principal")
@state_dir_option
@click.option("--pool", default=None, help="For edge-NODE: the pool its edge serves (default local).")
@ttl_option
def creds_issue(principal: str, state_dir: Path, pool: str | None, ttl: float | None) -> None:
    """Write a new credential for PRINCIPAL; its earlier one stops working now."""
    found = _load(state_dir)
    principal = identities.principal_name(principal)
    if principal.startswith("tenant:"):
        path = found.issue_tenant(principal[7:], ttl or 0.0)
    else:
        path = found.issue_platform(principal, ttl or 0.0)
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


@iam.command("sweep")
@state_dir_option
def iam_sweep(state_dir: Path) -> None:
    """Take expired credentials out of the server's configuration and reload it (the server `dsec up`
    runs does this every second; run it from a timer beside a server of your own)."""
    _load(state_dir)
    n = iamserver.sweep(state_dir)
    click.echo(f"dsec: {n} expired credential(s) taken out" + (" (server reloaded)" if n else ""))


@iam.command("set")
@click.argument("name")
@state_dir_option
@nats_option
@click.option("--rate", default=None, type=click.FloatRange(min=0),
              help="Control API requests/s over all engines (0: the default, 200); past it: RateLimited.")
@click.option("--sandboxes", default=None, type=click.IntRange(min=0), help="Max concurrent sandboxes (0: none).")
@click.option("--cpu", default=None, type=click.FloatRange(min=0), help="Max cores in total (0: no limit).")
@click.option("--memory", default=None, type=Size(zero_ok=True), help="Max memory in total, e.g. 64Gi (0: no limit).")
@run_async
async def iam_set(name: str, state_dir: Path, nats_url: str, rate: float | None, sandboxes: int | None,
                  cpu: float | None, memory: int | None) -> None:
    """Set tenant (or TENANT/PROJECT) NAME's limits (kept in its quota record, read by every placement
    engine). A project's sandboxes and requests count against its own limits and its tenant's."""
    from placement import quota as quotas
    found = _load(state_dir)
    found.tenant(name)
    name = subjects.account_name(name)
    bus = await connect(nats_url, "dsec-iam", "admin", reconnect=False)
    try:
        changes = {k: v for k, v in (("rate", rate), ("max_sandboxes", sandboxes), ("max_cpu", cpu)) if v is not None}
        if memory is not None:
            changes["max_memory"] = memory
        q = await quotas.change_quota(bus, name, **changes)
    finally:
        await bus.close()
    if rate is not None:
        found.tenants[name].rate = rate
        found.save()
    click.echo(f"dsec: limits of {subjects.display_name(name)}: sandboxes={q.max_sandboxes or '-'} cpu={q.max_cpu or '-'} "
               f"memory={q.max_memory or '-'} rate={q.rate or 'default'}")

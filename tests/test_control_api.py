"""The control API: the SDK reads records, snapshots and warm pools only through `dsec.api.<tenant>.<verb>`,
each tenant sees only its own (filtered on the server), bad requests get one typed error, and a tenant
past its rate gets RateLimited while others are served."""
from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from nats.js.api import DeliverPolicy

import libdsec
from bus import streams, subjects
from bus.apiwire import MAX_PAGE, ListSandboxes, SandboxPage, api_reply_decoder
from bus.messages import ErrorReply
from bus.records import Quota, SandboxRecord
from placement import listing, quota as quotas


@pytest.fixture
async def other(stack):
    """A second tenant's client."""
    async with libdsec.AsyncClient(stack.url, tenant="tenant-b") as c:
        yield c


def no_store_access(client) -> None:
    """Make every KV and object-store call of this client's connection fail the test."""
    def refuse(name):
        def _refused(*a, **k):
            raise AssertionError(f"the SDK called {name}{a[:2]}: it must use the control API")
        return _refused
    for name in dir(client.bus):
        if name.startswith(("kv_", "obj_")) or name in ("kv",):
            setattr(client.bus, name, refuse(name))


async def test_a_tenant_sees_only_its_own_sandboxes_snapshots_and_pools(stack, client, other):
    no_store_access(client), no_store_access(other)
    sb = await client.create(labels={"job": "api-a"})
    try:
        snap = await sb.snapshot(tag="api-a-snap")
        await client.set_warm_pool("api-a-pool", min=0, max=0)
        try:
            assert sb.id in [r.sandbox_id for r in await client.list()]
            assert (await client.get(sb.id)).id == sb.id
            assert sb.id not in [r.sandbox_id for r in await other.list(all_states=True)]
            with pytest.raises(libdsec.SandboxNotFound) as err:
                await other.get(sb.id)
            assert err.value.reason == "never_existed"     # the same answer as for an id nobody has
            assert [s.id for s in await client.snapshots(tag="api-a-snap")] == [snap.id]
            assert await other.snapshots() == [] or snap.id not in [s.id for s in await other.snapshots()]
            for ref in (snap.id, "api-a-snap"):
                with pytest.raises(libdsec.ImageNotFound):
                    await other.snapshot(ref)
                with pytest.raises(libdsec.ImageNotFound):
                    await other.delete_snapshot(ref)
            with pytest.raises(libdsec.ImageNotFound):   # nor start from A's snapshot, record in hand
                await other.create(from_snapshot=snap, timeout=5)
            assert "api-a-pool" in [p.spec.name for p in await client.warm_pools()]
            assert "api-a-pool" not in [p.spec.name for p in await other.warm_pools()]
            with pytest.raises(libdsec.InvalidRequest, match="no warm pool"):
                await other.delete_warm_pool("api-a-pool")
            # B names a pool of its own as it likes: one of A's names tells it nothing, squats nothing (helper A3:
            # "taken by another tenant"), and the two pools are each their tenant's alone
            await other.set_warm_pool("api-a-pool", min=0, max=1)
            try:
                assert [(p.spec.name, p.spec.max) for p in await other.warm_pools()] == [("api-a-pool", 1)]
                assert [p.spec.max for p in await client.warm_pools() if p.spec.name == "api-a-pool"] == [0]
            finally:
                await other.delete_warm_pool("api-a-pool")
            assert [p.spec.max for p in await client.warm_pools() if p.spec.name == "api-a-pool"] == [0]
            assert await client.snapshot(snap.id) == snap        # A's own still are
        finally:
            await client.delete_warm_pool("api-a-pool")
    finally:
        await sb.destroy()
    await client.delete_snapshot(snap.id)
    assert await client.snapshots(tag="api-a-snap") == []


async def test_list_pages_and_filters_on_the_server(stack, client):
    """1,200 records of one tenant come back complete and in order through pages of at most MAX_PAGE;
    states and labels are filtered by the server."""
    tenant = "paged"
    now = time.time()
    recs = [SandboxRecord(sandbox_id=f"sb-page-{i:04d}", tenant=tenant, state="destroyed" if i % 3 else "failed",
                          labels={"n": str(i % 2)}, created_at=now + i * 1e-3) for i in range(1200)]
    await asyncio.gather(*(stack.bus.kv_put(streams.SANDBOXES_KV, subjects.record_key(tenant, r.sandbox_id), r) for r in recs))
    try:
        async with libdsec.AsyncClient(stack.url, tenant=tenant) as c:
            no_store_access(c)
            got = await c.list(all_states=True)
            assert [r.sandbox_id for r in got] == [r.sandbox_id for r in recs]
            assert await c.list() == []                           # none is ready
            odd = await c.list(all_states=True, labels={"n": "1"})
            assert [r.sandbox_id for r in odd] == [r.sandbox_id for r in recs if r.labels["n"] == "1"]
            data = await stack.bus.request(subjects.api(tenant, "sandbox-list"), ListSandboxes(states=["failed"]), 5)
            page = api_reply_decoder.decode(data)
            assert isinstance(page, SandboxPage) and len(page.records) == 400 and not page.next_token
            assert all(r.state == "failed" for r in page.records)
            data = await stack.bus.request(subjects.api(tenant, "sandbox-list"), ListSandboxes(), 5)
            page = api_reply_decoder.decode(data)
            assert len(page.records) == MAX_PAGE and page.next_token
    finally:
        await asyncio.gather(*(stack.bus.kv_delete(streams.SANDBOXES_KV, subjects.record_key(tenant, r.sandbox_id)) for r in recs))


async def test_lists_of_running_sandboxes_read_what_runs_and_a_full_list_reads_each_record_once(stack):
    """Helper S2's soak: a list of running sandboxes, a quota, `dsec ls` read every record the bucket kept for
    two days, and a list of every state read them all again for each page (past about 80,000 records a
    request timed out). The engine's connection counts what it received: a list of the running costs what
    runs, and a whole list of every state about one message per record. Read-your-writes holds: a sandbox
    a create just returned is listed, one just destroyed is not."""
    tenant, n = "paged", 3000
    now = time.time()
    old = [SandboxRecord(sandbox_id=f"sb-old-{i:05d}", tenant=tenant, state="destroyed", created_at=now - 3600 + i)
           for i in range(n)]
    await asyncio.gather(*(stack.bus.kv_put(streams.SANDBOXES_KV, subjects.record_key(tenant, r.sandbox_id), r)
                           for r in old))
    engine = stack.placement.bus.nc

    async def received(call):
        before = engine.stats["in_msgs"]
        out = await call
        return out, engine.stats["in_msgs"] - before
    sbs = []
    try:
        async with libdsec.AsyncClient(stack.url, tenant=tenant) as c:
            for _ in range(3):
                sbs.append(await c.create())
                listed, cost = await received(c.list())
                assert [r.sandbox_id for r in listed] == [sb.id for sb in sbs]
                assert cost < 200, cost
            usage, cost = await received(c.quota())
            assert usage.sandboxes == 3 and cost < 200, (usage, cost)
            gone = sbs.pop()
            await gone.destroy()
            assert [r.sandbox_id for r in await c.list()] == [sb.id for sb in sbs]
            everything, cost = await received(c.list(all_states=True))
            info = await stack.bus.js.stream_info(f"KV_{streams.SANDBOXES_KV}",
                                                  subjects_filter=f"$KV.{streams.SANDBOXES_KV}.{tenant}.>")
            stored = sum((info.state.subjects or {}).values())   # (with earlier tests' delete markers)
            assert cost < stored + 100, (cost, stored)   # by id: 7 pages of every record each, 21,000
            assert {r.sandbox_id: r.state for r in everything} == {
                **{r.sandbox_id: "destroyed" for r in old}, gone.id: "destroyed", **{sb.id: "ready" for sb in sbs}}
            # a record written while the pages are read comes again, later: the later wins
            first = api_reply_decoder.decode(await stack.bus.request(
                subjects.api(tenant, "sandbox-list"), ListSandboxes(states=[], limit=10), 5))
            moved = msgspec.structs.replace(first.records[0], labels={"moved": "1"})
            await stack.bus.kv_put(streams.SANDBOXES_KV, subjects.record_key(tenant, moved.sandbox_id), moved)
            seen, token = [r.sandbox_id for r in first.records], first.next_token
            while token:
                page = api_reply_decoder.decode(await stack.bus.request(
                    subjects.api(tenant, "sandbox-list"), ListSandboxes(states=[], next_token=token), 5))
                seen += [r.sandbox_id for r in page.records]
                token = page.next_token
            assert len(set(seen)) == n + 3 and seen.count(moved.sandbox_id) == 2 and seen[-1] == moved.sandbox_id
            while sbs:
                await sbs.pop().destroy()
            assert await c.list() == [] and (await c.quota()).sandboxes == 0
        assert stack.placement.api.listings.index.fallbacks == 0
    finally:
        await asyncio.gather(*(sb.destroy() for sb in sbs), return_exceptions=True)
        await asyncio.gather(*(stack.bus.kv_delete(streams.SANDBOXES_KV, subjects.record_key(tenant, r.sandbox_id))
                               for r in old))


async def test_an_index_that_stops_hearing_the_bucket_is_loaded_afresh_or_not_used(stack, monkeypatch):
    """The engine's live index loses its watch (its consumer deleted on the server, as a server that died
    with it would): a list right after a create still holds that sandbox, because the index, found behind,
    is loaded afresh. An index that cannot catch up at all is not used: the list reads the bucket."""
    index = stack.placement.api.listings.index
    admin = stack.bus.js
    async with libdsec.AsyncClient(stack.url, tenant="paged") as c:
        sbs = [await c.create()]
        watches = [ci.name for ci in await admin.consumers_info(f"KV_{streams.SANDBOXES_KV}")
                   if ci.config.filter_subject == f"$KV.{streams.SANDBOXES_KV}.>"
                   and ci.config.deliver_policy == DeliverPolicy.LAST_PER_SUBJECT]
        assert watches
        for name in watches:
            await admin.delete_consumer(f"KV_{streams.SANDBOXES_KV}", name)
        try:
            sbs.append(await c.create())
            assert [r.sandbox_id for r in await c.list()] == [sb.id for sb in sbs]
            assert index.fallbacks == 0
            api = stack.placement.api
            api._index.cancel()   # no watch at all from here on
            await asyncio.gather(api._index, return_exceptions=True)
            monkeypatch.setattr(listing, "CATCH_UP", 0.2)
            monkeypatch.setattr(listing, "RELOAD", 0.2)
            await sbs.pop().destroy()
            assert [r.sandbox_id for r in await c.list()] == [sbs[0].id]
            assert (await c.quota()).sandboxes == 1 and index.fallbacks == 2
        finally:
            for sb in sbs:
                await sb.destroy()
            if stack.placement.api._index.done():
                stack.placement.api._index = await index.start()
    monkeypatch.undo()
    async with libdsec.AsyncClient(stack.url, tenant="paged") as c:
        assert await c.list() == []


@pytest.mark.parametrize("subject,payload,code,says", [
    ("dsec.api.t1.bogus", b"{}", "invalid_request", "unknown control verb"),
    ("dsec.api.t1.sandbox-get", b"not json", "invalid_request", "undecodable"),
    ("dsec.api.t1.sandbox-get", b'{"kind":"list_sandboxes"}', "invalid_request", "takes a GetSandbox"),
    ("dsec.api.t1.sandbox-get", b'{"kind":"get_sandbox","sandbox_id":"../x"}', "invalid_request", "sandbox_id"),
    ("dsec.api.t1.sandbox-list", b'{"kind":"list_sandboxes","limit":100000}', "invalid_request", "limit"),
    ("dsec.api.t1.sandbox-list", b'{"kind":"list_sandboxes","states":["zombie"]}', "invalid_request", "states"),
    ("dsec.api.t1.sandbox-list", b'{"kind":"list_sandboxes","next_token":"x|y"}', "invalid_request", "next_token"),
    ("dsec.api.t1.snapshot-get", b'{"kind":"get_snapshot","ref":""}', "invalid_request", "snapshot"),
])
async def test_bad_control_requests_get_one_typed_error(stack, subject, payload, code, says):
    m = await stack.bus.nc.request(subject, payload, timeout=5)
    reply = api_reply_decoder.decode(m.data)
    assert isinstance(reply, ErrorReply) and reply.code == code and says in reply.message, reply
    # and the service still answers
    data = await stack.bus.request(subjects.api("t1", "sandbox-list"), ListSandboxes(), 5)
    assert isinstance(api_reply_decoder.decode(data), SandboxPage)


async def test_a_tenant_past_its_rate_is_refused_and_others_are_served(stack, client):
    await quotas.set_quota(stack.bus, Quota(tenant="flooder", rate=20))
    try:
        await asyncio.sleep(0.3)   # the engines' quota watch
        async with libdsec.AsyncClient(stack.url, tenant="flooder") as flood:
            results = await asyncio.gather(*(flood.list() for _ in range(300)), return_exceptions=True)
            limited = [r for r in results if isinstance(r, libdsec.RateLimited)]
            assert limited and isinstance(limited[0], libdsec.QuotaExceeded), results[:3]
            assert "rate of 20" in str(limited[0])
            assert all(isinstance(r, (list, libdsec.RateLimited)) for r in results), results
            sb = await client.create()         # the other tenant meanwhile
            assert sb.id in [r.sandbox_id for r in await client.list()]
            await sb.destroy()
    finally:
        await stack.bus.kv_delete(streams.QUOTAS_KV, "flooder")


def test_the_sdk_uses_no_bucket_store_or_server_package():
    """Static half of the check above: libdsec names no KV bucket or object store and imports no server
    package (it must run with only the control API and the lanes)."""
    import pathlib
    root = pathlib.Path(libdsec.__file__).parent
    for path in root.glob("*.py"):
        text = path.read_text()
        for bad in ("kv_get", "kv_put", "kv_items", "kv_delete", "obj_", "_KV", "LAYERS_OBJ", "import placement",
                    "from placement", "from edge", "import edge"):
            assert bad not in text, f"{path.name} uses {bad}"


async def test_records_of_the_earlier_layout_move_to_tenant_keys(stack):
    """A sandbox and a snapshot record stored under their bare ids (before <tenant>.<id>) are moved at
    provisioning, and read through the API afterwards; running it again changes nothing."""
    from bus import migrations
    from bus.records import SnapshotRecord
    rec = SandboxRecord(sandbox_id="sb-legacy-1", tenant="legacy", state="destroyed", created_at=time.time())
    snap = SnapshotRecord(id="snap-legacy-1", tenant="legacy", created_at=time.time())
    await stack.bus.kv_put(streams.SANDBOXES_KV, rec.sandbox_id, rec)
    await stack.bus.kv_put(streams.SNAPSHOTS_KV, snap.id, snap)
    try:
        assert await migrations.record_keys(stack.bus) == 2
        assert await migrations.record_keys(stack.bus) == 0
        assert await stack.bus.kv_get(streams.SANDBOXES_KV, rec.sandbox_id) is None
        async with libdsec.AsyncClient(stack.url, tenant="legacy") as c:
            assert [r.sandbox_id for r in await c.list(all_states=True)] == [rec.sandbox_id]
            assert (await c._record(rec.sandbox_id)).state == "destroyed"
            assert (await c.snapshot(snap.id)).id == snap.id
    finally:
        for bucket, key in ((streams.SANDBOXES_KV, rec.sandbox_id), (streams.SNAPSHOTS_KV, snap.id)):
            await stack.bus.kv_delete(bucket, key)
            await stack.bus.kv_delete(bucket, subjects.record_key("legacy", key))


async def test_the_move_to_tenant_keys_takes_the_place_of_a_tombstone(stack):
    """A freed claim leaves a tombstone under the new key: the move still happens, and the bare key is
    deleted only once the new key holds the record."""
    from bus import migrations
    rec = SandboxRecord(sandbox_id="sb-legacy-2", tenant="legacy", state="destroyed", created_at=time.time())
    new = subjects.record_key("legacy", rec.sandbox_id)
    await stack.bus.kv_put(streams.SANDBOXES_KV, new, rec)
    await stack.bus.kv_delete(streams.SANDBOXES_KV, new)           # the tombstone
    await stack.bus.kv_put(streams.SANDBOXES_KV, rec.sandbox_id, rec)
    try:
        assert await migrations.record_keys(stack.bus) == 1
        assert await stack.bus.kv_get(streams.SANDBOXES_KV, new) is not None
        assert await stack.bus.kv_get(streams.SANDBOXES_KV, rec.sandbox_id) is None
    finally:
        for key in (rec.sandbox_id, new):
            await stack.bus.kv_delete(streams.SANDBOXES_KV, key)


async def test_a_rate_below_one_a_second_still_lets_requests_through_and_errors_are_counted(stack, client):
    await quotas.set_quota(stack.bus, Quota(tenant="slow", rate=0.2))
    try:
        await asyncio.sleep(0.3)
        async with libdsec.AsyncClient(stack.url, tenant="slow") as slow:
            assert await slow.list() == []
            with pytest.raises(libdsec.RateLimited):
                await slow.list()
    finally:
        await stack.bus.kv_delete(streams.QUOTAS_KV, "slow")
    before = stack.placement.api.outcomes[("sandbox-get", "sandbox_not_found")]
    with pytest.raises(libdsec.SandboxNotFound):
        await client.get("sb-nobody-has-this")
    assert stack.placement.api.outcomes[("sandbox-get", "sandbox_not_found")] == before + 1


async def test_a_tenant_reads_its_own_quota_and_what_it_holds(stack):
    await quotas.set_quota(stack.bus, Quota(tenant="quota-t", max_sandboxes=3, rate=50))
    try:
        await asyncio.sleep(0.3)
        async with libdsec.AsyncClient(stack.url, tenant="quota-t") as c, \
                libdsec.AsyncClient(stack.url, tenant="quota-u") as u:
            no_store_access(c)
            async with await c.create(resources=libdsec.Resources(cpu=0.5, memory="128Mi")):
                q = await c.quota()
                assert (q.quota.max_sandboxes, q.quota.rate, q.sandboxes, q.cpu, q.memory) == (3, 50, 1, 0.5, 128 << 20)
                theirs = await u.quota()
                assert (theirs.quota.max_sandboxes, theirs.sandboxes) == (0, 0)
            assert (await c.quota()).sandboxes == 0
    finally:
        await stack.bus.kv_delete(streams.QUOTAS_KV, "quota-t")


async def test_lists_at_the_rate_the_api_allows_leave_no_consumers_behind(stack):
    """Each list is an ordered pass over the bucket (an ephemeral consumer): 1,500 of them in a few seconds
    (several tenants at their rate) must all answer, and leave the stream's consumers as they were
    (left to the server's inactivity timer, they reached its limit of 1,000 and every list failed)."""
    stream = f"KV_{streams.SANDBOXES_KV}"
    await stack.bus.kv_put(streams.SANDBOXES_KV, "lister.sb-probe", b"{}")
    before = (await stack.bus.js.stream_info(stream)).state.consumer_count
    try:
        for _ in range(1500):
            assert len(await stack.bus.kv_items(streams.SANDBOXES_KV, prefix="lister")) == 1
    finally:
        await stack.bus.kv_delete(streams.SANDBOXES_KV, "lister.sb-probe")
    for _ in range(50):   # the deletes are sent without waiting for their answers
        left = (await stack.bus.js.stream_info(stream)).state.consumer_count
        if left <= before:
            break
        await asyncio.sleep(0.05)
    assert left <= before, f"{left - before} listing consumers left on {stream}"

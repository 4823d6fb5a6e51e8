"""The TTL loop's deadlines (edge/deadlines.py): a tick looks only at the sandboxes that came due."""
from __future__ import annotations

from edge.deadlines import Deadlines


def test_a_tick_looks_only_at_what_came_due_not_at_every_sandbox():
    deadlines, asked = Deadlines(), []
    truth = {f"sb{i}": 1000.0 + i for i in range(10_000)}    # 10,000 sandboxes, deadlines 1000..10999

    def deadline_of(sid):
        asked.append(sid)
        return truth.get(sid)

    for sid in truth:
        deadlines.look(sid)                                   # created: looked at on the next tick
    assert deadlines.due(10.0, deadline_of) == [] and len(asked) == 10_000   # each read once, all ahead
    asked.clear()
    for now in (11.0, 500.0, 999.5):                          # ticks before any deadline read nothing
        assert deadlines.due(now, deadline_of) == []
    assert asked == []
    assert sorted(deadlines.due(1003.5, deadline_of)) == ["sb0", "sb1", "sb2", "sb3"]
    assert sorted(asked) == ["sb0", "sb1", "sb2", "sb3"]
    assert len(deadlines) == 10_000 - 4                       # the due ones have no entry until looked at again


def test_a_change_is_looked_at_at_once_and_a_later_deadline_waits_for_its_time():
    deadlines, truth = Deadlines(), {"a": 100.0}
    deadlines.look("a")
    assert deadlines.due(50.0, truth.get) == []               # read: due at 100
    truth["a"] = 60.0                                         # set_timeout: sooner
    deadlines.look("a")
    assert deadlines.due(55.0, truth.get) == []               # read again at once: due at 60
    assert deadlines.due(60.0, truth.get) == []               # not yet: the old rule is "deadline < now"
    assert deadlines.due(60.5, truth.get) == ["a"]
    assert deadlines.due(1000.0, truth.get) == []             # once: no entry left for it
    deadlines.look("a", 2000.0)                               # the loop's retry look after an attempt
    deadlines.look("a", 1500.0)                               # a sooner one replaces it (the later is stale)
    assert deadlines.due(1600.0, truth.get) == ["a"] and deadlines.due(2500.0, truth.get) == []


def test_a_sandbox_gone_ending_or_without_a_ttl_is_dropped():
    deadlines, truth = Deadlines(), {"a": 5.0, "b": None}
    for sid in ("a", "b", "c"):
        deadlines.look(sid)
    del truth["a"]                                            # destroyed meanwhile
    assert deadlines.due(10.0, truth.get) == [] and len(deadlines) == 0
    assert deadlines.due(10_000.0, truth.get) == []


def test_next_at_is_the_soonest_live_entry():
    deadlines = Deadlines()
    assert deadlines.next_at() == float("inf")
    deadlines.look("a", 50.0)
    deadlines.look("b", 20.0)
    deadlines.look("a", 10.0)                                 # a sooner look replaces a's entry at 50
    assert deadlines.next_at() == 10.0
    assert deadlines.due(15.0, {"a": 12.0, "b": 30.0}.get) == ["a"]
    assert deadlines.next_at() == 20.0


async def test_a_sandbox_expires_on_time_not_at_the_next_half_second_tick(client):
    """The record of a sandbox that reached its TTL is written within a blink of its expiry (its updated_at,
    on the edge's clock): the loop wakes at the soonest deadline (before: at its next 0.5 s tick, up to 0.5 s
    later, while E2B's is_running() and get() still said it ran)."""
    import asyncio
    boxes = [await client.create(ttl=1.0 + 0.13 * i) for i in range(6)]
    lags = []
    for sb in boxes:
        for _ in range(200):
            rec = await client._record(sb.id)
            if rec.state != "ready":
                break
            await asyncio.sleep(0.05)
        assert rec.state == "expired", rec
        lags.append(rec.updated_at - rec.expires_at)
    assert max(lags) < 0.25, [f"{x:.3f}" for x in lags]

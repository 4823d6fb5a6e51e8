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

"""The proxy's session table: bounded by count, lapsing idle, forgetting closed sessions, so a
proxy that runs for days holds only the sessions that are alive."""

from __future__ import annotations

from agentserving.proxy.sessions import SessionTable
from testkit.clock import ManualClock


def test_sessions_idle_past_the_ttl_are_forgotten_the_rest_kept() -> None:
    clock = ManualClock(1000.0)
    table = SessionTable(100, idle_ttl_s=60, clock=clock)
    table.get("a").turns = 3
    clock.now += 40
    table.get("b").turns = 1
    clock.now += 30  # a idle 70 s, b 30 s
    table.get("c")
    assert table.peek("a") is None and table.peek("b").turns == 1 and len(table) == 2
    clock.now += 50  # b idle 80 s, c 50 s; a turn of c keeps it
    assert table.get("c") is table.peek("c") and table.peek("b") is None
    assert len(table) == 1


def test_a_used_session_moves_to_the_back_and_the_bound_drops_the_least_recent() -> None:
    clock = ManualClock(1000.0)
    table = SessionTable(2, idle_ttl_s=None, clock=clock)
    table.get("a")
    table.get("b")
    table.get("a")  # a is now the most recent
    table.get("c")
    assert table.peek("b") is None and table.peek("a") is not None and len(table) == 2
    clock.now += 10**9  # no TTL: nothing lapses
    table.get("a")
    assert table.peek("c") is not None


def test_a_closed_session_is_forgotten_at_once() -> None:
    table = SessionTable(10, idle_ttl_s=3600)
    table.get("a").turns = 5
    table.forget("a")
    table.forget("never-seen")
    assert table.peek("a") is None and len(table) == 0
    assert table.get("a").turns == 0  # a new session of that id starts afresh

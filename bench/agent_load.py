"""Agents that loop through the proxy, each running sessions back to back: a long first turn,
short appends, and a last turn that closes the session (``agent_memory.close_session``), as on
a long-lived service where sessions begin and end all the time. Shared by the soak and the
concurrency benches; each turn's latency and outcome is kept."""

from __future__ import annotations

import argparse
import random
import threading
import time
from typing import Any

import httpx


def add_workload_args(parser: argparse.ArgumentParser, turns: int = 5, first_tokens: int = 1000,
                      append_tokens: int = 200) -> None:
    """The agents' session shape, as every bench running them takes it (each its own sizes)."""
    parser.add_argument("--turns", type=int, default=turns, help="Turns per session.")
    parser.add_argument("--first-tokens", type=int, default=first_tokens,
                        help="Prompt tokens of a session's first turn.")
    parser.add_argument("--append-tokens", type=int, default=append_tokens,
                        help="Tokens each later turn appends.")


class AgentLoad:
    @classmethod
    def from_args(cls, proxy: str, agents: int, args: argparse.Namespace) -> AgentLoad:
        """``agents`` agents running sessions of the shape ``add_workload_args`` parsed."""
        return cls(proxy, agents, args.turns, args.first_tokens, args.append_tokens)

    def __init__(self, proxy: str, agents: int, turns: int, first_tokens: int,
                 append_tokens: int, max_tokens: int = 8) -> None:
        self.proxy = proxy
        self.turns_per_session, self.max_tokens = turns, max_tokens
        self.first_tokens, self.append_tokens = first_tokens, append_tokens
        self.stop = threading.Event()
        self.turns = self.sessions = self.failed = 0
        self.errors: dict[str, int] = {}
        self.answered: list[tuple[float, float]] = []  # (monotonic end, end-to-end ms)
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._agent, args=(i,), daemon=True)
                         for i in range(agents)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def _agent(self, i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(timeout=120) as http:
            n = 0
            while not self.stop.is_set():
                self._session(http, rng, f"agent-{i}-{n}")
                n += 1

    def _session(self, http: httpx.Client, rng: random.Random, sid: str) -> None:
        context = [rng.randrange(10, 30000) for _ in range(self.first_tokens)]
        for k in range(self.turns_per_session):
            last = k == self.turns_per_session - 1
            body: dict[str, Any] = {"model": "tiny", "prompt": context,
                                    "max_tokens": self.max_tokens}
            if last:
                body["agent_memory"] = {"close_session": True}
            start = time.perf_counter()
            try:
                r = http.post(self.proxy + "/v1/completions", json=body,
                              headers={"x-session-id": sid})
                ok, why = r.status_code == 200, f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                ok, why = False, type(exc).__name__
            end = time.perf_counter()
            with self._lock:
                self.turns += 1
                if ok:
                    self.answered.append((end, (end - start) * 1e3))
                else:
                    self.failed += 1
                    self.errors[why] = self.errors.get(why, 0) + 1
                if last:
                    self.sessions += 1
            if not ok or self.stop.is_set():
                return
            context = context + [rng.randrange(10, 30000) for _ in range(self.append_tokens)]

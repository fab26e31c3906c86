"""Whether a pod that has gone quiet on a turn is busy or stopped.

A deadline alone cannot tell them apart. A pod computing other turns' prompts leaves a stream
without a token for as long as those steps take, and that is longer on a slower machine or a
busier pool than any deadline learned elsewhere: in the main job on a machine 1.6x slower than
the one its deadlines were tuned on, three streams of busy vLLM pods were cut as stalled. A
stopped pod (``SIGSTOP``, a frozen cgroup, a node that no longer schedules it) takes the
request and never answers; with no token count to bound it (a blocking turn without
``max_tokens``) nothing ended the wait but the client's own timeout.

What tells them apart is the pod's own server. Its API process answers ``GET /v1/models`` from
its event loop while its engine computes (vLLM's API server and the reference worker both run
the engine in a process of its own), and a stopped process answers nothing. So a deadline
only raises the question: a pod is stalled when a turn found it silent past the deadline *and*
it did not answer a probe within ``timeout_s``. While it answers, the turn waits on (another
deadline, then another probe), so no turn is cut on a pod that is alive, at any machine speed.

Not covered: an engine wedged while its API process still answers (a hung forward pass). Its
turns wait for ``--upstream-timeout``; vLLM's own engine-death check answers 5xx, which fails
the turn over as any error does.

Every turn silent on the same pod shares one probe in flight, and an answer is taken as good
for ``fresh_s``: a pod with dozens of quiet streams gets one probe per interval, not dozens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp


class PodLiveness:
    """``answers(url)``: did the pod at ``url`` answer a probe just now (or within
    ``fresh_s``)? The probe itself is injected (``http_probe`` in the proxy)."""

    def __init__(self, probe: Callable[[str], Awaitable[bool]], fresh_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._probe = probe
        self.fresh_s = fresh_s
        self._clock = clock
        self._answered_at: dict[str, float] = {}
        self._inflight: dict[str, asyncio.Future[bool]] = {}

    async def answers(self, url: str) -> bool:
        seen = self._answered_at.get(url)
        if seen is not None and self._clock() - seen < self.fresh_s:
            return True
        probe = self._inflight.get(url)
        if probe is None:
            probe = asyncio.ensure_future(self._probe(url))
            self._inflight[url] = probe
            probe.add_done_callback(lambda _done: self._inflight.pop(url, None))
        # shielded: a turn that stops waiting (its answer came) leaves the probe to the others
        answered = await asyncio.shield(probe)
        if answered:
            self._answered_at[url] = self._clock()
        else:
            self._answered_at.pop(url, None)
        return answered


async def http_probe(http: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
    """Whether the pod's server answers ``GET /v1/models`` at all within ``timeout_s``: any
    status counts (a 503 comes from a process that runs; a refused connection or silence
    does not)."""
    try:
        async with http.get(url + "/v1/models",
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
            return True
    except (TimeoutError, aiohttp.ClientError):
        return False

"""The end-to-end tests' order and the pace they share.

The shared vLLM fleet's tests (e2e/vllm) run first among the end-to-end tests: that fleet
measures this machine's prefill rate, which the log shows before any vLLM test runs and the
later vLLM tests (on the test node, in ``agentserving compare``) stretch their bounds by
(``vllm_pace``); and it is stopped when its package ends, before the node's or compare's vLLM
pods start, so their memory never adds up.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.pace import STASH_KEY, Pace

HERE = Path(__file__).resolve().parent
FIRST = HERE / "vllm"


def _under(item: pytest.Item, folder: Path) -> bool:
    return folder in Path(str(item.path)).resolve().parents


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    e2e = [i for i, item in enumerate(items) if _under(item, HERE)]
    if not e2e:
        return
    ordered = sorted((items[i] for i in e2e), key=lambda item: not _under(item, FIRST))
    for i, item in zip(e2e, ordered, strict=True):
        items[i] = item


@pytest.fixture(scope="session")
def vllm_pace(request: pytest.FixtureRequest) -> Pace:
    """This machine's pace as the shared vLLM fleet measured it (unmeasured: bounds as set).
    First asked for after that fleet's tests, which run first among the e2e tests."""
    return request.config.stash.get(STASH_KEY, Pace())


def _on_vllm(item: pytest.Item) -> bool:
    return _under(item, FIRST) or "vllm_pace" in getattr(item, "fixturenames", ())


def _own_timeout(item: pytest.Item) -> float:
    """The timeout the test would get: its closest marker's, else the ini's (0: none)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        return float(marker.args[0] if marker.args else marker.kwargs.get("timeout") or 0)
    return float(item.config.getini("timeout") or 0)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ANN201
    """A vLLM test's own timeout stretched by the measured pace, as its waits are (before
    pytest-timeout reads it)."""
    measured = item.config.stash.get(STASH_KEY, None)
    if measured is not None and measured.factor > 1 and _on_vllm(item):
        if timeout := _own_timeout(item):
            item.add_marker(pytest.mark.timeout(timeout * measured.factor))
    yield


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    measured = config.stash.get(STASH_KEY, None)
    if measured is not None:
        terminalreporter.write_line(measured.describe())

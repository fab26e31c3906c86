"""Fixtures for the worker's in-process tests: the tiny model (loaded once), and engine
cores over real LMCache CPU + disk tiers in a temporary directory."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# LMCache reads its log level at import; keep test output readable.
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

from agentserving.engine.builder import EngineParts, build_engine  # noqa: E402
from agentserving.engine.model.loader import ModelBundle, load_model  # noqa: E402
from agentserving.engine.settings import WorkerSettings  # noqa: E402

torch.set_num_threads(1)  # two shared cores: no OpenMP spinning against other tests


@pytest.fixture(scope="session")
def tiny() -> ModelBundle:
    return load_model("tiny")


def make_settings(tmp: Path, **overrides: object) -> WorkerSettings:
    base: dict[str, object] = dict(cpu_cache_gib=0.25, disk_cache_dir=tmp / "disk",
                                   disk_cache_gib=0.5, pod_name=tmp.name)
    base.update(overrides)
    return WorkerSettings(**base)  # type: ignore[arg-type]


@pytest.fixture
def engine_factory(tmp_path: Path, tiny: ModelBundle) -> Iterator[Callable[..., EngineParts]]:
    built: list[EngineParts] = []

    def make(**overrides: object) -> EngineParts:
        parts = build_engine(make_settings(tmp_path / f"e{len(built)}", **overrides),
                             bundle=tiny)
        parts.core.capture_logits = True
        built.append(parts)
        return parts

    yield make
    for parts in built:
        parts.close()

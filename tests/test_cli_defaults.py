"""Each service's command line and its settings object share one default per knob:
``core.cli.settings_option`` reads it from the settings field, and this holds every command to
that, so a knob's default cannot be written a second time and drift."""

from __future__ import annotations

import dataclasses
import enum

import click
import pytest
from click.testing import CliRunner
from pydantic import BaseModel

from agentserving.core.cli import field_default, settings_option
from agentserving.engine.cli import command as worker
from agentserving.engine.kvserver.cli import command as kvserver
from agentserving.engine.kvserver.settings import KvServerSettings
from agentserving.engine.settings import WorkerSettings
from agentserving.kvindex.cli import command as kvindex
from agentserving.kvindex.settings import KvindexSettings
from agentserving.operator.cli import command as operator
from agentserving.operator.settings import OperatorSettings
from agentserving.proxy.cli import command as proxy
from agentserving.proxy.settings import ProxySettings

COMMANDS = [(kvindex, KvindexSettings), (proxy, ProxySettings), (worker, WorkerSettings),
            (operator, OperatorSettings), (kvserver, KvServerSettings)]


def _fields(settings: type) -> set[str]:
    if isinstance(settings, type) and issubclass(settings, BaseModel):
        return set(settings.model_fields)
    return {f.name for f in dataclasses.fields(settings)}


@pytest.mark.parametrize("command, settings", COMMANDS, ids=lambda x: getattr(x, "name", ""))
def test_every_option_of_a_setting_has_the_settings_default(command, settings):
    checked = 0
    for param in command.params:
        if not isinstance(param, click.Option) or param.name not in _fields(settings):
            continue
        want = field_default(settings, param.name)
        want = want.value if isinstance(want, enum.Enum) else want
        if isinstance(want, (list, tuple, dict)) and not want:
            assert param.default in (None, (), []) or param.default is click.core.UNSET, \
                param.name
        else:
            assert param.default == want, f"--{param.name}: {param.default!r} != {want!r}"
        checked += 1
    assert checked >= 8  # the command is settings-backed at all


class Mode(enum.StrEnum):
    FAST = "fast"


class Model(BaseModel):
    port: int = 8300
    mode: Mode = Mode.FAST
    urls: list[str] = []


@dataclasses.dataclass(frozen=True)
class Plain:
    timeout_s: float = 5.0
    names: tuple[str, ...] = ()


def _default_of(command: click.Command, name: str):  # type: ignore[no-untyped-def]
    return next(p for p in command.params if p.name == name).default


def test_settings_option_reads_pydantic_and_dataclass_defaults():
    model, plain = settings_option(Model), settings_option(Plain)

    @click.command()
    @model("--port", type=int)
    @model("--mode", type=click.Choice(["fast"]))
    @model("--url", "urls", multiple=True)
    @plain("--timeout", "timeout_s", type=float)
    @plain("--name", "names", multiple=True)
    def cmd(**kw):  # type: ignore[no-untyped-def]
        click.echo(repr(sorted(kw.items())))

    assert _default_of(cmd, "port") == 8300 and _default_of(cmd, "mode") == "fast"
    assert _default_of(cmd, "timeout_s") == 5.0
    out = CliRunner().invoke(cmd, [])
    assert out.exit_code == 0 and "('port', 8300)" in out.output \
        and "('urls', ())" in out.output and "('timeout_s', 5.0)" in out.output


def test_settings_option_refuses_a_second_default_and_an_unknown_field():
    with pytest.raises(TypeError, match="--port: the default is Model's"):
        settings_option(Model)("--port", default=1)
    with pytest.raises(KeyError):
        settings_option(Model)("--nope")

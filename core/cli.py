"""The `agentserving` command: one subcommand per deployable unit, loaded lazily.

Each subcommand lives beside the service it runs (``agentserving.<unit>.cli:command``) and is
imported only when invoked, so ``agentserving kvindex`` never imports torch. Every flag can
also be given as an environment variable ``AGENTSERVING_<SUBCOMMAND>_<FLAG>`` (click's
auto_envvar_prefix); ``--help`` shows each variable's name.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from enum import Enum
from typing import Any

import click

# name -> "module:attribute" of a click.Command
SUBCOMMANDS: dict[str, str] = {
    "chunk-hashes": "agentserving.core.hash_cli:command",
    "kvindex": "agentserving.kvindex.cli:command",
    "kvserver": "agentserving.engine.kvserver.cli:command",
    "operator": "agentserving.operator.cli:command",
    "worker": "agentserving.engine.cli:command",
    "models": "agentserving.engine.model_cli:command",
    "proxy": "agentserving.proxy.cli:command",
    "replay": "agentserving.replay.cli:command",
    "report": "agentserving.replay.report_cli:command",
    "trace": "agentserving.replay.trace_cli:command",
    "up": "agentserving.replay.fleet.cli:command",
    "compare": "agentserving.replay.compare:command",
    "sim": "agentserving.sim.cli:command",
}

# Every option shows its default and its environment variable in --help.
option = functools.partial(click.option, show_default=True, show_envvar=True)


def settings_option(settings: type) -> Callable[..., Callable[[Any], Any]]:
    """``option`` for the fields of ``settings`` (a pydantic model or a dataclass), each
    default read from its field: a knob's default is written once, where the settings object
    that validates it is, and ``--help`` shows that one. The field is the option's Python name
    (``"lease_ttl_s"`` in the declarations, or the long flag's); an empty collection is no
    default (click's own for a repeatable flag). Use: ``setting = settings_option(S)``, then
    ``@setting("--port", type=..., help=...)``."""

    def setting(*decls: str, **kwargs: Any) -> Callable[[Any], Any]:
        if "default" in kwargs:
            raise TypeError(f"{decls[0]}: the default is {settings.__name__}'s, not the option's")
        flag = next(d for d in decls if d.startswith("--")).split("/")[0]
        name = next((d for d in decls if not d.startswith("-")), flag[2:].replace("-", "_"))
        default = field_default(settings, name)
        if not (isinstance(default, (list, tuple, dict, set)) and not default):
            kwargs["default"] = default.value if isinstance(default, Enum) else default
        return option(*decls, **kwargs)

    return setting


LOG_LEVELS = click.Choice(["debug", "info", "warning", "error"])


def log_options(setting: Callable[..., Callable[[Any], Any]]) -> Callable[[Any], Any]:
    """The logging flags every service takes (``--log-level``, ``--log-json/--log-console``),
    declared through its ``settings_option`` so the defaults are its settings'."""

    def apply(command: Any) -> Any:
        command = setting("--log-json/--log-console", help="JSON log lines, or readable ones.")(
            command)
        return setting("--log-level", type=LOG_LEVELS, help="Log level.")(command)

    return apply


def serve(create_app: Callable[[Any], Any], settings: Any) -> None:
    """Logging configured from ``settings`` first (creating the app logs), then the app
    ``create_app(settings)`` served by uvicorn on the settings' host and port (blocks)."""
    import uvicorn

    from agentserving.core.logging import configure_logging

    configure_logging(settings.log_level, settings.log_json)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level=settings.log_level, access_log=False)


def field_default(settings: type, name: str) -> Any:
    """The default of field ``name`` of a pydantic model or a dataclass (KeyError: none)."""
    fields = getattr(settings, "model_fields", None)
    if fields is not None:
        return fields[name].get_default(call_default_factory=True)
    found = {f.name: f for f in dataclasses.fields(settings)}[name]
    if found.default_factory is not dataclasses.MISSING:
        return found.default_factory()
    if found.default is dataclasses.MISSING:
        raise KeyError(f"{settings.__name__}.{name} has no default")
    return found.default


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)


@click.group(
    cls=LazyGroup,
    context_settings={"auto_envvar_prefix": "AGENTSERVING", "help_option_names": ["-h", "--help"]},
)
@click.version_option(package_name="agentserving")
def main() -> None:
    """AgentServing: serve long-lived multi-turn agents with their KV cache kept warm.

    Every flag of every subcommand can also be set as AGENTSERVING_<SUBCOMMAND>_<FLAG>
    (upper case, dashes as underscores), e.g. AGENTSERVING_KVINDEX_PORT=8300.
    """

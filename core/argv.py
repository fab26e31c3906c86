"""Command lines rendered from settings objects, through the click command that parses them.

Whoever starts a service elsewhere (the operator's pods) builds the service's own settings
object, which validates every value, and renders it here with the options of the service's
own click command: a rendered command line cannot name a flag the command does not have, or
a value its settings refuse. Each service's ``settings_from_params`` turns the parsed
parameters back into the same settings object, so the round trip is testable without
starting anything.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Any

import click
from pydantic import BaseModel


class NoSuchFlag(KeyError):
    """A settings field the command has no option for."""


def option_for(command: click.Command, name: str) -> click.Option:
    for param in command.params:
        if isinstance(param, click.Option) and param.name == name and param.expose_value:
            return param
    raise NoSuchFlag(f"{command.name}: no option sets {name!r}")


def _text(value: Any) -> str:
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, Path):
        return str(value)
    return str(value)


def _long(opts: list[str]) -> str:
    return next((o for o in opts if o.startswith("--")), opts[0])


def render_option(option: click.Option, value: Any) -> list[str]:
    """One option with ``value``, as the command line that sets it (nothing for None)."""
    if value is None:
        return []
    flag = _long(option.opts)
    if option.is_flag:
        if value:
            return [flag]
        if option.secondary_opts:
            return [_long(option.secondary_opts)]
        return []
    values = list(value) if option.multiple else [value]
    out = []
    for item in values:
        text = _text(item)
        # `--flag=VALUE`: a value that looks like a flag (or a repeated free-form one) stays one
        out += [f"{flag}={text}"] if option.multiple or text.startswith("-") else [flag, text]
    return out


def render_argv(command: click.Command, settings: BaseModel, fields: Iterable[str]) -> list[str]:
    """The flags of ``command`` that set ``fields`` of ``settings`` (in that order)."""
    out: list[str] = []
    for name in fields:
        out += render_option(option_for(command, name), getattr(settings, name))
    return out


def settings_argv(command: click.Command, settings_cls: type[BaseModel],
                  values: dict[str, Any]) -> list[str]:
    """The flags that give ``command`` these ``values``, once ``settings_cls`` accepted them
    (pydantic's ``ValidationError`` names the field it refuses): how the operator and the local
    fleet type a service's command line, so neither can hand it a value it would refuse."""
    return render_argv(command, settings_cls(**values), values)

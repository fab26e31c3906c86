"""The `agentserving` command: one subcommand per deployable unit, loaded lazily.

Each subcommand lives beside the service it runs (``agentserving.<unit>.cli:command``) and is
imported only when invoked, so ``agentserving kvindex`` never imports torch. Every flag can
also be given as an environment variable ``AGENTSERVING_<SUBCOMMAND>_<FLAG>`` (click's
auto_envvar_prefix); ``--help`` shows each variable's name.
"""

from __future__ import annotations

import functools
import importlib

import click

# name -> "module:attribute" of a click.Command
SUBCOMMANDS: dict[str, str] = {
    "chunk-hashes": "agentserving.core.hash_cli:command",
    "kvindex": "agentserving.kvindex.cli:command",
    "operator": "agentserving.operator.cli:command",
    "worker": "agentserving.engine.cli:command",
    "proxy": "agentserving.proxy.cli:command",
    "replay": "agentserving.replay.cli:command",
    "report": "agentserving.replay.report_cli:command",
    "trace": "agentserving.replay.trace_cli:command",
    "up": "agentserving.replay.fleet.cli:command",
    "bench": "agentserving.replay.bench:command",
    "sim": "agentserving.sim.cli:command",
}

# Every option shows its default and its environment variable in --help.
option = functools.partial(click.option, show_default=True, show_envvar=True)


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

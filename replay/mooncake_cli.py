"""The flags that shape a Mooncake workload (``replay.mooncake``), shared by the commands that
load one (``replay``, ``compare``): declared once, handed to the command as one
``mooncake: MooncakeOptions``. Each command keeps its own defaults for the block size and the
output cap."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from agentserving.core.cli import option


def mooncake_options(*, block_tokens: int, max_output: int | None
                     ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def command(*args: Any, mooncake_block_tokens: int, mooncake_max_requests: int | None,
                    mooncake_max_input: int | None, mooncake_max_output: int | None,
                    **kwargs: Any) -> Any:
            from agentserving.replay.mooncake import MooncakeOptions  # with the command: light

            return fn(*args, mooncake=MooncakeOptions(
                block_tokens=mooncake_block_tokens, max_output_tokens=mooncake_max_output,
                max_requests=mooncake_max_requests, max_input_tokens=mooncake_max_input),
                **kwargs)

        flags = [
            option("--mooncake-block-tokens", type=click.IntRange(1, 512), default=block_tokens,
                   help="Mooncake workloads: tokens per hash block (below 512 scales prompts "
                        "down)."),
            option("--mooncake-max-requests", type=click.IntRange(min=1), default=None,
                   help="Mooncake workloads: only the first N requests (a time window of the "
                        "trace)."),
            option("--mooncake-max-input", type=click.IntRange(min=1), default=None,
                   help="Mooncake workloads: drop requests with more input tokens (before "
                        "scaling)."),
            option("--mooncake-max-output", type=click.IntRange(min=1), default=max_output,
                   help="Mooncake workloads: cap every output at N tokens."),
        ]
        for flag in reversed(flags):
            command = flag(command)
        return command

    return decorate

"""The registrar sidecar's command line and settings (``python -m
agentserving.engine.vllm.registrar``), apart from its loop so that the operator and the local
fleet render the command line (``argv``) without importing an HTTP client."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import click
from pydantic import BaseModel, Field

from agentserving.core.argv import settings_argv
from agentserving.core.cli import option, settings_option
from agentserving.core.hashing import DEFAULT_CHUNK_SIZE, HashScheme
from agentserving.core.internal_auth import TOKEN_ENV, TOKEN_HELP
from agentserving.core.schemas import PodRegistration, PodRole

MODULE = "agentserving.engine.vllm.registrar"  # run as python -m MODULE
PROG = f"python -m {MODULE}"
DESCRIPTION = ("Keep a pod registered with the kvindex (register, renew the lease, register "
               "again when forgotten, deregister on SIGTERM) without reporting residency: the "
               "sidecar of vLLM-Ascend pods and of the local fleet's plain vLLM workers.")


class RegistrarSettings(BaseModel):
    """What the sidecar registers and how it keeps the lease: validated here, so the operator
    and the local fleet, which render its command line from this (``argv``), cannot hand it
    a value it would refuse."""

    kvindex: str = Field(description="kvindex base URL")
    pod: str = Field(min_length=1, description="this pod's name")
    memory_api_url: str = Field(description="the pod's memory API (:6999)")
    api_url: str = Field(description="the pod's OpenAI API")
    role: PodRole = PodRole.BOTH
    model: str = Field(min_length=1, description="served model name")
    hash_scheme: HashScheme = HashScheme.LMCACHE_BUILTIN
    chunk_size: int = Field(default=DEFAULT_CHUNK_SIZE, gt=0)
    interval_s: float = Field(default=5.0, gt=0)
    engine: str = "vllm-ascend"
    residency: str = "lmcache-controller"
    internal_token: str | None = None

    def registration(self) -> PodRegistration:
        return PodRegistration(pod=self.pod, memory_api_url=self.memory_api_url,
                               api_url=self.api_url, role=self.role, model=self.model,
                               hash_scheme=self.hash_scheme, chunk_size=self.chunk_size,
                               labels={"engine": self.engine, "residency": self.residency})


setting = settings_option(RegistrarSettings)
Runner = Callable[[RegistrarSettings], Awaitable[None]]


def _required(flag: str, help: str) -> Callable[[Any], Any]:  # noqa: A002
    return option(flag, required=True, help=help)


@click.command("registrar", help=DESCRIPTION)
@_required("--kvindex", "kvindex base URL.")
@_required("--pod", "This pod's name.")
@_required("--memory-api-url", "The pod's memory API (:6999).")
@_required("--api-url", "The pod's OpenAI API.")
@setting("--role", type=click.Choice([r.value for r in PodRole]), help="The pod's role.")
@_required("--model", "Served model name.")
@setting("--hash-scheme", type=click.Choice([h.value for h in HashScheme]),
         help="The hash scheme of the chunk hashes the pod's residency is reported under.")
@setting("--chunk-size", type=click.IntRange(min=1), help="Tokens per chunk.")
@setting("--interval", "interval_s", type=click.FloatRange(min=0.01),
         help="Lease renewal, seconds.")
@setting("--engine", help="The pod's engine label.")
@setting("--residency", help="Where its residency comes from (label): lmcache-controller, "
                             "vllm-events.")
@setting("--internal-token", envvar=TOKEN_ENV, metavar="TOKEN", help=TOKEN_HELP)
@click.pass_obj
def command(run: Runner, **params: Any) -> None:
    asyncio.run(run(RegistrarSettings(**params)))


def parse_args(argv: Sequence[str]) -> RegistrarSettings:
    """The settings a command line gives (click's errors as it would raise them)."""
    with command.make_context(PROG, list(argv)) as ctx:
        return RegistrarSettings(**ctx.params)


def argv(values: dict[str, Any], python: str = "python") -> list[str]:
    """The sidecar's command line for ``values`` (RegistrarSettings fields), checked by them."""
    return [python, "-m", MODULE, *settings_argv(command, RegistrarSettings, values)]


def main(run: Runner, args: Sequence[str] | None = None) -> None:
    """Parse the command line and ``run`` the settings (the registrar's loop, which passes
    itself in: this module stays free of it and its HTTP client)."""
    command.main(args=args, prog_name=PROG, auto_envvar_prefix="AGENTSERVING_REGISTRAR",
                 obj=run)

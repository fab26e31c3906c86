"""`agentserving kvserver`: run the KV server (LMCache protocol + HTTP API)."""

from __future__ import annotations

import click

from agentserving.core.cli import log_options, settings_option
from agentserving.core.internal_auth import TOKEN_ENV, TOKEN_HELP
from agentserving.engine.kvserver.settings import KvServerSettings

setting = settings_option(KvServerSettings)


@click.command("kvserver")
@setting("--host", help="Address both ports bind (0.0.0.0 in a pod).")
@setting("--port", type=click.IntRange(0, 65535),
         help="LMCache protocol port: what LMCACHE_REMOTE_URL=lm://HOST:PORT names.")
@setting("--api-port", type=click.IntRange(0, 65535),
         help="HTTP API port: /healthz, /metrics, /v1/chunks, /memory/evict, /memory/pin, "
              "/memory/unpin, /v1/export, /v1/pull, /docs.")
@setting("--max-gib", type=click.FloatRange(min=0, min_open=True),
         help="The byte bound, GiB of KV payload: a PUT past it evicts the least recently used "
              "keys; a single value larger than all of it is refused.")
@setting("--pin-share", type=click.FloatRange(0, 1),
         help="Share of the bound that pinned chunks (POST /memory/pin, the pods' pin fan-out) "
              "may hold out of the LRU; pinned bytes past it are evicted as any others, and "
              "pins never refuse room for a PUT.")
@setting("--pull-timeout", "pull_timeout_s", type=click.FloatRange(min=0, min_open=True),
         help="Seconds a POST /v1/pull may take when its body names no timeout_s.")
@setting("--max-batch-chunks", type=click.IntRange(min=1),
         help="Most chunk hashes one evict, export or pull may carry (more: 413).")
@setting("--internal-token", envvar=TOKEN_ENV, metavar="TOKEN", help=TOKEN_HELP)
@log_options(setting)
def command(**kwargs: object) -> None:
    """Run the KV server vLLM pods hand KV through: LMCache's remote protocol (lm://) over a
    byte-bounded LRU store, plus an HTTP API to list, evict by chunk hash and pull chunks from
    another KV server."""
    import uvicorn

    from agentserving.core.logging import configure_logging
    from agentserving.engine.kvserver.app import create_app

    settings = KvServerSettings(**kwargs)  # type: ignore[arg-type]
    configure_logging(settings.log_level, settings.log_json)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.api_port,
                log_level=settings.log_level, access_log=False)

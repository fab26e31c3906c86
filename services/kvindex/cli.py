"""`agentserving kvindex`: run the kvindex service."""

from __future__ import annotations

import click

from agentserving.core.cli import log_options, option, serve, settings_option
from agentserving.core.internal_auth import TOKEN_ENV, TOKEN_HELP
from agentserving.kvindex.settings import KvindexSettings

setting = settings_option(KvindexSettings)


def _parse_pairs(values: tuple[str, ...], flag: str, form: str) -> dict[str, str]:
    """('a=b', ...) -> {'a': 'b'}; ``form`` names the two sides for the error message."""
    out = {}
    for value in values:
        key, sep, target = value.partition("=")
        if not sep or not key or not target:
            raise click.BadParameter(f"'{value}': expected {form}", param_hint=flag)
        out[key] = target
    return out


@click.command("kvindex")
@setting("--host", help="Address to bind (0.0.0.0 in a pod).")
@setting("--port", type=click.IntRange(0, 65535), help="HTTP port.")
@setting("--store",
         help="'memory' (one process, lost on exit), a Redis URL, e.g. redis://redis:6379/0, or "
              "Redis behind Sentinel: redis+sentinel://s1:26379,s2:26379/mymaster/0 (the "
              "master the sentinels name, followed through a failover).")
@setting("--redis-min-acks", type=click.IntRange(min=0),
         help="Replicas that must hold each write before the kvindex acknowledges it (Redis "
              "WAIT), so a failover loses nothing acknowledged; fewer in time: 503 (callers "
              "retry). Run one more replica than this. 0: the master's word is enough.")
@setting("--lease-ttl", "lease_ttl_s", type=click.FloatRange(min=0.01),
         help="Seconds a pod stays registered without a heartbeat. Keep it longer than the "
              "store's failover (Redis Sentinel: down-after-milliseconds plus the election): "
              "heartbeats cannot land while no master takes writes, and a longer outage "
              "lapses every pod's lease at once (the proxy then keeps its last-known pods for "
              "its --empty-registry-grace, until the pods register again).")
@setting("--reap-interval", "reap_interval_s", type=click.FloatRange(min=0.01),
         help="Seconds between sweeps that drop pods whose lease lapsed and sessions "
         "that expired idle.")
@setting("--change-feed-max", type=click.IntRange(min=1),
         help="Residency changes kept for followers (GET /v1/residency/changes: the proxies' "
              "in-process replicas); a follower further behind gets 410 and lists again. Each "
              "change holds its chunk hashes (~70 bytes each), in the kvindex's memory or, on "
              "Redis, in a stream beside the index.")
@setting("--max-batch-chunks", type=click.IntRange(min=1),
         help="Most chunk hashes one request may carry (more: 413).")
@setting("--fanout-timeout", "fanout_timeout_s", type=click.FloatRange(min=0.01),
         help="Seconds to wait for each pod's memory API during prefetch/evict fan-out.")
@setting("--session-idle-ttl", "session_idle_ttl_s", type=click.FloatRange(min=0),
         help="Seconds after its last write that an agent session expires and stops protecting "
         "its chunks from eviction (a pin extends it); 0: never.")
@setting("--stored-response-ttl", "stored_response_ttl_s",
         type=click.FloatRange(min=0, min_open=True),
         help="Seconds a stored response (the proxy's Responses API objects with store: true, "
              "kept for previous_response_id) lives when the proxy names no TTL; also the "
              "most any lives.")
@setting("--max-stored-response-bytes", type=click.IntRange(min=1),
         help="Largest stored response, serialized with its conversation's messages (more: "
              "413). Each is kept whole in the kvindex's memory or Redis.")
@setting("--max-stored-responses", type=click.IntRange(min=1),
         help="Stored responses kept at most, across tenants: past it the oldest written "
              "goes first, whatever its TTL.")
@option("--vllm-events", multiple=True, metavar="POD=ENDPOINT",
        help="Subscribe to a vLLM KV event stream (ZMQ PUB) on behalf of POD; repeatable.")
@setting("--lmcache-controller", metavar="tcp://HOST:PORT",
         help="Act as LMCache's controller for its workers: PULL on PORT, ROUTER on PORT+1.")
@setting("--lmcache-controller-reply", metavar="tcp://HOST:PORT",
         help="Where LMCache workers' requests (DEALER) connect; default PORT+1.")
@option("--lmcache-instance", multiple=True, metavar="INSTANCE=POD",
        help="Name the pod of an LMCache instance id (default: the id itself); repeatable.")
@setting("--internal-token", envvar=TOKEN_ENV, metavar="TOKEN", help=TOKEN_HELP)
@log_options(setting)
def command(**kwargs: object) -> None:
    """Run the kvindex: the cluster's directory of where every KV chunk lives."""
    from agentserving.kvindex.app import create_app

    serve(create_app, settings_from_params(kwargs))


def settings_from_params(params: dict[str, object]) -> KvindexSettings:
    """The kvindex's settings from this command's parsed parameters (starts nothing)."""
    params = dict(params)
    endpoints = _parse_pairs(params.pop("vllm_events", ()),  # type: ignore[arg-type]
                             "--vllm-events", "POD=tcp://HOST:PORT")
    instances = _parse_pairs(params.pop("lmcache_instance", ()),  # type: ignore[arg-type]
                             "--lmcache-instance", "INSTANCE=POD")
    return KvindexSettings(**params, vllm_event_endpoints=endpoints,  # type: ignore[arg-type]
                           lmcache_instance_pods=instances)

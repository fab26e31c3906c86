"""``agentserving operator``: run the AgentServing operator (kopf) until stopped.

It authenticates like kubectl: in a pod with its ServiceAccount, elsewhere with $KUBECONFIG
(or ~/.kube/config). Every flag can also be set as AGENTSERVING_OPERATOR_<FLAG>.
"""

from __future__ import annotations

import logging

import click

from agentserving.core.cli import option, settings_option

from .settings import OperatorSettings

setting = settings_option(OperatorSettings)


@click.command(name="operator")
@setting("--namespace", "namespaces", multiple=True,
         help="Namespace to watch (repeat for several; in the environment, space-separated). "
              "None: every namespace, cluster-wide.")
@setting("--image-registry",
         help="Registry/prefix of AgentServing's images: <registry>/{worker,proxy,kvindex}:<tag>.")
@setting("--image-tag", help="Tag of AgentServing's images.")
@setting("--vllm-image",
         help="Worker image for engine vllm when spec.engine.image is empty.")
@setting("--vllm-ascend-image",
         help="Worker image for engine vllm-ascend when spec.engine.image is empty.")
@setting("--redis-image",
         help="Image of the in-cluster Redis (spec.kvindex.redis.inCluster); with "
              "redis.replicas 2+ it runs the sentinels too (redis-server --sentinel, sh, "
              "redis-cli).")
@setting("--kvindex-url-template",
         help="How the finalizer reaches a resource's kvindex to forget its pods; {name} and "
              "{namespace} are the resource's.")
@option("--cleanup-timeout", type=click.FloatRange(min=0.1), default=5.0,
        help="Seconds the finalizer may spend on kvindex clean-up before letting the "
             "deletion proceed anyway.")
@option("--resync-interval", type=click.FloatRange(min=1.0), default=300.0,
        help="Seconds between re-applying each resource's children (drift correction).")
@setting("--field-manager",
         help="Server-side apply field manager name.")
@setting("--token-key", metavar="KEY",
         help="Secret key from which each resource's internal token is derived (the chart "
              "makes one); the token, in a Secret <name>-internal, is what the resource's "
              "kvindex and memory APIs require. Unset: no tokens, no checks between the "
              "components. Prefer the environment variable (a command line is visible to "
              "every process on the host).")
@option("--metrics-host", default="0.0.0.0", help="Address of the Prometheus /metrics server.")
@option("--metrics-port", type=click.IntRange(min=0, max=65535), default=9090,
        help="Port of the Prometheus /metrics server (0: off).")
@option("--health-host", default="0.0.0.0", help="Address of the liveness endpoint.")
@option("--health-port", type=click.IntRange(min=0, max=65535), default=8081,
        help="Port of the liveness endpoint GET /healthz (0: off).")
@option("--log-format", type=click.Choice(["json", "text"]), default="json",
        help="json: one JSON object per line (with the object's namespace/name); text: plain.")
@option("--verbose", is_flag=True, default=False, help="Debug logging.")
def command(namespaces: tuple[str, ...], image_registry: str, image_tag: str, vllm_image: str,
            vllm_ascend_image: str, redis_image: str, kvindex_url_template: str,
            cleanup_timeout: float, resync_interval: float, field_manager: str,
            token_key: str | None, metrics_host: str, metrics_port: int, health_host: str,
            health_port: int, log_format: str, verbose: bool) -> None:
    """Run the AgentServing operator: reconcile AgentServing resources into prefill and
    decode worker pools, a proxy, a kvindex and (optionally) Redis, and report their status."""
    import kopf
    from prometheus_client import start_http_server

    from .handlers import register

    settings = OperatorSettings(
        namespaces=tuple(namespaces), image_registry=image_registry, image_tag=image_tag,
        vllm_image=vllm_image, vllm_ascend_image=vllm_ascend_image, redis_image=redis_image,
        kvindex_url_template=kvindex_url_template, cleanup_timeout_s=cleanup_timeout,
        resync_interval_s=resync_interval, field_manager=field_manager, token_key=token_key)
    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.JSON if log_format == "json"
                   else kopf.LogFormat.FULL)
    logging.getLogger("urllib3").setLevel(logging.WARNING)
    if metrics_port:
        start_http_server(metrics_port, addr=metrics_host)
    registry = kopf.OperatorRegistry()
    register(registry, settings)
    logging.getLogger(__name__).info(
        "starting: namespaces=%s metrics=%s:%s", list(namespaces) or "all", metrics_host,
        metrics_port)
    kopf.run(
        registry=registry,
        memo=kopf.Memo(settings=settings),
        standalone=True,
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=f"http://{health_host}:{health_port}/healthz" if health_port else None,
    )

"""Operator settings: built once from CLI flags / environment, passed to everything else."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_IMAGE_REGISTRY = "agentserving"
DEFAULT_IMAGE_TAG = "0.1.0"


@dataclass(frozen=True)
class OperatorSettings:
    """What the operator needs to know besides each resource's spec."""

    # Namespaces to watch; empty means every namespace (cluster-wide).
    namespaces: tuple[str, ...] = ()
    # Images of AgentServing's own components: <registry>/<component>:<tag>.
    image_registry: str = DEFAULT_IMAGE_REGISTRY
    image_tag: str = DEFAULT_IMAGE_TAG
    # Default worker images for the vLLM engines (a resource's spec.engine.image overrides).
    vllm_image: str = "agentserving/vllm:0.33.0"  # docker/vllm.Dockerfile
    vllm_ascend_image: str = "quay.io/ascend/vllm-ascend:v0.11.0"
    redis_image: str = "redis:7.4-alpine"
    # How the finalizer reaches a resource's kvindex ({name}, {namespace} are filled in).
    kvindex_url_template: str = "http://{name}-kvindex.{namespace}.svc:8300"
    # Upper bound, in seconds, of the finalizer's kvindex clean-up.
    cleanup_timeout_s: float = 5.0
    # Re-apply every resource's children this often (drift correction), seconds.
    resync_interval_s: float = 300.0
    # Server-side apply field manager.
    field_manager: str = "agentserving-operator"
    # Key of every resource's internal token (builders.credentials); None: no tokens, no
    # credential checks between the components.
    token_key: str | None = field(default=None, repr=False)

    def image(self, component: str) -> str:
        """The default image of one of AgentServing's components (worker, proxy, kvindex)."""
        return f"{self.image_registry}/{component}:{self.image_tag}"

    def kvindex_url(self, name: str, namespace: str) -> str:
        return self.kvindex_url_template.format(name=name, namespace=namespace)

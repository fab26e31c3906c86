"""The AgentServing operator: reconciles ``AgentServing`` resources into running pools.

- ``builders/``: pure functions, spec -> the desired child manifests (no cluster needed).
- ``status.py``: pure status computation from the children's observed state.
- ``kube.py``: the few Kubernetes API calls the operator makes (server-side apply, list,
  delete, status patch).
- ``reconcile.py``: one reconcile pass and one status refresh, wired from those pieces.
- ``kvindex.py``: the finalizer's bounded, best-effort kvindex clean-up.
- ``handlers.py``: kopf handlers, a few lines each; ``cli.py``: ``agentserving operator``.

Unit tests live in tests/operator/: a tests folder inside this one would be imported by
pytest under the name ``operator``, shadowing the standard library's module.
"""

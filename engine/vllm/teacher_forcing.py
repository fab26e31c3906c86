"""Teacher forcing on vLLM: a turn emits exactly its ``forced_output_token_ids``.

A replayed trace is only the same load on every system if every system computes the same
tokens: the output a pod emits for turn k is part of turn k+1's prompt, and the KV it computed
for that output is only reusable by the next turn if it is the trace's output. The reference
engine honours ``forced_output_token_ids`` itself; vLLM does not know the field, so two pieces
make every vLLM pod the project renders (agentserving's and the plain ones it is compared
with) honour it:

- ``TeacherForcingMiddleware`` (``vllm serve --middleware``): moves the field into
  ``vllm_xargs`` (vLLM's per-request arguments for logits processors), sets ``ignore_eos`` (a
  forced output that contains the end-of-sequence id must not stop there) and caps the output
  at the forced length (or at a smaller ``max_tokens``: a P/D prefill leg asks for one token).
  Ids outside the vocabulary are a 400 naming the field, before any engine works on them.
- ``agentserving.engine.vllm.forced_logits.ForcedOutputProcessor`` (``--logits-processors``):
  in the engine process, leaves only the next forced id with a finite logit, so whatever the
  sampling parameters, the sampler picks it.
"""

from __future__ import annotations

from typing import Any

from agentserving.engine.vllm.request_body import BodyRejected, JsonBodyMiddleware, Scope

FORCED_FIELD = "forced_output_token_ids"
XARGS = "vllm_xargs"


def forced_body(body: Any, vocab_size: int | None) -> Any | None:
    """``body`` with its forced output handed to the logits processor (see the module
    docstring); None when it forces nothing. Raises ``BodyRejected`` naming the field."""
    if not isinstance(body, dict) or body.get(FORCED_FIELD) is None:
        return None
    forced = body[FORCED_FIELD]
    if not isinstance(forced, list) or not forced:
        raise BodyRejected(FORCED_FIELD, f"{FORCED_FIELD}: a non-empty list of token ids")
    for i, t in enumerate(forced):
        if type(t) is not int or t < 0:
            raise BodyRejected(FORCED_FIELD, f"{FORCED_FIELD}[{i}]: not a token id: {t!r}")
        if vocab_size is not None and t >= vocab_size:
            raise BodyRejected(FORCED_FIELD, f"{FORCED_FIELD}[{i}]: token id {t} is not below "
                               f"the vocabulary size {vocab_size}")
    xargs = body.get(XARGS)
    if xargs is not None and not isinstance(xargs, dict):
        raise BodyRejected(XARGS, f"{XARGS}: must be an object")
    out = {k: v for k, v in body.items() if k != FORCED_FIELD}
    out[XARGS] = {**(xargs or {}), FORCED_FIELD: forced}
    out["ignore_eos"] = True
    key = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
    asked = body.get(key)
    out[key] = min(asked, len(forced)) if isinstance(asked, int) and asked > 0 else len(forced)
    return out


def vocab_size(scope: Scope) -> int | None:
    """The served model's vocabulary, from vLLM's app state (None outside a vLLM server)."""
    app = scope.get("app")
    config = getattr(getattr(app, "state", None), "vllm_config", None)
    try:
        return int(config.model_config.get_vocab_size())  # type: ignore[union-attr]
    except (AttributeError, TypeError, ValueError):
        return None


def force_next(forced: tuple[int, ...], output_ids: list[int], logits: Any) -> Any:
    """One request's row of logits (a tensor) at its next output position: only the forced id
    keeps a finite logit. Past the forced ids (a client that asked for more tokens than it
    forced), or at an id the row does not have, the row passes unchanged: forcing never
    crashes the engine."""
    i = len(output_ids)
    if i >= len(forced) or not 0 <= forced[i] < logits.shape[-1]:
        return logits
    logits.fill_(float("-inf"))
    logits[forced[i]] = 0.0
    return logits


class TeacherForcingMiddleware(JsonBodyMiddleware):
    def rewrite(self, body: Any, scope: Scope) -> Any | None:
        return forced_body(body, vocab_size(scope))

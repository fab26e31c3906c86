"""vLLM's side of teacher forcing: a logits processor that makes the sampler pick the next
forced id (``agentserving.engine.vllm.teacher_forcing`` says why and how the ids get here).

Loaded into vLLM's engine process by ``--logits-processors
agentserving.engine.vllm.forced_logits:ForcedOutputProcessor``. A request without
``vllm_xargs.forced_output_token_ids`` is not touched; one with them gets, at output position
i, every logit -inf but forced[i]'s (``teacher_forcing.force_next``), so greedy and random
sampling alike emit it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from agentserving.engine.vllm.teacher_forcing import FORCED_FIELD, force_next


class ForcedOutputProcessor(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax: vLLM must apply it under greedy sampling too

    def new_req_logits_processor(self, params: Any) -> Any:
        forced = (params.extra_args or {}).get(FORCED_FIELD)
        if not forced:
            return None
        return partial(force_next, tuple(int(t) for t in forced))

"""KV data-path kernels (seed 003 section 2.3).

- :func:`gather_blocks` / :func:`scatter_blocks`: paged KV blocks of one or all layers to and
  from one contiguous staging buffer, in one launch; block tables with holes; any block-size
  view (:func:`block_view`, no copy).
- :class:`LayerStager`: double-buffered layer-wise staging (layer i+1 stages while i is used).
- :func:`prefill_mask`: the chunked-prefill mask built at its valid shape ``[C, D+C]``;
  :func:`offset_causal_attention`: the same attention without any mask in memory (Triton).

Each has a PyTorch reference (:mod:`.reference`) and a Triton version (:mod:`.triton_impl`);
:func:`select_impl` picks one per call. See docs/kernels.md.
"""

from agentserving.kernels.dispatch import (
    IMPLS,
    gather_blocks,
    offset_causal_attention,
    prefill_mask,
    scatter_blocks,
    select_impl,
    staging_shape,
    triton_available,
)
from agentserving.kernels.layout import (
    HOLE,
    block_view,
    coarsen_block_table,
    refine_block_table,
    split_stacked,
)
from agentserving.kernels.stager import LayerStager

__all__ = [
    "HOLE", "IMPLS", "LayerStager", "block_view", "coarsen_block_table", "gather_blocks",
    "offset_causal_attention", "prefill_mask", "refine_block_table", "scatter_blocks",
    "select_impl", "split_stacked", "staging_shape", "triton_available",
]

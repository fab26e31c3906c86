"""Picks an implementation per call and validates inputs; the public entry points.

Implementations (``impl=``):
- ``"reference"``: the PyTorch ops of :mod:`.reference`. The default on the CPU.
- ``"triton"``: :mod:`.triton_impl`; compiled on CUDA/ROCm tensors, Triton's interpreter on CPU
  tensors (correct, slow: a test path). The default on CUDA when triton is installed.
- ``"npu"``: selected at run time on ``npu`` tensors (torch-npu present). It runs the reference
  ops, which torch-npu lowers to its own kernels; no Ascend-specific kernel is written and this
  path is not exercised here (no NPU, no torch-npu on these machines).
- ``None`` / ``"auto"``: by the tensors' device as above.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from agentserving.kernels import layout, reference

IMPLS = ("reference", "triton", "npu")


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` imports (the ``kernels`` extra)."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return True


def _device_type(device: torch.device | str) -> str:
    # a string, not torch.device(): "npu" only parses once torch-npu has registered it
    return device.type if isinstance(device, torch.device) else str(device).split(":")[0]


def select_impl(device: torch.device | str, requested: str | None = None) -> str:
    """The implementation to run for tensors on ``device``; raises if ``requested`` can't run."""
    kind = _device_type(device)
    if requested in (None, "auto"):
        if kind == "npu":
            return "npu"
        if kind == "cuda" and triton_available():
            return "triton"
        return "reference"
    if requested not in IMPLS:
        raise ValueError(f"unknown kernel implementation {requested!r}; one of {IMPLS}")
    if requested == "triton":
        if not triton_available():
            raise RuntimeError("impl='triton' needs triton: pip install 'agentserving[kernels]'")
        if kind not in ("cpu", "cuda"):
            raise RuntimeError(f"impl='triton' runs on cpu (interpreter) or cuda, not {device}")
    if requested == "npu" and kind != "npu":
        raise RuntimeError(f"impl='npu' needs npu tensors (torch-npu), got {device}")
    return requested


def _module(impl: str) -> ModuleType:
    if impl == "triton":
        from agentserving.kernels import triton_impl

        return triton_impl
    return reference  # "reference" and "npu"


def _prepare(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, tokens: int | None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, bool]:
    k5, v5, single = layout.as_layers(k, v)
    tokens = layout.check_tokens(table, k5.shape[2], tokens)
    layout.check_range(table, k5.shape[1])
    return k5, v5, table.to(device=k.device), tokens, single


def staging_shape(k: torch.Tensor, table: torch.Tensor, tokens: int | None = None
                  ) -> tuple[int, ...]:
    """Shape of the staging buffer :func:`gather_blocks` fills for this cache and table."""
    *lead, _, bs, heads, dim = k.shape
    tokens = layout.check_tokens(table, bs, tokens)
    return (*lead, 2, tokens, heads, dim)


def gather_blocks(k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor, *,
                  tokens: int | None = None, out: torch.Tensor | None = None,
                  impl: str | None = None) -> torch.Tensor:
    """Copy the blocks listed in ``block_table`` (holes read as zeros) of one or all layers
    into one staging buffer, in one launch.

    ``k``, ``v``: ``[blocks, block_size, heads, dim]`` (one layer) or ``[layers, blocks,
    block_size, heads, dim]`` (all layers; see :func:`layout.split_stacked`), any strides,
    including :func:`layout.block_view` views. Returns ``out`` (allocated contiguous when not
    given): ``[2, tokens, heads, dim]`` or ``[layers, 2, tokens, heads, dim]``.
    """
    k5, v5, table, tokens, single = _prepare(k, v, block_table, tokens)
    shape = (k5.shape[0], 2, tokens, *k5.shape[3:])
    if out is None:
        out = torch.empty(shape[1:] if single else shape, dtype=k.dtype, device=k.device)
    out5 = out.unsqueeze(0) if single else out
    if tuple(out5.shape) != shape or out.dtype != k.dtype or out.device != k.device:
        raise ValueError(f"out {tuple(out.shape)}/{out.dtype} does not fit {shape}/{k.dtype}")
    _module(select_impl(k.device, impl)).gather_blocks(k5, v5, table, tokens, out5)
    return out


def scatter_blocks(staging: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   block_table: torch.Tensor, *, tokens: int | None = None,
                   impl: str | None = None, unique: bool = False) -> None:
    """The inverse of :func:`gather_blocks`: write ``staging`` into the listed blocks in place
    (holes skipped; a block id listed twice is refused). ``unique=True``: the caller
    guarantees distinct ids (an allocator's table), skipping that check on a hot path."""
    k5, v5, table, tokens, single = _prepare(k, v, block_table, tokens)
    if not unique:
        layout.check_unique(table)
    staging5 = staging.unsqueeze(0) if single else staging
    shape = (k5.shape[0], 2, tokens, *k5.shape[3:])
    if tuple(staging5.shape) != shape or staging.dtype != k.dtype:
        raise ValueError(f"staging {tuple(staging.shape)} does not fit {shape}/{k.dtype}")
    _module(select_impl(k.device, impl)).scatter_blocks(staging5, k5, v5, table, tokens)


def prefill_mask(chunk: int, cached: int, *, dtype: torch.dtype = torch.bool,
                 device: torch.device | str = "cpu", impl: str | None = None) -> torch.Tensor:
    """The chunked-prefill mask at its valid shape ``[chunk, cached + chunk]`` (see
    :func:`reference.prefill_mask`); its size never depends on the model's max length."""
    if chunk <= 0 or cached < 0:
        raise ValueError(f"need chunk > 0 and cached >= 0, got {chunk}, {cached}")
    return _module(select_impl(device, impl)).prefill_mask(chunk, cached, dtype=dtype,
                                                           device=device)


def offset_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int, *,
                            scale: float | None = None, impl: str | None = None) -> torch.Tensor:
    """Chunk attention over ``cached`` prefix tokens plus the chunk itself (causal at offset
    ``cached``). The Triton version never builds a mask; the reference builds the valid-shape
    one. Results agree to floating-point tolerance, not bit for bit (different sum order)."""
    heads, chunk, _ = q.shape
    if k.shape[0] == 0 or heads % k.shape[0] or k.shape[1] != cached + chunk or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, cached {cached} do not fit")
    return _module(select_impl(q.device, impl)).offset_causal_attention(q, k, v, cached, scale)

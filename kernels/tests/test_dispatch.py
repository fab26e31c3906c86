"""Implementation selection, and the interpreter selected the documented way (env var)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from agentserving.kernels import select_impl, triton_available


def test_defaults_by_device() -> None:
    assert select_impl("cpu") == "reference"
    assert select_impl(torch.device("cpu"), "auto") == "reference"
    assert select_impl("npu:0") == "npu"
    assert select_impl("cuda:0") == ("triton" if triton_available() else "reference")


def test_requests_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown"):
        select_impl("cpu", "cutlass")
    with pytest.raises(RuntimeError, match="npu"):
        select_impl("cpu", "npu")
    assert select_impl("cpu", "reference") == "reference"
    if triton_available():
        assert select_impl("cpu", "triton") == "triton"
        with pytest.raises(RuntimeError):
            select_impl("mps", "triton")


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_triton_interpret_env_runs_the_same_kernels() -> None:
    """With TRITON_INTERPRET=1 set before import, ``triton.jit`` itself interprets."""
    code = (
        "import torch, triton\n"
        "from triton.runtime.interpreter import InterpretedFunction\n"
        "from agentserving import kernels as K\n"
        "from agentserving.kernels import triton_impl\n"
        "assert isinstance(triton_impl._KERNELS['_paged_copy'][0], InterpretedFunction)\n"
        "c = torch.randn(2, 2, 5, 4, 2, 3)\n"
        "t = torch.tensor([3, -1, 0])\n"
        "a = K.gather_blocks(*K.split_stacked(c), t, tokens=10, impl='triton')\n"
        "b = K.gather_blocks(*K.split_stacked(c), t, tokens=10, impl='reference')\n"
        "m = K.prefill_mask(4, 6, impl='triton')\n"
        "q = torch.randn(2, 4, 8); kv = torch.randn(1, 10, 8)\n"
        "o = K.offset_causal_attention(q, kv, kv, 6, impl='triton')\n"
        "r = K.offset_causal_attention(q, kv, kv, 6)\n"
        "print(torch.equal(a, b), torch.equal(m, K.prefill_mask(4, 6)),"
        " torch.allclose(o, r, atol=1e-5))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "True"]

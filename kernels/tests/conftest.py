"""Shared fixtures: the Triton variants every kernel test runs.

``interp``: Triton's interpreter on CPU tensors (always, when triton is installed).
``cuda``: the same kernels compiled, on a GPU; skipped where there is none. The reference
(``impl="reference"``) runs on the same device as the variant's tensors.
"""

from __future__ import annotations

import pytest
import torch

from agentserving.kernels import triton_available

VARIANTS = [
    pytest.param("cpu", id="interp",
                 marks=pytest.mark.skipif(not triton_available(), reason="triton not installed")),
    pytest.param("cuda", id="cuda-compiled",
                 marks=pytest.mark.skipif(not (triton_available() and torch.cuda.is_available()),
                                          reason="no GPU here: compiled Triton not exercised")),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(params=VARIANTS)
def device(request: pytest.FixtureRequest) -> str:
    return request.param

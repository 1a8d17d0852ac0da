"""node/runtime/finite.py: the one-sum finiteness test agrees with torch.isfinite, overflow included."""

from __future__ import annotations

import pytest
import torch

from node.runtime.finite import is_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_agrees_with_isfinite(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max
    cases = {
        "ordinary": torch.randn(8, 64, 64),
        "empty": torch.empty(0, 64),
        "a NaN": torch.tensor([1.0, float("nan"), 2.0]),
        "an inf": torch.tensor([1.0, float("inf")]),
        "a -inf": torch.tensor([-float("inf"), 3.0]),
        "inf and -inf (sum NaN)": torch.tensor([float("inf"), -float("inf")]),
        "finite values whose sum overflows": torch.tensor([big, big, big]),
    }
    for name, t in cases.items():
        t = t.to(dtype)
        assert is_finite(t) == bool(torch.isfinite(t).all()), name
    assert is_finite(torch.tensor([big, big, big], dtype=dtype))  # the exact test settles an overflowing sum

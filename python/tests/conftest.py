"""Shared fixtures of the poslsh binding tests."""

import numpy as np
import pytest

# The methods of the all-heads functions (the library's Method names).
METHODS = ["lsh_fused", "lsh_per_sample", "fixed_blocks", "exact_tiled", "exact_banded"]


@pytest.fixture
def rng():
    return np.random.default_rng(20261130)


def random_qkv(rng, n, d, dtype, d_v=None):
    """q, k, v with entries in [-1, 1)."""
    d_v = d if d_v is None else d_v
    q = rng.uniform(-1.0, 1.0, (n, d)).astype(dtype)
    k = rng.uniform(-1.0, 1.0, (n, d)).astype(dtype)
    v = rng.uniform(-1.0, 1.0, (n, d_v)).astype(dtype)
    return q, k, v


def masking_of(causal):
    """The masking keyword of a causal flag: "causal" or "bidirectional"."""
    return "causal" if causal else "bidirectional"


def tolerance(dtype):
    """Absolute tolerance of a kernel output against the float64 dense formula."""
    return 2e-5 if np.dtype(dtype) == np.float32 else 1e-11

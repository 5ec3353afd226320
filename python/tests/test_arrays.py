"""The array contract: strides without copies, out= in place, dtype rules, error mapping."""

import numpy as np
import pytest

import poslsh
import reference
from conftest import random_qkv, tolerance


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_strided_inputs_and_out_view_write_into_the_parent(rng, dtype):
    """Heads of [n, H, d] buffers are used in place: inputs read and the output written through
    their row stride, no copy (the parent output buffer receives the result)."""
    n, heads, d, sigma = 150, 3, 8, 6.0
    qkv = rng.uniform(-1, 1, (n, 3, heads, d)).astype(dtype)
    q, k, v = qkv[:, 0, 1, :], qkv[:, 1, 1, :], qkv[:, 2, 1, :]
    assert q.strides == (3 * heads * d * q.itemsize, q.itemsize)
    parent = np.full((n, heads, d), np.nan, dtype=dtype)
    out = parent[:, 2, :]
    assert not out.flags.c_contiguous
    hashes = poslsh.rbf_hashes(sigma, 6, seed=9)
    returned = poslsh.lsh_attention_fused(q, k, v, hashes, out=out)
    assert returned is out
    expected = reference.lsh_attention(q, k, v, hashes.widths, hashes.offsets)
    np.testing.assert_allclose(parent[:, 2, :], expected, rtol=0, atol=tolerance(dtype))
    assert np.isnan(parent[:, :2, :]).all()  # the other heads are untouched
    parent[:, 1, :] = 0
    poslsh.alibi_attention_tiled(q, k, v, sigma, out=parent[:, 1, :])
    np.testing.assert_allclose(parent[:, 1, :], reference.alibi_attention(q, k, v, sigma), rtol=0, atol=tolerance(dtype))


def test_every_kernel_accepts_row_strides(rng):
    n, d, sigma = 90, 4, 5.0
    wide = rng.uniform(-1, 1, (n, 3 * d + 5))
    q, k, v = wide[:, :d], wide[:, d : 2 * d], wide[:, 2 * d + 1 : 3 * d + 1]
    hashes = poslsh.rbf_hashes(sigma, 4, seed=1)
    lsh = reference.lsh_attention(q, k, v, hashes.widths, hashes.offsets)
    exact = reference.alibi_attention(q, k, v, sigma)
    np.testing.assert_allclose(poslsh.lsh_attention_per_sample(q, k, v, hashes), lsh, atol=1e-12)
    np.testing.assert_allclose(poslsh.alibi_attention_banded(q, k, v, sigma, n), exact, atol=1e-12)
    np.testing.assert_allclose(poslsh.alibi_attention_reference(q, k, v, sigma), exact, atol=1e-12)
    every_other = np.ascontiguousarray(np.repeat(q, 2, axis=0))[::2]  # row stride 2 d
    assert every_other.strides[0] == 2 * d * 8
    np.testing.assert_allclose(poslsh.lsh_attention_fused(every_other, k, v, hashes), lsh, atol=1e-12)


def test_float64_where_float32_is_required_is_type_error(rng):
    q, k, v = random_qkv(rng, 20, 4, np.float32)
    hashes = poslsh.rbf_hashes(4.0, 2, seed=0)
    with pytest.raises(TypeError) as error:
        poslsh.lsh_attention_fused(q, k.astype(np.float64), v, hashes)
    assert str(error.value).startswith(
        "poslsh: lsh_attention_fused: argument 'k' has dtype float64: must be float32 like 'q'"
    )
    out64 = np.zeros((20, 4))
    with pytest.raises(TypeError, match="argument 'out' has dtype float64: must be float32"):
        poslsh.alibi_attention_tiled(q, k, v, 4.0, out=out64)
    assert not out64.any()
    with pytest.raises(TypeError, match="argument 'q' has dtype int64: must be float32 or float64"):
        poslsh.alibi_attention_tiled(np.zeros((20, 4), dtype=np.int64), k, v, 4.0)
    # float16 q takes float16 k, v only (test_half_precision.py has the half-precision rules).
    with pytest.raises(TypeError, match="argument 'k' has dtype float32: must be float16 like 'q'"):
        poslsh.lsh_attention_fused(q.astype(np.float16), k, v, hashes)
    with pytest.raises(TypeError, match="argument 'v' must be a numpy.ndarray, got list"):
        poslsh.lsh_attention_fused(q, k, v.tolist(), hashes)
    swapped = v.astype(v.dtype.newbyteorder(">"))
    with pytest.raises(TypeError, match="argument 'v' has dtype >f4"):
        poslsh.lsh_attention_fused(q, k, swapped, hashes)


def test_layout_errors_are_value_errors(rng):
    q, k, v = random_qkv(rng, 20, 4, np.float64)
    hashes = poslsh.rbf_hashes(4.0, 2, seed=0)
    with pytest.raises(ValueError, match=r"argument 'k' has strides \(8, 160\) bytes: its last axis must be contiguous"):
        poslsh.lsh_attention_fused(q, np.asfortranarray(k), v, hashes)
    wide = np.zeros((20, 8))
    with pytest.raises(ValueError, match="argument 'v' has strides .* its last axis must be contiguous"):
        poslsh.lsh_attention_fused(q, k, wide[:, ::2], hashes)
    with pytest.raises(ValueError, match="argument 'q' has strides .* the row stride must be a positive multiple"):
        poslsh.lsh_attention_fused(q[::-1], k, v, hashes)
    with pytest.raises(ValueError, match="argument 'k' has strides .* the row stride must be a positive multiple"):
        poslsh.lsh_attention_fused(q, np.broadcast_to(k[0], k.shape), v, hashes)
    with pytest.raises(ValueError, match="argument 'q' has 3 dimensions: must be a 2-D array"):
        poslsh.alibi_attention_tiled(q[None], k, v, 4.0)
    with pytest.raises(ValueError, match=r"argument 'out' has shape \(20, 3\): must be \(20, 4\)"):
        poslsh.alibi_attention_tiled(q, k, v, 4.0, out=np.zeros((20, 3)))
    read_only = np.zeros((20, 4))
    read_only.setflags(write=False)
    with pytest.raises(ValueError, match="argument 'out' is read-only"):
        poslsh.alibi_attention_tiled(q, k, v, 4.0, out=read_only)
    with pytest.raises(ValueError, match="argument 'out' shares memory with 'v'"):
        poslsh.alibi_attention_tiled(q, k, v, 4.0, out=v)
    buffer = np.zeros((20, 2, 4))
    buffer[:, 0] = v
    # Interleaved but disjoint: allowed.
    poslsh.alibi_attention_tiled(q, k, buffer[:, 0], 4.0, out=buffer[:, 1])
    np.testing.assert_allclose(buffer[:, 1], reference.alibi_attention(q, k, v, 4.0), atol=1e-12)


def test_library_errors_are_value_errors_with_its_message(rng):
    q, k, v = random_qkv(rng, 20, 4, np.float32)
    with pytest.raises(ValueError) as error:
        poslsh.alibi_attention_tiled(q, k[:, :3], v, 4.0)
    assert str(error.value) == (
        "poslsh: alibi_attention_tiled: argument 'k' = 3: column count (d) must equal q.cols() = 4"
    )
    with pytest.raises(ValueError) as error:
        poslsh.alibi_attention_tiled(q, k, v, 0.0)
    assert str(error.value) == "poslsh: alibi_attention_tiled: argument 'sigma' = 0: must be finite and > 0"
    with pytest.raises(ValueError, match="lsh_attention_fused: argument 'options.scale' = inf"):
        poslsh.lsh_attention_fused(q, k, v, poslsh.rbf_hashes(4.0, 2, seed=0), scale=float("inf"))
    with pytest.raises(ValueError, match="alibi_attention_banded: argument 'band' = -1: must be >= 0"):
        poslsh.alibi_attention_banded(q, k, v, 4.0, -1)

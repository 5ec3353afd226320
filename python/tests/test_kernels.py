"""Single-head kernels and decoders against the dense numpy formulas."""

import numpy as np
import pytest

import poslsh
import reference
from conftest import masking_of, random_qkv, tolerance

DTYPES = [np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("function", ["alibi_attention_tiled", "alibi_attention_reference"])
def test_exact_alibi(rng, dtype, causal, function):
    n, d, sigma = 200, 16, 8.0
    q, k, v = random_qkv(rng, n, d, dtype, d_v=12)
    out = getattr(poslsh, function)(q, k, v, sigma, masking=masking_of(causal))
    assert out.dtype == dtype and out.shape == (n, 12)
    expected = reference.alibi_attention(q, k, v, sigma, causal=causal)
    np.testing.assert_allclose(out, expected, rtol=0, atol=tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_alibi_scale(rng, dtype):
    n, d, sigma = 150, 8, 4.0
    q, k, v = random_qkv(rng, n, d, dtype)
    out = poslsh.alibi_attention_tiled(q, k, v, sigma, scale=2.5)
    expected = reference.alibi_attention(q, k, v, sigma, scale=2.5)
    np.testing.assert_allclose(out, expected, rtol=0, atol=tolerance(dtype))
    # Different from the default scale 1/sqrt(d).
    assert np.abs(poslsh.alibi_attention_tiled(q, k, v, sigma) - expected).max() > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_banded(rng, dtype, causal):
    n, d, sigma = 200, 16, 6.0
    q, k, v = random_qkv(rng, n, d, dtype)
    band = poslsh.band_for_bias_error(sigma, 1e-2)
    out = poslsh.alibi_attention_banded(q, k, v, sigma, band, masking=masking_of(causal))
    expected = reference.alibi_attention(q, k, v, sigma, causal=causal, band=band)
    np.testing.assert_allclose(out, expected, rtol=0, atol=tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("function", ["lsh_attention_fused", "lsh_attention_per_sample"])
def test_lsh_estimator(rng, dtype, causal, function):
    n, d, sigma = 257, 16, 12.0
    q, k, v = random_qkv(rng, n, d, dtype, d_v=24)
    hashes = poslsh.rbf_hashes(sigma, 9, seed=5, stream=2)
    out = getattr(poslsh, function)(q, k, v, hashes, masking=masking_of(causal), scale=0.3)
    expected = reference.lsh_attention(q, k, v, hashes.widths, hashes.offsets, causal, scale=0.3)
    np.testing.assert_allclose(out, expected, rtol=0, atol=tolerance(dtype))


def test_lsh_estimator_from_given_hashes(rng):
    n, d = 100, 8
    q, k, v = random_qkv(rng, n, d, np.float64)
    hashes = poslsh.HashSet([7.5, 20.0, 3.25], [0.5, 19.0, 3.0])
    out = poslsh.lsh_attention_fused(q, k, v, hashes)
    expected = reference.lsh_attention(q, k, v, [7.5, 20.0, 3.25], [0.5, 19.0, 3.0], True)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fixed_blocks(rng, dtype):
    n, d, sigma = 130, 8, 5.0
    q, k, v = random_qkv(rng, n, d, dtype)
    out = poslsh.fixed_blocks_attention(q, k, v, sigma, masking="bidirectional")
    expected = reference.lsh_attention(q, k, v, [2 * sigma], [0.0], causal=False)
    np.testing.assert_allclose(out, expected, rtol=0, atol=tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_lsh_converges_to_alibi(rng, dtype):
    """E[M~] = L*: with many samples the estimate approaches exact ALiBi attention."""
    n, d, sigma = 256, 16, 8.0
    q, k, v = random_qkv(rng, n, d, dtype)
    exact = reference.alibi_attention(q, k, v, sigma)
    errors = []
    for s in (4, 64, 1024):
        out = poslsh.lsh_attention_fused(q, k, v, poslsh.rbf_hashes(sigma, s, seed=11))
        errors.append(np.linalg.norm(out - exact) / np.linalg.norm(exact))
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.06


@pytest.mark.parametrize("dtype", DTYPES)
def test_decoders(rng, dtype):
    n, d, sigma, t = 120, 16, 8.0, 77
    q, k, v = random_qkv(rng, n, d, dtype)
    hashes = poslsh.rbf_hashes(sigma, 16, seed=3)
    # Rows after t of the cache are never read: poison them.
    k_cache, v_cache = k.copy(), v.copy()
    k_cache[t + 1 :] = np.nan
    v_cache[t + 1 :] = np.nan
    lsh_rows = reference.lsh_attention(q[: t + 1], k[: t + 1], v[: t + 1], hashes.widths, hashes.offsets)
    exact_rows = reference.alibi_attention(q[: t + 1], k[: t + 1], v[: t + 1], sigma)
    lsh = poslsh.lsh_attention_decode(q[t], k_cache, v_cache, t, hashes)
    assert lsh.shape == (d,) and lsh.dtype == dtype
    np.testing.assert_allclose(lsh, lsh_rows[t], rtol=0, atol=tolerance(dtype))
    exact = poslsh.alibi_attention_decode_exact(q[t : t + 1], k_cache, v_cache, t, sigma)
    assert exact.shape == (1, d)
    np.testing.assert_allclose(exact[0], exact_rows[t], rtol=0, atol=tolerance(dtype))
    out = np.zeros(d, dtype=dtype)
    returned = poslsh.lsh_attention_decode(q[t], k_cache, v_cache, t, hashes, out=out)
    assert returned is out
    np.testing.assert_array_equal(out, lsh)


def test_decode_errors(rng):
    q, k, v = random_qkv(rng, 10, 4, np.float32)
    hashes = poslsh.rbf_hashes(4.0, 2, seed=0)
    with pytest.raises(ValueError, match=r"lsh_attention_decode: argument 't' = 10: must lie in \[0, keys.rows\(\)\)"):
        poslsh.lsh_attention_decode(q[0], k, v, 10, hashes)
    with pytest.raises(ValueError, match=r"lsh_attention_decode: argument 'query' = 5: row count m must be <= t \+ 1 = 4"):
        poslsh.lsh_attention_decode(q[:5], k, v, 3, hashes)
    with pytest.raises(ValueError, match="argument 'query' has strides"):
        poslsh.lsh_attention_decode(np.asfortranarray(q[:2]), k, v, 3, hashes)


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_token_decode(rng, dtype):
    """m queries at positions t - m + 1 .. t: the rows of the prefill at those positions."""
    n, d, sigma, t, m = 90, 8, 6.0, 70, 4
    q, k, v = random_qkv(rng, n, d, dtype)
    hashes = poslsh.rbf_hashes(sigma, 8, seed=6)
    lsh_rows = reference.lsh_attention(q[: t + 1], k[: t + 1], v[: t + 1], hashes.widths, hashes.offsets)
    exact_rows = reference.alibi_attention(q[: t + 1], k[: t + 1], v[: t + 1], sigma)
    queries = q[t - m + 1 : t + 1]
    lsh = poslsh.lsh_attention_decode(queries, k, v, t, hashes)
    assert lsh.shape == (m, d)
    np.testing.assert_allclose(lsh, lsh_rows[t - m + 1 :], rtol=0, atol=tolerance(dtype))
    exact = poslsh.alibi_attention_decode_exact(queries, k, v, t, sigma)
    np.testing.assert_allclose(exact, exact_rows[t - m + 1 :], rtol=0, atol=tolerance(dtype))


@pytest.mark.parametrize("function", ["alibi_attention_tiled", "lsh_attention_fused"])
def test_thread_count_does_not_change_bits(rng, function):
    n, d = 700, 32
    q, k, v = random_qkv(rng, n, d, np.float32)
    argument = 16.0 if function == "alibi_attention_tiled" else poslsh.rbf_hashes(16.0, 8, seed=2)
    kernel = getattr(poslsh, function)
    one = kernel(q, k, v, argument, num_threads=1)
    two = kernel(q, k, v, argument, num_threads=2)
    three = kernel(q, k, v, argument, num_threads=3)
    np.testing.assert_array_equal(one, two)
    np.testing.assert_array_equal(one, three)
    with pytest.raises(ValueError, match="argument 'num_threads' = 0: must be >= 1"):
        kernel(q, k, v, argument, num_threads=0)


def test_empty_and_single_row(rng):
    hashes = poslsh.rbf_hashes(4.0, 3, seed=0)
    empty = np.zeros((0, 8), dtype=np.float32)
    assert poslsh.lsh_attention_fused(empty, empty, empty, hashes).shape == (0, 8)
    assert poslsh.alibi_attention_tiled(empty, empty, empty, 4.0).shape == (0, 8)
    q, k, v = random_qkv(rng, 1, 8, np.float64)
    np.testing.assert_allclose(poslsh.lsh_attention_fused(q, k, v, hashes), v, atol=1e-15)
    np.testing.assert_allclose(poslsh.alibi_attention_tiled(q, k, v, 4.0), v, atol=1e-15)

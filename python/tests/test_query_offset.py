"""query_offset of the prefill kernels: m queries at positions p0 .. p0 + m - 1 over L keys,
against the dense formulas at those positions, and chunked prefill bitwise equal to one
prefill."""

import numpy as np
import pytest

import poslsh
import reference
from conftest import masking_of, random_qkv, tolerance

DTYPES = [np.float32, np.float64]


def dense_at_offset(q, k, v, p0, causal, sigma=None, band=None, widths=None, offsets=None, scale=None):
    """Rows p0 .. p0 + m - 1 of the dense formula over the L = k.shape[0] positions: exact
    ALiBi softmax(tau q_r.k_j - |p0 + r - j| / sigma) (band: |i - j| <= band), or the LSH
    estimator softmax(tau q_r.k_j + log M~_{p0+r, j}); causal keeps j <= p0 + r."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    m, d = q.shape
    L = k.shape[0]
    i = p0 + np.arange(m)[:, None]
    j = np.arange(L)[None, :]
    keep = (j <= i) if causal else np.ones((m, L), dtype=bool)
    scores = reference.tau_of(d, scale) * (q @ k.T)
    if widths is None:
        logits = scores - np.abs(i - j) / sigma
        if band is not None:
            keep = keep & (np.abs(i - j) <= band)
        return reference.softmax_rows(np.where(keep, logits, -np.inf), v)
    mask = reference.mean_mask(widths, offsets, L, causal=False)[p0 : p0 + m]
    with np.errstate(divide="ignore"):
        logits = scores + np.log(np.where(keep, mask, 0.0))
    return reference.softmax_rows(logits, v)


KERNELS = ["alibi_attention_tiled", "alibi_attention_banded", "lsh_attention_fused", "lsh_attention_per_sample", "fixed_blocks_attention"]


def call(function, q, k, v, sigma, hashes, **keywords):
    kernel = getattr(poslsh, function)
    if function in ("alibi_attention_tiled", "fixed_blocks_attention"):
        return kernel(q, k, v, sigma, **keywords)
    if function == "alibi_attention_banded":
        return kernel(q, k, v, sigma, 9, **keywords)
    return kernel(q, k, v, hashes, **keywords)


def expected(function, q, k, v, p0, causal, sigma, hashes):
    if function == "alibi_attention_tiled":
        return dense_at_offset(q, k, v, p0, causal, sigma=sigma)
    if function == "alibi_attention_banded":
        return dense_at_offset(q, k, v, p0, causal, sigma=sigma, band=9)
    if function == "fixed_blocks_attention":
        return dense_at_offset(q, k, v, p0, causal, widths=[2 * sigma], offsets=[0.0])
    return dense_at_offset(q, k, v, p0, causal, widths=hashes.widths, offsets=hashes.offsets)


@pytest.mark.parametrize("function", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_offset_rows_equal_the_dense_formula(rng, function, dtype, causal):
    L, d, sigma = 160, 8, 6.0
    q, k, v = random_qkv(rng, L, d, dtype, d_v=5)
    hashes = poslsh.rbf_hashes(sigma, 5, seed=12)
    for p0, m in ((0, 30), (37, 50), (101, 59), (159, 1)):
        chunk = q[p0 : p0 + m]
        out = call(function, chunk, k, v, sigma, hashes, masking=masking_of(causal), query_offset=p0)
        assert out.shape == (m, 5) and out.dtype == dtype
        np.testing.assert_allclose(out, expected(function, chunk, k, v, p0, causal, sigma, hashes),
                                   rtol=0, atol=tolerance(dtype))


@pytest.mark.parametrize("function", KERNELS)
def test_unset_offset_is_bottom_right(rng, function):
    """Without query_offset, m queries over L keys are the last m positions (p0 = L - m)."""
    L, m, d, sigma = 120, 45, 8, 5.0
    q, k, v = random_qkv(rng, L, d, np.float64)
    hashes = poslsh.rbf_hashes(sigma, 4, seed=3)
    out = call(function, q[L - m :], k, v, sigma, hashes)
    np.testing.assert_allclose(out, expected(function, q[L - m :], k, v, L - m, True, sigma, hashes), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(out, call(function, q[L - m :], k, v, sigma, hashes, query_offset=L - m))


CHUNKS = [0, 1, 38, 64, 65, 130, 200, 263, 300]  # chunk boundaries over L = 300


@pytest.mark.parametrize("function", ["alibi_attention_tiled", "lsh_attention_fused", "alibi_attention_banded"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_chunked_prefill_equals_one_prefill_bitwise(rng, function, dtype):
    """Chunk [a, b) with the keys so far (k[:b]) and query_offset a: bitwise rows a .. b-1 of
    one prefill of all L tokens (also with the offset left unset: bottom-right is a)."""
    L, d, sigma = CHUNKS[-1], 16, 10.0
    q, k, v = random_qkv(rng, L, d, dtype)
    hashes = poslsh.rbf_hashes(sigma, 8, seed=4)
    full = call(function, q, k, v, sigma, hashes)
    chunked = np.empty_like(full)
    for a, b in zip(CHUNKS[:-1], CHUNKS[1:]):
        call(function, q[a:b], k[:b], v[:b], sigma, hashes, query_offset=a, out=chunked[a:b])
        np.testing.assert_array_equal(call(function, q[a:b], k[:b], v[:b], sigma, hashes), chunked[a:b])
    np.testing.assert_array_equal(chunked, full)
    np.testing.assert_allclose(full, expected(function, q, k, v, 0, True, sigma, hashes), rtol=0, atol=tolerance(dtype))


@pytest.mark.parametrize("function", ["alibi_attention_tiled", "lsh_attention_fused", "lsh_attention_per_sample"])
@pytest.mark.parametrize("causal", [True, False])
def test_chunks_over_all_keys_equal_one_prefill_bitwise(rng, function, causal):
    """Chunk [a, b) over all L keys with query_offset a: bitwise rows a .. b-1 of one prefill,
    for any thread count."""
    L, d, sigma = CHUNKS[-1], 16, 10.0
    q, k, v = random_qkv(rng, L, d, np.float32)
    hashes = poslsh.rbf_hashes(sigma, 8, seed=9)
    full = call(function, q, k, v, sigma, hashes, masking=masking_of(causal))
    for threads in (1, 2):
        chunked = np.vstack([call(function, q[a:b], k, v, sigma, hashes, masking=masking_of(causal), query_offset=a, num_threads=threads)
                             for a, b in zip(CHUNKS[:-1], CHUNKS[1:])])
        np.testing.assert_array_equal(chunked, full)


@pytest.mark.parametrize("method", ["lsh_fused", "exact_tiled", "exact_banded", "lsh_per_sample", "fixed_blocks"])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_multihead_chunks_equal_one_prefill_bitwise(rng, method, layout):
    L, heads, kv_heads, d = 200, 4, 2, 8
    token_axis = 0 if layout == "nhd" else 1
    shape = (lambda h: (L, h, d)) if layout == "nhd" else (lambda h: (h, L, d))
    q = rng.uniform(-1, 1, shape(heads)).astype(np.float32)
    k, v = (rng.uniform(-1, 1, shape(kv_heads)).astype(np.float32) for _ in range(2))
    keywords = dict(layout=layout, method=method, masking="bidirectional", samples=6, seed=1)
    full = poslsh.multihead_attention(q, k, v, **keywords)
    pieces = []
    for a, b in ((0, 70), (70, 71), (71, 200)):
        rows = np.take(q, np.arange(a, b), axis=token_axis)
        pieces.append(poslsh.multihead_attention(rows, k, v, query_offset=a, **keywords))
    np.testing.assert_array_equal(np.concatenate(pieces, axis=token_axis), full)
    # Causal with the keys so far: the same rows.
    keywords["masking"] = "causal"
    if method in ("lsh_per_sample", "fixed_blocks"):
        return  # causal blocks cut at the sequence end: equal to rounding only (see the docstring)
    full = poslsh.multihead_attention(q, k, v, **keywords)
    a, b = 64, 150
    rows = np.take(q, np.arange(a, b), axis=token_axis)
    keys, values = (np.take(x, np.arange(b), axis=token_axis) for x in (k, v))
    chunk = poslsh.multihead_attention(rows, keys, values, query_offset=a, **keywords)
    np.testing.assert_array_equal(chunk, np.take(full, np.arange(a, b), axis=token_axis))


def test_multihead_offset_against_the_dense_formula(rng):
    L, m, p0, heads, d = 90, 20, 33, 2, 8
    q = rng.uniform(-1, 1, (m, heads, d))
    k, v = (rng.uniform(-1, 1, (L, heads, d)) for _ in range(2))
    sigmas = poslsh.alibi_sigmas(heads)
    exact = poslsh.multihead_attention(q, k, v, method="exact_tiled", query_offset=p0)
    lsh = poslsh.multihead_attention(q, k, v, method="lsh_fused", samples=5, seed=8, query_offset=p0)
    for h in range(heads):
        hashes = poslsh.rbf_hashes(sigmas[h], 5, 8, stream=h)
        np.testing.assert_allclose(exact[:, h], dense_at_offset(q[:, h], k[:, h], v[:, h], p0, True, sigma=sigmas[h]), rtol=0, atol=1e-12)
        np.testing.assert_allclose(lsh[:, h], dense_at_offset(q[:, h], k[:, h], v[:, h], p0, True,
                                                              widths=hashes.widths, offsets=hashes.offsets), rtol=0, atol=1e-12)


def test_offset_errors(rng):
    q, k, v = random_qkv(rng, 20, 4, np.float32)
    hashes = poslsh.rbf_hashes(4.0, 2, seed=0)
    with pytest.raises(ValueError, match=r"poslsh: alibi_attention_tiled: argument 'options.query_offset' = 11: must lie in \[0, keys - queries\] = \[0, 10\]"):
        poslsh.alibi_attention_tiled(q[:10], k, v, 4.0, query_offset=11)
    with pytest.raises(ValueError, match=r"lsh_attention_fused: argument 'options.query_offset' = -1"):
        poslsh.lsh_attention_fused(q[:10], k, v, hashes, query_offset=-1)
    with pytest.raises(ValueError, match="argument 'k' = 5: row count must be >= the query count 10"):
        poslsh.lsh_attention_per_sample(q[:10], k[:5], v[:5], hashes)
    with pytest.raises(ValueError, match="multihead_attention: argument 'options.query_offset' = 3"):
        x = q.reshape(20, 1, 4)
        poslsh.multihead_attention(x[:18], x, x, query_offset=3)
    # Self-attention is query_offset 0.
    x = q.reshape(20, 1, 4)
    np.testing.assert_array_equal(poslsh.multihead_attention(x, x, x, method="exact_tiled", query_offset=0),
                                  poslsh.multihead_attention(x, x, x, method="exact_tiled"))

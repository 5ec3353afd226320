"""multihead_attention_varlen (packed batches, int32 cu_seqlens) bitwise equal to one
multihead_attention call per sequence, and to the dense formula."""

import numpy as np
import pytest

import poslsh
import reference
from conftest import METHODS


def packed(rng, lengths, heads, d, layout, dtype):
    """A packed [total, H, d] array (or [H, total, d]) of random values."""
    total = int(sum(lengths))
    shape = (total, heads, d) if layout == "nhd" else (heads, total, d)
    return rng.uniform(-1, 1, shape).astype(dtype)


def cumulative(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def tokens(array, begin, end, layout):
    return array[begin:end] if layout == "nhd" else array[:, begin:end]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_equals_per_sequence_calls_bitwise(rng, method, layout, dtype):
    heads, kv_heads, d = 4, 2, 8
    query_lengths = [70, 0, 1, 130, 33]
    key_lengths = [70, 5, 40, 130, 100]  # m_b <= L_b: the queries are the last m_b keys
    q = packed(rng, query_lengths, heads, d, layout, dtype)
    k, v = (packed(rng, key_lengths, kv_heads, d, layout, dtype) for _ in range(2))
    cu_q, cu_k = cumulative(query_lengths), cumulative(key_lengths)
    keywords = dict(layout=layout, method=method, samples=6, seed=3, band_error=1e-2)
    for masking in ("causal", "bidirectional"):
        out = poslsh.multihead_attention_varlen(q, k, v, cu_q, cu_k, masking=masking, **keywords)
        assert out.shape == q.shape and out.dtype == dtype
        for b in range(len(query_lengths)):
            if query_lengths[b] == 0:
                continue
            single = poslsh.multihead_attention(
                tokens(q, cu_q[b], cu_q[b + 1], layout), tokens(k, cu_k[b], cu_k[b + 1], layout),
                tokens(v, cu_k[b], cu_k[b + 1], layout), masking=masking, **keywords)
            np.testing.assert_array_equal(tokens(out, cu_q[b], cu_q[b + 1], layout), single)


@pytest.mark.parametrize("method", ["lsh_fused", "exact_tiled", "lsh_per_sample"])
def test_query_offsets(rng, method):
    heads, d = 2, 8
    query_lengths, key_lengths, offsets = [20, 64, 3], [90, 64, 10], [5, 0, 7]
    q = packed(rng, query_lengths, heads, d, "nhd", np.float64)
    k, v = (packed(rng, key_lengths, heads, d, "nhd", np.float64) for _ in range(2))
    cu_q, cu_k = cumulative(query_lengths), cumulative(key_lengths)
    out = poslsh.multihead_attention_varlen(q, k, v, cu_q, cu_k, query_offsets=offsets, method=method,
                                            masking="bidirectional", samples=4, seed=2)
    sigmas = poslsh.alibi_sigmas(heads)
    for b, p0 in enumerate(offsets):
        qb, kb, vb = q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        single = poslsh.multihead_attention(qb, kb, vb, query_offset=p0, method=method,
                                            masking="bidirectional", samples=4, seed=2)
        np.testing.assert_array_equal(out[cu_q[b] : cu_q[b + 1]], single)
        # The dense formula at positions p0 .. p0 + m - 1 of the sequence's own positions.
        m, L = qb.shape[0], kb.shape[0]
        i = p0 + np.arange(m)[:, None]
        j = np.arange(L)[None, :]
        for h in range(heads):
            scores = (qb[:, h] @ kb[:, h].T) / np.sqrt(d)
            if method == "exact_tiled":
                logits = scores - np.abs(i - j) / sigmas[h]
            else:
                hashes = poslsh.rbf_hashes(sigmas[h], 4, 2, stream=h)
                mask = reference.mean_mask(hashes.widths, hashes.offsets, L, causal=False)[p0 : p0 + m]
                with np.errstate(divide="ignore"):
                    logits = scores + np.log(mask)
            np.testing.assert_allclose(out[cu_q[b] : cu_q[b + 1], h], reference.softmax_rows(logits, vb[:, h]), rtol=0, atol=1e-12)


def test_errors(rng):
    lengths = [4, 6]
    q, k, v = (packed(rng, lengths, 2, 4, "nhd", np.float32) for _ in range(3))
    cu = cumulative(lengths)
    varlen = poslsh.multihead_attention_varlen
    with pytest.raises(TypeError, match="argument 'cu_seqlens_q' has dtype int64: must be int32"):
        varlen(q, k, v, cu.astype(np.int64), cu)
    with pytest.raises(TypeError, match="argument 'cu_seqlens_k' must be a numpy.ndarray, got list"):
        varlen(q, k, v, cu, [0, 4, 10])
    with pytest.raises(ValueError, match="multihead_attention_varlen: argument 'cu_seqlens_q' = 9: last entry must equal the packed token count 10"):
        varlen(q, k, v, np.array([0, 4, 9], np.int32), cu)
    with pytest.raises(ValueError, match="argument 'cu_seqlens_k' = 2: must have as many entries as cu_seqlens_q"):
        varlen(q, k, v, cu, np.array([0, 10], np.int32))
    with pytest.raises(ValueError, match=r"argument 'query_offsets' = 5: must lie in \[0, keys - queries\] = \[0, 0\]"):
        varlen(q, k, v, cu, cu, query_offsets=[0, 5])
    with pytest.raises(TypeError, match="argument 'k' has dtype float64: must be float32"):
        varlen(q, k.astype(np.float64), v, cu, cu)

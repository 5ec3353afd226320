"""Paged KV cache kernels (int32 block table) bitwise equal to the contiguous kernels on the
same keys and values."""

import numpy as np
import pytest

import poslsh
from conftest import masking_of
import reference


def paged_cache(rng, lengths, page_size, kv_heads, d, d_v, dtype):
    """Contiguous caches [L_b, H_kv, d] per sequence, and the same rows scattered over shuffled
    pages of one pool: k_pages, v_pages [num_pages, page_size, H_kv, d], block_table (unused
    entries -1), seq_lens."""
    keys = [rng.uniform(-1, 1, (L, kv_heads, d)).astype(dtype) for L in lengths]
    values = [rng.uniform(-1, 1, (L, kv_heads, d_v)).astype(dtype) for L in lengths]
    pages_of = [-(-L // page_size) for L in lengths]
    num_pages = sum(pages_of) + 3  # a few pages no sequence uses
    order = rng.permutation(num_pages)
    k_pages = np.full((num_pages, page_size, kv_heads, d), np.nan, dtype=dtype)
    v_pages = np.full((num_pages, page_size, kv_heads, d_v), np.nan, dtype=dtype)
    table = np.full((len(lengths), max(pages_of) + 1), -1, dtype=np.int32)
    used = 0
    for b, L in enumerate(lengths):
        for p in range(pages_of[b]):
            page = order[used]
            used += 1
            table[b, p] = page
            rows = slice(p * page_size, min(L, (p + 1) * page_size))
            count = rows.stop - rows.start
            k_pages[page, :count] = keys[b][rows]
            v_pages[page, :count] = values[b][rows]
    return keys, values, k_pages, v_pages, table, np.array(lengths, dtype=np.int32)


@pytest.mark.parametrize("page_size", [16, 64, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_equals_contiguous_bitwise(rng, page_size, dtype, causal):
    lengths, kv_heads, d, d_v, sigma = [150, 37], 2, 16, 8, 9.0
    keys, values, k_pages, v_pages, table, seq_lens = paged_cache(rng, lengths, page_size, kv_heads, d, d_v, dtype)
    hashes = poslsh.rbf_hashes(sigma, 6, seed=5)
    for b, L in enumerate(lengths):
        queries = rng.uniform(-1, 1, (L, d)).astype(dtype)
        for h in range(kv_heads):
            k, v = keys[b][:, h], values[b][:, h]
            # Prefill (m = L), a chunk at an offset, and a one-token decode (bottom-right).
            for p0, m in ((0, L), (L // 3, L // 2), (L - 1, 1)):
                q = queries[p0 : p0 + m]
                offset = None if p0 + m == L else p0
                fused = poslsh.lsh_attention_fused_paged(q, k_pages, v_pages, table, seq_lens, b, h, hashes,
                                                         masking=masking_of(causal), query_offset=offset)
                np.testing.assert_array_equal(fused, poslsh.lsh_attention_fused(q, k, v, hashes, masking=masking_of(causal), query_offset=p0))
                exact = poslsh.alibi_attention_tiled_paged(q, k_pages, v_pages, table, seq_lens, b, h, sigma,
                                                           masking=masking_of(causal), query_offset=offset)
                assert exact.shape == (m, d_v) and exact.dtype == dtype
                np.testing.assert_array_equal(exact, poslsh.alibi_attention_tiled(q, k, v, sigma, masking=masking_of(causal), query_offset=p0))


def test_paged_against_the_dense_formula_and_out(rng):
    lengths, d, sigma = [70], 8, 5.0
    keys, values, k_pages, v_pages, table, seq_lens = paged_cache(rng, lengths, 16, 1, d, d, np.float64)
    wide = rng.uniform(-1, 1, (70, 3 * d))
    q = wide[:, d : 2 * d]  # row stride 3 d: used in place
    k, v = keys[0][:, 0], values[0][:, 0]
    parent = np.full((70, 2 * d), np.nan)
    out = poslsh.alibi_attention_tiled_paged(q, k_pages, v_pages, table, seq_lens, 0, 0, sigma, out=parent[:, d:])
    assert out.base is parent
    np.testing.assert_allclose(parent[:, d:], reference.alibi_attention(q, k, v, sigma), rtol=0, atol=1e-12)
    assert np.isnan(parent[:, :d]).all()
    hashes = poslsh.rbf_hashes(sigma, 4, seed=1)
    fused = poslsh.lsh_attention_fused_paged(q, k_pages, v_pages, table, seq_lens, 0, 0, hashes, num_threads=2)
    np.testing.assert_allclose(fused, reference.lsh_attention(q, k, v, hashes.widths, hashes.offsets), rtol=0, atol=1e-12)


def test_paged_errors(rng):
    keys, values, k_pages, v_pages, table, seq_lens = paged_cache(rng, [40], 16, 1, 4, 4, np.float32)
    q = rng.uniform(-1, 1, (1, 4)).astype(np.float32)
    hashes = poslsh.rbf_hashes(4.0, 2, seed=0)
    fused = poslsh.lsh_attention_fused_paged
    with pytest.raises(TypeError, match="argument 'block_table' has dtype int64: must be int32"):
        fused(q, k_pages, v_pages, table.astype(np.int64), seq_lens, 0, 0, hashes)
    with pytest.raises(TypeError, match="argument 'k_pages' has dtype float64: must be float32 like 'q'"):
        fused(q, k_pages.astype(np.float64), v_pages, table, seq_lens, 0, 0, hashes)
    with pytest.raises(ValueError, match="argument 'k_pages' must be C-contiguous"):
        fused(q, k_pages[:, ::-1], v_pages, table, seq_lens, 0, 0, hashes)
    with pytest.raises(ValueError, match="argument 'v_pages' has shape"):
        fused(q, k_pages, v_pages[:-1], table, seq_lens, 0, 0, hashes)
    bad = table.copy()
    bad[0, 1] = k_pages.shape[0]
    with pytest.raises(ValueError, match=r"lsh_attention_fused_paged: argument 'cache.block_table' = \[0\]\[1\] = %d: page indices must lie in \[0, num_pages\)" % k_pages.shape[0]):
        fused(q, k_pages, v_pages, bad, seq_lens, 0, 0, hashes)
    with pytest.raises(ValueError, match=r"argument 'kv_head' = 1: must lie in \[0, cache.heads\)"):
        fused(q, k_pages, v_pages, table, seq_lens, 0, 1, hashes)
    with pytest.raises(ValueError, match=r"argument 'sequence' = 1: must lie in \[0, cache.batch\)"):
        poslsh.alibi_attention_tiled_paged(q, k_pages, v_pages, table, seq_lens, 1, 0, 4.0)
    with pytest.raises(ValueError, match="argument 'seq_lens' has 2 entries: must have one per block table row"):
        fused(q, k_pages, v_pages, table, np.array([40, 40], np.int32), 0, 0, hashes)

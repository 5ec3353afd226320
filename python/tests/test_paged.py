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
    with pytest.raises(ValueError, match="argument 'k_pages' has stride -16 bytes on axis 1"):
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


# The all-heads entry point: multihead_attention_paged (and _with_lse). -------------------------

HALF_DTYPES = {"float16": np.float16, "bfloat16": "bfloat16"}


def as_storage(x, dtype):
    """x (float32 values) as a binding argument of `dtype`: numpy arrays of float32, float64 or
    float16, or poslsh.BFloat16Bits (the upper 16 bits of the float32 values, round to nearest
    even) for "bfloat16"; also the float32 values it holds."""
    if dtype != "bfloat16":
        stored = x.astype(dtype)
        return stored, stored.astype(np.float64 if dtype == np.float64 else np.float32)
    bits = x.astype(np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return poslsh.BFloat16Bits(rounded), (rounded.astype(np.uint32) << 16).view(np.float32)


def heads_batch(rng, lengths, page_size, kv_heads, d, d_v, dtype):
    """A paged cache of the sequences' keys and values (paged_cache on their values in `dtype`:
    float32 arrays of bfloat16 values for "bfloat16") and the gathered [sum L, H_kv, d] arrays."""
    keys, values, k_pages, v_pages, table, seq_lens = paged_cache(rng, lengths, page_size, kv_heads, d, d_v,
                                                                  np.float32)
    k_store, k_values = as_storage(k_pages, dtype)
    v_store, v_values = as_storage(v_pages, dtype)
    cu_k = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    # The gathered cache: each sequence's tokens read back from the pages (the dense copy the
    # paged call never makes).
    flat_k = k_values.reshape(-1, kv_heads, d)
    flat_v = v_values.reshape(-1, kv_heads, d_v)
    rows = np.concatenate([table[b, np.arange(L) // page_size] * page_size + np.arange(L) % page_size
                           for b, L in enumerate(lengths)]).astype(np.int64)
    return k_store, v_store, table, seq_lens, cu_k, flat_k[rows], flat_v[rows]


@pytest.mark.parametrize("page_size", [5, 16, 64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, "bfloat16"])
def test_multihead_paged_is_bitwise_the_varlen_call_on_the_gathered_cache(rng, page_size, dtype):
    """Every method (exact_tiled also with a window), a packed batch of queries (a prefill chunk,
    an empty sequence, a decode step) at their default and explicit offsets: out and lse bitwise
    the varlen call on the gathered keys, whatever the page size."""
    lengths, heads, kv_heads, d, d_v = [150, 0, 37], 4, 2, 16, 8
    k_pages, v_pages, table, seq_lens, cu_k, k, v = heads_batch(rng, lengths, page_size, kv_heads, d, d_v, dtype)
    cu_q = np.array([0, 70, 70, 71], dtype=np.int32)
    q, _ = as_storage(rng.uniform(-1, 1, (71, heads, d)), dtype)
    k_dense, _ = as_storage(k, dtype)
    v_dense, _ = as_storage(v, dtype)
    for method in poslsh.method_names():
        for offsets, window in ((None, (-1, -1)), ([30, 0, 10], (-1, -1)), (None, (4, -1))):
            if window != (-1, -1) and not method.startswith("exact"):
                continue
            keywords = dict(method=method, samples=3, seed=2, sigmas=[3.0, 9.0, 40.0, 1e300], window=window,
                            query_offsets=offsets)
            paged = poslsh.multihead_attention_paged(q, k_pages, v_pages, table, seq_lens, cu_q, **keywords)
            gathered = poslsh.multihead_attention_varlen(q, k_dense, v_dense, cu_q, cu_k, **keywords)
            if dtype == "bfloat16":
                paged, gathered = paged.bits, gathered.bits
            assert paged.dtype == gathered.dtype
            np.testing.assert_array_equal(paged, gathered, err_msg=f"{method} {offsets} {window}")
            if not poslsh.method_has_lse(method):
                with pytest.raises(ValueError, match="argument 'options.method' = mean_of_outputs: has no log-sum-exp"):
                    poslsh.multihead_attention_paged_with_lse(q, k_pages, v_pages, table, seq_lens, cu_q, **keywords)
                continue
            out, lse = poslsh.multihead_attention_paged_with_lse(q, k_pages, v_pages, table, seq_lens, cu_q,
                                                                 **keywords)
            del keywords["query_offsets"]
            if offsets is None:
                want, want_lse = poslsh.multihead_attention_with_lse(q, k_dense, v_dense, cu_seqlens=cu_q,
                                                                     cu_seqlens_k=cu_k, **keywords)
                np.testing.assert_array_equal(lse, want_lse)
            assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32) and lse.shape == (heads, 71)
            np.testing.assert_array_equal(out.bits if dtype == "bfloat16" else out, paged)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_multihead_paged_reads_a_strided_cache_in_place(rng, dtype):
    """k_pages and v_pages as views with strides (the halves of a packed [num_pages, page_size,
    2, H_kv, d] cache; pages interleaved with rows), read in place: out and lse bitwise those
    of the same cache copied C-contiguous, for every method."""
    lengths, heads, kv_heads, d = [45, 0, 20], 4, 2, 8
    _, _, k_pages, v_pages, table, seq_lens = paged_cache(rng, lengths, 8, kv_heads, d, d, dtype)
    q = rng.uniform(-1, 1, (7, heads, d)).astype(dtype)
    cu_q = np.array([0, 5, 5, 7], dtype=np.int32)
    packed = np.stack([k_pages, v_pages], axis=2)
    interleaved = np.ascontiguousarray(k_pages.transpose(1, 0, 2, 3)).transpose(1, 0, 2, 3)
    for k_view, v_view in ((packed[:, :, 0], packed[:, :, 1]), (interleaved, v_pages)):
        assert not k_view.flags.c_contiguous
        for method in poslsh.method_names(has_lse=True):
            keywords = dict(method=method, samples=3, seed=2, sigmas=[3.0, 9.0, 40.0, 1e300])
            out, lse = poslsh.multihead_attention_paged_with_lse(q, k_view, v_view, table, seq_lens, cu_q, **keywords)
            want, want_lse = poslsh.multihead_attention_paged_with_lse(q, k_pages, v_pages, table, seq_lens, cu_q,
                                                                       **keywords)
            np.testing.assert_array_equal(out, want, err_msg=method)
            np.testing.assert_array_equal(lse, want_lse, err_msg=method)


def test_multihead_paged_float32_queries_over_a_half_precision_cache(rng):
    """float32 q over a float16 or bfloat16 cache read in place: out and lse bitwise the float32
    call on the widened cache."""
    lengths, heads, kv_heads, d = [90, 33], 2, 1, 8
    q = rng.uniform(-1, 1, (6, heads, d)).astype(np.float32)
    cu_q = np.array([0, 5, 6], dtype=np.int32)
    for dtype in (np.float16, "bfloat16"):
        k_pages, v_pages, table, seq_lens, cu_k, k, v = heads_batch(rng, lengths, 16, kv_heads, d, d, dtype)
        for method in ("exact_tiled", "lsh_fused"):
            out, lse = poslsh.multihead_attention_paged_with_lse(q, k_pages, v_pages, table, seq_lens, cu_q,
                                                                 method=method)
            want, want_lse = poslsh.multihead_attention_with_lse(q, k, v, cu_seqlens=cu_q, cu_seqlens_k=cu_k,
                                                                 method=method)
            assert out.dtype == np.float32 and lse.dtype == np.float32
            np.testing.assert_array_equal(out, want)
            np.testing.assert_array_equal(lse, want_lse)


def test_multihead_paged_decode_against_the_dense_formula(rng):
    """Decode steps of 3 tokens at the end of two sequences, grouped-query heads, strided q (a slice
    of a packed buffer), out= and lse= written in place, layout 'hnd': the exact method against the
    dense float64 formula."""
    lengths, heads, kv_heads, d, m = [70, 21], 4, 2, 8, 3
    keys, values, k_pages, v_pages, table, seq_lens = paged_cache(rng, lengths, 16, kv_heads, d, d, np.float64)
    full = [rng.uniform(-1, 1, (L, heads, d)) for L in lengths]
    packed = rng.uniform(-1, 1, (2 * m, 3, heads, d))
    for b in range(2):
        packed[b * m:(b + 1) * m, 1] = full[b][-m:]
    q = packed[:, 1]  # strides (3 H d, d, 1) elements
    sigmas = [2.0, 5.0, 17.0, 60.0]
    out = np.full((heads, 2 * m, d), np.nan)  # 'hnd'
    lse = np.full((heads, 2 * m), np.nan)
    cu_q = np.array([0, m, 2 * m], dtype=np.int32)
    result = poslsh.multihead_attention_paged_with_lse(q.transpose(1, 0, 2), k_pages, v_pages, table, seq_lens, cu_q,
                                                       layout="hnd", method="exact_tiled", sigmas=sigmas, out=out,
                                                       lse=lse, num_threads=2)
    assert result[0] is out and result[1] is lse
    for b, L in enumerate(lengths):
        for h in range(heads):
            want = reference.alibi_attention(full[b][:, h], keys[b][:, h // 2], values[b][:, h // 2], sigmas[h])
            np.testing.assert_allclose(out[h, b * m:(b + 1) * m], want[-m:], rtol=0, atol=1e-12)
    assert np.isfinite(lse).all()


def test_multihead_paged_bad_arguments_name_them(rng):
    lengths, heads, kv_heads, d = [40, 20], 2, 1, 4
    keys, values, k_pages, v_pages, table, seq_lens = paged_cache(rng, lengths, 16, kv_heads, d, d, np.float32)
    q = rng.uniform(-1, 1, (3, heads, d)).astype(np.float32)
    cu_q = np.array([0, 2, 3], dtype=np.int32)
    call = poslsh.multihead_attention_paged
    call(q, k_pages, v_pages, table, seq_lens, cu_q)  # valid
    with pytest.raises(TypeError, match="multihead_attention_paged: argument 'block_table' has dtype int64"):
        call(q, k_pages, v_pages, table.astype(np.int64), seq_lens, cu_q)
    with pytest.raises(TypeError, match="argument 'cu_seqlens_q' has dtype int64"):
        call(q, k_pages, v_pages, table, seq_lens, cu_q.astype(np.int64))
    with pytest.raises(TypeError, match="argument 'k_pages' has dtype float64: must be float32 like 'q'"):
        call(q, k_pages.astype(np.float64), v_pages, table, seq_lens, cu_q)
    with pytest.raises(TypeError, match="argument 'v_pages' has dtype float32: must be float16 like 'k_pages'"):
        call(q, k_pages.astype(np.float16), v_pages, table, seq_lens, cu_q)
    with pytest.raises(ValueError, match="argument 'k_pages' has stride -16 bytes on axis 1"):
        call(q, k_pages[:, ::-1], v_pages, table, seq_lens, cu_q)
    with pytest.raises(ValueError, match="argument 'v_pages' must have a contiguous last axis"):
        call(q, k_pages, np.repeat(v_pages, 2, axis=3)[..., ::2], table, seq_lens, cu_q)
    with pytest.raises(ValueError, match="argument 'seq_lens' must be C-contiguous"):
        call(q, k_pages, v_pages, table, np.array([40, 0, 20, 0], np.int32)[::2], cu_q)
    with pytest.raises(ValueError, match="argument 'q' has stride"):
        call(q[:, :, ::2], k_pages, v_pages, table, seq_lens, cu_q)
    bad = table.copy()
    bad[1, 1] = k_pages.shape[0]  # sequence 1 has 20 tokens: its second page is used
    with pytest.raises(ValueError, match=r"multihead_attention_paged: argument 'cache.block_table' = \[1\]\[1\] = "):
        call(q, k_pages, v_pages, bad, seq_lens, cu_q)
    with pytest.raises(ValueError, match="argument 'cache.seq_lens'"):
        call(q, k_pages, v_pages, table, np.array([40, -1], np.int32), cu_q)
    # A query over no cached key is valid: it sees no key (FlashAttention's alignment), out 0.
    out = call(q, k_pages, v_pages, table, np.array([40, 0], np.int32), cu_q)
    assert np.isfinite(out).all() and (out[2] == 0).all()
    with pytest.raises(ValueError, match="argument 'cu_seqlens_q' = 2: must hold cache.batch \\+ 1 = 3 entries"):
        call(q, k_pages, v_pages, table, seq_lens, np.array([0, 3], np.int32))
    with pytest.raises(ValueError, match="argument 'query_offsets'"):
        call(q, k_pages, v_pages, table, seq_lens, cu_q, query_offsets=[39, 0])
    with pytest.raises(ValueError, match="argument 'options.sigmas'"):
        call(q, k_pages, v_pages, table, seq_lens, cu_q, sigmas=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="argument 'out' shares memory with 'q'"):
        call(q, k_pages, v_pages, table, seq_lens, cu_q, out=q)
    with pytest.raises(ValueError, match="argument 'method' = flash: must be " + ", ".join(poslsh.method_names()[:-1])):
        call(q, k_pages, v_pages, table, seq_lens, cu_q, method="flash")
    with pytest.raises(ValueError, match="argument 'lse' has shape"):
        poslsh.multihead_attention_paged_with_lse(q, k_pages, v_pages, table, seq_lens, cu_q,
                                                  lse=np.zeros((heads, 2), np.float32))


def test_method_names_are_the_library_table():
    names = poslsh.method_names()
    assert names == ["lsh_fused", "lsh_per_sample", "fixed_blocks", "exact_tiled", "exact_banded", "mean_of_outputs"]
    assert [poslsh.method_has_lse(name) for name in names] == [True] * 5 + [False]
    with pytest.raises(ValueError, match="argument 'method' = flash"):
        poslsh.method_has_lse("flash")

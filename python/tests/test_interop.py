"""block_plans and LseMerger: the LSH estimator around another block attention kernel."""

import numpy as np
import pytest

import poslsh
import reference
from conftest import masking_of, random_qkv, tolerance


def boundaries_from_bins(widths, offsets, k, length):
    """Block starts of sample k on positions 0..length-1, from the bins, plus the end."""
    b = reference.bins(widths, offsets, length)[k]
    starts = [0] + [i for i in range(1, length) if b[i] != b[i - 1]]
    return starts + [length]


def test_block_plans(rng):
    hashes = poslsh.rbf_hashes(6.0, 4, seed=8)
    lengths = [50, 0, 17, 33]
    plans = poslsh.block_plans(hashes, lengths)
    assert len(plans) == 4
    for k, plan in enumerate(plans):
        expected = [0]
        offset = 0
        for length in lengths:
            if length:
                expected += [offset + e for e in boundaries_from_bins(hashes.widths, hashes.offsets, k, length)[1:]]
            offset += length
        assert plan.cu_seqlens.dtype == np.int32
        np.testing.assert_array_equal(plan.cu_seqlens, expected)
        assert plan.blocks == len(expected) - 1
        assert plan.max_seqlen == np.diff(expected).max()
    single = poslsh.block_plans(hashes, 50)
    np.testing.assert_array_equal(single[2].cu_seqlens, boundaries_from_bins(hashes.widths, hashes.offsets, 2, 50))
    with pytest.raises(ValueError, match="block_plan: argument 'sequence_lengths' = -1: lengths must be >= 0"):
        poslsh.block_plans(hashes, [4, -1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
def test_lse_merger_gives_the_lsh_estimator(rng, dtype, causal):
    n, d, s = 120, 8, 5
    q, k, v = random_qkv(rng, n, d, dtype)
    hashes = poslsh.rbf_hashes(7.0, s, seed=12)
    merger = poslsh.LseMerger(n, d, dtype=dtype)
    for sample in range(s):
        output, lse = reference.block_attention_with_lse(q, k, v, hashes.widths, hashes.offsets, sample, causal)
        merger.add(output.astype(dtype), lse.astype(dtype))
    assert merger.samples == s and merger.dtype == np.dtype(dtype)
    merged = merger.result()
    assert merged.dtype == dtype
    expected = reference.lsh_attention(q, k, v, hashes.widths, hashes.offsets, causal)
    np.testing.assert_allclose(merged, expected, rtol=0, atol=tolerance(dtype))
    out = np.zeros((n, d), dtype=dtype)
    assert merger.result(out=out) is out
    np.testing.assert_array_equal(out, merged)
    # Merged lse: log sum_k e^{lse_k} per row.
    lses = np.array([reference.block_attention_with_lse(q, k, v, hashes.widths, hashes.offsets, t, causal)[1] for t in range(s)])
    np.testing.assert_allclose(merger.lse(), np.log(np.exp(lses).sum(axis=0)), rtol=1e-5 if dtype == np.float32 else 1e-12)
    # And the built-in kernel agrees.
    np.testing.assert_allclose(poslsh.lsh_attention_fused(q, k, v, hashes, masking=masking_of(causal)), merged, atol=tolerance(dtype))


def test_lse_merger_errors():
    merger = poslsh.LseMerger(4, 2)
    assert merger.dtype == np.float32
    with pytest.raises(TypeError, match="argument 'output' has dtype float64: must be float32"):
        merger.add(np.zeros((4, 2)), np.zeros(4, dtype=np.float32))
    with pytest.raises(ValueError, match="LseMerger::add: argument 'lse' = nan: entries must be finite or -inf"):
        merger.add(np.zeros((4, 2), dtype=np.float32), np.array([0, np.nan, 0, 0], dtype=np.float32))
    with pytest.raises(TypeError, match="argument 'dtype' = int32"):
        poslsh.LseMerger(4, 2, dtype=np.int32)
    empty = poslsh.LseMerger(3, 2, dtype="float64")
    empty.add(np.full((3, 2), np.nan), np.full(3, -np.inf))  # rows without keys take nothing
    np.testing.assert_array_equal(empty.result(), np.zeros((3, 2)))

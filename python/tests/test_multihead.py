"""multihead_attention on [n, H, d] and [H, n, d] arrays against per-head dense formulas."""

import numpy as np
import pytest

import poslsh
import reference
from conftest import METHODS, tolerance


def heads_of(array, layout):
    """[n, H, d] views of an array in the given layout."""
    return array if layout == "nhd" else array.transpose(1, 0, 2)


def expected_heads(q, k, v, method, causal, sigmas, samples=16, seed=0, band_error=1e-3, scale=None):
    """Per query head h: the dense formula on (Q_h, K_{h//G}, V_{h//G}), [n, H, d_v]."""
    n, heads, d = q.shape
    group = heads // k.shape[1]
    out = np.empty((n, heads, v.shape[2]))
    for h in range(heads):
        qh, kh, vh = q[:, h], k[:, h // group], v[:, h // group]
        sigma = sigmas[h]
        if method in ("lsh_fused", "lsh_per_sample"):
            hashes = poslsh.rbf_hashes(sigma, samples, seed, stream=h)
            out[:, h] = reference.lsh_attention(qh, kh, vh, hashes.widths, hashes.offsets, causal, scale)
        elif method == "fixed_blocks":
            out[:, h] = reference.lsh_attention(qh, kh, vh, [2 * sigma], [0.0], causal, scale)
        elif method == "exact_banded":
            band = int(np.ceil(sigma * np.log(1 / band_error)))
            out[:, h] = reference.alibi_attention(qh, kh, vh, sigma, causal, scale, band=band)
        else:
            out[:, h] = reference.alibi_attention(qh, kh, vh, sigma, causal, scale)
    return out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_methods_and_layouts(rng, method, layout, dtype):
    n, heads, d, causal = 96, 4, 8, method != "exact_tiled"
    shape = (n, heads, d) if layout == "nhd" else (heads, n, d)
    q, k, v = (rng.uniform(-1, 1, shape).astype(dtype) for _ in range(3))
    out = poslsh.multihead_attention(
        q, k, v, layout=layout, method=method, masking="causal" if causal else "bidirectional",
        samples=8, seed=4, band_error=1e-2,
    )
    assert out.shape == shape and out.dtype == dtype
    sigmas = 1 / reference.alibi_slopes(heads)
    expected = expected_heads(heads_of(q, layout), heads_of(k, layout), heads_of(v, layout),
                              method, causal, sigmas, samples=8, seed=4, band_error=1e-2)
    np.testing.assert_allclose(heads_of(out, layout), expected, rtol=0, atol=tolerance(dtype))


def test_grouped_query_sigmas_scale_and_out_view(rng):
    n, heads, kv_heads, d = 80, 6, 2, 8
    q = rng.uniform(-1, 1, (n, heads, d))
    kv = rng.uniform(-1, 1, (n, 2, kv_heads, d))  # packed K and V: strided views
    k, v = kv[:, 0], kv[:, 1]
    sigmas = np.array([2.0, 3.0, 5.0, 7.0, 11.0, 13.0])
    parent = np.full((n, heads + 2, d), np.nan)
    out = parent[:, 1 : heads + 1, :]
    returned = poslsh.multihead_attention(q, k, v, sigmas=sigmas, scale=0.7, samples=5, seed=3, out=out)
    assert returned is out
    expected = expected_heads(q, k, v, "lsh_fused", True, sigmas, samples=5, seed=3, scale=0.7)
    np.testing.assert_allclose(parent[:, 1 : heads + 1], expected, rtol=0, atol=1e-12)
    assert np.isnan(parent[:, 0]).all() and np.isnan(parent[:, heads + 1]).all()


def test_matches_single_head_kernels(rng):
    n, heads, d = 200, 8, 16
    q, k, v = (rng.uniform(-1, 1, (n, heads, d)).astype(np.float32) for _ in range(3))
    out = poslsh.multihead_attention(q, k, v, samples=16, seed=21)
    sigmas = poslsh.alibi_sigmas(heads)
    for h in range(heads):
        hashes = poslsh.rbf_hashes(sigmas[h], 16, 21, stream=h)
        np.testing.assert_array_equal(out[:, h], poslsh.lsh_attention_fused(q[:, h], k[:, h], v[:, h], hashes))


def test_errors(rng):
    q = rng.uniform(-1, 1, (10, 4, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="argument 'layout' = 'bnhd': must be 'nhd'"):
        poslsh.multihead_attention(q, q, q, layout="bnhd")
    methods = "must be lsh_fused, lsh_per_sample, fixed_blocks, exact_tiled, exact_banded or mean_of_outputs"
    with pytest.raises(ValueError, match=f"^poslsh: multihead_attention: argument 'method' = flash: {methods}$"):
        poslsh.multihead_attention(q, q, q, method="flash")
    # exact_reference is not a method of the all-heads calls (alibi_attention_reference is the dense check).
    cu = np.array([0, 10], np.int32)
    for function, arrays in [(poslsh.multihead_attention, (q, q, q)), (poslsh.multihead_attention_varlen, (q, q, q, cu, cu)),
                             (poslsh.multihead_attention_with_lse, (q, q, q))]:
        with pytest.raises(ValueError, match=f"argument 'method' = exact_reference: {methods}$"):
            function(*arrays, method="exact_reference")
    with pytest.raises(ValueError, match="^poslsh: multihead_attention: argument 'masking' = none: must be causal or bidirectional$"):
        poslsh.multihead_attention(q, q, q, masking="none")
    with pytest.raises(ValueError, match="poslsh: multihead_attention: argument 'k.heads' = 3: must divide q.heads = 4"):
        poslsh.multihead_attention(q, q[:, :3], q[:, :3])
    with pytest.raises(ValueError, match="argument 'options.sigmas' = 2: must hold one sigma per query head"):
        poslsh.multihead_attention(q, q, q, sigmas=[1.0, 2.0])
    with pytest.raises(TypeError, match="argument 'k' has dtype float64: must be float32"):
        poslsh.multihead_attention(q, q.astype(np.float64), q)
    with pytest.raises(ValueError, match="argument 'q' has 2 dimensions: must be 3-D"):
        poslsh.multihead_attention(q[:, 0], q, q)
    with pytest.raises(ValueError, match="argument 'v' has stride 8 bytes on its last axis"):
        wide = np.zeros((10, 4, 16), dtype=np.float32)
        poslsh.multihead_attention(q, q, wide[:, :, ::2])
    with pytest.raises(ValueError, match="argument 'out' shares memory with 'q'"):
        poslsh.multihead_attention(q, q.copy(), q.copy(), out=q)


def test_method_traits_are_the_table_rows():
    names = poslsh.method_names()
    assert poslsh.method_names(takes_window=True) == ["exact_tiled", "exact_banded"]
    assert poslsh.method_names(has_slope_gradients=True) == ["exact_tiled", "exact_banded"]
    assert poslsh.method_names(draws_hashes=True) == ["lsh_fused", "lsh_per_sample", "mean_of_outputs"]
    assert poslsh.method_names(has_lse=False) == ["mean_of_outputs"]
    assert poslsh.method_names(has_slice_backward=True) == ["lsh_fused", "lsh_per_sample", "fixed_blocks",
                                                            "exact_tiled", "exact_banded"]
    assert poslsh.method_names(draws_hashes=True, has_lse=True) == ["lsh_fused", "lsh_per_sample"]
    for name in names:
        traits = poslsh.method_traits(name)
        assert sorted(traits) == ["draws_hashes", "has_lse", "has_slice_backward", "has_slope_gradients",
                                  "takes_window"]
        assert traits["has_lse"] == poslsh.method_has_lse(name)
        for trait, value in traits.items():
            assert name in poslsh.method_names(**{trait: value})
    with pytest.raises(TypeError, match="argument 'window' is not a method trait"):
        poslsh.method_names(window=True)
    with pytest.raises(TypeError, match="argument 'has_lse' must be a bool"):
        poslsh.method_names(has_lse=1)
    with pytest.raises(ValueError, match="argument 'method' = flash"):
        poslsh.method_traits("flash")

"""Half-precision arrays: numpy float16 (and bfloat16 as poslsh.BFloat16Bits) in the kernels that
take them, against dense float64 formulas on the rounded inputs.

The rules checked for every kernel and layout: on inputs rounded to the half type, the
half-precision kernel with a float32 output is at most 2x as far from the dense float64 formula
as the float32 kernel on the same (widened) inputs (it is in fact bitwise that kernel's output);
its half-precision output is the float32 output rounded once; float32 queries over a
half-precision K, V (ggml's layout) follow the same 2x rule. The prefill kernels are checked
here under precision="float_products" (float16 and bfloat16 q, k, v may multiply on a matrix
unit under the default, "matrix_units": test_matrix_units.py checks it).
"""

import numpy as np
import pytest

import poslsh
import reference
from conftest import METHODS, masking_of
from test_multihead import expected_heads, heads_of


def max_error(out, expected):
    return float(np.abs(np.asarray(out, dtype=np.float64) - expected).max())


def half_qkv(rng, n, d, d_v=None, shape=None):
    """q, k, v rounded to float16 (entries of [-1, 1))."""
    d_v = d if d_v is None else d_v
    return tuple(rng.uniform(-1, 1, s).astype(np.float16) for s in ((n, d), (n, d), (n, d_v)))


def bf16_round(x):
    """float32 -> bfloat16 bit patterns by truncation (an exact bfloat16 value; independent of
    the library's rounding)."""
    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_values(bits):
    """bfloat16 bit patterns -> their exact float32 values."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def check_rules(kernel, q16, k16, v16, expected, bitwise=True):
    """kernel(q, k, v, out_dtype=None) under the half-precision rules, against `expected`
    (float64). bitwise: the float32-output half kernel is bitwise the float32 kernel on the
    widened inputs (the prefill kernels; the decoders stream their key window in widened chunks,
    so they sum in another order); the half output is then the float32 output rounded once."""
    q32, k32, v32 = (x.astype(np.float32) for x in (q16, k16, v16))
    out32 = kernel(q32, k32, v32)
    float_error = max_error(out32, expected)
    assert float_error < 1e-4
    wide = kernel(q16, k16, v16, out_dtype=np.float32)
    assert wide.dtype == np.float32
    assert max_error(wide, expected) <= 2 * float_error
    if bitwise:
        np.testing.assert_array_equal(wide, out32)  # bitwise the float kernel on the widened inputs
    out16 = kernel(q16, k16, v16)
    assert out16.dtype == np.float16 and out16.shape == out32.shape
    assert np.array_equal(out16, wide.astype(np.float16))  # rounded once
    mixed = kernel(q32, k16, v16)
    assert mixed.dtype == np.float32
    assert max_error(mixed, expected) <= 2 * float_error
    if bitwise:
        np.testing.assert_array_equal(mixed, out32)
    return out32


TILE_KERNELS = ["alibi_attention_tiled", "alibi_attention_banded", "lsh_attention_fused"]
SINGLE_HEAD = TILE_KERNELS + ["lsh_attention_per_sample", "fixed_blocks_attention"]


def with_out(call, shape):
    """kernel(q, k, v, out_dtype=None): call(q, k, v, out) with out None or a new array of
    `shape(q, v)` in out_dtype (which the kernel must return, written in place)."""

    def kernel(q, k, v, out_dtype=None):
        out = None if out_dtype is None else np.full(shape(q, v), np.nan, out_dtype)
        result = call(q, k, v, out)
        assert out is None or result is out
        return result

    return kernel


def single_head(function, sigma, causal, scale=None, query_offset=None, **extra):
    """The kernel as kernel(q, k, v, out_dtype=None), and its dense formula; `extra`: further
    keywords of the kernel (precision)."""
    shape = lambda q, v: (q.shape[0], v.shape[1])  # noqa: E731
    if function == "alibi_attention_tiled":
        return (with_out(lambda q, k, v, out: poslsh.alibi_attention_tiled(
            q, k, v, sigma, masking=masking_of(causal), scale=scale, query_offset=query_offset, out=out, **extra), shape),
            lambda q, k, v: reference.alibi_attention(q, k, v, sigma, causal, scale))
    if function == "alibi_attention_banded":
        band = poslsh.band_for_bias_error(sigma, 1e-2)
        return (with_out(lambda q, k, v, out: poslsh.alibi_attention_banded(
            q, k, v, sigma, band, masking=masking_of(causal), scale=scale, query_offset=query_offset, out=out, **extra), shape),
            lambda q, k, v: reference.alibi_attention(q, k, v, sigma, causal, scale, band=band))
    if function == "fixed_blocks_attention":
        return (with_out(lambda q, k, v, out: poslsh.fixed_blocks_attention(
            q, k, v, sigma, masking=masking_of(causal), scale=scale, query_offset=query_offset, out=out, **extra), shape),
            lambda q, k, v: reference.lsh_attention(q, k, v, [2 * sigma], [0.0], causal, scale))
    hashes = poslsh.rbf_hashes(sigma, 12, seed=3, stream=1)
    if function == "lsh_attention_per_sample":
        return (with_out(lambda q, k, v, out: poslsh.lsh_attention_per_sample(
            q, k, v, hashes, masking=masking_of(causal), scale=scale, query_offset=query_offset, out=out, **extra), shape),
            lambda q, k, v: reference.lsh_attention(q, k, v, hashes.widths, hashes.offsets, causal, scale))
    return (with_out(lambda q, k, v, out: poslsh.lsh_attention_fused(
        q, k, v, hashes, masking=masking_of(causal), scale=scale, query_offset=query_offset, out=out, **extra), shape),
        lambda q, k, v: reference.lsh_attention(q, k, v, hashes.widths, hashes.offsets, causal, scale))


@pytest.mark.parametrize("function", SINGLE_HEAD)
@pytest.mark.parametrize("causal", [True, False])
def test_single_head_float16(rng, function, causal):
    n, d, d_v, sigma = 230, 32, 24, 9.0
    q16, k16, v16 = half_qkv(rng, n, d, d_v)
    kernel, dense = single_head(function, sigma, causal, scale=0.3, precision="float_products")
    check_rules(kernel, q16, k16, v16, dense(*(x.astype(np.float64) for x in (q16, k16, v16))))


@pytest.mark.parametrize("function", TILE_KERNELS)
def test_single_head_float16_query_offset(rng, function):
    """Queries at an offset: the rows of the full call, in float16 too."""
    n, d, sigma, p0, m = 200, 16, 7.0, 70, 50
    q16, k16, v16 = half_qkv(rng, n, d)
    kernel, dense = single_head(function, sigma, True, precision="float_products")
    full = dense(*(x.astype(np.float64) for x in (q16, k16, v16)))
    chunk_kernel, _ = single_head(function, sigma, True, query_offset=p0, precision="float_products")
    check_rules(chunk_kernel, q16[p0 : p0 + m], k16[: p0 + m], v16[: p0 + m], full[p0 : p0 + m])
    np.testing.assert_array_equal(chunk_kernel(q16[p0 : p0 + m], k16, v16), kernel(q16, k16, v16)[p0 : p0 + m])


@pytest.mark.parametrize("function", SINGLE_HEAD)
def test_single_head_bfloat16_bits(rng, function):
    """bfloat16 as BFloat16Bits with precision="float_products": the same rules, the output a
    BFloat16Bits over a new uint16 array (or written into an out= BFloat16Bits / float32
    array). test_matrix_units.py has the default precision's rules."""
    n, d, sigma = 180, 32, 8.0
    bits = [bf16_round(rng.uniform(-1, 1, (n, d))) for _ in range(3)]
    q32, k32, v32 = (bf16_values(b) for b in bits)
    q, k, v = (poslsh.BFloat16Bits(b) for b in bits)
    kernel, dense = single_head(function, sigma, True, precision="float_products")
    expected = dense(q32, k32, v32)
    out32 = kernel(q32, k32, v32)
    float_error = max_error(out32, expected)
    wide = kernel(q, k, v, out_dtype=np.float32)
    assert max_error(wide, expected) <= 2 * float_error
    np.testing.assert_array_equal(wide, out32)
    mixed = kernel(q32, k, v)
    assert mixed.dtype == np.float32 and max_error(mixed, expected) <= 2 * float_error
    out = kernel(q, k, v)
    assert isinstance(out, poslsh.BFloat16Bits) and out.bits.dtype == np.uint16 and out.shape == (n, d)
    np.testing.assert_array_equal(out.bits, poslsh.BFloat16Bits.from_float32(out32).bits)
    # Rounded once to nearest: within half a bfloat16 unit (2^-8 relative) of the float32 output.
    assert np.all(np.abs(bf16_values(out.bits) - out32) <= np.abs(out32) * 2.0**-8)
    target = poslsh.BFloat16Bits(np.zeros((n, d), np.int16))
    argument = poslsh.rbf_hashes(sigma, 12, seed=3, stream=1) if function.startswith("lsh") else sigma
    band = [poslsh.band_for_bias_error(sigma, 1e-2)] if "banded" in function else []
    assert getattr(poslsh, function)(q, k, v, argument, *band, out=target, precision="float_products") is target
    np.testing.assert_array_equal(target.bits.view(np.uint16), out.bits)


@pytest.mark.parametrize("function", ["lsh_attention_decode", "alibi_attention_decode_exact"])
@pytest.mark.parametrize("m", [1, 5])
def test_decoders_float16(rng, function, m):
    """Queries at t - m + 1 .. t over a float16 cache (rows after t poisoned with NaN, never
    read): the rows of the dense causal formula; [d] queries give [d_v] outputs."""
    n, d, sigma, t = 300, 32, 9.0, 260
    q16, k16, v16 = half_qkv(rng, n, d)
    k16[t + 1 :] = np.nan
    v16[t + 1 :] = np.nan
    hashes = poslsh.rbf_hashes(sigma, 16, seed=8)
    argument = hashes if function == "lsh_attention_decode" else sigma
    rows = tuple(x[: t + 1].astype(np.float64) for x in (q16, k16, v16))
    if function == "lsh_attention_decode":
        dense = reference.lsh_attention(*rows, hashes.widths, hashes.offsets)
    else:
        dense = reference.alibi_attention(*rows, sigma)
    decoder = getattr(poslsh, function)
    kernel = with_out(lambda q, k, v, out: decoder(q, k, v, t, argument, out=out),
                      lambda q, v: (q.shape[0], v.shape[1]))
    check_rules(kernel, q16[t - m + 1 : t + 1], k16, v16, dense[t - m + 1 :], bitwise=False)
    vector = decoder(q16[t], k16, v16, t, argument)
    assert vector.shape == (d,) and vector.dtype == np.float16
    np.testing.assert_array_equal(vector, decoder(q16[t : t + 1], k16, v16, t, argument)[0])
    bits = [poslsh.BFloat16Bits(bf16_round(x.astype(np.float32))) for x in (q16[t], k16, v16)]
    one = decoder(*bits, t, argument)
    assert isinstance(one, poslsh.BFloat16Bits) and one.shape == (d,)
    wide = decoder(bits[0], bits[1], bits[2], t, argument, out=np.zeros(d, np.float32))
    np.testing.assert_array_equal(one.bits, poslsh.BFloat16Bits.from_float32(wide).bits)
    # bfloat16 cache: within 2x the float32 decoder's error on the same (bfloat16) values.
    q_b, k_b, v_b = (bf16_values(bf16_round(x[: t + 1].astype(np.float32))) for x in (q16, k16, v16))
    if function == "lsh_attention_decode":
        dense_b = reference.lsh_attention(q_b, k_b, v_b, hashes.widths, hashes.offsets)[t]
    else:
        dense_b = reference.alibi_attention(q_b, k_b, v_b, sigma)[t]
    float_b = decoder(q_b[t], k_b, v_b, t, argument)
    assert max_error(wide, dense_b) <= 2 * max_error(float_b, dense_b)
    assert max_error(decoder(q_b[t], bits[1], bits[2], t, argument), dense_b) <= 2 * max_error(float_b, dense_b)
    with pytest.raises(TypeError, match="argument 'keys' has dtype float32: must be float16 like 'query'"):
        decoder(q16[t], k16.astype(np.float32), v16, t, argument)
    with pytest.raises(ValueError, match="argument 'out' must be 1-D like 'query'"):
        decoder(q16[t], k16, v16, t, argument, out=np.zeros((1, d), np.float16))


def test_bfloat16_bits_conversions(rng):
    x = rng.uniform(-3, 3, (40, 7)).astype(np.float32)
    x[0, :4] = [0.0, -0.0, np.inf, 1.0 + 2.0**-8]  # 1 + 2^-8: a tie, to even (1.0)
    bits = poslsh.BFloat16Bits.from_float32(x)
    values = bits.to_float32()
    assert values.dtype == np.float32 and values.shape == x.shape
    np.testing.assert_array_equal(values, bf16_values(bits.bits))
    assert values[0, 3] == 1.0 and values[0, 2] == np.inf
    # Nearest bfloat16: no representable value is closer (the two candidates around x).
    low = bf16_values(bf16_round(x))
    high = bf16_values(bf16_round(x) + np.where(np.isfinite(x), 1, 0).astype(np.uint16))
    f = np.isfinite(x)
    assert np.all(np.abs(values[f] - x[f]) <= np.minimum(np.abs(low[f] - x[f]), np.abs(high[f] - x[f])))
    wrapped = poslsh.BFloat16Bits(bits.bits)
    assert np.shares_memory(wrapped.bits, bits.bits)
    with pytest.raises(TypeError, match="argument 'bits' has dtype float16: must be int16 or uint16"):
        poslsh.BFloat16Bits(x.astype(np.float16))
    with pytest.raises(TypeError, match="argument 'values' has dtype float64: must be float32"):
        poslsh.BFloat16Bits.from_float32(x.astype(np.float64))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_multihead_float16(rng, method, layout):
    n, heads, kv_heads, d = 90, 4, 2, 16
    q_shape = (n, heads, d) if layout == "nhd" else (heads, n, d)
    kv_shape = (n, kv_heads, d) if layout == "nhd" else (kv_heads, n, d)
    q16 = rng.uniform(-1, 1, q_shape).astype(np.float16)
    k16, v16 = (rng.uniform(-1, 1, kv_shape).astype(np.float16) for _ in range(2))
    keywords = dict(layout=layout, method=method, samples=8, seed=2, band_error=1e-2, precision="float_products")
    sigmas = 1 / reference.alibi_slopes(heads)
    expected = expected_heads(*(heads_of(x.astype(np.float64), layout) for x in (q16, k16, v16)), method, True,
                              sigmas, samples=8, seed=2, band_error=1e-2)

    def kernel(q, k, v, out_dtype=None):
        out = None if out_dtype is None else np.full((q.shape[0], q.shape[1], v.shape[2]), np.nan, out_dtype)
        result = poslsh.multihead_attention(q, k, v, out=out, **keywords)
        assert out is None or result is out
        return heads_of(result, layout)

    out32 = check_rules(kernel, q16, k16, v16, expected)
    assert out32.shape == (n, heads, d)


def test_multihead_bfloat16_bits_gqa(rng):
    """precision="float_products": bitwise the float32 call on the widened inputs."""
    n, heads, kv_heads, d = 70, 6, 3, 8
    q_bits = bf16_round(rng.uniform(-1, 1, (n, heads, d)))
    k_bits, v_bits = (bf16_round(rng.uniform(-1, 1, (n, kv_heads, d))) for _ in range(2))
    q32, k32, v32 = (bf16_values(b) for b in (q_bits, k_bits, v_bits))
    out32 = poslsh.multihead_attention(q32, k32, v32, method="exact_tiled")
    expected = expected_heads(q32, k32, v32, "exact_tiled", True, 1 / reference.alibi_slopes(heads))
    float_error = max_error(out32, expected)
    q, k, v = (poslsh.BFloat16Bits(b) for b in (q_bits, k_bits, v_bits))
    wide = poslsh.multihead_attention(q, k, v, method="exact_tiled", out=np.empty((n, heads, d), np.float32),
                                      precision="float_products")
    assert max_error(wide, expected) <= 2 * float_error
    np.testing.assert_array_equal(wide, out32)
    out = poslsh.multihead_attention(q, k, v, method="exact_tiled", precision="float_products")
    assert isinstance(out, poslsh.BFloat16Bits) and out.shape == (n, heads, d)
    np.testing.assert_array_equal(out.bits, poslsh.BFloat16Bits.from_float32(out32).bits)
    np.testing.assert_array_equal(poslsh.multihead_attention(q32, k, v, method="exact_tiled"), out32)


def test_varlen_float16_is_the_per_sequence_calls(rng):
    heads, d = 2, 8
    lengths = [30, 0, 65, 17]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1])
    q, k, v = (rng.uniform(-1, 1, (total, heads, d)).astype(np.float16) for _ in range(3))
    products = dict(samples=4, precision="float_products")
    for method in ("lsh_fused", "exact_banded"):
        out = poslsh.multihead_attention_varlen(q, k, v, cu, cu, method=method, **products)
        assert out.dtype == np.float16
        wide = poslsh.multihead_attention_varlen(q, k, v, cu, cu, method=method, **products,
                                                 out=np.empty((total, heads, d), np.float32))
        mixed = poslsh.multihead_attention_varlen(q.astype(np.float32), k, v, cu, cu, method=method, **products)
        np.testing.assert_array_equal(mixed, wide)
        assert np.array_equal(out, wide.astype(np.float16))
        for b in range(len(lengths)):
            rows = slice(cu[b], cu[b + 1])
            single = poslsh.multihead_attention(q[rows], k[rows], v[rows], method=method, **products)
            np.testing.assert_array_equal(out[rows], single)
            f32 = poslsh.multihead_attention(*(x[rows].astype(np.float32) for x in (q, k, v)), method=method,
                                             **products)
            np.testing.assert_array_equal(wide[rows], f32)


def test_strided_float16_views_are_read_and_written_in_place(rng):
    """Heads of [n, 3, H, d] float16 buffers go in as they are, and out= views of a float16 (or
    float32) parent buffer are written through: no copies."""
    n, heads, d, sigma = 120, 3, 16, 6.0
    qkv = rng.uniform(-1, 1, (n, 3, heads, d)).astype(np.float16)
    q, k, v = qkv[:, 0, 1], qkv[:, 1, 1], qkv[:, 2, 1]
    assert q.strides == (3 * heads * d * 2, 2)
    hashes = poslsh.rbf_hashes(sigma, 8, seed=4)
    contiguous = [np.ascontiguousarray(x) for x in (q, k, v)]
    parent = np.full((n, heads, d), np.nan, np.float16)
    returned = poslsh.lsh_attention_fused(q, k, v, hashes, out=parent[:, 2])
    assert np.shares_memory(returned, parent)
    np.testing.assert_array_equal(parent[:, 2], poslsh.lsh_attention_fused(*contiguous, hashes))
    assert np.isnan(parent[:, :2]).all()
    parent32 = np.full((n, heads, d), np.nan, np.float32)
    poslsh.alibi_attention_tiled(q, k, v, sigma, out=parent32[:, 0], precision="float_products")
    np.testing.assert_array_equal(parent32[:, 0], poslsh.alibi_attention_tiled(
        *(x.astype(np.float32) for x in contiguous), sigma))
    assert np.isnan(parent32[:, 1:]).all()
    # Multi-head: q, k, v slices of the packed buffer ([n, H, d] with row stride 3 H d), out a
    # slice of a wider buffer.
    packed = np.full((n, 2, heads, d), np.nan, np.float16)
    poslsh.multihead_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], method="exact_tiled", out=packed[:, 1])
    expected = poslsh.multihead_attention(*(np.ascontiguousarray(qkv[:, i]) for i in range(3)), method="exact_tiled")
    np.testing.assert_array_equal(packed[:, 1], expected)
    assert np.isnan(packed[:, 0]).all()
    # A column slice of a wider float16 matrix (row stride > d).
    wide = rng.uniform(-1, 1, (n, 2 * d + 3)).astype(np.float16)
    np.testing.assert_array_equal(poslsh.alibi_attention_banded(wide[:, 3 : d + 3], k, v, sigma, 10),
                                  poslsh.alibi_attention_banded(np.ascontiguousarray(wide[:, 3 : d + 3]), k, v,
                                                                sigma, 10))


def test_dtype_rules(rng):
    n, d, sigma = 20, 4, 4.0
    q16, k16, v16 = half_qkv(rng, n, d)
    q32, k32, v32 = (x.astype(np.float32) for x in (q16, k16, v16))
    hashes = poslsh.rbf_hashes(sigma, 2, seed=0)
    with pytest.raises(TypeError, match="argument 'k' has dtype float16: must be float64 like 'q'"):
        poslsh.lsh_attention_fused(q16.astype(np.float64), k16, v16, hashes)
    with pytest.raises(TypeError, match="argument 'k' has dtype float64: must be float16 like 'q'"):
        poslsh.lsh_attention_fused(q16, k16.astype(np.float64), v16, hashes)
    with pytest.raises(TypeError, match="argument 'v' has dtype float32: must be float16 like 'q'"):
        poslsh.alibi_attention_tiled(q16, k16, v32, sigma)
    with pytest.raises(TypeError, match="argument 'out' has dtype float64: must be float16 or float32 for float16 'q'"):
        poslsh.alibi_attention_tiled(q16, k16, v16, sigma, out=np.zeros((n, d)))
    with pytest.raises(TypeError, match="argument 'out' has dtype float16: must be float32: float32 'q' over float16"):
        poslsh.alibi_attention_banded(q32, k16, v16, sigma, 3, out=np.zeros((n, d), np.float16))
    with pytest.raises(TypeError, match="argument 'v' has dtype float32: must be float16 like 'k'"):
        poslsh.lsh_attention_fused(q32, k16, v32, hashes)
    with pytest.raises(TypeError, match=r"argument 'v' is bfloat16 \(poslsh.BFloat16Bits\): must be float16 like 'k'"):
        poslsh.lsh_attention_fused(q32, k16, poslsh.BFloat16Bits(bf16_round(v32)), hashes)
    with pytest.raises(TypeError, match=r"argument 'k' has dtype float16: must be bfloat16 \(poslsh.BFloat16Bits\)"):
        poslsh.lsh_attention_fused(poslsh.BFloat16Bits(bf16_round(q32)), k16, v16, hashes)
    with pytest.raises(TypeError, match="argument 'k' must be a numpy.ndarray, got list"):
        poslsh.lsh_attention_fused(q16, k16.tolist(), v16, hashes)
    # float32 q with float32 k and float16 v: the float32 rule.
    with pytest.raises(TypeError, match="argument 'v' has dtype float16: must be float32 like 'q'"):
        poslsh.lsh_attention_fused(q32, k32, v16, hashes)
    # Integer arrays are never read as bfloat16 by the ordinary kernels.
    with pytest.raises(TypeError, match="argument 'q' has dtype int16: must be float32 or float64"):
        poslsh.alibi_attention_tiled(bf16_round(q32).view(np.int16), k32, v32, sigma)
    # Non-native byte order.
    with pytest.raises(TypeError, match="argument 'q' has dtype >f2"):
        poslsh.alibi_attention_tiled(q16.astype(">f2"), k16, v16, sigma)
    # Kernels without half-precision views keep float32/float64 only.
    with pytest.raises(TypeError, match="argument 'q' has dtype float16: must be float32 or float64"):
        poslsh.alibi_attention_reference(q16, k16, v16, sigma)
    with pytest.raises(TypeError, match="argument 'k' has dtype float64: must be float16 like 'q'"):
        poslsh.multihead_attention(q16[:, None], k16[:, None].astype(np.float64), v16[:, None])
    with pytest.raises(TypeError, match="argument 'out' has dtype float64: must be float16 or float32"):
        poslsh.multihead_attention(q16[:, None], k16[:, None], v16[:, None], out=np.zeros((n, 1, d)))


def test_layout_and_library_errors(rng):
    n, d, sigma = 20, 4, 4.0
    q, k, v = half_qkv(rng, n, d)
    hashes = poslsh.rbf_hashes(sigma, 2, seed=0)
    with pytest.raises(ValueError, match=r"argument 'k' has strides \(2, 40\) bytes: its last axis must be contiguous"):
        poslsh.lsh_attention_fused(q, np.asfortranarray(k), v, hashes)
    with pytest.raises(ValueError, match="argument 'q' has strides .* the row stride must be a positive multiple"):
        poslsh.alibi_attention_tiled(q[::-1], k, v, sigma)
    with pytest.raises(ValueError, match="argument 'q' has 3 dimensions: must be a 2-D array"):
        poslsh.alibi_attention_tiled(q[None], k, v, sigma)
    with pytest.raises(ValueError, match=r"argument 'out' has shape \(20, 3\): must be \(20, 4\)"):
        poslsh.alibi_attention_tiled(q, k, v, sigma, out=np.zeros((n, 3), np.float16))
    read_only = np.zeros((n, d), np.float32)
    read_only.setflags(write=False)
    with pytest.raises(ValueError, match="argument 'out' is read-only"):
        poslsh.lsh_attention_fused(q, k, v, hashes, out=read_only)
    with pytest.raises(ValueError, match="argument 'out' shares memory with 'v'"):
        poslsh.alibi_attention_tiled(q, k, v, sigma, out=v)
    bits = bf16_round(v.astype(np.float32))
    with pytest.raises(ValueError, match="argument 'out' shares memory with 'v'"):
        poslsh.alibi_attention_tiled(*(poslsh.BFloat16Bits(bf16_round(x.astype(np.float32))) for x in (q, k)),
                                     poslsh.BFloat16Bits(bits), sigma, out=poslsh.BFloat16Bits(bits))
    with pytest.raises(ValueError) as error:
        poslsh.alibi_attention_tiled(q, k[:, :3], v, sigma)
    assert str(error.value) == (
        "poslsh: alibi_attention_tiled: argument 'k' = 3: column count (d) must equal q.cols() = 4"
    )
    with pytest.raises(ValueError, match="argument 'sigma' = 0: must be finite and > 0"):
        poslsh.alibi_attention_banded(q, k, v, 0.0, 3)
    with pytest.raises(ValueError, match="argument 'band' = -1: must be >= 0"):
        poslsh.alibi_attention_banded(q, k, v, sigma, -1)
    with pytest.raises(ValueError, match="argument 'num_threads' = 0: must be >= 1"):
        poslsh.lsh_attention_fused(q, k, v, hashes, num_threads=0)
    with pytest.raises(ValueError, match="argument 'method' = exact_reference: must be lsh_fused, lsh_per_sample"):
        poslsh.multihead_attention(q[:, None], k[:, None], v[:, None], method="exact_reference")
    with pytest.raises(ValueError, match="must divide q.heads"):
        poslsh.multihead_attention(np.zeros((n, 3, d), np.float16), np.zeros((n, 2, d), np.float16),
                                   np.zeros((n, 2, d), np.float16))
    with pytest.raises(ValueError, match="argument 'q' has 2 dimensions: must be 3-D"):
        poslsh.multihead_attention(q, k[:, None], v[:, None])


def test_empty_and_thread_count(rng):
    empty = np.zeros((0, 8), np.float16)
    assert poslsh.alibi_attention_tiled(empty, empty, empty, 4.0).shape == (0, 8)
    q, k, v = half_qkv(rng, 300, 32)
    hashes = poslsh.rbf_hashes(16.0, 8, seed=1)
    one = poslsh.lsh_attention_fused(q, k, v, hashes, num_threads=1)
    np.testing.assert_array_equal(poslsh.lsh_attention_fused(q, k, v, hashes, num_threads=3), one)
    np.testing.assert_array_equal(poslsh.alibi_attention_tiled(q, k, v, 8.0, num_threads=1),
                                  poslsh.alibi_attention_tiled(q, k, v, 8.0, num_threads=2))

"""bfloat16 inputs on the CPU's matrix unit: the `precision` keyword ("matrix_units", the default,
or "float_products") of the kernels that take bfloat16 q, k, v, and the unit queries
(matrix_units, matrix_unit, matrix_unit_available).

Rules checked:
  - precision="float_products": bitwise the float32 kernel on the widened inputs;
  - precision="matrix_units" on a CPU with a unit: FlashAttention's accuracy rule, the error
    against float64 attention on the same rounded inputs at most 2x that of a plain bfloat16
    implementation (bfloat16 operands, float32 accumulation and softmax, probabilities rounded
    to bfloat16 before P V; written below in numpy), and the result is one fixed function of
    the inputs (the same for 1 and 2 threads, chunked prefill bitwise one prefill, every head
    of multihead_attention bitwise its single-head kernel);
  - precision="matrix_units" on a CPU without a unit: bitwise precision="float_products".
"""

import zlib

import numpy as np
import pytest

import poslsh
from conftest import masking_of
import reference

FLOAT_PRODUCTS = "float_products"
UNIT = poslsh.matrix_unit("bfloat16", "bfloat16")
HAS_UNIT = UNIT != poslsh.matrix_unit("bfloat16", "bfloat16", precision=FLOAT_PRODUCTS)
needs_unit = pytest.mark.skipif(not HAS_UNIT, reason="this CPU has no matrix unit for bfloat16")
needs_no_unit = pytest.mark.skipif(HAS_UNIT, reason=f"this CPU has the unit {UNIT} (the matrix-unit tests run)")


# bfloat16 in numpy (independent of the library). -------------------------------------------


def bf16_bits(x):
    """float values -> bfloat16 bit patterns (uint16), rounded to nearest, ties to even."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(bits):
    """bfloat16 bit patterns -> their exact float32 values."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def bf16(x):
    """x rounded to bfloat16, as float32 values."""
    return bf16_values(bf16_bits(x))


def plain_bf16_attention(q, k, v, tau, additive, weights=None):
    """softmax(tau Q K^T + additive) V as a plain bfloat16 implementation computes it: q, k, v
    hold bfloat16 values; Q K^T accumulated in float32, the softmax in float32, the
    probabilities rounded to bfloat16 before P V (float32 accumulation), then divided by the
    float32 row sum of the unrounded probabilities. additive: float64 (m, L), -inf for masked
    pairs. weights (the LSH estimator, whose weights are counts multiplying the exponentials):
    the probabilities are w_ij e^{x_ij - M_i}, M_i the row's largest score x_ij = tau q_i.k_j
    over the keys of nonzero weight (additive is then log of the weights, unused)."""
    scores = q.astype(np.float32) @ k.astype(np.float32).T
    if weights is None:
        logits = np.float32(tau) * scores + additive.astype(np.float32)
        probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
    else:
        logits = np.where(weights > 0, np.float32(tau) * scores, -np.inf).astype(np.float32)
        probabilities = weights.astype(np.float32) * np.exp(logits - logits.max(axis=1, keepdims=True))
    total = probabilities.sum(axis=1, keepdims=True, dtype=np.float32)
    return (bf16(probabilities) @ v.astype(np.float32)) / total


def dense_attention(q, k, v, tau, additive):
    """softmax(tau Q K^T + additive) V in float64."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    return reference.softmax_rows(tau * (q @ k.T) + additive, v)


def alibi_additive(m, n, sigma, causal, offset=None, band=None):
    """-|i-j| / sigma for query rows at positions offset .. offset + m - 1 (default n - m) over
    n keys; -inf for the pairs causal masking or the band drop."""
    offset = n - m if offset is None else offset
    i = offset + np.arange(m)[:, None]
    j = np.arange(n)[None, :]
    keep = (j <= i) if causal else np.ones((m, n), dtype=bool)
    if band is not None:
        keep &= np.abs(i - j) <= band
    return np.where(keep, -np.abs(i - j) / sigma, -np.inf)


def lsh_counts(hashes, n, causal):
    """The counts c_ij = #{k : bin_k(i) = bin_k(j)} (causal: lower triangle)."""
    return reference.mean_mask(hashes.widths, hashes.offsets, n, causal) * len(hashes.widths)


def lsh_additive(hashes, n, causal):
    """log M~ (M~ the mean of the block masks; -inf where 0)."""
    with np.errstate(divide="ignore"):
        return np.log(reference.mean_mask(hashes.widths, hashes.offsets, n, causal))


def inputs(kind, n, d, seed, d_v=None):
    """q, k, v as bfloat16 bit patterns: 'random' (normal), 'smooth' (slowly varying in the
    position) or 'heavy' (Student t with 2 degrees of freedom: a few large entries)."""
    rng = np.random.default_rng(seed)
    d_v = d if d_v is None else d_v
    shapes = ((n, d), (n, d), (n, d_v))
    if kind == "random":
        values = [rng.standard_normal(s) for s in shapes]
    elif kind == "smooth":
        positions = np.arange(n)[:, None]
        values = [np.sin(positions * rng.uniform(0.005, 0.05, s[1]) + rng.uniform(0, 2 * np.pi, s[1]))
                  * rng.uniform(0.5, 2.0, s[1]) for s in shapes]
    else:
        values = [0.5 * rng.standard_t(2, s) for s in shapes]
    return [bf16_bits(x) for x in values]


def seed_of(*parts):
    """A seed fixed by the test case's parameters."""
    return zlib.crc32(repr(parts).encode())


def wrap(bits):
    return poslsh.BFloat16Bits(bits)


def max_error(out, expected):
    return float(np.abs(np.asarray(out, dtype=np.float64) - expected).max())


def float_out(q_bits, v_bits):
    return np.full((q_bits.shape[0], v_bits.shape[-1]), np.nan, np.float32)


# The unit queries. --------------------------------------------------------------------------


def cpu_flags():
    """The flags of /proc/cpuinfo (empty off Linux)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_unit_names_and_availability():
    names = poslsh.matrix_unit_names()
    assert names == ["float_products", "avx512_bf16", "amx_bf16", "amx_fp16"]
    assert poslsh.precision_names() == ["matrix_units", FLOAT_PRODUCTS]
    available = poslsh.matrix_units()
    assert available[0] == "float_products"
    assert available == [name for name in names if poslsh.matrix_unit_available(name)]
    assert poslsh.matrix_unit_available("float_products")
    flags = cpu_flags()
    if flags:  # Linux: the kernel's view of the CPU agrees (it lists avx512_bf16 only if the OS saves the state)
        assert poslsh.matrix_unit_available("avx512_bf16") == ({"avx512f", "avx512bw", "avx512_bf16"} <= flags)
        # AMX also needs the process's tile permission, which Linux may refuse.
        if poslsh.matrix_unit_available("amx_bf16"):
            assert {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags
        if poslsh.matrix_unit_available("amx_fp16"):
            assert {"amx_tile", "amx_fp16", "avx512_bf16"} <= flags
    with pytest.raises(ValueError,
                       match="argument 'name' = amx: must be float_products, avx512_bf16, amx_bf16 or amx_fp16"):
        poslsh.matrix_unit_available("amx")


def test_unit_of_a_call():
    torch = pytest.importorskip("torch")
    bf16_unit = next(unit for unit in ("amx_bf16", "avx512_bf16", "float_products")
                     if poslsh.matrix_unit_available(unit))
    assert poslsh.matrix_unit("bfloat16") == bf16_unit
    assert poslsh.matrix_unit("bfloat16", "bfloat16", precision="matrix_units") == bf16_unit
    assert poslsh.matrix_unit(torch.bfloat16, torch.bfloat16) == bf16_unit
    assert poslsh.matrix_unit("bfloat16", precision=FLOAT_PRODUCTS) == "float_products"
    # float16 q, k, v: AMX-FP16 where the CPU has it, else widened (no AVX-512 float16 product sums in float).
    f16_unit = "amx_fp16" if poslsh.matrix_unit_available("amx_fp16") else "float_products"
    for dtype in ("float16", np.float16, torch.float16):
        assert poslsh.matrix_unit(dtype) == f16_unit
        assert poslsh.matrix_unit(dtype, dtype, precision=FLOAT_PRODUCTS) == "float_products"
    for q_dtype, kv_dtype in (("float32", None), ("float64", None), ("float32", "bfloat16"),
                              ("float32", "float16"), (np.float32, np.float16)):
        for precision in poslsh.precision_names():
            assert poslsh.matrix_unit(q_dtype, kv_dtype, precision=precision) == "float_products"
    with pytest.raises(ValueError, match="argument 'precision' = fast: must be matrix_units or float_products"):
        poslsh.matrix_unit("bfloat16", precision="fast")
    with pytest.raises(ValueError, match="argument 'q_dtype' = 'int8'"):
        poslsh.matrix_unit("int8")
    with pytest.raises(ValueError, match="argument 'kv_dtype' = 'float32' under 'bfloat16' q"):
        poslsh.matrix_unit("bfloat16", "float32")


# The kernels. -------------------------------------------------------------------------------

SIGMAS = [0.5, 8.0, 1e6]
KINDS = ["random", "smooth", "heavy"]


def single_head_case(function, sigma, causal, n):
    """(call(q, k, v, **keywords), tau, additive, weights) of a single-head kernel on n tokens,
    d = 64 (weights: the LSH counts, None for the ALiBi kernels)."""
    tau = 1.0 / 8.0
    if function == "alibi_attention_tiled":
        return (lambda q, k, v, **kw: poslsh.alibi_attention_tiled(q, k, v, sigma, masking=masking_of(causal), **kw), tau,
                alibi_additive(n, n, sigma, causal), None)
    if function == "alibi_attention_banded":
        band = poslsh.band_for_bias_error(sigma, 1e-3)
        return (lambda q, k, v, **kw: poslsh.alibi_attention_banded(q, k, v, sigma, band, masking=masking_of(causal), **kw), tau,
                alibi_additive(n, n, sigma, causal, band=band), None)
    hashes = poslsh.rbf_hashes(sigma, 8, seed=5, stream=2)
    return (lambda q, k, v, **kw: poslsh.lsh_attention_fused(q, k, v, hashes, masking=masking_of(causal), **kw), tau,
            lsh_additive(hashes, n, causal), lsh_counts(hashes, n, causal))


def check_accuracy(call, bits, tau, additive, weights=None):
    """The matrix-unit call (float32 out=) against float64 and the plain bfloat16
    implementation on the same inputs; the bfloat16 output is its float32 result rounded once.
    Returns the float32 result."""
    q_bits, k_bits, v_bits = bits
    q, k, v = (bf16_values(b) for b in bits)
    expected = dense_attention(q, k, v, tau, additive)
    plain_error = max_error(plain_bf16_attention(q, k, v, tau, additive, weights), expected)
    unit = call(*map(wrap, bits), out=float_out(q_bits, v_bits))
    assert np.isfinite(unit).all()
    assert max_error(unit, expected) <= 2 * plain_error, (max_error(unit, expected), plain_error)
    rounded = call(*map(wrap, bits))
    np.testing.assert_array_equal(rounded.bits, bf16_bits(unit))
    return unit


@needs_unit
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sigma", SIGMAS)
@pytest.mark.parametrize("causal", [True, False])
def test_tiled_accuracy_on_the_unit(kind, sigma, causal):
    n, d = 150, 64
    bits = inputs(kind, n, d, seed=seed_of(kind, sigma, causal))
    call, tau, additive, _ = single_head_case("alibi_attention_tiled", sigma, causal, n)
    unit = check_accuracy(call, bits, tau, additive)
    # The unit is used: the products differ from the widened float32 call's somewhere.
    widened = call(*map(wrap, bits), out=float_out(bits[0], bits[2]), precision=FLOAT_PRODUCTS)
    np.testing.assert_array_equal(widened, call(*(bf16_values(b) for b in bits)))
    assert not np.array_equal(unit, widened)


@needs_unit
@pytest.mark.parametrize("function", ["alibi_attention_banded", "lsh_attention_fused"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sigma", [0.5, 30.0])
@pytest.mark.parametrize("causal", [True, False])
def test_banded_and_lsh_accuracy_on_the_unit(function, kind, sigma, causal):
    """The LSH estimator multiplies each exponential by its count c_ij (A o M~): its plain
    bfloat16 implementation rounds c_ij e^{x_ij - M_i}, M_i the row's largest score."""
    n, d = 197, 64
    bits = inputs(kind, n, d, seed=seed_of(function, kind, sigma, causal))
    call, tau, additive, weights = single_head_case(function, sigma, causal, n)
    check_accuracy(call, bits, tau, additive, weights)


@needs_unit
@pytest.mark.parametrize("d, d_v", [(33, 20), (128, 64)])
def test_odd_and_wide_heads_on_the_unit(d, d_v):
    """Head widths that are odd (the pairs of the dot product padded) or 128."""
    n, sigma = 131, 16.0
    bits = inputs("random", n, d, seed=d, d_v=d_v)
    tau = 1.0 / np.sqrt(d)
    call = lambda q, k, v, **kw: poslsh.alibi_attention_tiled(q, k, v, sigma, **kw)  # noqa: E731
    check_accuracy(call, bits, tau, alibi_additive(n, n, sigma, True))


@needs_unit
@pytest.mark.parametrize("function", ["alibi_attention_tiled", "alibi_attention_banded", "lsh_attention_fused"])
def test_unit_results_are_fixed(function):
    """1 and 2 threads give the same bits, and a prefill in chunks (query_offset) gives the rows
    of one prefill."""
    n, d, sigma = 230, 64, 20.0
    bits = inputs("random", n, d, seed=7)
    call, _, _, _ = single_head_case(function, sigma, True, n)
    q, k, v = map(wrap, bits)
    one = call(q, k, v, out=float_out(bits[0], bits[2]), num_threads=1)
    two = call(q, k, v, out=float_out(bits[0], bits[2]), num_threads=2)
    np.testing.assert_array_equal(one, two)
    for start, stop in ((0, 70), (70, 71), (71, 200), (200, 230)):
        chunk = call(wrap(bits[0][start:stop]), wrap(bits[1][:stop]), wrap(bits[2][:stop]), query_offset=start,
                     out=np.empty((stop - start, d), np.float32))
        np.testing.assert_array_equal(chunk, one[start:stop])
        # Over all the keys (causal: those after each row are masked).
        later = call(wrap(bits[0][start:stop]), k, v, query_offset=start, out=np.empty((stop - start, d), np.float32))
        np.testing.assert_array_equal(later, one[start:stop])


@needs_unit
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("masking", ["causal", "bidirectional"])
def test_multihead_on_the_unit(layout, masking):
    """Grouped-query heads (4 query heads over 2 KV heads): each head bitwise its single-head
    kernel on the unit, the accuracy rule per head, and multihead_attention_varlen bitwise the
    per-sequence calls."""
    n, heads, kv_heads, d = 140, 4, 2, 64
    sigmas = [0.5, 4.0, 60.0, 1e6]
    q_bits = np.stack(inputs("random", n, d, seed=11)[:1] + inputs("heavy", n, d, seed=12)[:1]
                      + inputs("smooth", n, d, seed=13)[:1] + inputs("random", n, d, seed=14)[:1], axis=1)
    k_bits = np.stack([inputs("random", n, d, seed=15)[1], inputs("smooth", n, d, seed=16)[1]], axis=1)
    v_bits = np.stack([inputs("random", n, d, seed=17)[2], inputs("heavy", n, d, seed=18)[2]], axis=1)
    arrange = (lambda x: x) if layout == "nhd" else (lambda x: np.ascontiguousarray(x.transpose(1, 0, 2)))
    keywords = dict(layout=layout, method="exact_tiled", masking=masking, sigmas=sigmas)
    out = poslsh.multihead_attention(*(wrap(arrange(b)) for b in (q_bits, k_bits, v_bits)),
                                     out=arrange(np.empty((n, heads, d), np.float32)), **keywords)
    out = out if layout == "nhd" else out.transpose(1, 0, 2)
    causal = masking == "causal"
    for h, sigma in enumerate(sigmas):
        head_bits = (q_bits[:, h], k_bits[:, h // 2], v_bits[:, h // 2])
        single = poslsh.alibi_attention_tiled(*(wrap(b) for b in head_bits), sigma, masking=masking_of(causal),
                                              out=np.empty((n, d), np.float32))
        np.testing.assert_array_equal(out[:, h], single)
        q, k, v = (bf16_values(b) for b in head_bits)
        additive = alibi_additive(n, n, sigma, causal)
        expected = dense_attention(q, k, v, 1 / 8.0, additive)
        assert max_error(out[:, h], expected) <= 2 * max_error(plain_bf16_attention(q, k, v, 1 / 8.0, additive),
                                                               expected)
    if layout == "nhd":
        cu = np.array([0, 50, 50, 140], dtype=np.int32)
        packed = poslsh.multihead_attention_varlen(*(wrap(b) for b in (q_bits, k_bits, v_bits)), cu, cu,
                                                   out=np.empty((n, heads, d), np.float32), **keywords)
        for b in range(3):
            rows = slice(cu[b], cu[b + 1])
            one = poslsh.multihead_attention(*(wrap(np.ascontiguousarray(x[rows])) for x in (q_bits, k_bits, v_bits)),
                                             out=np.empty((cu[b + 1] - cu[b], heads, d), np.float32), **keywords)
            np.testing.assert_array_equal(packed[rows], one)
        one_thread = poslsh.multihead_attention_varlen(*(wrap(b) for b in (q_bits, k_bits, v_bits)), cu, cu,
                                                       out=np.empty((n, heads, d), np.float32), num_threads=1,
                                                       **keywords)
        np.testing.assert_array_equal(one_thread, packed)


@needs_no_unit
@pytest.mark.parametrize("function", ["alibi_attention_tiled", "alibi_attention_banded", "lsh_attention_fused"])
def test_without_a_unit_matrix_units_is_float_products(function):
    n, d = 150, 64
    bits = inputs("random", n, d, seed=3)
    call, _, _, _ = single_head_case(function, 8.0, True, n)
    default = call(*map(wrap, bits), out=float_out(bits[0], bits[2]))
    np.testing.assert_array_equal(default, call(*map(wrap, bits), out=float_out(bits[0], bits[2]),
                                                precision=FLOAT_PRODUCTS))
    np.testing.assert_array_equal(default, call(*(bf16_values(b) for b in bits)))
    heads = [np.stack([b, b], axis=1) for b in bits]
    np.testing.assert_array_equal(
        poslsh.multihead_attention(*map(wrap, heads), method="exact_tiled").bits,
        poslsh.multihead_attention(*map(wrap, heads), method="exact_tiled", precision=FLOAT_PRODUCTS).bits)


@pytest.mark.parametrize("precision", ["matrix_units", FLOAT_PRODUCTS])
def test_float_inputs_ignore_the_precision(precision):
    rng = np.random.default_rng(4)
    # float16 too where it has no unit (on AMX-FP16 it follows the keyword, as bfloat16).
    dtypes = (np.float32, np.float64) + ((np.float16,) if poslsh.matrix_unit("float16") == "float_products" else ())
    for dtype in dtypes:
        q, k, v = (rng.uniform(-1, 1, (90, 16)).astype(dtype) for _ in range(3))
        np.testing.assert_array_equal(poslsh.alibi_attention_tiled(q, k, v, 5.0, precision=precision),
                                      poslsh.alibi_attention_tiled(q, k, v, 5.0))
        heads = [x[:, None] for x in (q, k, v)]
        np.testing.assert_array_equal(poslsh.multihead_attention(*heads, precision=precision),
                                      poslsh.multihead_attention(*heads, precision=FLOAT_PRODUCTS))
    # float32 queries over a bfloat16 cache are widened under either precision.
    q = rng.uniform(-1, 1, (90, 16)).astype(np.float32)
    k, v = (wrap(bf16_bits(rng.uniform(-1, 1, (90, 16)))) for _ in range(2))
    np.testing.assert_array_equal(poslsh.alibi_attention_tiled(q, k, v, 5.0, precision=precision),
                                  poslsh.alibi_attention_tiled(q, k.to_float32(), v.to_float32(), 5.0))


def test_bad_precision_names_the_argument():
    bits = inputs("random", 10, 8, seed=1)
    q, k, v = map(wrap, bits)
    heads = [wrap(b[:, None]) for b in bits]
    hashes = poslsh.rbf_hashes(4.0, 2, seed=0)
    cu = np.array([0, 10], dtype=np.int32)
    calls = {
        "alibi_attention_tiled": lambda p: poslsh.alibi_attention_tiled(q, k, v, 4.0, precision=p),
        "alibi_attention_banded": lambda p: poslsh.alibi_attention_banded(q, k, v, 4.0, 3, precision=p),
        "lsh_attention_fused": lambda p: poslsh.lsh_attention_fused(q, k, v, hashes, precision=p),
        "lsh_attention_per_sample": lambda p: poslsh.lsh_attention_per_sample(q, k, v, hashes, precision=p),
        "fixed_blocks_attention": lambda p: poslsh.fixed_blocks_attention(q, k, v, 4.0, precision=p),
        "multihead_attention": lambda p: poslsh.multihead_attention(*heads, precision=p),
        "multihead_attention_varlen": lambda p: poslsh.multihead_attention_varlen(*heads, cu, cu, precision=p),
    }
    for function, call in calls.items():
        with pytest.raises(ValueError, match=f"poslsh: {function}: argument 'precision' = matrix: must be "
                                             "matrix_units or float_products"):
            call("matrix")
    # Float32 inputs check the name too.
    with pytest.raises(ValueError, match="argument 'precision' = bf16"):
        poslsh.alibi_attention_tiled(*(bf16_values(b) for b in bits), 4.0, precision="bf16")
    with pytest.raises(TypeError):
        poslsh.alibi_attention_tiled(q, k, v, 4.0, precision=None)

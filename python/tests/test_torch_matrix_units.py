"""The `precision` keyword through poslsh.torch, poslsh.flash and poslsh.modules on bfloat16 CPU
tensors: under "matrix_units" (the default) the forward is the compiled bfloat16 kernels' (on the
CPU's matrix unit where it has one), under "float_products" the float32 call on the widened
tensors rounded once; the gradients come from the compiled bfloat16 forward with lse and backward
under the same precision (test_half_training.py checks their rules)."""

import math

import numpy as np
import pytest

import poslsh
from test_matrix_units import (FLOAT_PRODUCTS, HAS_UNIT, alibi_additive, bf16_values, dense_attention, max_error,
                               needs_no_unit, needs_unit, plain_bf16_attention)

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
import poslsh.torch as ptorch  # noqa: E402
from test_half_training import float32_gradients  # noqa: E402

BF16 = torch.bfloat16


def rand(shape, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(BF16)


def bits(tensor):
    """The tensor as the compiled kernels take it (its memory)."""
    return poslsh.BFloat16Bits(tensor.view(torch.int16).numpy())


def core_out(tensor_shape):
    return torch.empty(tensor_shape, dtype=BF16)


def test_forward_only_kernels_are_the_compiled_kernels():
    n, d, sigma = 150, 64, 12.0
    q, k, v = (rand((n, d), s) for s in (1, 2, 3))
    hashes = poslsh.rbf_hashes(sigma, 8, seed=1)
    for precision in ("matrix_units", FLOAT_PRODUCTS):
        out = ptorch.alibi_attention_forward(q, k, v, sigma, precision=precision)
        expected = core_out((n, d))
        poslsh.alibi_attention_tiled(bits(q), bits(k), bits(v), sigma, out=bits(expected), precision=precision)
        assert torch.equal(out, expected)
        out = ptorch.lsh_attention_forward(q, k, v, hashes, precision=precision)
        poslsh.lsh_attention_fused(bits(q), bits(k), bits(v), hashes, out=bits(expected), precision=precision)
        assert torch.equal(out, expected)
        heads = [x.reshape(n, 2, d // 2) for x in (q, k, v)]
        out = ptorch.multihead_attention_forward(*heads, method="exact_tiled", precision=precision)
        expected = core_out((n, 2, d // 2))
        poslsh.multihead_attention(*map(bits, heads), method="exact_tiled", out=bits(expected), precision=precision)
        assert torch.equal(out, expected)
    wide = ptorch.alibi_attention_forward(q, k, v, sigma, precision=FLOAT_PRODUCTS)
    assert torch.equal(wide, ptorch.alibi_attention_forward(q.float(), k.float(), v.float(), sigma).to(BF16))
    assert torch.equal(ptorch.alibi_attention_forward(q, k, v, sigma), ptorch.alibi_attention_forward(
        q, k, v, sigma, precision="matrix_units"))
    if HAS_UNIT:
        assert not torch.equal(ptorch.alibi_attention_forward(q, k, v, sigma), wide)


@pytest.mark.parametrize("function", ["alibi", "lsh", "multihead", "packed"])
def test_differentiable_functions_forward_on_the_unit(function):
    """The output is the forward-only kernels' (the unit under the default precision) with or
    without gradients; the gradients are the compiled bfloat16 backward's, cast once."""
    n, d = 100, 16
    shape = (n, d) if function in ("alibi", "lsh") else (n, 2, d)
    q, k, v, dout = (rand(shape, seed) for seed in (21, 22, 23, 24))
    hashes = poslsh.rbf_hashes(6.0, 6, seed=3)
    cu = torch.tensor([0, 35, 100], dtype=torch.int32)
    calls = {
        "alibi": (lambda a, b, c, **kw: ptorch.alibi_attention(a, b, c, 6.0, **kw),
                  lambda a, b, c: ptorch.alibi_attention_forward(a, b, c, 6.0)),
        "lsh": (lambda a, b, c, **kw: ptorch.lsh_attention(a, b, c, hashes, **kw),
                lambda a, b, c: ptorch.lsh_attention_forward(a, b, c, hashes)),
        "multihead": (lambda a, b, c, **kw: ptorch.multihead_attention(a, b, c, samples=6, seed=2, **kw),
                      lambda a, b, c: ptorch.multihead_attention_forward(a, b, c, samples=6, seed=2)),
        "packed": (lambda a, b, c, **kw: ptorch.multihead_attention(a, b, c, method="exact_tiled", cu_seqlens=cu,
                                                                   **kw),
                   lambda a, b, c: torch.cat([ptorch.multihead_attention_forward(
                       a[s:e], b[s:e], c[s:e], method="exact_tiled") for s, e in ((0, 35), (35, 100))])),
    }
    differentiable, forward_only = calls[function]
    with torch.no_grad():
        expected = forward_only(q, k, v)
    assert torch.equal(differentiable(q, k, v), expected)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = differentiable(*leaves)
    assert out.dtype == BF16 and out.requires_grad and torch.equal(out.detach(), expected)
    out.backward(dout)
    # The gradients: the compiled bfloat16 backward's on the tensors and the output (the unit
    # under the default precision), from the compiled forward's lse, cast once.
    keywords = dict(method="exact_tiled") if function == "packed" else dict(samples=6, seed=2)
    _, want = float32_gradients(function, q, k, v, out, dout, 6.0, hashes, keywords, cu, argument=bits)
    for got, gradient in zip(leaves, want):
        assert got.grad.dtype == BF16 and torch.equal(got.grad, torch.from_numpy(gradient).to(BF16))
    fp_out = differentiable(q, k, v, precision=FLOAT_PRODUCTS)
    with torch.no_grad():
        assert torch.equal(fp_out, differentiable(*(x.float() for x in (q, k, v))).to(BF16))
    if HAS_UNIT:
        assert not torch.equal(fp_out, expected)


def flash_reference(q, k, v, slopes, causal, precision="matrix_units"):
    """flash_attn_func's output as per-row poslsh.multihead_attention calls (sigma_h = 1 /
    slope_h, bottom-right) on the bfloat16 tensors, float32 out."""
    out = torch.empty(q.shape, dtype=torch.float32)
    sigmas = [1.0 / float(s) for s in slopes]
    for b in range(q.shape[0]):
        out[b] = torch.from_numpy(poslsh.multihead_attention(
            *(bits(x[b].contiguous()) for x in (q, k, v)), method="exact_tiled",
            masking="causal" if causal else "bidirectional", sigmas=sigmas, out=np.empty(q.shape[1:], np.float32),
            precision=precision))
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_func_on_the_unit(causal):
    batch, n, heads, heads_k, d = 2, 130, 4, 2, 64
    q, k = rand((batch, n, heads, d), 31), rand((batch, n, heads_k, d), 32)
    v = rand((batch, n, heads_k, d), 33)
    slopes = torch.tensor([2.0, 0.25, 1 / 64, 1e-6])
    extras = dict(causal=causal, alibi_slopes=slopes)
    out = ptorch.flash_attn_func(q, k, v, **extras)
    reference = flash_reference(q, k, v, slopes, causal)
    assert torch.equal(out, reference.to(BF16))
    # The accuracy rule on the float32 results of each head.
    for b in range(batch):
        for h in range(heads):
            qh, kh, vh = (bf16_values(x[b, :, g].contiguous().view(torch.int16).numpy().view(np.uint16))
                          for x, g in ((q, h), (k, h // 2), (v, h // 2)))
            additive = alibi_additive(n, n, 1.0 / float(slopes[h]), causal)
            expected = dense_attention(qh, kh, vh, 1 / 8.0, additive)
            plain = max_error(plain_bf16_attention(qh, kh, vh, 1 / 8.0, additive), expected)
            assert max_error(reference[b, :, h].numpy(), expected) <= 2 * plain
    fp = ptorch.flash_attn_func(q, k, v, precision=FLOAT_PRODUCTS, **extras)
    assert torch.equal(fp, ptorch.flash_attn_func(q.float(), k.float(), v.float(), **extras).to(BF16))
    assert torch.equal(fp, flash_reference(q, k, v, slopes, causal, FLOAT_PRODUCTS).to(BF16))
    if HAS_UNIT:
        assert not torch.equal(out, fp)
    # Gradients: the output is unchanged; each batch row's gradients and lse are those of
    # poslsh.torch.multihead_attention on its tensors (the compiled bfloat16 forward with lse and
    # backward under the same precision).
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    graded, lse, _ = ptorch.flash_attn_func(*leaves, return_attn_probs=True, **extras)
    assert torch.equal(graded.detach(), out)
    dout = rand(out.shape, 34)
    grads = torch.autograd.grad(graded, leaves, dout)
    sigmas = [1.0 / float(s) for s in slopes]
    masking = "causal" if causal else "bidirectional"
    for b in range(batch):
        row = [x[b].clone().requires_grad_(True) for x in (q, k, v)]
        row_out = ptorch.multihead_attention(*row, method="exact_tiled", masking=masking, sigmas=sigmas)
        for got, want in zip(grads, torch.autograd.grad(row_out, row, dout[b])):
            assert got.dtype == BF16 and torch.equal(got[b], want)
        _, row_lse = poslsh.multihead_attention_with_lse(*(bits(x[b].contiguous()) for x in (q, k, v)),
                                                         method="exact_tiled", masking=masking, sigmas=sigmas)
        expected_lse = torch.from_numpy(row_lse)
        if causal:  # FlashAttention-2's causal lse: its bias +slope * j, poslsh's lse + slope * i, rounded once
            shift = slopes.double()[:, None] * torch.arange(n, dtype=torch.float64)[None, :]
            expected_lse = (expected_lse.double() + shift).float()
        assert torch.equal(lse[b], expected_lse)
    # Without gradients: the same forward with lse (out and softmax_lse bitwise the call's with
    # gradients).
    with torch.no_grad():
        plain_out, plain_lse, _ = ptorch.flash_attn_func(q, k, v, return_attn_probs=True, **extras)
    assert torch.equal(plain_out, out) and torch.equal(plain_lse, lse)


def test_flash_attn_varlen_func_on_the_unit():
    """Each sequence of a packed batch is its own flash_attn_func call; seqlen_q < seqlen_k
    rows at the last key positions."""
    heads, d = 2, 32
    lengths_q, lengths_k = [40, 0, 7, 70], [40, 5, 30, 70]
    cu_q = torch.tensor([0] + np.cumsum(lengths_q).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + np.cumsum(lengths_k).tolist(), dtype=torch.int32)
    q = rand((int(cu_q[-1]), heads, d), 41)
    k, v = rand((int(cu_k[-1]), heads, d), 42), rand((int(cu_k[-1]), heads, d), 43)
    slopes = torch.tensor([0.5, 0.03])
    out = ptorch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 70, 70, causal=True, alibi_slopes=slopes)
    for b in range(4):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lengths_q[b] == 0:
            continue
        one = ptorch.flash_attn_func(q[None, qs], k[None, ks], v[None, ks], causal=True, alibi_slopes=slopes)
        assert torch.equal(out[qs], one[0])
    fp = ptorch.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 70, 70, causal=True, alibi_slopes=slopes,
                                       precision=FLOAT_PRODUCTS)
    wide = ptorch.flash_attn_varlen_func(q.float(), k.float(), v.float(), cu_q, cu_k, 70, 70, causal=True,
                                         alibi_slopes=slopes)
    assert torch.equal(fp, wide.to(BF16))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("method", ["exact", "lsh"])
def test_kv_cache_decode_on_the_unit_is_one_prefill(paged, method):
    """bfloat16 queries over a bfloat16 cache: a prefill of 70 tokens, then decode steps of 1 and
    3 tokens give bitwise the rows of one flash_attn_func call on all 74 tokens (under both
    precisions), and so do out and softmax_lse with return_softmax_lse (one computation: under
    matrix_units the lse of the unit's products, not of a float32 copy)."""
    batch, n, heads, heads_k, d = 2, 74, 4, 2, 64
    q, k = rand((batch, n, heads, d), 51), rand((batch, n, heads_k, d), 52)
    v = rand((batch, n, heads_k, d), 53)
    slopes = torch.tensor([0.5, 0.1, 0.02, 0.0])
    for precision in ("matrix_units", FLOAT_PRODUCTS):
        extras = dict(causal=True, alibi_slopes=slopes, method=method, samples=4, seed=5, precision=precision)
        full = ptorch.flash_attn_func(q, k, v, **extras)
        if paged:
            block = 16
            k_cache, v_cache = torch.zeros(10, block, heads_k, d, dtype=BF16), torch.zeros(10, block, heads_k, d,
                                                                                           dtype=BF16)
            table = torch.tensor([[9, 1, 4, 6, 2], [0, 3, 5, 7, 8]], dtype=torch.int32)
            paging = dict(block_table=table)
        else:
            k_cache, v_cache = torch.zeros(batch, 80, heads_k, d, dtype=BF16), torch.zeros(batch, 80, heads_k, d,
                                                                                           dtype=BF16)
            paging = {}
        start = 0
        for stop in (70, 71, 74):
            step = ptorch.flash_attn_with_kvcache(q[:, start:stop], k_cache, v_cache, k[:, start:stop],
                                                  v[:, start:stop], cache_seqlens=start, **paging, **extras)
            assert torch.equal(step, full[:, start:stop]), (precision, start, stop)
            start = stop
        # The last 14 rows: some of their lse differ between the two precisions' products.
        out, lse = ptorch.flash_attn_with_kvcache(q[:, 60:], k_cache, v_cache, cache_seqlens=74,
                                                  return_softmax_lse=True, **paging, **extras)
        assert torch.equal(out, full[:, 60:])
        _, full_lse, _ = ptorch.flash_attn_func(q, k, v, return_attn_probs=True, **extras)
        assert torch.equal(lse, full_lse[:, :, 60:]), (precision, paged)
        _, wide_lse, _ = ptorch.flash_attn_func(q.float(), k.float(), v.float(), return_attn_probs=True,
                                                **dict(extras, precision=FLOAT_PRODUCTS))
        if precision == FLOAT_PRODUCTS or not HAS_UNIT:  # float sums of the widened values
            assert torch.equal(lse, wide_lse[:, :, 60:])
        else:  # the same exact products of bfloat16 values, summed in another order
            assert not torch.equal(lse, wide_lse[:, :, 60:])
            assert torch.allclose(lse, wide_lse[:, :, 60:], atol=1e-5, rtol=0)


def test_module_on_the_unit():
    """A bfloat16 AlibiSelfAttention: its attention is flash_attn_func's under the module's
    precision (the default matrix_units)."""
    torch.manual_seed(3)
    module = ptorch.AlibiSelfAttention(64, 4, 2).to(BF16)
    assert module.precision == "matrix_units" and "precision='matrix_units'" in repr(module)
    x = torch.randn(2, 70, 64).to(BF16)
    with torch.no_grad():
        q, k, v = module._projections(x)
        for precision in ("matrix_units", FLOAT_PRODUCTS):
            module.precision = precision
            attention = ptorch.flash_attn_func(q, k, v, causal=True, alibi_slopes=module.alibi_slopes,
                                               precision=precision)
            assert torch.equal(module(x), module.o_proj(attention.reshape(2, 70, 64)))
            # transformers' attention-function signature reads poslsh_precision.
            module.poslsh_precision = precision
            out, _ = ptorch.attention_forward(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None)
            assert torch.equal(out, attention)


def test_bad_precision_names_the_argument():
    q = rand((1, 5, 2, 8), 61)
    for call in (lambda: ptorch.flash_attn_func(q, q, q, precision="fast"),
                 lambda: ptorch.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 5], dtype=torch.int32),
                                                       torch.tensor([0, 5], dtype=torch.int32), 5, 5, precision="fast"),
                 lambda: ptorch.flash_attn_with_kvcache(q, q.clone(), q.clone(), cache_seqlens=5, precision="fast")):
        with pytest.raises(ValueError, match="argument 'precision' = fast: must be matrix_units or float_products"):
            call()
    for call in (lambda: ptorch.alibi_attention(q[0, :, 0], q[0, :, 0], q[0, :, 0], 4.0, precision="fast"),
                 lambda: ptorch.lsh_attention(q[0, :, 0], q[0, :, 0], q[0, :, 0], poslsh.rbf_hashes(4.0, 2, seed=0),
                                              precision="fast"),
                 lambda: ptorch.multihead_attention(q[0], q[0], q[0], precision="fast")):
        with pytest.raises(ValueError, match="argument 'precision' = fast: must be matrix_units or float_products"):
            call()
    with pytest.raises(ValueError, match="poslsh: alibi_attention_tiled: argument 'precision' = fast"):
        ptorch.alibi_attention_forward(q[0, :, 0], q[0, :, 0], q[0, :, 0], 4.0, precision="fast")
    with pytest.raises(ValueError, match="argument 'precision' = 'fast'"):
        ptorch.AlibiSelfAttention(16, 2, precision="fast")
    # float32 tensors check the name as well.
    with pytest.raises(ValueError, match="argument 'precision'"):
        ptorch.flash_attn_func(q.float(), q.float(), q.float(), precision="fast")


@needs_no_unit
def test_without_a_unit_the_default_is_float_products():
    q, k, v = (rand((2, 40, 2, 16), s) for s in (71, 72, 73))
    assert torch.equal(ptorch.flash_attn_func(q, k, v, causal=True),
                       ptorch.flash_attn_func(q, k, v, causal=True, precision=FLOAT_PRODUCTS))
    assert torch.equal(ptorch.alibi_attention_forward(q[0, :, 0], k[0, :, 0], v[0, :, 0], 4.0),
                       ptorch.alibi_attention_forward(q[0, :, 0], k[0, :, 0], v[0, :, 0], 4.0,
                                                      precision=FLOAT_PRODUCTS))


@needs_unit
def test_jit_trace_records_the_precision():
    slopes = torch.tensor([0.5, 0.25])
    q, k, v = (rand((1, 20, 2, 16), s) for s in (81, 82, 83))
    for precision in ("matrix_units", FLOAT_PRODUCTS):
        def attention(a, b, c):
            return ptorch.flash_attn_func(a, b, c, causal=True, alibi_slopes=slopes, precision=precision)

        traced = torch.jit.trace(attention, (q, k, v), check_trace=False)
        assert torch.equal(traced(q, k, v), attention(q, k, v))
    assert not math.isnan(float(traced(q, k, v).float().sum()))

"""Tests of poslsh.torch.AlibiSelfAttention, KVCache, attention_forward and make_alibi_slopes
against a dense float64 PyTorch formula written here (BLOOM-style: the bias -slope |i - j| built
as a full matrix, softmax, grouped-query heads by repetition)."""

import math

import pytest

torch = pytest.importorskip("torch")
import poslsh  # noqa: E402
import poslsh.torch as ptorch  # noqa: E402


def dense_attention(q, k, v, slopes, causal, scale=None):
    """softmax(scale q k^T - slope_h |i + Lk - Lq - j|) v over (batch, seq, heads, dim) tensors,
    in float64, key/value head h // G for query head h; slopes (H,) or (batch, H)."""
    batch, q_len, heads, dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    q, k, v = q.double(), k.double().repeat_interleave(group, 2), v.double().repeat_interleave(group, 2)
    slopes = slopes.double()
    slopes = slopes.expand(batch, heads) if slopes.dim() == 1 else slopes
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    i = torch.arange(q_len, dtype=torch.float64)[:, None] + (kv_len - q_len)
    j = torch.arange(kv_len, dtype=torch.float64)[None, :]
    bias = -slopes[:, :, None, None] * (i - j).abs()                     # (batch, H, Lq, Lk)
    scores = scale * torch.einsum("bihd,bjhd->bhij", q, k) + bias
    if causal:
        scores = scores.masked_fill(j > i, -math.inf)
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(scores, dim=-1), v)


def dense_module(module, x, slopes=None):
    """AlibiSelfAttention's forward with its own weights and dense_attention, in float64."""
    batch, length, _ = x.shape
    x = x.double()
    h, hk, d = module.num_heads, module.num_kv_heads, module.head_dim

    def linear(layer, inputs):
        return torch.nn.functional.linear(inputs, layer.weight.double(),
                                          None if layer.bias is None else layer.bias.double())

    if module.fused_qkv:
        q, k, v = linear(module.qkv_proj, x).split([h * d, hk * d, hk * d], dim=-1)
    else:
        q, k, v = linear(module.q_proj, x), linear(module.k_proj, x), linear(module.v_proj, x)
    slopes = module.alibi_slopes if slopes is None else slopes
    out = dense_attention(q.reshape(batch, length, h, d), k.reshape(batch, length, hk, d),
                          v.reshape(batch, length, hk, d), slopes, module.causal, module.softmax_scale)
    return linear(module.o_proj, out.reshape(batch, length, h * d))


def sharpen(module, std=0.3):
    """Weights larger than nn.Linear's initialisation, so that attention is far from uniform."""
    torch.manual_seed(1234)
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter is not module.alibi_slopes:
                parameter.normal_(0.0, std)
    return module


# make_alibi_slopes ----------------------------------------------------------------------------

@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 8, 12, 16, 24])
def test_slopes_are_the_official_ones(heads):
    got = ptorch.make_alibi_slopes(heads)
    assert got.dtype == torch.float32 and got.shape == (heads,)
    assert torch.equal(got, torch.from_numpy(poslsh.alibi_slopes(heads)).float())


def test_slopes_max_bias():
    # Power of two: 2^(-b (h+1) / H); otherwise the 4 slopes of 4 heads, then slopes 0 and 2 of 8.
    assert torch.equal(ptorch.make_alibi_slopes(4, 16.0), torch.tensor([2.0 ** (-4 * (h + 1)) for h in range(4)]))
    want = [2.0 ** (-2 * (h + 1)) for h in range(4)] + [2.0 ** -1, 2.0 ** -3]
    assert torch.equal(ptorch.make_alibi_slopes(6, 8.0), torch.tensor(want, dtype=torch.float64).float())


# AlibiSelfAttention ---------------------------------------------------------------------------

@pytest.mark.parametrize("fused_qkv", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_module_forward_backward_match_dense(fused_qkv, causal, heads, kv_heads):
    module = sharpen(ptorch.AlibiSelfAttention(48, heads, kv_heads, fused_qkv=fused_qkv, bias=True,
                                               causal=causal)).double()
    torch.manual_seed(5)
    x = torch.randn(2, 37, 48, dtype=torch.float64, requires_grad=True)
    got = module(x)
    want = dense_module(module, x)
    assert got.shape == (2, 37, 48) and got.dtype == torch.float64
    assert (got - want).abs().max().item() < 1e-10 * max(1.0, want.abs().max().item())
    seed = torch.randn_like(got)
    grads = torch.autograd.grad((got * seed).sum(), [x, *module.parameters()])
    want_grads = torch.autograd.grad((want * seed).sum(), [x, *module.parameters()])
    for a, b in zip(grads, want_grads):
        assert (a - b).abs().max().item() < 1e-9 * max(1.0, b.abs().max().item())


def test_module_float32_matches_dense():
    module = sharpen(ptorch.AlibiSelfAttention(64, 4, 2, slopes=[0.5, 0.05, 0.0, 1.5]))
    torch.manual_seed(6)
    x = torch.randn(3, 50, 64)
    got = module(x)
    assert got.dtype == torch.float32
    want = dense_module(module, x)
    assert (got.double() - want).abs().max().item() < 2e-5 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("causal", [True, False])
def test_trainable_slope_gradients_match_dense(causal):
    module = sharpen(ptorch.AlibiSelfAttention(32, 4, trainable_slopes=True, causal=causal)).double()
    assert isinstance(module.alibi_slopes, torch.nn.Parameter) and module.alibi_slopes.dtype == torch.float32
    torch.manual_seed(7)
    x = torch.randn(2, 29, 32, dtype=torch.float64)
    seed = torch.randn(2, 29, 32, dtype=torch.float64)
    (module(x) * seed).sum().backward()
    reference = module.alibi_slopes.detach().double().requires_grad_(True)
    (dense_module(module, x, slopes=reference) * seed).sum().backward()
    got = module.alibi_slopes.grad
    assert got is not None and got.dtype == torch.float32
    assert (got.double() - reference.grad).abs().max().item() < 1e-6 * max(1.0, reference.grad.abs().max().item())
    assert reference.grad.abs().min().item() > 0     # every head's slope matters


def test_module_bfloat16_matches_dense():
    """bfloat16 weights and inputs: the projections are torch's bfloat16 Linear layers, the
    attention is computed in float32 and rounded once, so the reference takes the module's own
    bfloat16 q, k, v, the dense formula in float64 rounded to bfloat16, and the bfloat16 o_proj."""
    module = sharpen(ptorch.AlibiSelfAttention(64, 4, 2)).to(torch.bfloat16)
    assert module.alibi_slopes.dtype == torch.float32 and module.q_proj.weight.dtype == torch.bfloat16
    torch.manual_seed(8)
    x = torch.randn(2, 40, 64).to(torch.bfloat16)
    got = module(x)
    assert got.dtype == torch.bfloat16
    q, k, v = module._projections(x)
    attention = dense_attention(q, k, v, module.alibi_slopes, True).to(torch.bfloat16)
    want = module.o_proj(attention.reshape(2, 40, 64)).double()
    # The float32 attention and the float64 reference may round to neighbouring bfloat16
    # values; o_proj then differs by a few units in the last place of its largest output.
    assert (got.double() - want).abs().max().item() <= 2.0 ** -6 * want.abs().max().item()


def test_module_window_matches_dense():
    """window_size=(left, right) as flash_attn_func: key j visible from query i iff
    i - left <= j <= i + right (bidirectional here), the other keys masked in the reference."""
    module = sharpen(ptorch.AlibiSelfAttention(32, 4, causal=False, window_size=(5, 2))).double()
    torch.manual_seed(9)
    x = torch.randn(2, 30, 32, dtype=torch.float64)
    q, k, v = (t.detach() for t in module._projections(x))
    i = torch.arange(30)[:, None]
    j = torch.arange(30)[None, :]
    slopes = module.alibi_slopes.double()
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(8) - slopes[None, :, None, None] * (i - j).abs()
    scores = scores.masked_fill((j < i - 5) | (j > i + 2), -math.inf)
    attention = torch.einsum("bhij,bjhd->bihd", torch.softmax(scores, dim=-1), v)
    want = module.o_proj(attention.reshape(2, 30, 32))
    assert (module(x) - want).abs().max().item() < 1e-10


def test_module_lsh_method_with_flat_slopes_is_softmax_attention():
    """method="lsh" with every slope 0: each hash puts all positions in one bin, so the
    estimator is plain causal softmax attention, the dense formula with slope 0."""
    module = sharpen(ptorch.AlibiSelfAttention(32, 4, 2, slopes=[0.0] * 4, method="lsh", samples=4,
                                               seed=5)).double()
    torch.manual_seed(10)
    x = torch.randn(2, 33, 32, dtype=torch.float64, requires_grad=True)
    got = module(x)
    want = dense_module(module, x)
    assert (got - want).abs().max().item() < 1e-10
    grad = torch.autograd.grad(got.sum(), x)[0]
    want_grad = torch.autograd.grad(want.sum(), x)[0]
    assert (grad - want_grad).abs().max().item() < 1e-9


def test_slopes_stay_float32_through_conversions():
    module = ptorch.AlibiSelfAttention(18, 3)
    want = ptorch.make_alibi_slopes(3)
    for convert in (lambda m: m.double(), lambda m: m.to(torch.bfloat16), lambda m: m.float()):
        convert(module)
        assert module.alibi_slopes.dtype == torch.float32 and torch.equal(module.alibi_slopes, want)
    assert module.o_proj.weight.dtype == torch.float32
    assert "alibi_slopes" in module.state_dict()


def greedy_model(method="exact"):
    """Embedding, two AlibiSelfAttention layers with residuals, tied output: a causal LM."""
    torch.manual_seed(11)
    embed = torch.nn.Embedding(32, 24).double()
    layers = torch.nn.ModuleList(sharpen(ptorch.AlibiSelfAttention(24, 4, 2, method=method), 0.4).double()
                                 for _ in range(2))

    def logits(tokens, caches=None):
        x = embed(tokens)
        for index, layer in enumerate(layers):
            x = x + layer(x, cache=None if caches is None else caches[index])
        return x @ embed.weight.t()

    return layers, logits


def test_generation_through_the_cache_equals_recomputation():
    layers, logits = greedy_model()
    torch.manual_seed(12)
    prompt = torch.randint(0, 32, (2, 7))
    steps = 10
    with torch.no_grad():
        # Full recomputation: the whole sequence every step, the last position's argmax.
        tokens = prompt.clone()
        full_logits = []
        for _ in range(steps):
            last = logits(tokens)[:, -1]
            full_logits.append(last)
            tokens = torch.cat([tokens, last.argmax(-1, keepdim=True)], dim=1)
        # Through the caches: the prompt in two chunks, then one token at a time.
        caches = [ptorch.KVCache.for_module(layer, 2, 32) for layer in layers]
        logits(prompt[:, :4], caches)
        last = logits(prompt[:, 4:], caches)[:, -1]
        cached = prompt.clone()
        for step in range(steps):
            assert (last - full_logits[step]).abs().max().item() < 1e-10
            cached = torch.cat([cached, last.argmax(-1, keepdim=True)], dim=1)
            if step + 1 < steps:
                last = logits(cached[:, -1:], caches)[:, -1]
    assert torch.equal(cached, tokens)
    assert all(torch.equal(c.cache_seqlens, torch.full((2,), 7 + steps - 1, dtype=torch.int32)) for c in caches)


def test_cache_rows_at_different_lengths():
    layers, logits = greedy_model()
    torch.manual_seed(13)
    rows = [torch.randint(0, 32, (1, 9)), torch.randint(0, 32, (1, 4))]
    with torch.no_grad():
        caches = [ptorch.KVCache.for_module(layer, 2, 16) for layer in layers]
        for b, row in enumerate(rows):
            singles = [ptorch.KVCache.for_module(layer, 1, 16) for layer in layers]
            logits(row, singles)
            for cache, single in zip(caches, singles):
                cache.k_cache[b], cache.v_cache[b] = single.k_cache[0], single.v_cache[0]
                cache.cache_seqlens[b] = single.cache_seqlens[0]
        step = torch.tensor([[3], [17]])
        got = logits(step, caches)[:, -1]
        for b, row in enumerate(rows):
            want = logits(torch.cat([row, step[b:b + 1]], dim=1))[0, -1]
            assert (got[b] - want).abs().max().item() < 1e-10
    assert caches[0].cache_seqlens.tolist() == [10, 5]


# attention_forward ----------------------------------------------------------------------------

class HubAttention(torch.nn.Module):
    """Stands for a transformers attention layer: the attributes attention_forward reads."""

    def __init__(self, slopes, is_causal=True):
        super().__init__()
        self.register_buffer("alibi_slopes", slopes)
        self.is_causal = is_causal


def hub_inputs(batch=2, heads=4, kv_heads=2, q_len=9, kv_len=14, dtype=torch.float64, seed=21):
    torch.manual_seed(seed)
    query = torch.randn(batch, heads, q_len, 16, dtype=dtype)
    key = torch.randn(batch, kv_heads, kv_len, 16, dtype=dtype)
    value = torch.randn(batch, kv_heads, kv_len, 16, dtype=dtype)
    return query, key, value


def causal_bool_mask(batch, q_len, kv_len):
    i = torch.arange(q_len)[:, None] + (kv_len - q_len)
    return (torch.arange(kv_len)[None, :] <= i).expand(batch, 1, q_len, kv_len)


@pytest.mark.parametrize("mask_kind", ["none", "padding_ones", "bool_causal", "float_causal", "min_causal"])
def test_attention_forward_causal_matches_dense(mask_kind):
    query, key, value = hub_inputs()
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    keep = causal_bool_mask(batch, q_len, kv_len)
    mask = {"none": None,
            "padding_ones": torch.ones(batch, kv_len, dtype=torch.long),
            "bool_causal": keep,
            "float_causal": torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, -math.inf),
            "min_causal": torch.zeros(keep.shape, dtype=torch.float32).masked_fill(
                ~keep, torch.finfo(torch.float32).min)}[mask_kind]
    slopes = ptorch.make_alibi_slopes(4)
    out, weights = ptorch.attention_forward(HubAttention(slopes), query, key, value, mask, scaling=0.3)
    assert weights is None and out.shape == (batch, q_len, 4, 16)
    want = dense_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), slopes, True, 0.3)
    assert (out - want).abs().max().item() < 1e-10


def test_attention_forward_bidirectional_and_batch_slopes():
    query, key, value = hub_inputs(q_len=14, kv_len=14)
    slopes = torch.tensor([[0.5, 0.25, 0.125, 0.0], [1.0, 0.3, 0.02, 0.7]], dtype=torch.float32)
    module = HubAttention(torch.zeros(4), is_causal=True)
    full = torch.ones(2, 1, 14, 14, dtype=torch.bool)                # the full mask: bidirectional
    want = dense_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), slopes, False)
    for mask, keywords in ((full, {}), (None, {"is_causal": False})):
        out, _ = ptorch.attention_forward(module, query, key, value, mask, alibi_slopes=slopes, **keywords)
        assert (out - want).abs().max().item() < 1e-10


def test_attention_forward_gradients_match_dense():
    query, key, value = (x.requires_grad_(True) for x in hub_inputs(q_len=11, kv_len=11, seed=22))
    slopes = ptorch.make_alibi_slopes(4)
    out, _ = ptorch.attention_forward(HubAttention(slopes), query, key, value, None)
    want = dense_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), slopes, True)
    seed = torch.randn_like(want)
    got = torch.autograd.grad((out * seed).sum(), (query, key, value))
    ref = torch.autograd.grad((want * seed).sum(), (query, key, value))
    for a, b in zip(got, ref):
        assert (a - b).abs().max().item() < 1e-10


def packed_reference(query, key, value, slopes, causal, lengths):
    """dense_attention of each sequence of a packed row (batch 1) on its own, concatenated."""
    outs, start = [], 0
    for length in lengths:
        part = [x[:, :, start:start + length].transpose(1, 2) for x in (query, key, value)]
        outs.append(dense_attention(*part, slopes, causal))
        start += length
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_forward_packed_sequences(causal):
    lengths = [5, 1, 0, 8]
    total = sum(lengths)
    query, key, value = hub_inputs(batch=1, q_len=total, kv_len=total, seed=23)
    slopes = ptorch.make_alibi_slopes(4)
    module = HubAttention(slopes, is_causal=causal)
    want = packed_reference(query, key, value, slopes, causal, lengths)
    cu = torch.tensor([0, 5, 6, 6, 14], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    block_mask = torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).tril() if causal else
                                    torch.ones(n, n, dtype=torch.bool) for n in lengths])[None, None]
    for keywords, mask in (({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, None),
                           ({"position_ids": positions}, None),
                           ({"position_ids": positions}, block_mask)):
        out, _ = ptorch.attention_forward(module, query, key, value, mask, **keywords)
        assert out.shape == (1, total, 4, 16)
        assert (out - want).abs().max().item() < 1e-10
    with pytest.raises(ValueError, match="attention_mask"):      # the unpacked causal mask crosses sequences
        ptorch.attention_forward(module, query, key, value, causal_bool_mask(1, total, total),
                                 position_ids=positions)


def test_attention_forward_position_ids_of_a_decode_step():
    query, key, value = hub_inputs()                              # q_len 9 over kv_len 14
    module = HubAttention(ptorch.make_alibi_slopes(4))
    want, _ = ptorch.attention_forward(module, query, key, value, None)
    got, _ = ptorch.attention_forward(module, query, key, value, None, position_ids=torch.arange(5, 14)[None])
    assert torch.equal(got, want)
    for positions in (torch.arange(9)[None], torch.stack([torch.arange(5, 14), torch.arange(4, 13)])):
        with pytest.raises(ValueError, match="position_ids"):
            ptorch.attention_forward(module, query, key, value, None, position_ids=positions)


# Bad inputs -----------------------------------------------------------------------------------

def test_attention_forward_rejects_what_it_cannot_honour():
    query, key, value = hub_inputs()
    module = HubAttention(ptorch.make_alibi_slopes(4))
    padding = torch.ones(2, 14, dtype=torch.long)
    padding[1, :3] = 0
    keep = causal_bool_mask(2, 9, 14)
    biased = torch.zeros(keep.shape).masked_fill(~keep, -math.inf)
    biased[0, 0, 0, 0] = -0.5
    window = keep.clone()
    window[:, :, -1, 0] = False
    cases = [
        (dict(attention_mask=padding), ValueError, "attention_mask"),
        (dict(attention_mask=biased), ValueError, "attention_mask"),
        (dict(attention_mask=window), ValueError, "attention_mask"),
        (dict(attention_mask=keep[:, :, :, :5]), ValueError, "attention_mask"),
        (dict(attention_mask=keep.long()), TypeError, "attention_mask"),
        (dict(attention_mask=[[1]]), TypeError, "attention_mask"),
        (dict(attention_mask=None, dropout=0.1), ValueError, "dropout"),
        (dict(attention_mask=None, softcap=30.0), ValueError, "softcap"),
        (dict(attention_mask=None, sliding_window=4), ValueError, "sliding_window"),
    ]
    for keywords, error, name in cases:
        with pytest.raises(error, match=name):
            ptorch.attention_forward(module, query, key, value, **keywords)
    with pytest.raises(ValueError, match="alibi_slopes"):
        ptorch.attention_forward(torch.nn.Module(), query, key, value, None)
    with pytest.raises(ValueError, match="query"):
        ptorch.attention_forward(module, query[0], key, value, None)
    with pytest.raises(TypeError, match="key"):
        ptorch.attention_forward(module, query, key.numpy(), value, None)
    with pytest.raises(ValueError, match="value"):
        ptorch.attention_forward(module, query, key, value[:, :, :5], None)
    cu = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):                 # batch 2
        ptorch.attention_forward(module, query, key, value, None, cu_seq_lens_q=cu,
                                 cu_seq_lens_k=torch.tensor([0, 14], dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seq_lens_k"):
        ptorch.attention_forward(module, query[:1], key[:1], value[:1], None, cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="cu_seq_lens_k"):                 # does not end at kv_len 14
        ptorch.attention_forward(module, query[:1], key[:1], value[:1], None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_module_rejects_bad_arguments():
    cases = [
        (lambda: ptorch.AlibiSelfAttention(32, 4, 3), ValueError, "num_kv_heads"),
        (lambda: ptorch.AlibiSelfAttention(30, 4), ValueError, "num_heads"),
        (lambda: ptorch.AlibiSelfAttention(32.0, 4), TypeError, "hidden_size"),
        (lambda: ptorch.AlibiSelfAttention(32, 0), ValueError, "num_heads"),
        (lambda: ptorch.AlibiSelfAttention(32, 4, slopes=[0.5, 0.25]), ValueError, "slopes"),
        (lambda: ptorch.AlibiSelfAttention(32, 4, slopes="abcd"), TypeError, "slopes"),
        (lambda: ptorch.AlibiSelfAttention(32, 4, slopes=[0.5, 0.25, math.nan, 1.0]), ValueError, "slopes"),
        (lambda: ptorch.AlibiSelfAttention(32, 4, causal=1), TypeError, "causal"),
        (lambda: ptorch.AlibiSelfAttention(32, 4, trainable_slopes=True, method="lsh"), ValueError,
         "trainable_slopes"),
        (lambda: ptorch.make_alibi_slopes(4, -1.0), ValueError, "max_bias"),
        (lambda: ptorch.KVCache(1, 0, 2, 8), ValueError, "max_seqlen"),
        (lambda: ptorch.KVCache(1, 8, 2, 8, dtype=torch.int32), TypeError, "dtype"),
        (lambda: ptorch.KVCache.for_module(torch.nn.Linear(2, 2), 1, 8), TypeError, "module"),
    ]
    for make, error, name in cases:
        with pytest.raises(error, match=name):
            make()
    module = ptorch.AlibiSelfAttention(32, 4, 2)
    with pytest.raises(ValueError, match="'x'"):
        module(torch.zeros(2, 5, 31))
    with pytest.raises(TypeError, match="'x'"):
        module([[0.0] * 32])
    with pytest.raises(ValueError, match="cache.*no_grad"):
        module(torch.zeros(1, 3, 32), cache=ptorch.KVCache.for_module(module, 1, 8))
    with torch.no_grad():
        with pytest.raises(TypeError, match="cache"):
            module(torch.zeros(1, 3, 32), cache=(torch.zeros(1, 8, 2, 8),) * 2)
        with pytest.raises(ValueError, match="cache"):
            module(torch.zeros(1, 3, 32), cache=ptorch.KVCache(1, 8, 4, 8))
        cache = ptorch.KVCache.for_module(module, 1, 8)
        module(torch.zeros(1, 6, 32), cache=cache)
        with pytest.raises(ValueError, match="cache"):
            module(torch.zeros(1, 3, 32), cache=cache)
        assert cache.cache_seqlens.tolist() == [6]

"""poslsh.transformers: BLOOM, MPT and Falcon-ALiBi from transformers with poslsh attention,
against transformers' own eager attention on the same weights (small random models)."""

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="poslsh.transformers needs transformers")

import poslsh  # noqa: E402
import poslsh.transformers as pt  # noqa: E402

KINDS = ("bloom", "mpt", "falcon")
VOCAB = 97


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The models are tiny: one thread (torch's and, as they share the OpenMP runtime, poslsh's;
    the kernels give the same bits on any thread count). Spinning threads of tiny operators made
    the file 6x slower on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(kind, dtype=torch.float32, init=0.5, **overrides):
    """A 2-layer random model of `kind` in eager attention, seeded (the same weights each call).
    initializer_range 0.5 spreads the logits, so greedy decoding has clear winners; the training
    tests take 0.1, where float32 gradients are well conditioned (at 0.5 transformers' own float32
    gradients are 6e-5 from float64's)."""
    torch.manual_seed(1234)
    common = dict(vocab_size=VOCAB, initializer_range=init, attn_implementation="eager")
    if kind == "bloom":  # 6 heads: Press et al.'s interleaved slopes
        config = transformers.BloomConfig(hidden_size=96, n_layer=2, n_head=6, **overrides, **common)
        model = transformers.BloomForCausalLM(config)
    elif kind == "mpt":
        config = transformers.MptConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=128, **overrides, **common)
        model = transformers.MptForCausalLM(config)
    else:  # Falcon-RW's layout: alibi, no multi-query, sequential attention and MLP
        options = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True, multi_query=False,
                       new_decoder_architecture=False, parallel_attn=False, bias=True)
        options.update(overrides)
        config = transformers.FalconConfig(**options, **common)
        model = transformers.FalconForCausalLM(config)
    return model.to(dtype).eval()


def pair(kind, dtype=torch.float32, method="exact", init=0.5, config=None, **options):
    """(transformers eager, poslsh) models with the same weights (`config`: options of the
    model's config)."""
    reference = make_model(kind, dtype, init, **(config or {}))
    model = pt.use_poslsh(make_model(kind, dtype, init, **(config or {})), method=method, **options)
    return reference, model


def batch(lengths, total, seed=0, side="left"):
    """Token ids (len(lengths), total) and the attention mask of prompts of the given lengths,
    padded on `side` (pad id 0)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), total), generator=generator)
    mask = torch.zeros((len(lengths), total), dtype=torch.long)
    for b, n in enumerate(lengths):
        if side == "left":
            mask[b, total - n:] = 1
        else:
            mask[b, :n] = 1
    return ids * mask, mask


def relative_error(x, reference, where=None):
    """max |x - reference| / max |reference| (over the rows `where` selects)."""
    x, reference = x.double(), reference.double()
    if where is not None:
        x, reference = x[where], reference[where]
    return float((x - reference).abs().max() / reference.abs().max())


# Conventions. ---------------------------------------------------------------------------------


def press_slopes(heads):
    """Press et al.'s ALiBi slopes, written out: 2^(-8(h+1)/p) for p = 2^floor(log2 H), then
    the odd powers of the base of 2p heads."""
    def power_of_two(n):
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    p = 2 ** int(math.floor(math.log2(heads)))
    return power_of_two(p) + power_of_two(2 * p)[0::2][:heads - p]


@pytest.mark.parametrize("kind", KINDS)
def test_slopes_follow_each_models_convention(kind):
    model = make_model(kind)
    heads = 6 if kind == "bloom" else 4
    expected = torch.tensor(press_slopes(heads), dtype=torch.float32)
    if kind == "falcon":  # bfloat16 slopes, the bias divided by sqrt(head_dim)
        expected = expected.to(torch.bfloat16).float() / math.sqrt(64 // heads)
    assert torch.allclose(pt.model_slopes(model), expected, rtol=1e-7, atol=0)
    assert np.allclose(press_slopes(heads), poslsh.alibi_slopes(heads), rtol=1e-15)


# Logits. --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_logits_float32_equal_eager(kind, padding):
    reference, model = pair(kind)
    if padding == "none":
        ids, mask = batch([40, 40], 40)
        mask_arg = None
    else:
        ids, mask = batch([40, 23, 31], 40, side=padding)
        mask_arg = mask
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask_arg).logits
        got = model(ids, attention_mask=mask_arg).logits
    assert relative_error(got, expected, mask.bool()) <= 1e-5


@pytest.mark.parametrize("kind, config", [
    # MPT: its own softmax scale, clipped q/k/v, and an alibi_bias_max that transformers does
    # not pass to build_mpt_alibi_tensor (the slopes stay those of 8).
    ("mpt", dict(attn_config=dict(softmax_scale=0.3, clip_qkv=0.5, alibi_bias_max=16))),
    ("bloom", dict(pretraining_tp=2, slow_but_exact=True)),  # the tensor-parallel output slices
])
def test_model_options(kind, config):
    reference, model = pair(kind, config=config)
    if kind == "mpt":
        assert torch.allclose(pt.model_slopes(model), torch.tensor(press_slopes(4)), rtol=1e-7, atol=0)
    ids, mask = batch([30, 21], 30, seed=17)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
    assert relative_error(got, expected, mask.bool()) <= 1e-5


@pytest.mark.parametrize("kind", ["bloom", "falcon"])
def test_padding_between_tokens(kind):
    # BLOOM's and Falcon's positions count the tokens before a key, padding excluded, wherever
    # the padding is.
    reference, model = pair(kind)
    ids, mask = batch([30, 30], 30, seed=14)
    mask[0, 10:14] = 0
    mask[1, 3] = 0
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
    assert relative_error(got, expected, mask.bool()) <= 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_cached_decoding_of_a_batch_equals_one_prefill(kind):
    # Prefill 14 tokens, then 6 single-token steps on the DynamicCache: transformers' logits of
    # the 20 tokens at once (a batch of 2 without padding, no mask).
    reference, model = pair(kind)
    ids, _ = batch([20, 20], 20, seed=15)
    with torch.no_grad():
        expected = reference(ids).logits
    assert relative_error(cached_logits(model, ids, 14), expected) <= 1e-5


def cached_logits(model, ids, prefix):
    """Logits of `prefix` tokens at once, then of the others one at a time on the cache."""
    with torch.no_grad():
        out = model(ids[:, :prefix], use_cache=True)
        steps, cache = [out.logits], out.cache
        for t in range(prefix, ids.shape[1]):
            out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.cache
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("kind", KINDS)
def test_cached_decoding_bfloat16_within_twice_transformers_error(kind):
    ids, _ = batch([24], 24, seed=16)
    with torch.no_grad():
        truth = make_model(kind, torch.float64, init=0.1)(ids).logits
    theirs = relative_error(cached_logits(make_model(kind, torch.bfloat16, init=0.1), ids, 8), truth)
    ours = relative_error(cached_logits(pt.use_poslsh(make_model(kind, torch.bfloat16, init=0.1)), ids, 8), truth)
    assert ours <= 2 * theirs, (ours, theirs)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_bfloat16_within_twice_transformers_error(kind):
    # Right padding: transformers' float64 eager run gives NaN in left-padded rows (its mask's
    # float64 minimum plus the bias overflows to -inf in rows with no key).
    ids, mask = batch([40, 23, 31], 40, side="right")
    exact = make_model(kind, torch.float64, init=0.1)
    reference = make_model(kind, torch.bfloat16, init=0.1)
    model = pt.use_poslsh(make_model(kind, torch.bfloat16, init=0.1))
    with torch.no_grad():
        truth = exact(ids, attention_mask=mask).logits
        theirs = relative_error(reference(ids, attention_mask=mask).logits, truth, mask.bool())
        ours = relative_error(model(ids, attention_mask=mask).logits, truth, mask.bool())
    assert ours <= 2 * theirs, (ours, theirs)


# Generation. ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generate_with_cache_equals_eager(kind):
    reference, model = pair(kind)
    settings = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0, use_cache=True)
    ids, mask = batch([9], 9, seed=3)
    expected = reference.generate(ids, attention_mask=mask, **settings)
    got = model.generate(ids, attention_mask=mask, **settings)
    assert got.shape == (1, 41)
    assert torch.equal(got, expected)
    ids, mask = batch([11, 4, 7], 11, seed=4)  # left-padded batch of three prompts
    expected = reference.generate(ids, attention_mask=mask, **settings)
    got = model.generate(ids, attention_mask=mask, **settings)
    assert got.shape == (3, 43)
    assert torch.equal(got, expected)


def test_generate_with_padding_uses_per_row_positions():
    # BLOOM's positions count the tokens before a key (padding excluded): a left-padded row
    # generates what the same prompt generates alone.
    model = pt.use_poslsh(make_model("bloom"))
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    ids, mask = batch([10, 4], 10, seed=5)
    together = model.generate(ids, attention_mask=mask, **settings)
    alone = model.generate(ids[1:, 6:], attention_mask=mask[1:, 6:], **settings)
    assert torch.equal(together[1, 6:], alone[0])


# Training. ------------------------------------------------------------------------------------


def loss_and_gradients(model, ids, mask):
    """The per-token losses (next-token cross-entropy at the tokens, a vector) and the gradients
    of their mean, the causal-LM loss, of a right-padded batch. The vector is compared: the
    scalar mean of errors of random sign says little about either run. Query rows at padding
    slots are not used: poslsh gives them zeros where transformers gives a meaningless value
    (which a left-padded batch would use to predict its first token)."""
    model.zero_grad(set_to_none=True)
    logits = model(ids, attention_mask=mask).logits[:, :-1]
    keep = mask[:, 1:].bool()
    wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
    losses = torch.nn.functional.cross_entropy(logits[keep].to(wide), ids[:, 1:][keep], reduction="none")
    losses.mean().backward()
    return losses.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("kind", KINDS)
def test_training_float32_loss_and_every_gradient_equal_eager(kind):
    reference, model = pair(kind, init=0.1)
    reference.train()
    model.train()
    ids, mask = batch([24, 13, 19], 24, seed=6, side="right")
    loss_ref, grads_ref = loss_and_gradients(reference, ids, mask)
    loss, grads = loss_and_gradients(model, ids, mask)
    assert relative_error(loss, loss_ref) <= 1e-5
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads.items():
        assert grad is not None, name
        assert relative_error(grad, grads_ref[name]) <= 1e-5, name


@pytest.mark.parametrize("kind", KINDS)
def test_training_bfloat16_within_twice_transformers_error(kind):
    ids, mask = batch([24, 13, 19], 24, seed=7, side="right")
    runs = {}
    for name, dtype, poslsh_on in (("truth", torch.float64, False), ("theirs", torch.bfloat16, False),
                                   ("ours", torch.bfloat16, True)):
        model = make_model(kind, dtype, init=0.1).train()
        if poslsh_on:
            pt.use_poslsh(model)
        runs[name] = loss_and_gradients(model, ids, mask)
    (loss64, grads64), (loss_t, grads_t), (loss_p, grads_p) = runs["truth"], runs["theirs"], runs["ours"]
    assert relative_error(loss_p, loss64) <= 2 * relative_error(loss_t, loss64)
    for name in grads64:
        theirs, ours = relative_error(grads_t[name], grads64[name]), relative_error(grads_p[name], grads64[name])
        assert ours <= 2 * theirs, (name, ours, theirs)


# Methods per head and the planner, against the dense formula. ----------------------------------


def dense_layer0(model, ids, bands):
    """Layer 0's attention (B, L, H*d) of a BLOOM model by the dense formula: per head h,
    softmax(q k^T / sqrt(d) - m_h (i - j)) v over j <= i, |i - j| <= bands[h] (None: all)."""
    block = model.transformer.h[0]
    with torch.no_grad():
        hidden = model.transformer.word_embeddings_layernorm(model.transformer.word_embeddings(ids))
        fused = block.self_attention.query_key_value(block.input_layernorm(hidden))
    q, k, v = block.self_attention._reshape(fused)  # (B, H, L, d)
    heads, length, d = q.shape[1], q.shape[2], q.shape[3]
    slopes = torch.tensor(press_slopes(heads), dtype=torch.float64)
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    outs = []
    for h in range(heads):
        scores = q[:, h] @ k[:, h].transpose(-1, -2) / math.sqrt(d) - slopes[h] * (i - j)
        keep = j <= i
        if bands[h] is not None:
            keep = keep & (i - j <= bands[h])
        probs = torch.softmax(scores.masked_fill(~keep, -math.inf), dim=-1)
        outs.append(probs @ v[:, h])
    return torch.stack(outs, dim=2).reshape(q.shape[0], length, heads * d)


def poslsh_layer0(model, ids):
    captured = []
    handle = model.transformer.h[0].self_attention.dense.register_forward_pre_hook(
        lambda module, args: captured.append(args[0].detach()))
    with torch.no_grad():
        model(ids)
    handle.remove()
    return captured[0]


def test_planner_runs_each_heads_planned_method():
    length, target = 48, 1e-2
    model = pt.use_poslsh(make_model("bloom", torch.float64), method="plan", error=target)
    ids, _ = batch([length], length, seed=8)
    sigmas = [1.0 / m for m in press_slopes(6)]
    plans = poslsh.plan_heads(length, sigmas, target, head_dim=16, lsh_samplers=["independent"])
    methods = {p.method for p in plans}
    assert methods == {"exact_tiled", "exact_banded"}  # this length mixes both
    bands = [p.band if p.method == "exact_banded" else None for p in plans]
    expected = dense_layer0(model, ids, bands)
    assert relative_error(poslsh_layer0(model, ids), expected) <= 1e-12


def test_per_head_methods():
    band_error = 1e-2
    method = ["exact", "banded", "exact", "banded", "banded", "exact"]
    model = pt.use_poslsh(make_model("bloom", torch.float64), method=method, band_error=band_error)
    ids, _ = batch([40], 40, seed=9)
    bands = []
    for h, m in enumerate(press_slopes(6)):
        band = math.ceil(math.log(1.0 / band_error) / m)  # |i - j| / sigma > ln(1/eps) is dropped
        assert band == poslsh.band_for_bias_error(1.0 / m, band_error)
        bands.append(band if method[h] == "banded" else None)
    assert relative_error(poslsh_layer0(model, ids), dense_layer0(model, ids, bands)) <= 1e-12


def test_lsh_decode_equals_rows_of_the_prefill():
    # The LSH hashes depend on positions only: prefill + cached decoding gives the logits of one
    # prefill of the whole sequence.
    model = pt.use_poslsh(make_model("bloom"), method="lsh", samples=8)
    ids, _ = batch([20], 20, seed=10)
    with torch.no_grad():
        whole = model(ids).logits
        out = model(ids[:, :14], use_cache=True)
        steps = [out.logits]
        cache = out.cache
        for t in range(14, 20):
            out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
    assert relative_error(torch.cat(steps, dim=1), whole) <= 1e-5
    model.train()
    loss, grads = loss_and_gradients(model, *batch([20, 12], 20, seed=11, side="right"))
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads.values())


def test_grouped_query_falcon():
    for options in (dict(multi_query=True), dict(new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True)):
        reference = make_model("falcon", **options)
        model = pt.use_poslsh(make_model("falcon", **options), method=["exact", "banded", "exact", "exact"],
                              band_error=1e-30)  # a band wider than the sequence: exact
        ids, mask = batch([30, 17], 30, seed=12)
        with torch.no_grad():
            expected = reference(ids, attention_mask=mask).logits
            got = model(ids, attention_mask=mask).logits
        assert relative_error(got, expected, mask.bool()) <= 1e-5


# Saving, loading and restoring. ---------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_and_restore(kind, tmp_path):
    reference, model = pair(kind)
    ids, mask = batch([20, 12], 20, seed=13)
    with torch.no_grad():
        eager = reference(ids, attention_mask=mask).logits
        before = model(ids, attention_mask=mask).logits
    state = model.state_dict()
    assert state.keys() == reference.state_dict().keys()
    model.save_pretrained(tmp_path)
    with torch.no_grad():  # saving leaves poslsh attention on
        assert torch.equal(model(ids, attention_mask=mask).logits, before)
    loaded = type(reference).from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert not pt.is_poslsh(loaded)
    with torch.no_grad():  # from_pretrained gives transformers' attention...
        assert torch.equal(loaded(ids, attention_mask=mask).logits, eager)
        pt.use_poslsh(loaded)  # ...until use_poslsh is applied again
        assert torch.equal(loaded(ids, attention_mask=mask).logits, before)
        pt.restore(model)
        assert not pt.is_poslsh(model)
        assert model.config._attn_implementation == "eager"
        assert torch.equal(model(ids, attention_mask=mask).logits, eager)
    alone = type(reference).from_pretrained(tmp_path, attn_implementation=pt.IMPLEMENTATION).eval()
    with pytest.raises(ValueError, match="use_poslsh"):
        alone(ids, attention_mask=mask)
    copied = copy.deepcopy(loaded)
    with pytest.raises(ValueError, match="use_poslsh"):
        copied(ids, attention_mask=mask)
    with torch.no_grad():
        assert torch.equal(pt.use_poslsh(copied)(ids, attention_mask=mask).logits, before)
        assert torch.equal(pt.restore(copied)(ids, attention_mask=mask).logits, eager)
        assert torch.equal(pt.use_poslsh(alone)(ids, attention_mask=mask).logits, before)
        assert torch.equal(pt.restore(alone)(ids, attention_mask=mask).logits, eager)


# Errors. --------------------------------------------------------------------------------------


def test_errors():
    model = make_model("bloom")
    with pytest.raises(ValueError, match="'method'"):
        pt.use_poslsh(model, method="fastest")
    with pytest.raises(ValueError, match="one per query head"):
        pt.use_poslsh(model, method=["exact"] * 5)
    with pytest.raises(ValueError, match="'error'"):
        pt.use_poslsh(model, method="plan", error=0.0)
    with pytest.raises(TypeError, match="'model'"):
        pt.use_poslsh(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="alibi=False"):
        pt.use_poslsh(make_model("falcon", alibi=False))
    mpt = pt.use_poslsh(make_model("mpt"))
    ids, mask = batch([12], 12)
    mask[0, 5] = 0  # padding between tokens: MPT's slot positions cannot be packed
    with pytest.raises(ValueError, match="between tokens"), torch.no_grad():
        mpt(ids, attention_mask=mask)
    falcon = pt.use_poslsh(make_model("falcon"))
    positions = torch.cat([torch.arange(6), torch.arange(6)])[None]  # two packed sequences
    with pytest.raises(ValueError, match="packed"), torch.no_grad():
        falcon(ids, position_ids=positions, use_cache=False)  # transformers packs without a cache
    bloom = pt.use_poslsh(make_model("bloom"))
    bloom.transformer.h[0].self_attention.attention_dropout.p = 0.1
    bloom.train()
    with pytest.raises(ValueError, match="dropout"):
        bloom(ids)

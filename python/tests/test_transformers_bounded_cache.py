"""poslsh.transformers.BoundedCache: transformers' generate() of BLOOM, MPT and Falcon-ALiBi
under poslsh attention with a cache that keeps only the keys the heads can still read, against
the same model on transformers' DynamicCache (every key): the same ids, bitwise the same logits
at every step, and the bytes held equal to the retention rule's count written out here from the
bands, the plan and the hashes (small random models)."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="poslsh.transformers needs transformers")

import poslsh  # noqa: E402
import poslsh.transformers as pt  # noqa: E402
from test_transformers import batch, make_model, one_torch_thread  # noqa: E402,F401

PAGE = 64
PROMPT, NEW = 400, 64
MAX_LENGTH = PROMPT + NEW
BAND_ERROR = 1e-2
SAMPLES = 4


def generate(model, ids, mask, cache=None, new=NEW, **settings):
    """Greedy generate() of `new` tokens, with the logits of every step."""
    options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, use_cache=True,
                   output_logits=True, return_dict_in_generate=True)
    options.update(settings)
    if cache is not None:
        options["cache"] = cache
    return model.generate(ids, attention_mask=mask, **options)


def assert_same_run(bounded, full):
    assert torch.equal(bounded.sequences, full.sequences)
    assert len(bounded.logits) == len(full.logits)
    for step, (got, want) in enumerate(zip(bounded.logits, full.logits)):
        assert torch.equal(got, want), step


def dynamic_cache_bytes(cache):
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def sigmas_of(model):
    return [1.0 / float(m) for m in pt.model_slopes(model).tolist()]


def head_dim_of(model):
    config = model.config
    heads = {"bloom": "n_head", "mpt": "n_heads", "falcon": "num_attention_heads"}[config.model_type]
    return config.hidden_size // getattr(config, heads)


def lsh_first_live_key(sigma, stream, t):
    """The first key an LSH head (hashes rbf_hashes(sigma, SAMPLES, seed 0, stream)) can still
    read from queries at positions >= t, by a scan of the bins: the smallest position sharing,
    in some sample, the bin of t (bins are intervals, so that block reaches t)."""
    hashes = poslsh.sample_hashes(sigma, SAMPLES, 0, stream)
    positions = np.arange(t + 1, dtype=np.float64)
    first = t
    for width, offset in zip(hashes.widths, hashes.offsets):
        bins = np.floor((positions - offset) / width)
        first = min(first, int(np.nonzero(bins == bins[t])[0][0]))
    return first


def predicted_bytes(model, method, lengths, dtype_size, layers):
    """Bytes the retention rule keeps after generation (the last append a single token, so the
    frontier t is L - 1): per layer, batch row of L tokens and head h (one K/V head per query
    head), the pages from the one holding the first live key f_h to the last written one,
    ceil(L / P) - floor(f_h / P); an exact head without a window keeps its L rows."""
    sigmas = sigmas_of(model)
    d = head_dim_of(model)
    if method == "plan":
        plans = poslsh.plan_heads(MAX_LENGTH, sigmas, 1e-2, head_dim=d, lsh_samplers=["independent"])
        assert {p.method for p in plans} == {"exact_tiled", "exact_banded"}, "this test's plan"
        reach = [None if p.method == "exact_tiled" else p.band for p in plans]
    elif method == "banded":
        reach = [poslsh.band_for_bias_error(s, BAND_ERROR) for s in sigmas]
    total = 0
    for length in lengths:
        t = length - 1
        for h, sigma in enumerate(sigmas):
            if method == "lsh":
                first = lsh_first_live_key(sigma, h, t)
            elif method == "exact" or reach[h] is None:
                total += length * 2 * d * dtype_size
                continue
            else:
                first = max(0, t - reach[h])
            total += (-(-length // PAGE) - first // PAGE) * PAGE * 2 * d * dtype_size
    return layers * total


@pytest.mark.parametrize("kind", ["bloom", "mpt", "falcon"])
@pytest.mark.parametrize("method", ["banded", "lsh", "plan"])
def test_generate_is_bitwise_the_full_cache_run(kind, method):
    options = {"banded": dict(band_error=BAND_ERROR), "lsh": dict(samples=SAMPLES), "plan": dict(
        plan_length=MAX_LENGTH)}[method]
    model = pt.use_poslsh(make_model(kind), method=method, **options)
    ids, mask = batch([PROMPT], PROMPT, seed=21)
    full = generate(model, ids, mask)
    cache = pt.BoundedCache(model, MAX_LENGTH, page_size=PAGE)
    bounded = generate(model, ids, mask, cache)
    assert_same_run(bounded, full)
    assert bounded.cache is cache
    length = PROMPT + NEW - 1  # the last token is not fed back
    assert cache.get_seq_length() == length
    assert cache.full_cache_bytes() == dynamic_cache_bytes(full.cache)
    expected = predicted_bytes(model, method, [length], 4, len(cache.layers))
    assert cache.bytes_in_use == expected
    assert cache.bytes_in_use < 0.9 * cache.full_cache_bytes()


@pytest.mark.parametrize("kind, dtype", [("bloom", torch.float32), ("mpt", torch.bfloat16),
                                         ("falcon", torch.float32)])
def test_left_padded_batch_and_chunked_prefill(kind, dtype):
    # Rows of 3 prompt lengths (left padding), the prompt in chunks of 48: each row keeps its own
    # tokens, bitwise the DynamicCache run; its pages follow its own length.
    model = pt.use_poslsh(make_model(kind, dtype), method="banded", band_error=BAND_ERROR)
    ids, mask = batch([300, 170, 241], 300, seed=22)
    full = generate(model, ids, mask, prefill_chunk_size=48)
    cache = pt.BoundedCache(model, 300 + NEW, page_size=PAGE)
    bounded = generate(model, ids, mask, cache, prefill_chunk_size=48)
    assert_same_run(bounded, full)
    lengths = [n + NEW - 1 for n in (300, 170, 241)]
    size = torch.empty((), dtype=dtype).element_size()
    assert cache.bytes_in_use == predicted_bytes(model, "banded", lengths, size, len(cache.layers))
    assert cache.full_cache_bytes() == dynamic_cache_bytes(full.cache)


@pytest.mark.parametrize("kind", ["bloom", "falcon"])
def test_padding_between_tokens(kind):
    # BLOOM's and Falcon's positions count the tokens before a key, padding excluded.
    model = pt.use_poslsh(make_model(kind), method="lsh", samples=SAMPLES)
    ids, mask = batch([90, 90], 90, seed=23)
    mask[0, 30:37] = 0
    mask[1, 5] = 0
    full = generate(model, ids, mask, new=16)
    bounded = generate(model, ids, mask, pt.BoundedCache(model, 90 + 16, page_size=PAGE), new=16)
    assert_same_run(bounded, full)


@pytest.mark.parametrize("options", [dict(multi_query=True),
                                     dict(new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True)])
def test_grouped_query_falcon(options):
    # A K/V head keeps the union of its query heads' keys: those of its widest band.
    ids, mask = batch([PROMPT, 300], PROMPT, seed=27)
    for method in (["banded", "lsh", "exact", "banded"], "banded"):
        model = pt.use_poslsh(make_model("falcon", **options), method=method, samples=SAMPLES,
                              band_error=BAND_ERROR)
        full = generate(model, ids, mask, new=16)
        cache = pt.BoundedCache(model, PROMPT + 16, page_size=PAGE)
        assert_same_run(generate(model, ids, mask, cache, new=16), full)
    kv_heads = 1 if options.get("multi_query") else options["num_kv_heads"]
    bands = [poslsh.band_for_bias_error(s, BAND_ERROR) for s in sigmas_of(model)]
    group = len(bands) // kv_heads
    expected = 0
    for length in (PROMPT + 15, 300 + 15):
        for g in range(kv_heads):
            first = max(0, length - 1 - max(bands[g * group:(g + 1) * group]))
            expected += (-(-length // PAGE) - first // PAGE) * PAGE * 2 * head_dim_of(model) * 4
    assert cache.bytes_in_use == len(cache.layers) * expected < cache.full_cache_bytes()


def test_exact_heads_without_window_keep_every_key():
    # Exact heads keep their rows (the full cache's bytes); banded heads next to them drop keys.
    model = pt.use_poslsh(make_model("bloom"), method="exact")
    ids, mask = batch([PROMPT], PROMPT, seed=24)
    full = generate(model, ids, mask, new=8)
    cache = pt.BoundedCache(model, MAX_LENGTH, page_size=PAGE)
    assert_same_run(generate(model, ids, mask, cache, new=8), full)
    assert cache.bytes_in_use == cache.full_cache_bytes() == dynamic_cache_bytes(full.cache)
    method = ["exact", "banded", "exact", "banded", "banded", "exact"]
    model = pt.use_poslsh(make_model("bloom"), method=method, band_error=BAND_ERROR)
    full = generate(model, ids, mask, new=8)
    cache = pt.BoundedCache(model, MAX_LENGTH, page_size=PAGE)
    assert_same_run(generate(model, ids, mask, cache, new=8), full)
    length, d = PROMPT + 7, head_dim_of(model)
    expected = 0
    for name, sigma in zip(method, sigmas_of(model)):
        if name == "exact":
            expected += length * 2 * d * 4
        else:
            first = max(0, length - 1 - poslsh.band_for_bias_error(sigma, BAND_ERROR))
            expected += (-(-length // PAGE) - first // PAGE) * PAGE * 2 * d * 4
    assert cache.bytes_in_use == len(cache.layers) * expected


def test_bad_input_is_named():
    ids, mask = batch([30], 30, seed=25)
    with pytest.raises(TypeError, match="'model'"):
        pt.BoundedCache(torch.nn.Linear(2, 2), 64)
    with pytest.raises(ValueError, match="'model'"):
        pt.BoundedCache(make_model("bloom"), 64)  # not set up by use_poslsh
    model = pt.use_poslsh(make_model("bloom"), method="banded")
    for value in (0, 2.5, None, True):
        with pytest.raises(ValueError, match="'max_length'"):
            pt.BoundedCache(model, value)
    with pytest.raises(ValueError, match="'page_size'"):
        pt.BoundedCache(model, 64, page_size=100)
    with pytest.raises(ValueError, match="'max_length'"):  # more tokens than it was sized for
        generate(model, ids, mask, pt.BoundedCache(model, 40), new=16)
    with pytest.raises(ValueError, match="'num_beams'"):
        generate(model, ids, mask, pt.BoundedCache(model, 64), new=4, num_beams=2, output_logits=False)
    # A cache is for the model (and use_poslsh settings) it was built for.
    cache = pt.BoundedCache(model, 64)
    other = pt.use_poslsh(make_model("bloom"), method="banded")
    with pytest.raises(ValueError, match="'cache'"):
        generate(other, ids, mask, cache, new=4)
    cache = pt.BoundedCache(model, 64)
    with pytest.raises(ValueError, match="'cache'"):  # transformers' own attention would read new keys only
        generate(pt.restore(make_model("bloom")), ids, mask, cache, new=4)
    cache = pt.BoundedCache(model, 64)
    generate(model, ids, mask, cache, new=4)
    two, two_mask = batch([30, 30], 30, seed=26)
    with pytest.raises(ValueError, match="'cache'"):  # one batch per cache
        generate(model, two, two_mask, cache, new=4)
    mpt = pt.use_poslsh(make_model("mpt"), method="banded")
    holes = mask.clone()
    holes[0, 10] = 0  # MPT biases by slot: padding between tokens
    with pytest.raises(ValueError, match="'attention_mask'"):
        generate(mpt, ids, holes, pt.BoundedCache(mpt, 64), new=4)
    with pytest.raises(ValueError, match="'use_cache'"):  # MPT's default: generate() feeds every token again
        generate(mpt, ids, mask, pt.BoundedCache(mpt, 64), new=4, use_cache=None)
    with pytest.raises(ValueError, match="'cache'"), torch.enable_grad():
        model.train()
        model(ids, cache=pt.BoundedCache(model, 64), use_cache=True)
    model.eval()
    with pytest.raises(ValueError, match="'plan_length'"):
        pt.use_poslsh(make_model("bloom"), method="plan", plan_length=0)
    assert math.isfinite(float(generate(model, ids, mask, pt.BoundedCache(model, 64), new=4).logits[-1].sum()))

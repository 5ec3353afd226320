"""sample_hashes (variance-reduced samplers) and the per-head planner against numpy formulas."""

import math

import numpy as np
import pytest

import poslsh
import reference
from conftest import tolerance

HASH_SAMPLERS = ["independent", "antithetic", "stratified", "lattice_offsets", "coupled_offsets", "rqmc",
                 "stratified_lattice"]


def gamma2_cdf(x):
    """F(x) = 1 - (1 + x) e^{-x}, written as -expm1(log1p(x) - x) to keep small x accurate."""
    return -np.expm1(np.log1p(x) - x)


def circular_spread(fractions):
    """Largest distance on the unit circle between any fraction and the first one."""
    delta = np.mod(fractions - fractions[0], 1.0)
    return np.minimum(delta, 1.0 - delta).max()


def test_sampler_names_in_declaration_order():
    assert poslsh.sampler_names() == HASH_SAMPLERS + ["poisson"]


@pytest.mark.parametrize("sampler", HASH_SAMPLERS)
def test_every_sample_is_a_valid_hash_and_the_set_is_deterministic(sampler):
    hashes = poslsh.sample_hashes(9.0, 37, 5, 2, sampler)
    assert isinstance(hashes, poslsh.HashSet) and len(hashes) == 37
    assert np.all(hashes.widths > 0) and np.all(hashes.offsets >= 0)
    assert np.all(hashes.offsets < hashes.widths)
    again = poslsh.sample_hashes(9.0, 37, seed=5, stream=2, sampler=sampler)
    np.testing.assert_array_equal(again.widths, hashes.widths)
    np.testing.assert_array_equal(again.offsets, hashes.offsets)
    other = poslsh.sample_hashes(9.0, 37, 5, 3, sampler)
    assert not np.array_equal(other.widths, hashes.widths)


def test_independent_is_rbf_hashes_bit_for_bit():
    hashes = poslsh.sample_hashes(12.5, 40, 17, stream=6)
    rbf = poslsh.rbf_hashes(12.5, 40, 17, stream=6)
    np.testing.assert_array_equal(hashes.widths, rbf.widths)
    np.testing.assert_array_equal(hashes.offsets, rbf.offsets)


@pytest.mark.parametrize("s, lattice_group", [(10, 0), (16, 0), (13, 5), (7, 1)])
def test_stratified_lattice_groups(s, lattice_group):
    sigma = 3.0
    g = lattice_group if lattice_group > 0 else max(1, round(math.sqrt(s)))
    groups = math.ceil(s / g)
    sizes = [s // groups + (1 if m < s % groups else 0) for m in range(groups)]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    np.testing.assert_array_equal(poslsh.lattice_group_starts(s, lattice_group), starts)
    hashes = poslsh.sample_hashes(sigma, s, 4, 1, "stratified_lattice", lattice_group=lattice_group)
    widths, fractions = hashes.widths, hashes.offsets / hashes.widths
    for m in range(groups):
        members = np.arange(starts[m], starts[m + 1])
        np.testing.assert_array_equal(widths[members], widths[starts[m]])
        assert circular_spread(fractions[members] - (members - starts[m]) / sizes[m]) < 1e-12
    strata = np.floor(gamma2_cdf(widths[starts[:-1]] / sigma) * groups)
    np.testing.assert_array_equal(np.sort(strata), np.arange(groups))


@pytest.mark.parametrize("sampler", HASH_SAMPLERS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sampled_hashes_compose_with_the_fused_kernel(rng, sampler, dtype):
    n, d, sigma = 120, 8, 10.0
    q, k, v = (rng.uniform(-1, 1, (n, d)).astype(dtype) for _ in range(3))
    hashes = poslsh.sample_hashes(sigma, 6, 13, 2, sampler)
    out = poslsh.lsh_attention_fused(q, k, v, hashes)
    expected = reference.lsh_attention(q, k, v, hashes.widths, hashes.offsets)
    np.testing.assert_allclose(out, expected, rtol=0, atol=tolerance(dtype))
    rebuilt = poslsh.HashSet(list(hashes.widths), list(hashes.offsets))
    np.testing.assert_array_equal(poslsh.lsh_attention_fused(q, k, v, rebuilt), out)
    assert poslsh.lsh_fused_pair_count(hashes, n) == np.count_nonzero(
        reference.mean_mask(hashes.widths, hashes.offsets, n))


# The planner.

PLAN_SIGMAS = [1.5, 4.0, 16.0, 64.0]
PLAN_N = 1024
PLAN_TARGET = 0.1
DEFAULT_MODEL_SAMPLERS = ["independent", "antithetic", "stratified", "rqmc", "stratified_lattice"]


def banded_error(sigma, band, causal=True):
    """3 (1 + 1.6 / sigma^2) times the dropped row mass of the ALiBi kernel beyond the band."""
    tail = math.exp(-(band + 1) / sigma)
    share = tail if causal else 2 * tail / (1 + math.exp(-1 / sigma))
    return 3.0 * (1 + 1.6 / sigma**2) * share


def banded_pairs(n, band):
    """Causal pairs with i - j <= W."""
    return float(np.minimum(np.arange(n), band).sum() + n)


def test_plan_heads_meets_the_target_with_the_cheapest_method():
    plans = poslsh.plan_heads(PLAN_N, PLAN_SIGMAS, PLAN_TARGET)
    assert len(plans) == len(PLAN_SIGMAS)
    candidates = [poslsh.plan_single_method(PLAN_N, PLAN_SIGMAS, PLAN_TARGET, "exact_tiled"),
                  poslsh.plan_single_method(PLAN_N, PLAN_SIGMAS, PLAN_TARGET, "exact_banded")]
    candidates += [poslsh.plan_single_method(PLAN_N, PLAN_SIGMAS, PLAN_TARGET, "lsh_fused", sampler=name)
                   for name in DEFAULT_MODEL_SAMPLERS]
    assert all(len(single) == len(PLAN_SIGMAS) for single in candidates)
    for h, plan in enumerate(plans):
        assert plan.sigma == PLAN_SIGMAS[h]
        assert plan.predicted_error <= PLAN_TARGET
        cheapest = min(single[h].seconds for single in candidates)
        assert plan.seconds == cheapest
        assert plan.method in {single[h].method for single in candidates if single[h].seconds == cheapest}
    assert poslsh.plan_seconds(plans) == pytest.approx(sum(p.seconds for p in plans), rel=1e-12)
    assert len({p.method for p in plans}) >= 2  # the scenario exercises more than one method


def test_single_method_plans_match_their_formulas():
    exact, banded, lsh = (poslsh.plan_single_method(PLAN_N, PLAN_SIGMAS, PLAN_TARGET, method, sampler="rqmc")
                          for method in ["exact_tiled", "exact_banded", "lsh_fused"])
    for h, sigma in enumerate(PLAN_SIGMAS):
        assert exact[h].method == "exact_tiled" and exact[h].predicted_error == 0.0
        assert exact[h].pairs == PLAN_N * (PLAN_N + 1) / 2
        assert exact[h].band is None and exact[h].samples is None and exact[h].sampler is None
        # The smallest band whose predicted error meets the target.
        band = banded[h].band
        assert banded[h].method == "exact_banded"
        assert banded_error(sigma, band) <= PLAN_TARGET
        assert band == 0 or banded_error(sigma, band - 1) > PLAN_TARGET
        assert banded[h].predicted_error == pytest.approx(banded_error(sigma, band), rel=1e-12)
        assert banded[h].pairs == banded_pairs(PLAN_N, band)
        assert lsh[h].method == "lsh_fused" and lsh[h].sampler == "rqmc" and lsh[h].stream == h
        assert lsh[h].predicted_error <= PLAN_TARGET
        hashes = poslsh.sample_hashes(sigma, lsh[h].samples, lsh[h].seed, lsh[h].stream, "rqmc")
        np.testing.assert_array_equal(lsh[h].hashes().widths, hashes.widths)
        assert lsh[h].pairs == poslsh.lsh_fused_pair_count(hashes, PLAN_N)
    # LSH with no sampler model, and banded for a band that covers the sequence, have no plan.
    assert poslsh.plan_single_method(PLAN_N, PLAN_SIGMAS, PLAN_TARGET, "lsh_fused", lsh_samplers=[]) == []
    assert poslsh.plan_single_method(64, [1000.0], PLAN_TARGET, "exact_banded") == []


def test_lsh_pairs_counted_independently():
    n = 256
    (plan,) = poslsh.plan_single_method(n, [8.0], 0.2, "lsh_fused", sampler="stratified_lattice", seed=3)
    hashes = plan.hashes()
    assert len(hashes) == plan.samples
    assert plan.pairs == np.count_nonzero(reference.mean_mask(hashes.widths, hashes.offsets, n))


def test_lsh_samplers_restrict_the_candidates():
    plans = poslsh.plan_heads(PLAN_N, PLAN_SIGMAS, PLAN_TARGET, lsh_samplers=["antithetic"])
    assert all(p.sampler in (None, "antithetic") for p in plans)
    assert all(p.method != "lsh_fused" for p in poslsh.plan_heads(PLAN_N, PLAN_SIGMAS, PLAN_TARGET, lsh_samplers=[]))


def test_format_plan_lists_every_head_and_the_total():
    plans = poslsh.plan_heads(PLAN_N, PLAN_SIGMAS, PLAN_TARGET)
    lines = poslsh.format_plan(plans, PLAN_N).splitlines()
    assert len(lines) == len(plans) + 2
    for h, plan in enumerate(plans):
        fields = lines[1 + h].split()
        assert int(fields[0]) == h and float(fields[1]) == pytest.approx(plan.sigma, rel=1e-4)
        assert fields[2] == plan.method
        if plan.method == "lsh_fused":
            assert f"s = {plan.samples} {plan.sampler}" in lines[1 + h]
        if plan.method == "exact_banded":
            assert f"W = {plan.band}" in lines[1 + h]
        assert float(fields[-3]) == pytest.approx(plan.pairs / PLAN_N, abs=0.05)
    assert f"total predicted {1e3 * sum(p.seconds for p in plans):.2f} ms" in lines[-1]


def run_head(q, k, v, plan):
    """The single-head kernel plans[h] names."""
    if plan.method == "exact_tiled":
        return poslsh.alibi_attention_tiled(q, k, v, plan.sigma)
    if plan.method == "exact_banded":
        return poslsh.alibi_attention_banded(q, k, v, plan.sigma, plan.band)
    return poslsh.lsh_attention_fused(q, k, v, poslsh.sample_hashes(plan.sigma, plan.samples, plan.seed,
                                                                    plan.stream, plan.sampler))


PLANNED_SIGMAS = [1.2, 3.0, 20.0, 300.0]


@pytest.mark.parametrize("method", ["mixed", "exact_tiled", "exact_banded", "lsh_fused"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_planned_heads_equal_their_single_head_kernels(rng, method, dtype):
    n, kv_heads, d, target = 256, 2, 16, 0.15
    if method == "mixed":
        plans = poslsh.plan_heads(n, PLANNED_SIGMAS, target, head_dim=d)
        assert len({p.method for p in plans}) >= 2
    else:
        plans = poslsh.plan_single_method(n, PLANNED_SIGMAS[:3], target, method, sampler="antithetic",
                                          head_dim=d)
        plans += poslsh.plan_single_method(n, PLANNED_SIGMAS[:1], target, method, head_dim=d)
    heads = len(plans)
    q = rng.normal(size=(n, heads, d)).astype(dtype)
    k = rng.normal(size=(n, kv_heads, d)).astype(dtype)
    v = rng.normal(size=(n, kv_heads, d)).astype(dtype)
    out = poslsh.multihead_attention(q, k, v, plans=plans)
    assert out.shape == (n, heads, d) and out.dtype == dtype
    group = heads // kv_heads
    for h, plan in enumerate(plans):
        kh, vh = k[:, h // group], v[:, h // group]
        np.testing.assert_array_equal(out[:, h], run_head(q[:, h], kh, vh, plan))
        # Within the planned error of the dense ALiBi attention (float32 adds its rounding).
        exact = reference.alibi_attention(q[:, h], kh, vh, plan.sigma)
        error = np.linalg.norm(out[:, h] - exact) / np.linalg.norm(exact)
        assert error <= plan.predicted_error + 10 * tolerance(dtype)


def test_planned_layout_masking_scale_and_out_view(rng):
    n, heads, d = 96, 3, 8
    sigmas = [2.0, 8.0, 32.0]
    plans = poslsh.plan_heads(n, sigmas, 0.2, masking="bidirectional", head_dim=d)
    q, k, v = (rng.uniform(-1, 1, (heads, n, d)) for _ in range(3))
    parent = np.full((heads, n, d + 2), np.nan)
    out = parent[:, :, 1 : d + 1]
    returned = poslsh.multihead_attention(q, k, v, plans=plans, layout="hnd", masking="bidirectional", scale=0.5,
                                          out=out, num_threads=1)
    assert returned is out
    assert np.isnan(parent[:, :, 0]).all() and np.isnan(parent[:, :, d + 1]).all()
    for h, plan in enumerate(plans):
        if plan.method == "lsh_fused":
            hashes = plan.hashes()
            expected = reference.lsh_attention(q[h], k[h], v[h], hashes.widths, hashes.offsets, False, 0.5)
        else:
            expected = reference.alibi_attention(q[h], k[h], v[h], plan.sigma, False, 0.5, band=plan.band)
        np.testing.assert_allclose(out[h], expected, rtol=0, atol=1e-12)


def test_errors(rng):
    with pytest.raises(ValueError, match="^poslsh: sample_hashes: argument 'sampler' = sobol: must be independent, antithetic, stratified, lattice_offsets, coupled_offsets, rqmc, stratified_lattice or poisson$"):
        poslsh.sample_hashes(4.0, 8, 0, sampler="sobol")
    with pytest.raises(ValueError, match="sample_hashes: argument 'sampler'.*no BinHash form"):
        poslsh.sample_hashes(4.0, 8, 0, sampler="poisson")
    with pytest.raises(ValueError, match="sample_hashes: argument 'samples' = 0"):
        poslsh.sample_hashes(4.0, 0, 0, sampler="stratified")
    for sigma in [0.0, -2.0, math.nan, math.inf]:
        with pytest.raises(ValueError, match="sample_hashes: argument 'sigma'"):
            poslsh.sample_hashes(sigma, 8, 0, sampler="rqmc")
    with pytest.raises(ValueError, match="argument 'options.group' = 0"):
        poslsh.sample_hashes(4.0, 8, 0, sampler="lattice_offsets", group=0)
    with pytest.raises(ValueError, match="argument 'options.lattice_group' = -1"):
        poslsh.sample_hashes(4.0, 8, 0, sampler="stratified_lattice", lattice_group=-1)
    for target in [0.0, 1.0, -0.5, math.nan]:
        with pytest.raises(ValueError, match="plan_heads: argument 'target'"):
            poslsh.plan_heads(128, [4.0], target)
    with pytest.raises(ValueError, match="plan_heads: argument 'sigma'"):
        poslsh.plan_heads(128, [4.0, -1.0], 0.1)
    with pytest.raises(ValueError, match="plan_heads: argument 'sigmas'"):
        poslsh.plan_heads(128, [], 0.1)
    with pytest.raises(ValueError, match="plan_heads: argument 'n' = 0"):
        poslsh.plan_heads(0, [4.0], 0.1)
    with pytest.raises(ValueError, match="plan_heads: argument 'masking' = none: must be causal or bidirectional"):
        poslsh.plan_heads(128, [4.0], 0.1, masking="none")
    with pytest.raises(ValueError, match="plan_heads: argument 'lsh_samplers' holds 'coupled_offsets'"):
        poslsh.plan_heads(128, [4.0], 0.1, lsh_samplers=["coupled_offsets"])
    with pytest.raises(ValueError, match="plan_single_method: argument 'method' = flash: must be lsh_fused, lsh_per_sample"):
        poslsh.plan_single_method(128, [4.0], 0.1, "flash")
    for method in ["lsh_per_sample", "fixed_blocks"]:
        with pytest.raises(ValueError, match=f"plan_single_method: argument 'method' = {method}: the planner plans "
                                             "lsh_fused, exact_tiled, exact_banded$"):
            poslsh.plan_single_method(128, [4.0], 0.1, method)
    with pytest.raises(ValueError, match="plan_single_method: argument 'sampler' = sobol"):
        poslsh.plan_single_method(128, [4.0], 0.1, "lsh_fused", sampler="sobol")
    plans = poslsh.plan_heads(16, [2.0, 4.0], 0.1)
    q = rng.uniform(-1, 1, (16, 2, 8))
    with pytest.raises(ValueError, match="multihead_attention: argument 'plans' = 2"):
        poslsh.multihead_attention(q[:, :1], q[:, :1], q[:, :1], plans=plans)
    with pytest.raises(ValueError, match="multihead_attention: argument 'out' = 16x1x8"):
        poslsh.multihead_attention(q, q, q, plans=plans, out=np.zeros((16, 1, 8)))
    with pytest.raises(ValueError, match="multihead_attention: argument 'layout'"):
        poslsh.multihead_attention(q, q, q, plans=plans, layout="bnhd")
    with pytest.raises(TypeError, match="argument 'k' has dtype float32: must be float64"):
        poslsh.multihead_attention(q, q.astype(np.float32), q, plans=plans)
    with pytest.raises(ValueError, match="argument 'out' shares memory with 'q'"):
        poslsh.multihead_attention(q, q.copy(), q.copy(), plans=plans, out=q)
    # A plan sets each head's method and parameters; a plan runs on float32 or float64 arrays.
    for keyword, value in [("method", "exact_tiled"), ("sigmas", [1.0, 2.0]), ("samples", 8), ("seed", 1),
                           ("band_error", 0.01)]:
        with pytest.raises(ValueError, match=f"multihead_attention: argument '{keyword}' is set together with 'plans'"):
            poslsh.multihead_attention(q, q, q, plans=plans, **{keyword: value})
    with pytest.raises(TypeError, match="argument 'q' has dtype float16: must be float32 or float64"):
        poslsh.multihead_attention(*(q.astype(np.float16),) * 3, plans=plans)

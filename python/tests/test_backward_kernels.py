"""Forwards with lse and gradients of every single-head kernel, and the mean-of-outputs
estimator, against dense numpy formulas of the weighted softmax and its backward."""

import numpy as np
import pytest

import poslsh
import reference
from conftest import masking_of, random_qkv


def weighted_forward(logits, weights, v):
    """out_i = sum_j w_ij e^{x_ij - lse_i} v_j with lse_i = log sum_j w_ij e^{x_ij}; P."""
    with np.errstate(divide="ignore"):
        x = logits + np.log(weights)
    top = x.max(axis=1, keepdims=True)
    e = np.exp(x - top)
    lse = (top + np.log(e.sum(axis=1, keepdims=True)))[:, 0]
    p = np.exp(x - lse[:, None])
    return p @ v, lse, p


def weighted_backward(p, q, k, v, out, dout, tau):
    """dV = P^T dO, dS = P o (dO V^T - D), D_i = dO_i . O_i, dQ = tau dS K, dK = tau dS^T Q."""
    delta = (dout * out).sum(axis=1, keepdims=True)
    ds = p * (dout @ v.T - delta)
    return tau * ds @ k, tau * ds.T @ q, p.T @ dout


def dense_case(kind, q, k, v, causal, sigma=None, band=None, hashes=None):
    """(logits, weights) of a kernel: exact ALiBi bias with weight 1 (banded: 0 past the band),
    or plain scores with the count weights c_ij of the hashes."""
    n, d = q.shape
    tau = 1.0 / np.sqrt(d)
    scores = tau * (q @ k.T)
    keep = reference.visible(n, causal).astype(np.float64)
    if kind in ("tiled", "banded"):
        distance = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
        weights = keep if band is None else keep * (distance <= band)
        return scores - distance / sigma, weights
    # The count weights c_ij = s M~_ij (the lse of the LSH kernels is log sum_j c_ij e^{x_ij}).
    return scores, len(hashes.widths) * reference.mean_mask(hashes.widths, hashes.offsets, n, causal)


CASES = ["banded", "per_sample", "fixed_blocks"]


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_forward_lse_and_gradients_equal_the_dense_formulas(rng, kind, causal):
    n, d, sigma, band = 70, 6, 5.0, 9
    q, k, v = (x.astype(np.float64) for x in random_qkv(rng, n, d, np.float64, d_v=5))
    dout = rng.uniform(-1.0, 1.0, (n, 5))
    if kind == "banded":
        out, lse = poslsh.alibi_attention_banded_with_lse(q, k, v, sigma, band, masking=masking_of(causal))
        grads = poslsh.alibi_attention_banded_backward(q, k, v, sigma, band, out, lse, dout, masking=masking_of(causal))
        logits, weights = dense_case("banded", q, k, v, causal, sigma=sigma, band=band)
    elif kind == "per_sample":
        hashes = poslsh.rbf_hashes(sigma, 4, seed=3)
        out, lse = poslsh.lsh_attention_per_sample_with_lse(q, k, v, hashes, masking=masking_of(causal))
        grads = poslsh.lsh_attention_per_sample_backward(q, k, v, hashes, out, lse, dout, masking=masking_of(causal))
        logits, weights = dense_case("lsh", q, k, v, causal, hashes=hashes)
    else:
        hashes = poslsh.HashSet([2.0 * sigma], [0.0])
        out, lse = poslsh.fixed_blocks_attention_with_lse(q, k, v, sigma, masking=masking_of(causal))
        grads = poslsh.fixed_blocks_attention_backward(q, k, v, sigma, out, lse, dout, masking=masking_of(causal))
        logits, weights = dense_case("lsh", q, k, v, causal, hashes=hashes)
    want_out, want_lse, p = weighted_forward(logits, weights, v)
    np.testing.assert_allclose(out, want_out, atol=1e-12, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12, rtol=0)
    for got, want in zip(grads, weighted_backward(p, q, k, v, want_out, dout, 1.0 / np.sqrt(d))):
        np.testing.assert_allclose(got, want, atol=1e-11, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_mean_of_outputs_forward_and_backward(rng, causal):
    n, d, sigma, s = 60, 4, 4.0, 3
    q, k, v = random_qkv(rng, n, d, np.float64, d_v=3)
    dout = rng.uniform(-1.0, 1.0, (n, 3))
    hashes = poslsh.rbf_hashes(sigma, s, seed=8)
    tau = 1.0 / np.sqrt(d)
    b = reference.bins(hashes.widths, hashes.offsets, n)
    want_out = np.zeros((n, 3))
    want = [np.zeros((n, d)), np.zeros((n, d)), np.zeros((n, 3))]
    for sample in range(s):
        weights = (b[sample][:, None] == b[sample][None, :]) & reference.visible(n, causal)
        out_k, _, p = weighted_forward(tau * (q @ k.T), weights.astype(np.float64), v)
        want_out += out_k / s
        for total, part in zip(want, weighted_backward(p, q, k, v, out_k, dout / s, tau)):
            total += part
    out = poslsh.lsh_attention_mean_of_outputs(q, k, v, hashes, masking=masking_of(causal))
    np.testing.assert_allclose(out, want_out, atol=1e-12, rtol=0)
    grads = poslsh.lsh_attention_mean_of_outputs_backward(q, k, v, hashes, dout, masking=masking_of(causal))
    for got, expected in zip(grads, want):
        np.testing.assert_allclose(got, expected, atol=1e-11, rtol=0)


def test_new_backward_bindings_reject_bad_shapes(rng):
    q, k, v = random_qkv(rng, 10, 4, np.float64)
    hashes = poslsh.rbf_hashes(3.0, 2, seed=1)
    out, lse = poslsh.lsh_attention_per_sample_with_lse(q, k, v, hashes)
    with pytest.raises(ValueError, match="lse"):
        poslsh.lsh_attention_per_sample_backward(q, k, v, hashes, out, lse[:5], out)
    with pytest.raises(ValueError, match="sigma"):
        poslsh.alibi_attention_banded_with_lse(q, k, v, -1.0, 3)
    with pytest.raises(TypeError):
        poslsh.lsh_attention_mean_of_outputs(q.astype(np.float32), k, v, hashes)

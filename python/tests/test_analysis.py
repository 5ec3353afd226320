"""Error analysis bindings against dense numpy norms of L* - M~ and of the outputs."""

import math

import numpy as np
import pytest

import poslsh
import reference
from conftest import masking_of, random_qkv

pytestmark = pytest.mark.skipif(not poslsh.has_spectra, reason="module built without Spectra")


def psi(sigma):
    return 1 + sigma + 1 / math.tanh(0.5 / sigma)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n, method", [(100, "automatic"), (300, "lanczos")])
def test_kernel_error_metrics(causal, n, method):
    sigma, s = 6.0, 12
    hashes = poslsh.rbf_hashes(sigma, s, seed=2)
    error = reference.alibi_kernel(n, sigma, causal) - reference.mean_mask(hashes.widths, hashes.offsets, n, causal)
    spectral = np.linalg.norm(error, 2)
    kernel_norm = np.linalg.norm(reference.alibi_kernel(n, sigma, causal), 2)
    metrics = poslsh.kernel_error_metrics(hashes, n, sigma, masking=masking_of(causal), spectral_method=method)
    assert metrics.spectral_details.method == ("dense" if method == "automatic" else "lanczos")
    assert metrics.spectral_details.converged
    assert metrics.spectral == pytest.approx(spectral, rel=1e-8)
    assert metrics.max == pytest.approx(np.abs(error).max(), rel=1e-12)
    assert metrics.kernel_norm == pytest.approx(kernel_norm, rel=1e-9)
    assert metrics.relative_spectral == pytest.approx(spectral / kernel_norm, rel=1e-8)
    assert metrics.epsilon == pytest.approx(spectral, rel=1e-8)
    assert metrics.good_samples == math.ceil(sigma**2 * math.log(n) / metrics.epsilon**2)
    ratio = math.log(n) / s
    assert metrics.expectation_bound == pytest.approx(psi(sigma) * (math.sqrt(ratio) + ratio), rel=1e-12)
    eps = metrics.epsilon
    tail = n * math.exp(-s * eps**2 / (4 * psi(sigma) * (4 * psi(sigma) + eps)))
    assert metrics.tail_bound == pytest.approx(tail, rel=1e-9)
    given = poslsh.kernel_error_metrics(hashes, n, sigma, masking=masking_of(causal), epsilon=0.5)
    assert given.epsilon == 0.5 and given.good_samples == math.ceil(sigma**2 * math.log(n) / 0.25)
    relative = poslsh.kernel_error_metrics(hashes, n, sigma, masking=masking_of(causal), epsilon_definition="relative")
    assert relative.epsilon == pytest.approx(spectral / kernel_norm, rel=1e-8)


def test_spectral_and_max_error_and_kernel_norm():
    n, sigma = 150, 4.0
    hashes = poslsh.rbf_hashes(sigma, 3, seed=5)
    error = reference.alibi_kernel(n, sigma, False) - reference.mean_mask(hashes.widths, hashes.offsets, n, False)
    norm = poslsh.spectral_error(hashes, n, sigma, masking="bidirectional")
    assert norm.value == pytest.approx(np.linalg.norm(error, 2), rel=1e-9)
    value, row, col = poslsh.max_error(hashes, n, sigma, masking="bidirectional")
    assert value == pytest.approx(np.abs(error).max(), rel=1e-12)
    assert abs(error[row, col]) == pytest.approx(value, rel=1e-12)
    assert poslsh.alibi_kernel_norm(n, sigma, masking="bidirectional") == pytest.approx(
        np.linalg.norm(reference.alibi_kernel(n, sigma, False), 2), rel=1e-10)
    with pytest.raises(ValueError, match="spectral_error: argument 'spectral_method' = qr: must be automatic, dense or lanczos"):
        poslsh.spectral_error(hashes, n, sigma, spectral_method="qr")
    with pytest.raises(ValueError, match="spectral_error: argument 'options.max_restarts' = 0: must be >= 1"):
        poslsh.spectral_error(hashes, n, sigma, max_restarts=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_output_error_metrics(rng, dtype):
    exact = rng.uniform(-1, 1, (200, 6)).astype(dtype)
    approximate = (exact + 0.05 * rng.standard_normal((200, 6))).astype(dtype)
    exact[7] = 0  # left out of the row statistics
    metrics = poslsh.output_error_metrics(exact, approximate)
    t, a = exact.astype(np.float64), approximate.astype(np.float64)
    difference = t - a
    assert metrics.frobenius == pytest.approx(np.linalg.norm(difference), rel=1e-12)
    assert metrics.relative_frobenius == pytest.approx(np.linalg.norm(difference) / np.linalg.norm(t), rel=1e-12)
    nonzero = np.linalg.norm(t, axis=1) > 0
    rows = np.linalg.norm(difference, axis=1)[nonzero] / np.linalg.norm(t, axis=1)[nonzero]
    assert metrics.zero_rows == 1
    assert metrics.row_relative_median == pytest.approx(np.percentile(rows, 50), rel=1e-12)
    assert metrics.row_relative_p90 == pytest.approx(np.percentile(rows, 90), rel=1e-12)
    assert metrics.row_relative_p99 == pytest.approx(np.percentile(rows, 99), rel=1e-12)
    assert metrics.cosine == pytest.approx((t * a).sum() / np.linalg.norm(t) / np.linalg.norm(a), rel=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_paper_metrics(rng, causal):
    n, d, sigma, s = 120, 8, 5.0, 6
    q, k, v = random_qkv(rng, n, d, np.float64)
    hashes = poslsh.rbf_hashes(sigma, s, seed=31)
    exact = poslsh.alibi_attention_tiled(q, k, v, sigma, masking=masking_of(causal))
    approximate = poslsh.lsh_attention_fused(q, k, v, hashes, masking=masking_of(causal))
    metrics = poslsh.paper_metrics(q, k, v, hashes, sigma, exact, approximate, masking=masking_of(causal))
    scores = np.exp(q @ k.T / math.sqrt(d))
    error = reference.alibi_kernel(n, sigma, causal) - reference.mean_mask(hashes.widths, hashes.offsets, n, causal)
    unnormalized = (scores * error) @ v
    assert metrics.unnormalized.frobenius == pytest.approx(np.linalg.norm(unnormalized), rel=1e-10)
    assert metrics.unnormalized.max == pytest.approx(np.abs(unnormalized).max(), rel=1e-10)
    assert metrics.kernel.spectral == pytest.approx(np.linalg.norm(error, 2), rel=1e-8)
    assert metrics.output.frobenius == pytest.approx(np.linalg.norm(exact - approximate), rel=1e-12)
    skipped = poslsh.paper_metrics(q, k, v, hashes, sigma, exact, approximate, masking=masking_of(causal), dense_limit=50)
    assert skipped.unnormalized is None

"""Dense numpy formulas the bindings are checked against (independent of the C++ code).

Everything is computed in float64 with n x n matrices, so only for small n.
"""

import numpy as np


def tau_of(d, scale):
    return 1.0 / np.sqrt(d) if scale is None else scale


def softmax_rows(logits, values):
    """sum_j e^{x_ij} v_j / sum_j e^{x_ij}; -inf entries drop out."""
    logits = logits - logits.max(axis=1, keepdims=True)
    weights = np.exp(logits)
    return (weights @ values) / weights.sum(axis=1, keepdims=True)


def visible(n, causal):
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    return (j <= i) if causal else np.ones((n, n), dtype=bool)


def alibi_attention(q, k, v, sigma, causal=True, scale=None, band=None):
    """softmax(tau Q K^T - |i-j| / sigma) V, causal keeps j <= i, band keeps |i-j| <= band."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    n, d = q.shape
    distance = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    logits = tau_of(d, scale) * (q @ k.T) - distance / sigma
    keep = visible(n, causal)
    if band is not None:
        keep &= distance <= band
    return softmax_rows(np.where(keep, logits, -np.inf), v)


def bins(widths, offsets, n):
    """bin_k(i) = floor((i - offset_k) / width_k), an s x n array."""
    positions = np.arange(n, dtype=np.float64)[None, :]
    widths = np.asarray(widths, dtype=np.float64)[:, None]
    offsets = np.asarray(offsets, dtype=np.float64)[:, None]
    return np.floor((positions - offsets) / widths)


def mean_mask(widths, offsets, n, causal=True):
    """M~ = (1/s) sum_k [bin_k(i) = bin_k(j)] (causal: lower triangle)."""
    b = bins(widths, offsets, n)
    mask = (b[:, :, None] == b[:, None, :]).mean(axis=0)
    return np.where(visible(n, causal), mask, 0.0)


def alibi_kernel(n, sigma, causal=True):
    """L*_ij = exp(-|i-j| / sigma) (causal: lower triangle)."""
    distance = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    return np.where(visible(n, causal), np.exp(-distance / sigma), 0.0)


def lsh_attention(q, k, v, widths, offsets, causal=True, scale=None):
    """T~ = D~^-1 (A o M~) V = softmax(tau Q K^T + log M~) V."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    n, d = q.shape
    mask = mean_mask(widths, offsets, n, causal)
    with np.errstate(divide="ignore"):
        logits = tau_of(d, scale) * (q @ k.T) + np.log(mask)
    return softmax_rows(logits, v)


def alibi_slopes(heads):
    """Press et al.'s slopes for any number of heads."""

    def power_of_two(count):
        return [2.0 ** (-8.0 * (h + 1) / count) for h in range(count)]

    p = 1
    while 2 * p <= heads:
        p *= 2
    slopes = power_of_two(p)
    slopes += power_of_two(2 * p)[0::2][: heads - p]
    return np.array(slopes)


def block_attention_with_lse(q, k, v, widths, offsets, sample, causal=True, scale=None):
    """Plain attention inside the blocks of one sample, and its log-sum-exp per row."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    n, d = q.shape
    b = bins(widths, offsets, n)[sample]
    keep = (b[:, None] == b[None, :]) & visible(n, causal)
    logits = np.where(keep, tau_of(d, scale) * (q @ k.T), -np.inf)
    top = logits.max(axis=1, keepdims=True)
    weights = np.exp(logits - top)
    total = weights.sum(axis=1, keepdims=True)
    return (weights @ v) / total, (top + np.log(total))[:, 0]

"""poslsh.torch: autograd Functions on CPU tensors, without copies; gradcheck in double."""

import numpy as np
import pytest

import poslsh
from conftest import masking_of
import reference

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
import poslsh.torch as ptorch  # noqa: E402

def tensors(n, d, dtype, seed=0, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand((n, d), generator=generator, dtype=dtype).mul_(2).sub_(1).requires_grad_(requires_grad) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [True, False])
def test_forward_matches_dense(dtype, causal):
    n, d, sigma = 100, 8, 6.0
    q, k, v = tensors(n, d, dtype)
    hashes = poslsh.rbf_hashes(sigma, 7, seed=1)
    atol = 2e-5 if dtype == torch.float32 else 1e-11
    exact = ptorch.alibi_attention(q, k, v, sigma, masking=masking_of(causal))
    assert isinstance(exact, torch.Tensor) and exact.dtype == dtype and exact.shape == (n, d)
    np.testing.assert_allclose(exact.numpy(), reference.alibi_attention(q.numpy(), k.numpy(), v.numpy(), sigma, causal), atol=atol, rtol=0)
    lsh = ptorch.lsh_attention(q, k, v, hashes, masking=masking_of(causal), scale=0.4)
    expected = reference.lsh_attention(q.numpy(), k.numpy(), v.numpy(), hashes.widths, hashes.offsets, causal, 0.4)
    np.testing.assert_allclose(lsh.numpy(), expected, atol=atol, rtol=0)


def test_strided_tensor_views_are_not_copied():
    """Heads of an [n, H, d] tensor go in as they are: numpy() of a view shares its memory."""
    n, heads, d = 64, 3, 8
    x = torch.rand((n, 3, heads, d), dtype=torch.float64)
    q, k, v = x[:, 0, 1], x[:, 1, 1], x[:, 2, 1]
    assert q.stride() == (3 * heads * d, 1)
    assert np.shares_memory(q.detach().numpy(), x.numpy())
    out = ptorch.alibi_attention(q, k, v, 4.0)
    np.testing.assert_allclose(out.numpy(), reference.alibi_attention(q.numpy(), k.numpy(), v.numpy(), 4.0), atol=1e-12)
    with pytest.raises(ValueError, match="its last axis must be contiguous"):
        ptorch.alibi_attention(q, k, x[:, 2, :, 0], 4.0)
    with pytest.raises(TypeError, match="argument 'k' has dtype float32: must be float64 like 'q'"):
        ptorch.alibi_attention(q, k.float(), v, 4.0)
    with pytest.raises(TypeError, match="argument 'q' has dtype torch.int32: must be torch.float32, torch.float64"):
        ptorch.alibi_attention(q.int(), k, v, 4.0)
    with pytest.raises(TypeError, match="argument 'k' has dtype torch.float64: must be torch.float16 like 'q'"):
        ptorch.alibi_attention(q.half(), k, v, 4.0)


@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_alibi(causal):
    q, k, v = tensors(24, 4, torch.float64, seed=3, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: ptorch.alibi_attention(a, b, c, 5.0, masking=masking_of(causal), scale=0.8), (q, k, v), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_lsh(causal):
    q, k, v = tensors(24, 4, torch.float64, seed=4, requires_grad=True)
    hashes = poslsh.rbf_hashes(5.0, 6, seed=2)
    assert torch.autograd.gradcheck(lambda a, b, c: ptorch.lsh_attention(a, b, c, hashes, masking=masking_of(causal)), (q, k, v), eps=1e-6, atol=1e-7)


def test_gradients_match_torch_dense_autograd():
    """The kernels' gradients equal autograd through a dense torch formula of the estimator."""
    n, d, sigma = 80, 8, 6.0
    q, k, v = tensors(n, d, torch.float64, seed=5, requires_grad=True)
    hashes = poslsh.rbf_hashes(sigma, 5, seed=9)
    mask = torch.from_numpy(reference.mean_mask(hashes.widths, hashes.offsets, n, True))
    weights = torch.randn((n, d), dtype=torch.float64)
    dense = torch.softmax(q @ k.T / np.sqrt(d) + torch.log(mask), dim=1) @ v
    dense_grads = torch.autograd.grad((dense * weights).sum(), (q, k, v))
    out = ptorch.lsh_attention(q, k, v, hashes)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    for got, want in zip(grads, dense_grads):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=0)
    # Expanded incoming gradient (sum()): accepted.
    grads = torch.autograd.grad(ptorch.lsh_attention(q, k, v, hashes).sum(), (q, k, v))
    dense = torch.softmax(q @ k.T / np.sqrt(d) + torch.log(mask), dim=1) @ v
    dense_grads = torch.autograd.grad(dense.sum(), (q, k, v))
    for got, want in zip(grads, dense_grads):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=0)


@pytest.mark.parametrize("method", ["lsh_fused", "exact_tiled", "lsh_per_sample"])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_multihead_gradcheck_grouped_query(method, layout):
    n, heads, kv_heads, d = 16, 4, 2, 3
    generator = torch.Generator().manual_seed(6)

    def tensor(h):
        shape = (n, h, d) if layout == "nhd" else (h, n, d)
        return torch.rand(shape, generator=generator, dtype=torch.float64).mul_(2).sub_(1).requires_grad_(True)

    q, k, v = tensor(heads), tensor(kv_heads), tensor(kv_heads)
    function = lambda a, b, c: ptorch.multihead_attention(a, b, c, layout=layout, method=method, samples=3, seed=1,
                                                         sigmas=[2.0, 3.0, 4.0, 6.0])
    assert torch.autograd.gradcheck(function, (q, k, v), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", ["lsh_fused", "exact_tiled"])
def test_multihead_gradcheck_packed_batch(method):
    """cu_seqlens: a packed batch of three sequences (one empty), differentiable like one."""
    cu = torch.tensor([0, 7, 7, 16], dtype=torch.int32)
    generator = torch.Generator().manual_seed(8)

    def tensor(h):
        return torch.rand((16, h, 3), generator=generator, dtype=torch.float64).mul_(2).sub_(1).requires_grad_(True)

    q, k, v = tensor(4), tensor(2), tensor(2)
    function = lambda a, b, c: ptorch.multihead_attention(a, b, c, method=method, samples=3, seed=1,
                                                         sigmas=[2.0, 3.0, 4.0, 6.0], cu_seqlens=cu)
    assert torch.autograd.gradcheck(function, (q, k, v), eps=1e-6, atol=1e-7)
    # The first sequence alone gives the same output rows.
    alone = ptorch.multihead_attention(q[:7], k[:7], v[:7], method=method, samples=3, seed=1,
                                       sigmas=[2.0, 3.0, 4.0, 6.0])
    assert torch.equal(function(q, k, v)[:7], alone)


def test_multihead_gradients_match_torch_dense_autograd():
    """Grouped-query exact ALiBi: the kernels' gradients equal autograd through a dense torch
    formula with K/V heads repeated over their query heads."""
    n, heads, kv_heads, d = 60, 4, 2, 8
    generator = torch.Generator().manual_seed(7)
    q = torch.randn((n, heads, d), generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn((n, kv_heads, d), generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weights = torch.randn((n, heads, d), generator=generator, dtype=torch.float64)
    sigmas = poslsh.alibi_sigmas(heads)
    out = ptorch.multihead_attention(q, k, v, method="exact_tiled")
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    distance = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs().double()
    causal = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
    rows = []
    for h in range(heads):
        g = h // (heads // kv_heads)
        logits = q[:, h] @ k[:, g].T / np.sqrt(d) - distance / sigmas[h]
        rows.append(torch.softmax(logits.masked_fill(~causal, -np.inf), dim=1) @ v[:, g])
    dense = torch.stack(rows, dim=1)
    torch.testing.assert_close(out, dense.detach(), atol=1e-12, rtol=0)
    dense_grads = torch.autograd.grad((dense * weights).sum(), (q, k, v), retain_graph=True)
    for got, want in zip(grads, dense_grads):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=0)
    # An expanded incoming gradient (sum()) is accepted.
    grads = torch.autograd.grad(ptorch.multihead_attention(q, k, v, method="exact_tiled").sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad(dense.sum(), (q, k, v))):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=0)


@pytest.mark.parametrize("masking", ["causal", "bidirectional"])
def test_multihead_local_window_matches_torch_dense_autograd(masking):
    """window=(left, right): exact ALiBi over keys i - left <= j <= i + right, forward and
    gradients against autograd through the dense formula."""
    n, heads, d, left, right = 40, 2, 4, 5, 3
    generator = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn((n, heads, d), generator=generator, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    sigmas = [3.0, 9.0]
    out = ptorch.multihead_attention(q, k, v, method="exact_tiled", masking=masking, sigmas=sigmas,
                                     window=(left, right))
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    keep = (j >= i - left) & (j <= i + right)
    if masking == "causal":
        keep &= j <= i
    rows = []
    for h in range(heads):
        logits = q[:, h] @ k[:, h].T / np.sqrt(d) - (i - j).abs().double() / sigmas[h]
        rows.append(torch.softmax(logits.masked_fill(~keep, -np.inf), dim=1) @ v[:, h])
    dense = torch.stack(rows, dim=1)
    torch.testing.assert_close(out, dense.detach(), atol=1e-12, rtol=0)
    upstream = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad((out * upstream).sum(), (q, k, v))
    dense_grads = torch.autograd.grad((dense * upstream).sum(), (q, k, v))
    for got, want in zip(grads, dense_grads):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=0)

"""poslsh.torch: autograd Functions on CPU tensors, without copies; gradcheck in double."""

import numpy as np
import pytest

import poslsh
import reference

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
import poslsh.torch as ptorch  # noqa: E402

needs_backward = pytest.mark.skipif(not poslsh.has_backward, reason="module built without the backward kernels")


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
    exact = ptorch.alibi_attention(q, k, v, sigma, causal=causal)
    assert isinstance(exact, torch.Tensor) and exact.dtype == dtype and exact.shape == (n, d)
    np.testing.assert_allclose(exact.numpy(), reference.alibi_attention(q.numpy(), k.numpy(), v.numpy(), sigma, causal), atol=atol, rtol=0)
    lsh = ptorch.lsh_attention(q, k, v, hashes, causal=causal, scale=0.4)
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
    with pytest.raises(TypeError, match="argument 'q' has dtype torch.float16"):
        ptorch.alibi_attention(q.half(), k, v, 4.0)


@needs_backward
@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_alibi(causal):
    q, k, v = tensors(24, 4, torch.float64, seed=3, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: ptorch.alibi_attention(a, b, c, 5.0, causal=causal, scale=0.8), (q, k, v), eps=1e-6, atol=1e-7)


@needs_backward
@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_lsh(causal):
    q, k, v = tensors(24, 4, torch.float64, seed=4, requires_grad=True)
    hashes = poslsh.rbf_hashes(5.0, 6, seed=2)
    assert torch.autograd.gradcheck(lambda a, b, c: ptorch.lsh_attention(a, b, c, hashes, causal=causal), (q, k, v), eps=1e-6, atol=1e-7)


@needs_backward
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


@pytest.mark.skipif(poslsh.has_backward, reason="module built with the backward kernels")
def test_backward_without_kernels_raises():
    q, k, v = tensors(10, 4, torch.float64, requires_grad=True)
    out = ptorch.alibi_attention(q, k, v, 4.0)
    with pytest.raises(NotImplementedError, match="no backward kernels"):
        out.sum().backward()

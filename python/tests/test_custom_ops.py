"""poslsh's torch operators as torch.library custom ops: torch.library.opcheck of every operator
(schema and mutations, autograd registration, fake tensors, AOT dispatch with dynamic shapes)
in float32 and bfloat16, with and without gradients; torch.compile(fullgraph=True) of a model
against eager, forward and backward; the two backward routes of the FlashAttention calls; the
required torch version."""

import os
import subprocess
import sys

import numpy as np
import pytest

import poslsh

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
import poslsh.torch as ptorch  # noqa: E402

OPS = torch.ops.poslsh
DTYPES = (torch.float32, torch.bfloat16)
SLOPES = (0.5, 0.25, 0.125, 0.0625)
EXTRAS = (None, True, -1, -1, "exact", 4, 3, 1e-3)  # softmax_scale .. band_error of the flash schemas


def rand(shape, seed, dtype, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=generator, dtype=torch.float32).mul_(2).sub_(1).to(dtype)
    return x.requires_grad_(requires_grad)


def registered_operators():
    """The names of every operator in the poslsh namespace."""
    return {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("poslsh::")}


def hash_tensors():
    hashes = poslsh.rbf_hashes(3.0, 4, seed=5)
    return torch.from_numpy(np.array(hashes.widths)), torch.from_numpy(np.array(hashes.offsets))


# The calls of each operator: name -> function(dtype, requires_grad) -> list of argument tuples.


def flash_cases(dtype, grad):
    q, k, v = rand((2, 3, 4, 8), 1, dtype, grad), rand((2, 5, 2, 8), 2, dtype, grad), rand((2, 5, 2, 6), 3, dtype, grad)
    slopes = torch.tensor(SLOPES, requires_grad=grad)
    lsh = EXTRAS[:4] + ("lsh",) + EXTRAS[5:]
    return [(q, k, v, slopes, *EXTRAS, True, "matrix_units"),                  # keys before the queries, lse
            (q, k[:, :3], v[:, :3], None, *lsh, False, "float_products")]       # LSH (slopes 0), no lse


def varlen_tensors(dtype, grad):
    q, k, v = rand((7, 4, 8), 4, dtype, grad), rand((10, 2, 8), 5, dtype, grad), rand((10, 2, 8), 6, dtype, grad)
    cu_q, cu_k = torch.tensor([0, 3, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 6, 10], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def varlen_cases(dtype, grad):
    q, k, v, cu_q, cu_k = varlen_tensors(dtype, grad)
    slopes = torch.rand((3, 4), generator=torch.Generator().manual_seed(7)).requires_grad_(grad)
    self_cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    return [(q, k, v, cu_q, cu_k, slopes, *EXTRAS, True, "matrix_units"),         # per-sequence slopes
            (q[:6], k[:6], v[:6], self_cu, self_cu, None, *EXTRAS, False, "matrix_units")]


def flash_backward_cases(dtype, grad):
    """The backward operator on the training forward's outputs (saved lse) and with recompute."""
    q, k, v, cu_q, cu_k = varlen_tensors(dtype, False)
    slopes = torch.tensor(SLOPES)
    forward = (q, k, v, cu_q, cu_k, slopes, *EXTRAS, False, "matrix_units")
    out, _, saved_lse = OPS.flash_attn_varlen_train(*forward)
    dout = rand(out.shape, 8, dtype)
    common = (dout, q, k, v, out)
    return [(*common, saved_lse, cu_q, cu_k, slopes, *EXTRAS, "matrix_units", False, True),
            (*common, saved_lse.new_empty((0,)), cu_q, cu_k, slopes, *EXTRAS, "matrix_units", True, False)]


def kvcache_cases(dtype, grad):
    q = rand((2, 2, 4, 8), 9, dtype)
    k_cache, v_cache = rand((2, 12, 2, 8), 10, dtype), rand((2, 12, 2, 8), 11, dtype)
    k, v = rand((2, 2, 2, 8), 12, dtype), rand((2, 2, 2, 8), 13, dtype)
    lengths = torch.tensor([3, 7], dtype=torch.int32)
    slopes = torch.tensor(SLOPES)
    pages_k, pages_v = rand((6, 4, 2, 8), 14, dtype), rand((6, 4, 2, 8), 15, dtype)
    table = torch.tensor([[5, 0, 2], [1, 4, 3]], dtype=torch.int32)
    return [(q, k_cache, v_cache, k, v, lengths, None, None, slopes, *EXTRAS, True, "matrix_units"),
            (q, pages_k, pages_v, k, v, lengths, None, table, slopes, *EXTRAS, False, "matrix_units"),
            (q[:, :1], k_cache, v_cache, None, None, lengths, torch.tensor([1, 0], dtype=torch.int32), None, None,
             *EXTRAS[:4], "lsh", *EXTRAS[5:], True, "matrix_units")]


def single_head_cases(name, dtype, grad):
    q, k, v = rand((9, 8), 16, dtype, grad), rand((9, 8), 17, dtype, grad), rand((9, 6), 18, dtype, grad)
    parameter = (3.0,) if name == "alibi_attention" else hash_tensors()
    return [(q, k, v, *parameter, "causal", None, "matrix_units"),
            (q, k, v, *parameter, "bidirectional", 0.3, "float_products")]


def single_head_backward_cases(name, dtype, grad):
    cases = []
    for q, k, v, *options in single_head_cases(name, dtype, False):
        out, lse = getattr(OPS, name)(q, k, v, *options)
        cases.append((rand(out.shape, 19, dtype), q, k, v, out, lse, *options))
    return cases


MULTIHEAD_OPTIONS = ("nhd", "lsh_fused", "causal", None, [2.0, 3.0, 4.0, 5.0], 4, 7, 1e-3)


def multihead_cases(dtype, grad):
    q, k, v = rand((10, 4, 8), 20, dtype, grad), rand((10, 2, 8), 21, dtype, grad), rand((10, 2, 8), 22, dtype, grad)
    exact = ("hnd", "exact_tiled", "bidirectional", 0.25, None, 16, 0, 1e-3)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    return [(q, k, v, *MULTIHEAD_OPTIONS, [-1, -1], None, "matrix_units"),
            (q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), *exact, [3, 1], None, "matrix_units"),
            (q, k, v, "nhd", "exact_tiled", "causal", None, None, 16, 0, 1e-3, [-1, -1], cu, "float_products")]


def multihead_backward_cases(dtype, grad):
    cases = []
    for q, k, v, *options in multihead_cases(dtype, False):
        out, lse = OPS.multihead_attention(q, k, v, *options)
        cases.append((rand(out.shape, 23, dtype), q, k, v, out, lse, *options))
    return cases


def forward_only_cases(name, dtype, grad):
    q, k, v = rand((5, 8), 24, dtype), rand((9, 8), 25, dtype), rand((9, 6), 26, dtype)
    if name == "multihead_attention_forward":
        q, k, v = rand((5, 4, 8), 27, dtype), rand((9, 2, 8), 28, dtype), rand((9, 2, 8), 29, dtype)
        return [(q, k, v, *MULTIHEAD_OPTIONS, 4, "matrix_units", q.new_empty((5, 4, 8))),
                (q, k, v, "nhd", "exact_tiled", "causal", None, None, 16, 0, 1e-3, 4, "matrix_units",
                 torch.empty((5, 4, 8), dtype=torch.float32))]
    parameter = (3.0,) if name == "alibi_attention_forward" else hash_tensors()
    strided = q.new_empty((5, 3, 6))[:, 1]  # written in place with a row stride
    return [(q, k, v, *parameter, "causal", None, 4, "matrix_units", strided),
            (q, k, v, *parameter, "causal", 0.3, 4, "float_products", torch.empty((5, 6), dtype=torch.float32))]


CASES = {
    "flash_attn": flash_cases,
    "flash_attn_train": flash_cases,
    "flash_attn_varlen": varlen_cases,
    "flash_attn_varlen_train": varlen_cases,
    "flash_attn_varlen_backward": flash_backward_cases,
    "flash_attn_with_kvcache": kvcache_cases,
    "alibi_attention": lambda dtype, grad: single_head_cases("alibi_attention", dtype, grad),
    "lsh_attention": lambda dtype, grad: single_head_cases("lsh_attention", dtype, grad),
    "alibi_attention_backward": lambda dtype, grad: single_head_backward_cases("alibi_attention", dtype, grad),
    "lsh_attention_backward": lambda dtype, grad: single_head_backward_cases("lsh_attention", dtype, grad),
    "multihead_attention": multihead_cases,
    "multihead_attention_backward": multihead_backward_cases,
    "alibi_attention_forward": lambda dtype, grad: forward_only_cases("alibi_attention_forward", dtype, grad),
    "lsh_attention_forward": lambda dtype, grad: forward_only_cases("lsh_attention_forward", dtype, grad),
    "multihead_attention_forward": lambda dtype, grad: forward_only_cases("multihead_attention_forward", dtype,
                                                                          grad),
}
# The operators with gradients (register_autograd); the others are backward or forward-only
# operators, or write their arguments (flash_attn_with_kvcache, the *_forward calls).
DIFFERENTIABLE = ("flash_attn", "flash_attn_train", "flash_attn_varlen", "flash_attn_varlen_train",
                  "alibi_attention", "lsh_attention", "multihead_attention")


def test_every_operator_has_cases():
    assert registered_operators() == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck(name, dtype):
    for grad in (False, True) if name in DIFFERENTIABLE else (False,):
        for arguments in CASES[name](dtype, grad):
            torch.library.opcheck(getattr(OPS, name).default, arguments)


def test_mutating_operators_declare_their_arguments():
    def written(name):
        schema = getattr(OPS, name).default._schema
        return {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}

    assert written("flash_attn_with_kvcache") == {"k_cache", "v_cache"}
    for name in ("alibi_attention_forward", "lsh_attention_forward", "multihead_attention_forward"):
        assert written(name) == {"out"}
    for name in set(CASES) - {"flash_attn_with_kvcache", "alibi_attention_forward", "lsh_attention_forward",
                              "multihead_attention_forward"}:
        assert written(name) == set()


def test_flash_backward_routes_agree():
    """The backward from the training forward's saved lse and the one that runs the training
    forward again (a call recorded without gradients) give the same gradients, bitwise, with
    queries after the first key (rows placed at their key positions) and with slopes."""
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, cu_q, cu_k = varlen_tensors(dtype, False)
        slopes = torch.tensor(SLOPES)
        forward = (q, k, v, cu_q, cu_k, slopes, *EXTRAS, False, "matrix_units")
        out, _, saved_lse = OPS.flash_attn_varlen_train(*forward)
        assert torch.equal(out, OPS.flash_attn_varlen(*forward)[0])
        dout = rand(out.shape, 30, dtype)
        tail = (cu_q, cu_k, slopes, *EXTRAS, "matrix_units")
        saved = OPS.flash_attn_varlen_backward(dout, q, k, v, out, saved_lse, *tail, False, True)
        again = OPS.flash_attn_varlen_backward(dout, q, k, v, out, saved_lse[:0], *tail, True, True)
        for a, b in zip(saved, again):
            assert torch.equal(a, b)
        assert saved[3].shape == slopes.shape and bool(saved[3].abs().sum() > 0)


# torch.compile. -------------------------------------------------------------------------------


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [ptorch.AlibiSelfAttention(32, 4, 2, trainable_slopes=True), ptorch.AlibiSelfAttention(32, 4, 4)])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def forward_backward(model, x, weight):
    x = x.clone().requires_grad_()
    out = model(x)
    (out * weight).sum().backward()
    gradients = [x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.detach(), gradients


def test_compile_fullgraph_matches_eager():
    """Two AlibiSelfAttention layers (flash_attn_func with trainable slopes: flash_attn_train and
    flash_attn_varlen_backward) under torch.compile(fullgraph=True, backend="inductor"): one graph,
    output and every gradient (x, projections, slopes) equal to eager within 1e-6 relative. The
    attention operators run the same kernels on the same tensors, and on this machine the result
    is bitwise eager's; the tolerance leaves inductor free to order the projections' and the
    residual's elementwise work (its generated C++) differently on another CPU."""
    torch.manual_seed(0)
    model = TwoLayers()
    x, weight = rand((2, 12, 32), 40, torch.float32), rand((2, 12, 32), 41, torch.float32)
    eager_out, eager_gradients = forward_backward(model, x, weight)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    out, gradients = forward_backward(compiled, x, weight)
    torch.testing.assert_close(out, eager_out, rtol=1e-6, atol=0)
    for a, b in zip(gradients, eager_gradients):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_compile_fullgraph_single_and_multihead_bitwise():
    """alibi_attention, multihead_attention (LSH, hashes from the seed) and
    flash_attn_varlen_func under torch.compile(fullgraph=True, backend="aot_eager"): outputs and
    gradients bitwise those of eager (aot_eager runs the same operators on the same tensors)."""
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    slopes = torch.tensor(SLOPES)

    def model(q, k, v):
        single = ptorch.alibi_attention(q[:, 0], k[:, 0], v[:, 0], 3.0)
        multi = ptorch.multihead_attention(q, k, v, method="lsh_fused", sigmas=[2.0, 3.0, 4.0, 5.0], seed=11)
        varlen = ptorch.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True, alibi_slopes=slopes)
        return single.sum(-1, keepdim=True) + multi[:, :1].sum(-1) + varlen[:, 1:2].sum(-1)

    q, k, v = rand((10, 4, 8), 42, torch.float32), rand((10, 2, 8), 43, torch.float32), rand((10, 2, 8), 44,
                                                                                            torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    results = []
    for call in (model, compiled):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = call(*leaves)
        out.pow(2).sum().backward()
        results.append([out.detach()] + [x.grad for x in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)


# The required torch. --------------------------------------------------------------------------


def test_older_torch_is_refused_at_import():
    code = ("import torch; torch.__version__ = '2.12.1+cpu'\n"
            "try:\n    import poslsh.torch\nexcept ImportError as error:\n    print(error)\n")
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment,
                            timeout=120)
    assert "poslsh.torch requires torch >= 2.13, found torch 2.12.1+cpu" in result.stdout, result.stderr

"""Tests of examples/python/tiny_lm.py: the model's ALiBi attention against a dense PyTorch
formula, the deterministic corpus split, and a --quick run.

    PYTHONPATH=<build>/python /usr/bin/python3 -m pytest examples/python/test_tiny_lm.py
"""

import math
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
poslsh = pytest.importorskip("poslsh")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tiny_lm  # noqa: E402


def dense_alibi(q, k, v, slope):
    """softmax(QK^T / sqrt(d) - m |i-j|) V, causal, written out densely (one head, [n, d])."""
    n, d = q.shape
    i = torch.arange(n, dtype=q.dtype)[:, None]
    j = torch.arange(n, dtype=q.dtype)[None, :]
    scores = q @ k.T / math.sqrt(d) - slope * (i - j).abs()
    scores = torch.where(j <= i, scores, torch.full_like(scores, -math.inf))
    return torch.softmax(scores, dim=-1) @ v


class DenseReference(torch.nn.Module):
    """The same transformer as tiny_lm.TinyLM, attention computed by ``dense_alibi`` with the
    official slopes; used with TinyLM's own weights."""

    def __init__(self, model, slopes):
        super().__init__()
        self.model, self.slopes = model, slopes

    def forward(self, tokens):
        m = self.model
        x = m.embed(tokens)
        for block in m.blocks:
            batch, length, width = x.shape
            heads = block.heads
            dim = width // heads
            qkv = block.attn.qkv_proj(block.ln1(x)).view(batch, length, 3, heads, dim)
            y = torch.empty(batch, length, heads, dim, dtype=x.dtype)
            for b in range(batch):
                for h in range(heads):
                    y[b, :, h] = dense_alibi(qkv[b, :, 0, h], qkv[b, :, 1, h], qkv[b, :, 2, h],
                                             float(self.slopes[h]))
            x = x + block.attn.o_proj(y.reshape(batch, length, width))
            x = x + block.mlp(block.ln2(x))
        return m.ln(x) @ m.embed.weight.t()


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_alibi_logits_match_dense_pytorch(dtype, tolerance):
    heads = 4
    torch.manual_seed(0)
    config = tiny_lm.AttentionConfig("alibi", heads, tiny_lm.sigmas_for(heads))
    model = tiny_lm.TinyLM(config, layers=2, width=64, heads=heads).to(dtype)
    # Larger weights than the initialisation so that the attention is far from uniform.
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv_proj.weight.normal_(0.0, 0.3)
    tokens = torch.randint(0, 256, (2, 96))
    with torch.no_grad():
        got = model(tokens)
        want = DenseReference(model, poslsh.alibi_slopes(heads))(tokens)
    assert got.dtype == dtype
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= tolerance * max(1.0, scale)


def test_alibi_gradients_match_dense_pytorch():
    heads = 2
    torch.manual_seed(1)
    config = tiny_lm.AttentionConfig("alibi", heads, tiny_lm.sigmas_for(heads))
    model = tiny_lm.TinyLM(config, layers=1, width=32, heads=heads).double()
    tokens = torch.randint(0, 256, (2, 40))
    model(tokens).square().mean().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    DenseReference(model, poslsh.alibi_slopes(heads))(tokens).square().mean().backward()
    for a, p in zip(got, model.parameters()):
        assert torch.allclose(a, p.grad, rtol=1e-9, atol=1e-12)


def sharpened_model(mode, seed=2, heads=4, samples=4):
    torch.manual_seed(seed)
    config = tiny_lm.AttentionConfig(mode, heads, tiny_lm.sigmas_for(heads), samples=samples, hash_seed=7)
    model = tiny_lm.TinyLM(config, layers=2, width=32, heads=heads).double()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv_proj.weight.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("mode", ["alibi", "lsh"])
def test_generation_through_the_caches_equals_recomputation(mode):
    """Greedy generation through the KV caches (flash_attn_with_kvcache) against the full
    forward on the whole sequence at every step: the same logits and tokens. For lsh the decode
    steps draw the prefill's hashes, so they equal the rows of one longer prefill."""
    model = sharpened_model(mode)
    prompt = torch.tensor([list(b"%\nA fool and")])
    steps = 12
    got = model.generate(prompt, steps, temperature=0)
    assert got.shape == (1, prompt.shape[1] + steps) and torch.equal(got[:, :prompt.shape[1]], prompt)
    with torch.no_grad():
        caches = model.new_caches(1, got.shape[1])
        cached = model(got[:, :prompt.shape[1]], caches)[:, -1]
        for t in range(prompt.shape[1], got.shape[1]):
            full = model(got[:, :t])[:, -1]
            assert (cached - full).abs().max().item() < 1e-10
            assert got[0, t].item() == full.argmax(-1).item()
            cached = model(got[:, t:t + 1], caches)[:, -1]


def test_sampled_generation_is_seeded():
    model = sharpened_model("alibi").float()
    first = tiny_lm.generate_text(model, b"The ", 20, 0.8, seed=3)
    assert first[:4] == b"The " and len(first) == 24
    assert tiny_lm.generate_text(model, b"The ", 20, 0.8, seed=3) == first


def test_lsh_mean_models_generate_with_exact_alibi():
    """mean_of_outputs has no KV-cache call: generate_text runs an lsh_mean model with exact
    ALiBi, the same weights giving the tokens of the alibi configuration, and restores it."""
    model = sharpened_model("lsh_mean")
    config = model.config
    got = tiny_lm.generate_text(model, b"%\n", 16, 0)
    assert model.config is config
    model.config = tiny_lm.AttentionConfig("alibi", config.heads, config.sigmas)
    assert got == tiny_lm.generate_text(model, b"%\n", 16, 0)


def test_fortune_split_is_deterministic(tmp_path):
    for name, count in (("alpha", 13), ("beta", 9)):
        text = "".join(f"{name} fortune {i}\nline two\n%\n" for i in range(count))
        (tmp_path / name).write_text(text)
    (tmp_path / "alpha.dat").write_bytes(b"\x00\x01")          # index files are skipped
    os.symlink(tmp_path / "alpha", tmp_path / "alpha.u8")       # so are links
    files = tiny_lm.fortune_files(str(tmp_path))
    assert [os.path.basename(f) for f in files] == ["alpha", "beta"]
    fortunes = tiny_lm.read_fortunes(files)
    assert len(fortunes) == 22
    assert fortunes[0] == b"alpha fortune 0\nline two\n"
    assert fortunes[13] == b"beta fortune 0\nline two\n"
    first = tiny_lm.split_fortunes(fortunes)
    second = tiny_lm.split_fortunes(tiny_lm.read_fortunes(tiny_lm.fortune_files(str(tmp_path))))
    for a, b in zip(first, second):
        assert np.array_equal(a, b)
    train, val, test = (bytes(x) for x in first)
    # Global index g: 8 and 18 -> validation, 9 and 19 -> test (alpha 8, alpha 9, beta 5, beta 6).
    assert val == b"alpha fortune 8\nline two\n%\nbeta fortune 5\nline two\n%\n"
    assert test == b"alpha fortune 9\nline two\n%\nbeta fortune 6\nline two\n%\n"
    assert train.count(b"%\n") == 18
    assert len(train) + len(val) + len(test) == sum(len(f) + 2 for f in fortunes)


def test_missing_corpus_fails_clearly(tmp_path):
    with pytest.raises(SystemExit, match="fortunes"):
        tiny_lm.ensure_corpus(str(tmp_path / "nothing"), install=False)


@pytest.mark.skipif(not tiny_lm.fortune_files(), reason="the fortunes package is not installed")
def test_real_split_sizes_are_stable():
    train, val, test = tiny_lm.load_splits(install=False)
    total = len(train) + len(val) + len(test)
    assert 0.05 < len(val) / total < 0.15 and 0.05 < len(test) / total < 0.15


def test_quick_run(tmp_path):
    out = tmp_path / "quick.csv"
    env = dict(os.environ)
    done = subprocess.run([sys.executable, os.path.join(HERE, "tiny_lm.py"), "--quick", "--csv", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "the training loss fell for every mode" in done.stdout
    rows = tiny_lm.read_rows(str(out))
    assert set(tiny_lm.CSV_COLUMNS[:7]) <= set(rows[0])
    assert {r["mode"] for r in rows} == set(tiny_lm.MODES)
    for row in rows:
        assert math.isfinite(float(row["val_bpb"])) and float(row["val_bpb"]) < 8.0


def test_generate_option(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "cookies").write_text("".join(f"fortune number {i} is a short one\n%\n" for i in range(200)))
    done = subprocess.run([sys.executable, os.path.join(HERE, "tiny_lm.py"), "--mode", "alibi", "--steps", "4",
                           "--batch", "2", "--context", "64", "--eval-bytes", "128", "--eval-factors", "1",
                           "--val-every", "0", "--data-dir", str(corpus), "--no-install", "--generate", "30",
                           "--prompt", "fortune ", "--temperature", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if "generated:" in x)
    text = eval(line.split("generated: ", 1)[1])          # the printed bytes literal
    assert isinstance(text, bytes) and text.startswith(b"fortune ") and len(text) == 8 + 30

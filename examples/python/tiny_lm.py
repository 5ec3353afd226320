#!/usr/bin/env python3
"""A byte-level language model trained from scratch with poslsh attention (a miniature of the
paper's training experiment).

A small decoder-only transformer (pre-LayerNorm, no position embeddings: the positional
information comes from the attention bias alone) is trained at context 256 with AdamW on the
fortune cookie files of Debian's ``fortunes`` package. Every attention layer is a
``poslsh.torch.AlibiSelfAttention`` (fused qkv projection, causal), which calls
``flash_attn_func`` (forward and backward in C++) with the method of the mode:

  alibi     exact ALiBi, softmax(tau QK^T - |i-j|/sigma_h) V (method "exact")
  lsh       count-weighted estimator softmax(tau QK^T + log M~) V (method "lsh"), s hashes
            w ~ Gamma(2, sigma_h), xi ~ U[0, w); fresh hashes every training step and for every
            layer, head and sequence (one call per sequence) unless --fixed-hashes
  lsh_mean  mean-of-outputs estimator (1/s) sum_k softmax within the blocks of hash k
            (method "mean_of_outputs")
  fixed     plain attention inside fixed blocks of width 2 sigma_h, offset 0 (method
            "fixed_blocks")
  none      no positional bias: the exact method with slope 0

sigma_h = 1/m_h with the ALiBi slopes of Press et al. (``poslsh.alibi_sigmas``), or one sigma
for every head (``--sigma 256``, the paper's setting).

Data: every fortune file of /usr/share/games/fortunes (``.dat`` indexes and ``.u8`` links
skipped), files in name order, fortunes separated by ``%`` lines; fortune number g (counted
over all files in that order) goes to validation when g % 10 == 8, to test when g % 10 == 9,
to training otherwise. Each split is its fortunes joined as ``text + "%\\n"``, as raw bytes.
Evaluation: bits per byte on the first --eval-bytes bytes of the validation split, cut into
non-overlapping windows of the evaluation length (every position of every window counts).

  tiny_lm.py --quick                                    # <= 60 s: each mode trains, loss falls
  tiny_lm.py --full --csv runs.csv --plot-dir docs/images --table table.md
  tiny_lm.py --mode lsh --samples 10 --seeds 0 --steps 300 --csv out.csv
  tiny_lm.py --mode alibi --steps 300 --generate 200 --prompt "Q: "   # then sample text

--generate N samples N bytes after --prompt from each trained model through the layers' KV
caches (``flash_attn_with_kvcache``: the prompt in one call, then one byte per call), at
--temperature (0: greedy), with the mode's attention (lsh_mean models: exact ALiBi, the
mean-of-outputs estimator runs on whole sequences only).

Needs poslsh (built with its backward kernels) on PYTHONPATH, PyTorch and numpy; the plots need
matplotlib.
"""

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import time

OPENBLAS_DIR = "/usr/lib/x86_64-linux-gnu/openblas-pthread"


def _use_openblas():
    """Debian's PyTorch does its matrix products through libblas.so.3; when that is the reference
    BLAS (tens of times slower) and OpenBLAS (package libopenblas0-pthread) is installed, run this
    script again with OpenBLAS first on the library path (this process only)."""
    if os.environ.get("TINY_LM_BLAS_DONE") or not os.path.exists(os.path.join(OPENBLAS_DIR, "libblas.so.3")):
        return
    current = os.path.realpath("/usr/lib/x86_64-linux-gnu/libblas.so.3")
    if "openblas" in current or "mkl" in current or "blis" in current:
        return
    env = dict(os.environ, TINY_LM_BLAS_DONE="1",
               LD_LIBRARY_PATH=OPENBLAS_DIR + (":" + os.environ["LD_LIBRARY_PATH"]
                                               if os.environ.get("LD_LIBRARY_PATH") else ""))
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


if __name__ == "__main__":
    _use_openblas()
    os.environ.setdefault("OMP_NUM_THREADS", "1")   # tiny [256, d] kernels: threads cost more than they give

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import poslsh
import poslsh.torch as ptorch

FORTUNE_DIR = "/usr/share/games/fortunes"
FORTUNE_PACKAGE = "fortunes"
MODES = ("alibi", "lsh", "lsh_mean", "fixed", "none")
CSV_COLUMNS = ("mode", "s", "seed", "train_context", "eval_context", "val_bpb", "train_seconds",
               "eval_attention")


# ----------------------------------------------------------------------------------------------
# Data


def fortune_files(directory=FORTUNE_DIR):
    """The fortune text files of ``directory`` in name order (no .dat indexes, no links)."""
    if not os.path.isdir(directory):
        return []
    names = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith(".dat") or os.path.islink(path) or not os.path.isfile(path):
            continue
        names.append(path)
    return names


def ensure_corpus(directory=FORTUNE_DIR, install=True):
    """The fortune files; installs the Debian package when they are missing and we are root."""
    files = fortune_files(directory)
    if files:
        return files
    if install and directory == FORTUNE_DIR and hasattr(os, "geteuid") and os.geteuid() == 0 \
            and shutil.which("apt-get"):
        print(f"tiny_lm: {directory} missing: apt-get install {FORTUNE_PACKAGE}", file=sys.stderr)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        command = ["apt-get", "install", "-y", "--no-install-recommends", FORTUNE_PACKAGE]
        if subprocess.run(command, env=env).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env)
            subprocess.run(command, env=env)
        files = fortune_files(directory)
        if files:
            return files
    raise SystemExit(
        f"tiny_lm: no fortune files in {directory}. Install the Debian package "
        f"'{FORTUNE_PACKAGE}' (as root: apt-get install {FORTUNE_PACKAGE}) or pass --data-dir.")


def read_fortunes(files):
    """All fortunes (bytes, each ending in a newline) of ``files`` in order."""
    fortunes = []
    for path in files:
        with open(path, "rb") as handle:
            current = []
            for line in handle:
                if line.rstrip(b"\r\n") == b"%":
                    if current:
                        fortunes.append(b"".join(current))
                    current = []
                else:
                    current.append(line)
            if current and b"".join(current).strip():
                text = b"".join(current)
                fortunes.append(text if text.endswith(b"\n") else text + b"\n")
    return fortunes


def split_fortunes(fortunes):
    """(train, validation, test) uint8 arrays: fortune g to validation if g % 10 == 8, to test if
    g % 10 == 9, to training otherwise; each split joined as text + '%\\n'."""
    parts = {"train": [], "val": [], "test": []}
    for index, text in enumerate(fortunes):
        key = "val" if index % 10 == 8 else "test" if index % 10 == 9 else "train"
        parts[key].append(text + b"%\n")
    return tuple(np.frombuffer(b"".join(parts[key]), dtype=np.uint8).copy()
                 for key in ("train", "val", "test"))


def load_splits(directory=FORTUNE_DIR, install=True):
    return split_fortunes(read_fortunes(ensure_corpus(directory, install)))


# ----------------------------------------------------------------------------------------------
# Attention


class AttentionConfig:
    """Which attention the model uses: the flash_attn_func method, the slopes and the LSH seeds.

    Every attention layer is a ``poslsh.torch.AlibiSelfAttention``; ``configure`` sets its
    method, samples, slopes and seed before a call. LSH hashes depend on the call's seed (head h
    draws ``rbf_hashes(sigma_h, samples, seed, stream=h)``): ``seed(layer, row)`` differs for
    every layer and every sequence of a batch, and ``set_hash_seed`` changes it every training
    step, unless ``fixed_hashes`` (one seed per layer for every sequence and step)."""

    METHODS = {"alibi": "exact", "none": "exact", "fixed": "fixed_blocks", "lsh": "lsh",
               "lsh_mean": "mean_of_outputs"}

    def __init__(self, mode, heads, sigmas, samples=10, fixed_hashes=False, hash_seed=0):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}")
        self.mode = mode
        self.method = self.METHODS[mode]
        self.heads = heads
        self.sigmas = [float(x) for x in sigmas]
        # slope_h = 1 / sigma_h; "none": slope 0 (no positional bias).
        self.slopes = torch.tensor([0.0 if mode == "none" else 1.0 / x for x in self.sigmas],
                                   dtype=torch.float32)
        self.samples = int(samples) if mode in ("lsh", "lsh_mean") else 16
        self.fixed_hashes = bool(fixed_hashes)
        self.hash_seed = int(hash_seed)      # fresh hashes: set before every step / evaluation

    @property
    def hashes_per_sequence(self):
        """Whether each sequence of a batch draws its own hashes (one attention call per row)."""
        return self.mode in ("lsh", "lsh_mean") and not self.fixed_hashes

    def set_hash_seed(self, seed):
        if not self.fixed_hashes:
            self.hash_seed = int(seed)

    def seed(self, layer, row=0):
        """The flash_attn_func seed of (layer, sequence row); with --fixed-hashes the same for
        every row and step."""
        row = 0 if self.fixed_hashes else row
        return (self.hash_seed * 64 + layer) * 65536 + row

    def configure(self, attention, layer, row=0):
        """Sets an AlibiSelfAttention's method, samples, slopes and seed for (layer, row)."""
        attention.method, attention.samples, attention.seed = self.method, self.samples, self.seed(layer, row)
        if not torch.equal(attention.alibi_slopes, self.slopes):
            with torch.no_grad():
                attention.alibi_slopes.copy_(self.slopes)


# ----------------------------------------------------------------------------------------------
# Model


class Block(nn.Module):
    """Pre-LayerNorm transformer block; attention by poslsh.torch.AlibiSelfAttention (fused qkv
    projection, no biases, causal)."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.attn = ptorch.AlibiSelfAttention(width, heads, fused_qkv=True, bias=False, causal=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, config, layer, cache=None):
        h = self.ln1(x)
        if cache is None and config.hashes_per_sequence:
            rows = []
            for row in range(h.shape[0]):          # each sequence its own LSH hashes
                config.configure(self.attn, layer, row)
                rows.append(self.attn(h[row:row + 1]))
            y = torch.cat(rows)
        else:
            config.configure(self.attn, layer)
            y = self.attn(h, cache=cache)
        x = x + y
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Byte-level decoder-only transformer without position embeddings."""

    def __init__(self, config, layers=2, width=128, heads=4):
        super().__init__()
        if width % heads:
            raise ValueError("width must be a multiple of heads")
        self.config = config
        self.embed = nn.Embedding(256, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens, caches=None):
        """Logits (batch, seqlen, 256) of byte tokens (batch, seqlen). caches: one
        poslsh.torch.KVCache per layer (new_caches); the tokens then continue the cached ones."""
        x = self.embed(tokens)
        for layer, block in enumerate(self.blocks):
            x = block(x, self.config, layer, None if caches is None else caches[layer])
        return self.ln(x) @ self.embed.weight.t()     # tied output embedding

    def new_caches(self, batch, max_seqlen):
        return [ptorch.KVCache.for_module(block.attn, batch, max_seqlen) for block in self.blocks]

    @torch.no_grad()
    def generate(self, prompt, steps, temperature=1.0, generator=None):
        """prompt (batch, m) byte tokens followed by `steps` sampled tokens: the prompt through the
        KV caches in one call, then one token per call (flash_attn_with_kvcache). temperature 0:
        greedy (argmax); otherwise sampled from softmax(logits / temperature)."""
        caches = self.new_caches(prompt.shape[0], prompt.shape[1] + steps)
        tokens, logits = prompt, self(prompt, caches)[:, -1]
        for step in range(steps):
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(logits.double() / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            tokens = torch.cat([tokens, nxt], dim=1)
            if step + 1 < steps:
                logits = self(nxt, caches)[:, -1]
        return tokens


def sigmas_for(heads, sigma=None):
    if sigma is not None:
        return [float(sigma)] * heads
    return [float(x) for x in poslsh.alibi_sigmas(heads)]


# ----------------------------------------------------------------------------------------------
# Training and evaluation


def evaluate_bpb(model, data, length, total_bytes, batch, hash_seed=123457):
    """Bits per byte on data[:total_bytes + 1], non-overlapping windows of ``length``."""
    windows = max(1, min(total_bytes, len(data) - 1) // length)
    model.config.set_hash_seed(hash_seed)
    nats, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, windows, batch):
            rows = range(start, min(windows, start + batch))
            x = torch.from_numpy(np.stack([data[r * length:(r + 1) * length] for r in rows])).long()
            y = torch.from_numpy(np.stack([data[r * length + 1:(r + 1) * length + 1] for r in rows])).long()
            logits = model(x)
            nats += F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="sum").item()
            count += y.numel()
    model.train()
    return nats / count / math.log(2.0)


def train_run(args, mode, samples, seed, train, val, log=print):
    """Trains one model; returns (rows for the CSV, curve dict, the model)."""
    torch.manual_seed(seed)
    sigmas = sigmas_for(args.heads, args.sigma)
    config = AttentionConfig(mode, args.heads, sigmas, samples, args.fixed_hashes, hash_seed=seed)
    model = TinyLM(config, args.layers, args.width, args.heads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    rng = np.random.default_rng(1000 + seed)       # the same batches for every mode of a seed
    context = args.context
    warmup = max(1, min(50, args.steps // 10))
    losses, val_curve = [], []
    started = time.perf_counter()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / warmup)
        if step >= warmup:
            progress = (step - warmup) / max(1, args.steps - warmup)
            lr = args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = rng.integers(0, len(train) - context - 1, size=args.batch)
        x = torch.from_numpy(np.stack([train[i:i + context] for i in starts])).long()
        y = torch.from_numpy(np.stack([train[i + 1:i + context + 1] for i in starts])).long()
        config.set_hash_seed(seed * 1_000_003 + step + 1)
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item() / math.log(2.0))
        if args.val_every and (step + 1) % args.val_every == 0 and step + 1 < args.steps:
            val_curve.append((step + 1, evaluate_bpb(model, val, context, args.curve_bytes, args.eval_batch)))
    train_seconds = time.perf_counter() - started
    rows = []
    eval_modes = [mode] + (["alibi"] if mode in ("lsh", "lsh_mean") else [])
    for eval_mode in eval_modes:
        eval_config = config if eval_mode == mode else AttentionConfig(eval_mode, args.heads, sigmas)
        model.config = eval_config
        for factor in args.eval_factors:
            length = context * factor
            bpb = evaluate_bpb(model, val, length, args.eval_bytes, max(1, args.eval_batch // factor))
            if eval_mode == mode and factor == 1:
                val_curve.append((args.steps, bpb))
            rows.append({"mode": mode, "s": samples if mode in ("lsh", "lsh_mean") else "",
                         "seed": seed, "train_context": context, "eval_context": length,
                         "val_bpb": f"{bpb:.5f}", "train_seconds": f"{train_seconds:.1f}",
                         "eval_attention": eval_mode})
            log(f"  {label(mode, samples)} seed {seed} eval {eval_mode:>8} @ {length:5d}: "
                f"{bpb:.4f} bpb")
    model.config = config
    curve = {"mode": mode, "s": samples, "seed": seed, "train_bpb": losses, "val_bpb": val_curve,
             "train_seconds": train_seconds}
    return rows, curve, model


def generate_text(model, prompt, steps, temperature, seed=0):
    """`prompt` (bytes) and `steps` bytes sampled after it by TinyLM.generate, with the model's
    attention (exact ALiBi for lsh_mean, which has no KV-cache call)."""
    config = model.config
    if config.mode == "lsh_mean":
        model.config = AttentionConfig("alibi", config.heads, config.sigmas)
    tokens = torch.tensor([list(prompt)], dtype=torch.long)
    model.eval()
    try:
        out = model.generate(tokens, steps, temperature, torch.Generator().manual_seed(seed))
    finally:
        model.config = config
        model.train()
    return bytes(out[0].tolist())


def label(mode, samples):
    return f"{mode} s={samples}" if mode in ("lsh", "lsh_mean") else mode


# ----------------------------------------------------------------------------------------------
# Report: table and plots


def read_rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def summary_table(rows):
    """Markdown table: mean ± sample std over seeds of val bpb per (mode, s, eval attention), and
    the paired difference to exact ALiBi at each length (same seed, hence same initialisation
    draw and same batches; mean ± std over seeds)."""
    groups = {}
    for row in rows:
        key = (row["mode"], row["s"], row.get("eval_attention") or row["mode"])
        per_length = groups.setdefault(key, {})
        per_length.setdefault(int(row["eval_context"]), {})[int(row["seed"])] = float(row["val_bpb"])
        per_length.setdefault("seconds", []).append(float(row["train_seconds"]))
    lengths = sorted({int(r["eval_context"]) for r in rows})
    reference = groups.get(("alibi", "", "alibi"), {})
    order = {m: i for i, m in enumerate(MODES)}
    keys = sorted(groups, key=lambda k: (order.get(k[0], 99), int(k[1] or 0), k[2] != k[0]))

    def cell(values):
        if not values:
            return ""
        spread = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
        return f"{float(np.mean(values)):.3f} ± {spread:.3f}"

    head = ("| trained with | s | evaluated with | seeds | "
            + " | ".join(f"val bpb @ {n}" for n in lengths) + " | "
            + " | ".join(f"minus alibi @ {n}" for n in lengths) + " | train s / run |")
    lines = [head, "|" + "---|" * (5 + 2 * len(lengths))]
    for key in keys:
        by_length = groups[key]
        seeds = max(len(by_length.get(n, {})) for n in lengths)
        values = [cell(list(by_length.get(n, {}).values())) for n in lengths]
        deltas = []
        for n in lengths:
            mine, base = by_length.get(n, {}), reference.get(n, {})
            paired = [mine[s] - base[s] for s in sorted(mine) if s in base]
            deltas.append("" if key == ("alibi", "", "alibi") or not paired
                          else cell(paired))
        deltas = [("+" + d if d and not d.startswith("-") else d) for d in deltas]
        seconds = np.mean(by_length["seconds"])
        eval_name = "same" if key[2] == key[0] else key[2]
        lines.append(f"| {key[0]} | {key[1] or '-'} | {eval_name} | {seeds} | " + " | ".join(values)
                     + " | " + " | ".join(deltas) + f" | {seconds:.0f} |")
    return "\n".join(lines)


def make_plots(rows, curves, directory, smooth=25):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("tiny_lm: matplotlib missing (apt-get install python3-matplotlib): no plots",
              file=sys.stderr)
        return []
    os.makedirs(directory, exist_ok=True)
    written = []
    colors = {}
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def color(name):
        return colors.setdefault(name, palette[len(colors) % len(palette)])

    # Training curves: mean over seeds of the smoothed training loss, and validation points.
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    by_label = {}
    for curve in curves:
        by_label.setdefault(label(curve["mode"], curve["s"]), []).append(curve)
    for name, group in by_label.items():
        length = min(len(c["train_bpb"]) for c in group)
        mean = np.mean([c["train_bpb"][:length] for c in group], axis=0)
        kernel = np.ones(min(smooth, length)) / min(smooth, length)
        smoothed = np.convolve(mean, kernel, mode="valid")
        steps = np.arange(len(smoothed)) + len(kernel)
        axes[0].plot(steps, smoothed, label=name, color=color(name), lw=1.2)
        points = {}
        for c in group:
            for step, value in c["val_bpb"]:
                points.setdefault(step, []).append(value)
        xs = sorted(points)
        axes[1].plot(xs, [np.mean(points[x]) for x in xs], "o-", label=name, color=color(name),
                     ms=3, lw=1.2)
    axes[0].set(xlabel="step", ylabel="training loss (bits per byte)",
                title=f"training loss (mean over seeds, {smooth}-step moving average)")
    axes[1].set(xlabel="step", ylabel="validation bits per byte",
                title="validation at the training length (mean over seeds)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    lows = [np.mean(p) for p in [[v for _, v in c["val_bpb"]] for c in curves] if p]
    if lows:
        top = max(min(c["val_bpb"][0][1] for c in curves if c["val_bpb"]) + 0.3, min(lows) + 0.5)
        axes[1].set_ylim(top=top)
    fig.tight_layout()
    path = os.path.join(directory, "tiny_lm_loss.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    # Validation bpb against the evaluation length.
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    groups = {}
    for row in rows:
        eval_mode = row.get("eval_attention") or row["mode"]
        name = label(row["mode"], row["s"])
        if eval_mode != row["mode"]:
            name += f" (eval {eval_mode})"
        groups.setdefault(name, {}).setdefault(int(row["eval_context"]), []).append(float(row["val_bpb"]))
    for name, by_length in groups.items():
        xs = sorted(by_length)
        means = [np.mean(by_length[x]) for x in xs]
        errs = [np.std(by_length[x], ddof=1) if len(by_length[x]) > 1 else 0.0 for x in xs]
        base = name.split(" (eval")[0]
        ax.errorbar(xs, means, yerr=errs, marker="o", ms=3, capsize=3, lw=1.2,
                    ls="--" if "(eval" in name else "-", color=color(base), label=name)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="evaluation length (bytes; trained at 256)", ylabel="validation bits per byte",
           title="length extrapolation (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(directory, "tiny_lm_extrapolation.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


# ----------------------------------------------------------------------------------------------
# Command line


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="each mode a few steps; fail unless the loss falls")
    p.add_argument("--full", action="store_true", help="every mode (lsh and lsh_mean at s = 10, 20), 3 seeds")
    p.add_argument("--mode", nargs="+", choices=MODES, help="modes to train (default: all)")
    p.add_argument("--samples", type=int, nargs="+", default=None, help="s for lsh and lsh_mean")
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--fixed-hashes", action="store_true", help="one hash set per (layer, head) for all steps")
    p.add_argument("--sigma", type=float, default=None, help="one sigma for every head (e.g. 256)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-bytes", type=int, default=None, help="validation bytes per evaluation")
    p.add_argument("--eval-factors", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--eval-batch", type=int, default=16)
    p.add_argument("--val-every", type=int, default=None)
    p.add_argument("--curve-bytes", type=int, default=4096)
    p.add_argument("--data-dir", default=FORTUNE_DIR)
    p.add_argument("--no-install", action="store_true", help="never apt-get install the corpus")
    p.add_argument("--csv", help="write one row per (mode, s, seed, eval length, eval attention)")
    p.add_argument("--curves", help="JSON of the loss curves (default: the CSV path + .curves.json)")
    p.add_argument("--plot-dir", help="write tiny_lm_loss.png and tiny_lm_extrapolation.png here")
    p.add_argument("--table", help="write the markdown results table here")
    p.add_argument("--report-only", action="store_true", help="table and plots from --csv/--curves, no training")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--generate", type=int, default=0, metavar="N",
                   help="after training, sample N bytes after --prompt through the KV caches")
    p.add_argument("--prompt", default="%\n", help="the bytes --generate continues (UTF-8)")
    p.add_argument("--temperature", type=float, default=0.8, help="--generate: 0 = greedy")
    args = p.parse_args(argv)
    if args.quick:
        defaults = dict(mode=list(MODES), samples=[10], seeds=[0], steps=20, eval_bytes=1024,
                        val_every=0, eval_factors=[1, 2], batch=4)
        args.eval_factors = defaults["eval_factors"] if argv.count("--eval-factors") == 0 else args.eval_factors
    elif args.full:
        defaults = dict(mode=list(MODES), samples=[10, 20], seeds=[0, 1, 2], steps=150,
                        eval_bytes=8192, val_every=30, batch=8)
    else:
        defaults = dict(mode=list(MODES), samples=[10], seeds=[0], steps=120, eval_bytes=8192,
                        val_every=30, batch=8)
    for key, value in defaults.items():
        if key in ("eval_factors",):
            continue
        if key == "batch":
            if "--batch" not in argv:
                args.batch = value
            continue
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.generate < 0 or (args.generate and not args.prompt):
        p.error("--generate needs N >= 0 and a non-empty --prompt")
    if args.curves is None and args.csv:
        args.curves = args.csv + ".curves.json"
    return args


def run_list(args):
    runs = []
    for mode in args.mode:
        for samples in (args.samples if mode in ("lsh", "lsh_mean") else [0]):
            if args.full and mode == "lsh_mean" and samples != min(args.samples):
                continue                     # the mean estimator at the smallest s only
            runs.extend((mode, samples, seed) for seed in args.seeds)
    return runs


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)

    if args.report_only:
        rows = read_rows(args.csv)
        curves = json.load(open(args.curves)) if args.curves and os.path.exists(args.curves) else []
        report(args, rows, curves)
        return 0

    train, val, test = load_splits(args.data_dir, install=not args.no_install)
    print(f"tiny_lm: corpus {args.data_dir}: train {len(train)} B, validation {len(val)} B, "
          f"test {len(test)} B; model {args.layers} layers, width {args.width}, {args.heads} heads, "
          f"sigmas {[round(s, 2) for s in sigmas_for(args.heads, args.sigma)]}; "
          f"{args.steps} steps of {args.batch} x {args.context}")
    runs = run_list(args)
    rows, curves = [], []
    done = set()
    writer_handle = None
    if args.csv:
        writer_handle = open(args.csv, "w", newline="")
        writer = csv.DictWriter(writer_handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
    failures = []
    started = time.perf_counter()
    for mode, samples, seed in runs:
        if (mode, samples, seed) in done:
            continue
        t0 = time.perf_counter()
        run_rows, curve, model = train_run(args, mode, samples, seed, train, val)
        rows.extend(run_rows)
        curves.append(curve)
        first = float(np.mean(curve["train_bpb"][:3]))
        last = float(np.mean(curve["train_bpb"][-3:]))
        print(f"{label(mode, samples):>12} seed {seed}: train loss {first:.3f} -> {last:.3f} bpb, "
              f"{curve['train_seconds']:.1f} s training, {time.perf_counter() - t0:.1f} s total",
              flush=True)
        if args.generate:
            text = generate_text(model, args.prompt.encode("utf-8"), args.generate, args.temperature, seed)
            print(f"{label(mode, samples):>12} seed {seed} generated: {text!r}", flush=True)
        if args.quick and not last < first - 0.5:
            failures.append(f"{label(mode, samples)}: training loss did not fall ({first:.3f} -> {last:.3f} bpb)")
        if writer_handle:
            for row in run_rows:
                writer.writerow(row)
            writer_handle.flush()
            with open(args.curves, "w") as handle:
                json.dump(curves, handle)
    if writer_handle:
        writer_handle.close()
    print(f"tiny_lm: {len(runs)} runs in {time.perf_counter() - started:.1f} s")
    if not args.quick or args.table or args.plot_dir:
        report(args, rows, curves)
    if failures:
        for failure in failures:
            print("FAIL " + failure, file=sys.stderr)
        return 1
    if args.quick:
        print("tiny_lm --quick: the training loss fell for every mode")
    return 0


def report(args, rows, curves):
    table = summary_table(rows)
    print(table)
    if args.table:
        with open(args.table, "w") as handle:
            handle.write(table + "\n")
    if args.plot_dir:
        for path in make_plots(rows, curves, args.plot_dir):
            print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Times one training step of ruda's models in PyTorch 2.x and prints them beside ruda's figures
(JSON lines of `ruda-bench --suite models --json`, given as the first argument) with the ratios
ruda / PyTorch (time: below 1 is ruda faster). With --attention, the figures are those of
`ruda-bench --suite attention --json`, and PyTorch's scaled_dot_product_attention is timed beside
them. Run through tools/compare-torch, which sets the
threads before import. The sharded peer (FSDP2) is tools/compare_torch_fsdp.py; it imports the
models from here.

The models are ruda's: the 784-1024-1024-10 ReLU MLP at batch 128 with AdamW; the GPT (vocabulary
256, width 256, 4 blocks, 4 heads, context 128, tied head, batch 16) with Adam; the GPT-2-small
shape (width 768, 12 blocks, 12 heads, context 1024, vocabulary 256, batch 1, f32) with Adam.
PyTorch runs at its best CPU settings: its own MKL/oneDNN kernels, SDPA (causal flash attention
on CPU), multi-tensor (foreach) optimizers, bf16 through autocast (oneDNN), and each step both
eager and with torch.compile (Inductor) on the forward and loss (AOTAutograd compiles the backward
with it; the optimizer step stays eager foreach). Where compiling fails, the error is printed and
the eager figure stands alone.
"""
import argparse
import json
import logging
import os
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F

# Inductor's C++ toolchain probe warns that this CPU-only machine has no CUDA runtime.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def median_ms(step, warmup=3, runs=15):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 10))


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)  # [B, H, T, D]
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(torch.nn.Module):
    """ruda's nn::GPT: pre-norm blocks, learned positions, erf GELU, head tied to the token embedding."""

    def __init__(self, vocab=256, context=128, d=256, layers=4, heads=4):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(context, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.ln(x) @ self.tok.weight.t()


def loss_of(model, dtype):
    """The forward and the loss (in f32, as ruda's), the part torch.compile compiles."""

    def loss(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(x)
        return F.cross_entropy(logits.float().flatten(0, -2), y.flatten())
    return loss


def make_step(model, opt, x, y, dtype, compiled):
    loss = loss_of(model, dtype)
    if compiled:
        loss = torch.compile(loss)

    def step():
        opt.zero_grad()
        loss(x, y).backward()
        opt.step()
    return step


# name, ruda's row, build(): (model, optimizer, x, y), warm-up and timed runs (ruda-bench's for
# GPT-2-small: 1 and 5), dtypes. The optimizers are
# multi-tensor (foreach): PyTorch 1.13's per-parameter loop took 28 ms of a 12 ms MLP step here.
def mlp_setup():
    m = mlp()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True), torch.rand(128, 784), torch.randint(0, 10, (128,))


def gpt_setup(context=128, d=256, layers=4, heads=4, batch=16):
    def build():
        m = GPT(256, context, d, layers, heads)
        return (m, torch.optim.Adam(m.parameters(), lr=3e-4, foreach=True), torch.randint(0, 256, (batch, context)),
                torch.randint(0, 256, (batch, context)))
    return build


CONFIGS = [
    ("mlp", "mlp step, {}", mlp_setup, (3, 15), ("f32", "bf16")),
    ("gpt", "gpt step, {}", gpt_setup(), (2, 7), ("f32", "bf16")),
    ("gpt2-small", "gpt2-small step (d768 L12 H12 T1024 b1), {}", gpt_setup(1024, 768, 12, 12, 1), (1, 5), ("f32", "bf16")),
]


def torch_figures(build, runs, dtype, compile_too):
    """{"eager": ms, "compile": ms or the reason it has none}, and the compile's first-call seconds."""
    out, compile_s = {}, None
    torch.manual_seed(0)
    warmup, runs = runs
    out["eager"] = median_ms(make_step(*build(), dtype, False), warmup=warmup, runs=runs)
    if not compile_too:
        return out, None
    torch.manual_seed(0)
    torch._dynamo.reset()  # each configuration compiles afresh (no recompile limit across them)
    try:
        step = make_step(*build(), dtype, True)
        t = time.perf_counter()
        step()  # compiles forward and backward
        compile_s = time.perf_counter() - t
        out["compile"] = median_ms(step, warmup=warmup, runs=runs)
    except Exception as e:  # noqa: BLE001 - the reason is the figure
        out["compile"] = f"torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return out, compile_s


def gemm_gflops(m, k, n, dtype):
    """PyTorch's matrix-product rate on [m, k] x [k, n] (MKL for f32, oneDNN for bf16), GFLOP/s."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    if dtype == "bf16":
        a, b = a.bfloat16(), b.bfloat16()
    return 2 * m * k * n / median_ms(lambda: a @ b, runs=20) / 1e6


def read_figures(path, take):
    """Calls take(figure) on each JSON line of ruda-bench --json output at `path`. Exits with a
    message when the file cannot be read or a line is not a figure (take raises ValueError,
    KeyError, TypeError or AttributeError on one it cannot use), naming the line."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        sys.exit(f"compare_torch.py: {path}: {e.strerror}")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            take(json.loads(line))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            sys.exit(f"compare_torch.py: {path}:{number}: not a ruda-bench --json figure ({type(e).__name__}: {e})")


def load_figures(path, configs):
    """ruda's step rows ({name: [(backend, ms)]}) and "fraction of GEMM" rows from ruda-bench's JSON
    lines. Exits with a message when the file cannot be read, holds a line that is not a figure, or
    lacks a step some chosen model and dtype needs: a table of '-' beside PyTorch's figures is no
    comparison."""
    ruda, fractions = {}, []

    def take(r):
        if r["suite"] == "models" and r["unit"] == "ms":
            ruda.setdefault(r["name"], []).append((r["backend"], float(r["median"])))
        elif r["suite"] == "models" and r["name"].endswith("fraction of GEMM"):
            if not isinstance(r["peer"], str) or not float(r["peer_median"]) > 0:
                raise ValueError("no GEMM peer")
            fractions.append(r)
    read_figures(path, take)
    missing = [row.format(dtype) for _, row, _, _, dtypes in configs for dtype in dtypes if row.format(dtype) not in ruda]
    if missing:
        sys.exit(f"compare_torch.py: {path} holds no ruda figure for: {'; '.join(missing)}"
                 + (" (it holds none of suite models: is it the output of ruda-bench --suite models --json?)"
                    if not ruda else ""))
    return ruda, fractions


ATTENTION_ROW = re.compile(r"(f32|bf16) causal fwd\+bwd B=1 H=12 D=64 T=(\d+)")


def load_attention_figures(path):
    """ruda's attention time rows from ruda-bench --suite attention --json: {(dtype, T): [(backend,
    fused ms, composed ms)]}. Exits with a message when the file cannot be read, holds a line that is
    not a figure, or holds no such row."""
    rows = {}

    def take(r):
        match = ATTENTION_ROW.fullmatch(r["name"]) if r["suite"] == "attention" and r["unit"] == "ms" else None
        if match:
            rows.setdefault((match[1], int(match[2])), []).append(
                (r["backend"], float(r["median"]), float(r["peer_median"])))
    read_figures(path, take)
    if not rows:
        sys.exit(f"compare_torch.py: {path} holds no ruda attention time row ('<dtype> causal fwd+bwd B=1 H=12 D=64"
                 " T=<T>'): is it the output of ruda-bench --suite attention --json?")
    return rows


def sdpa_ms(dtype, t, backend):
    """PyTorch's causal scaled_dot_product_attention, forward + backward into q, k and v, on the given
    SDPA kernel, at ruda-bench's shape and repeats (fewer at T = 2048, as ruda-bench)."""
    from torch.nn.attention import sdpa_kernel
    torch.manual_seed(0)
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    q, k, v = (torch.randn(1, 12, t, 64, dtype=kind, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 12, t, 64, dtype=kind)

    def step():
        q.grad = k.grad = v.grad = None
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)
    return median_ms(step, warmup=2, runs=5 if t >= 2048 else 10)


def attention_main(path):
    ruda = load_attention_figures(path)
    from torch.nn.attention import SDPBackend
    load_start = os.getloadavg()[0]
    print(f"PyTorch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads;"
          " causal attention forward + backward into q, k, v, B 1, H 12, D 64; ruda figures from ruda-bench --suite"
          " attention; medians in ms; ratio = ruda / PyTorch (time)")
    print(f"{'attention':<16} {'backend':<7} {'ruda fused':>10} {'ruda composed':>13} | {'torch flash':>11} {'fused/flash':>11}"
          f" | {'torch math':>10} {'composed/math':>13}")
    for (dtype, t), figures in sorted(ruda.items(), key=lambda item: (item[0][0] != "f32", item[0][1])):
        flash = sdpa_ms(dtype, t, SDPBackend.FLASH_ATTENTION)
        math = sdpa_ms(dtype, t, SDPBackend.MATH)
        for backend, fused, composed in figures:
            print(f"{dtype + ' T=' + str(t):<16} {backend:<7} {fused:10.2f} {composed:13.2f} | {flash:11.2f}"
                  f" {fused / flash:11.3f} | {math:10.2f} {composed / math:13.3f}")
            sys.stdout.flush()
    print("notes:")
    print("  torch flash: F.scaled_dot_product_attention(is_causal=True) held to SDPBackend.FLASH_ATTENTION, PyTorch's"
          " CPU flash-attention kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp), what it chooses for these"
          " inputs; torch math: held to SDPBackend.MATH, its composed ops (scores, mask, softmax, product), the"
          " counterpart of ruda's composed row. bf16: the tensors are bf16 (no autocast), as ruda's rows.")
    print(f"  load average (1 min) of this machine: {load_start:.1f} at the start of PyTorch's part,"
          f" {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores (others' work shifts the ratios)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("figures")
    parser.add_argument("--no-compile", action="store_true", help="eager PyTorch only")
    parser.add_argument("--only", action="append", choices=[c[0] for c in CONFIGS],
                        help="only these models (mlp, gpt, gpt2-small)")
    parser.add_argument("--attention", action="store_true",
                        help="the figures are ruda-bench --suite attention's: compare the attention with SDPA")
    args = parser.parse_args()
    if args.attention:
        if args.no_compile or args.only:
            parser.error("--attention takes no --no-compile or --only")
        attention_main(args.figures)
        return
    configs = [c for c in CONFIGS if not args.only or c[0] in args.only]
    ruda, fractions = load_figures(args.figures, configs)
    load_start = os.getloadavg()[0]
    print(f"PyTorch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads;"
          f" ruda figures from ruda-bench --suite models; step medians in ms; ratio = ruda / PyTorch (time)")
    print(f"{'step':<17} {'backend':<7} {'ruda':>8} | {'torch eager':>11} {'ratio':>6} | {'torch compile':>13} {'ratio':>6}"
          f" | {'best torch f32':>14} {'ratio':>6}")
    notes = []
    best_f32 = {}
    for name, row, build, runs, dtypes in configs:
        for dtype in dtypes:
            label = f"{name} {dtype}"
            fig, compile_s = torch_figures(build, runs, dtype, not args.no_compile)
            numbers = {k: v for k, v in fig.items() if isinstance(v, float)}
            if dtype == "f32":
                best_f32[name] = min(numbers.values())
            if isinstance(fig.get("compile"), str):
                notes.append(f"{label}: {fig['compile']}; eager only")
            elif compile_s is not None:
                notes.append(f"{label}: torch.compile's first step (compiling, or Inductor's on-disk cache of an"
                             f" earlier run) took {compile_s:.1f} s")
            for backend, ms in ruda[row.format(dtype)]:
                def cell(torch_ms, width):
                    if not isinstance(torch_ms, float):
                        return f"{'-':>{width}} {'-':>6}"
                    return f"{torch_ms:{width}.2f} {ms / torch_ms:6.3f}"
                print(f"{label:<17} {backend:<7} {ms:8.2f} | {cell(fig['eager'], 11)} | {cell(fig.get('compile'), 13)}"
                      f" | {cell(best_f32[name], 14)}")
                sys.stdout.flush()
    # The matrix-product rates behind the steps: ruda's (the "fraction of GEMM" rows' peer, same
    # ruda-bench run) beside PyTorch's on the same product, and each step's model FLOPs per second.
    # The ratio is of times, as the step table's (torch's rate over ruda's): below 1 is ruda faster.
    if fractions:
        print(f"{'GEMM behind the step':<44} {'backend':<7} {'ruda GFLOP/s':>12} {'torch GFLOP/s':>13} {'ruda/torch time':>15}"
              f" | {'ruda step GFLOP/s':>17} {'fraction':>8}")
        rates = {}
        for r in fractions:
            shape = r["peer"].removeprefix("ruda GEMM ")  # "[128, 1024] x [1024, 1024] f32"
            if shape not in rates:
                (m, k), (_, n) = (tuple(int(v) for v in side.strip(" []").split(",")) for side in shape.rsplit(" ", 1)[0].split(" x "))
                rates[shape] = gemm_gflops(m, k, n, shape.rsplit(" ", 1)[1])
            print(f"{shape:<44} {r['backend']:<7} {r['peer_median']:12.1f} {rates[shape]:13.1f}"
                  f" {rates[shape] / r['peer_median']:15.3f} | {r['median']:17.1f} {r['median'] / r['peer_median']:8.3f}")
    best = ("eager f32 only (--no-compile: nothing compiled)" if args.no_compile
            else "the faster of eager and compiled f32")
    print("notes:")
    print("  torch compile: torch.compile (Inductor, default mode) of the forward and loss, backward through"
          " AOTAutograd; optimizer foreach, eager. bf16: autocast (oneDNN bf16), loss in f32, parameters f32,"
          f" as ruda's bf16 compute. best torch f32: {best}, the baseline of ruda's"
          " targets (f32 <= 0.75x, bf16 <= 0.5x). Inductor hands the matrix products (MKL) and SDPA (flash"
          " attention) to the same ATen kernels as eager, 74% and 17% of the GPT-2-small step in a profile on a"
          " 2-core Zen machine, so compiling speeds only the rest (norms, GELU, adds, the loss) and is at best a"
          " little faster here; mode max-autotune was no faster on the MLP.")
    for n in notes:
        print("  " + n)
    print(f"  load average (1 min) of this machine: {load_start:.1f} at the start of PyTorch's part,"
          f" {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores (others' work shifts the ratios)")


if __name__ == "__main__":
    main()

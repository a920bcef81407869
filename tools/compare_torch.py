#!/usr/bin/python3
"""Times one training step of ruda-train's two models in PyTorch, and prints them beside ruda's
figures (JSON lines of `ruda-bench --suite models --json`, given as the first argument) with the
ratios ruda / PyTorch. Run through tools/compare-torch, which sets the threads before import.

The models are the same as ruda's: the 784-1024-1024-10 ReLU MLP at batch 128 with AdamW, and
the GPT (vocabulary 256, width 256, 4 blocks, 4 heads, context 128, tied head, batch 16) with Adam.
PyTorch (2.x from PyPI, build/bench-venv) runs at its best here: its own MKL/oneDNN kernels,
multi-tensor (foreach) optimizers, bf16 through autocast (oneDNN).
"""
import json
import math
import statistics
import sys
import time

import torch

torch.manual_seed(0)


def median_ms(step, warmup=3, runs=15):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def mlp_step(dtype):
    model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    # foreach: PyTorch 1.13's default per-parameter loop takes 28 ms per step here, foreach 4 ms.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = torch.rand(128, 784), torch.randint(0, 10, (128,))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
        att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class GPT(torch.nn.Module):
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


def gpt_step(dtype):
    model = GPT()
    opt = torch.optim.Adam(model.parameters(), lr=3e-4, foreach=True)
    x, y = torch.randint(0, 256, (16, 128)), torch.randint(0, 256, (16, 128))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, 256), y.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


def main():
    ruda = {}
    for line in open(sys.argv[1]):
        r = json.loads(line)
        if r["suite"] == "models":
            ruda[(r["backend"], r["name"])] = r["median"]
    print(f"PyTorch {torch.__version__}, {torch.get_num_threads()} threads; ruda figures from ruda-bench --suite models")
    # Targets: ruda f32 <= 0.75x PyTorch's (f32) step, ruda bf16 <= 0.5x it. The ratio to PyTorch's
    # own bf16 (autocast) step is printed too.
    print(f"{'step':<16} {'backend':<8} {'ruda ms':>9} {'torch ms':>9} {'ratio':>7}  target       {'torch bf16 ms':>13} {'ratio':>6}")
    targets = {"f32": 0.75, "bf16": 0.5}
    for name, make in (("mlp", mlp_step), ("gpt", gpt_step)):
        runs = 15 if name == "mlp" else 7
        torch_ms = {dtype: median_ms(make(dtype), runs=runs) for dtype in ("f32", "bf16")}
        for dtype in ("f32", "bf16"):
            for (backend, rname), ms in sorted(ruda.items()):
                if rname != f"{name} step, {dtype}":
                    continue
                ratio = ms / torch_ms["f32"]
                verdict = "met" if ratio <= targets[dtype] else "missed"
                line = f"{name + ' ' + dtype:<16} {backend:<8} {ms:9.2f} {torch_ms['f32']:9.2f} {ratio:7.3f}  <= {targets[dtype]:<4} {verdict:<6}"
                if dtype == "bf16":
                    line += f" {torch_ms['bf16']:13.2f} {ms / torch_ms['bf16']:6.3f}"
                print(line)
                sys.stdout.flush()


if __name__ == "__main__":
    main()

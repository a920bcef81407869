#!/usr/bin/python3
"""Writes golden.json: forward and backward values of layers, losses and a short training run,
computed by PyTorch (an independent framework), for tests/nn/test_golden.cpp.

Run from the repository root with Debian's PyTorch (python3-torch):
    /usr/bin/python3 tests/data/make_golden.py
The inputs are part of the file, so the C++ test needs no random generator agreement.
"""
import json
import math
import os

import torch

torch.manual_seed(1234)
torch.set_default_dtype(torch.float64)
out = {"generator": "PyTorch " + torch.__version__}


def t(x):
    return x.detach().reshape(-1).tolist()


def case(name, **tensors):
    out[name] = {k: {"shape": list(v.shape), "values": t(v)} for k, v in tensors.items()}


# Linear: ruda stores the weight as [in, out]; PyTorch as [out, in].
x = torch.randn(3, 4, requires_grad=True)
w = torch.randn(4, 5, requires_grad=True)
b = torch.randn(5, requires_grad=True)
y = torch.nn.functional.linear(x, w.t(), b)
r = torch.randn(3, 5)
(y * r).sum().backward()
case("linear", x=x, w=w, b=b, r=r, y=y, grad_x=x.grad, grad_w=w.grad, grad_b=b.grad)

# LayerNorm over the last axis with affine parameters.
x = torch.randn(2, 3, 6, requires_grad=True)
g = torch.randn(6, requires_grad=True)
beta = torch.randn(6, requires_grad=True)
y = torch.nn.functional.layer_norm(x, (6,), g, beta, eps=1e-5)
r = torch.randn(2, 3, 6)
(y * r).sum().backward()
case("layer_norm", x=x, weight=g, bias=beta, r=r, y=y, grad_x=x.grad, grad_weight=g.grad, grad_bias=beta.grad)

# Activations.
x = torch.linspace(-4, 4, 17, requires_grad=True)
acts = {
    "gelu": lambda v: torch.nn.functional.gelu(v),
    "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh"),
    "silu": torch.nn.functional.silu,
    "softplus": torch.nn.functional.softplus,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}
for name, f in acts.items():
    xx = x.detach().clone().requires_grad_(True)
    y = f(xx)
    y.sum().backward()
    case("act_" + name, x=xx, y=y, grad_x=xx.grad)

# Cross-entropy with ignore_index, class weights and label smoothing.
logits = torch.randn(6, 5, requires_grad=True)
targets = torch.tensor([0, 4, -100, 2, 2, 1])
weight = torch.tensor([1.0, 2.0, 0.5, 1.5, 1.0])
loss = torch.nn.functional.cross_entropy(logits, targets, weight=weight, ignore_index=-100, label_smoothing=0.1)
loss.backward()
case("cross_entropy", logits=logits, targets=targets.double(), weight=weight, loss=loss.reshape(1), grad_logits=logits.grad)

# Causal self-attention as ruda computes it: qkv and proj Linears ([in, out] weights), 2 heads.
B, T, C, H = 2, 4, 6, 2
x = torch.randn(B, T, C, requires_grad=True)
wqkv = (torch.randn(C, 3 * C) * 0.3).requires_grad_(True)
bqkv = (torch.randn(3 * C) * 0.1).requires_grad_(True)
wproj = (torch.randn(C, C) * 0.3).requires_grad_(True)
bproj = (torch.randn(C) * 0.1).requires_grad_(True)
qkv = x @ wqkv + bqkv
q, k, v = qkv.split(C, dim=2)
q = q.view(B, T, H, C // H).transpose(1, 2)
k = k.view(B, T, H, C // H).transpose(1, 2)
v = v.view(B, T, H, C // H).transpose(1, 2)
att = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
y = (att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C) @ wproj + bproj
r = torch.randn(B, T, C)
(y * r).sum().backward()
case("attention", x=x, wqkv=wqkv, bqkv=bqkv, wproj=wproj, bproj=bproj, r=r, y=y, grad_x=x.grad,
     grad_wqkv=wqkv.grad, grad_wproj=wproj.grad)

# A short training run in f32: a 2-layer MLP with AdamW on fixed data.
torch.set_default_dtype(torch.float32)
X = torch.randn(32, 8)
Y = torch.randint(0, 3, (32,))
w1 = (torch.randn(8, 16) * 0.3).requires_grad_(True)
b1 = torch.zeros(16, requires_grad=True)
w2 = (torch.randn(16, 3) * 0.3).requires_grad_(True)
b2 = torch.zeros(3, requires_grad=True)
init = {k: v.detach().clone() for k, v in dict(w1=w1, b1=b1, w2=w2, b2=b2).items()}
opt = torch.optim.AdamW([w1, b1, w2, b2], lr=0.01, weight_decay=0.01)
losses = []
for step in range(8):
    loss = torch.nn.functional.cross_entropy(torch.relu(X @ w1 + b1) @ w2 + b2, Y)
    losses.append(loss.item())
    opt.zero_grad()
    loss.backward()
    opt.step()
out["training"] = {
    "X": {"shape": list(X.shape), "values": t(X)},
    "Y": {"shape": list(Y.shape), "values": Y.tolist()},
    **{"init_" + k: {"shape": list(v.shape), "values": t(v)} for k, v in init.items()},
    **{"final_" + k: {"shape": list(v.shape), "values": t(v)} for k, v in dict(w1=w1, b1=b1, w2=w2, b2=b2).items()},
    "losses": {"shape": [len(losses)], "values": losses},
}

# Parameter groups: the same MLP, weights and biases in two groups with their own weight decay
# and learning rate (base lr 0.01; the biases' group at half of it, as ruda's lr_scale 0.5).
def grouped_run(make_optimizer):
    params = {k: v.detach().clone().requires_grad_(True) for k, v in init.items()}
    opt = make_optimizer(params)
    losses = []
    for step in range(6):
        p = params
        loss = torch.nn.functional.cross_entropy(torch.relu(X @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"], Y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {**{"final_" + k: {"shape": list(v.shape), "values": t(v)} for k, v in params.items()},
            "losses": {"shape": [len(losses)], "values": losses}}


def two_groups(p, decay):
    return [{"params": [p["w1"], p["w2"]], "weight_decay": decay},
            {"params": [p["b1"], p["b2"]], "weight_decay": 0.0, "lr": 0.005}]


out["param_groups"] = {
    "adamw": grouped_run(lambda p: torch.optim.AdamW(two_groups(p, 0.1), lr=0.01)),
    "adam": grouped_run(lambda p: torch.optim.Adam(two_groups(p, 0.05), lr=0.01)),
    "sgd": grouped_run(lambda p: torch.optim.SGD(two_groups(p, 0.05), lr=0.01, momentum=0.9)),
}

# Adam and AdamW in f32, as ruda's fused kernel runs them: 4096 values through three steps at
# lr 0.1 (the rounding of 1 - beta and the order of the update show at this rate), and a second
# parameter that first has a gradient in the second step (each parameter counts its own steps).
def adam_f32(make_optimizer):
    g = torch.Generator().manual_seed(7)
    p = torch.randn(4096, generator=g, dtype=torch.float32).requires_grad_(True)
    q = torch.randn(64, generator=g, dtype=torch.float32).requires_grad_(True)
    grads = [torch.randn(4096, generator=g, dtype=torch.float32) * 10 ** (i - 2) for i in range(3)]
    q_grads = [None] + [torch.randn(64, generator=g, dtype=torch.float32) for _ in range(2)]
    case = {"p0": {"shape": [4096], "values": t(p)}, "q0": {"shape": [64], "values": t(q)}}
    opt = make_optimizer([p, q])
    for i in range(3):
        opt.zero_grad()
        p.grad = grads[i].clone()
        if q_grads[i] is not None:
            q.grad = q_grads[i].clone()
        case["g%d" % i] = {"shape": [4096], "values": t(grads[i])}
        if q_grads[i] is not None:
            case["qg%d" % i] = {"shape": [64], "values": t(q_grads[i])}
        opt.step()
    case["p3"] = {"shape": [4096], "values": t(p)}
    case["q3"] = {"shape": [64], "values": t(q)}
    return case


out["adam_f32"] = {
    "adam": adam_f32(lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.01)),
    "adamw": adam_f32(lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1)),
}

path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden.json")
with open(path, "w") as f:
    json.dump(out, f)
print("wrote", path)

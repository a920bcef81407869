#!/usr/bin/python3
"""The sharded peer of tools/compare-torch --sharded: PyTorch FSDP2 (fully_shard) over 2 gloo
processes beside ruda-train over 2 MPI ranks, one thread per rank, on the MLP (global batch 128,
AdamW) and the GPT (global batch 16, AdamW), as ruda-train trains them. Three roles:

  compare_torch_fsdp.py worker --model mlp|gpt --steps N --out FILE   (under torchrun, one per rank)
  compare_torch_fsdp.py rss OUT -- COMMAND...   (under mpiexec: runs COMMAND, writes its peak RSS)
  compare_torch_fsdp.py report DIR               (prints the table from DIR's files)

The worker shards like ruda-train: each Linear of the MLP, each block of the GPT, then the root
(the embeddings, the final norm and the tied head); reshard after forward (ruda's recompute
strategy: backward gathers again); the loss all-reduced every step as ruda-train's is.
"""
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def rss_now_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def median_of(call, runs=15):
    call()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        call()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def worker(model_name, steps, out, warmup=5):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    from compare_torch import GPT, mlp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    start_rss = rss_now_kib()  # the interpreter, torch's libraries and gloo, before any model
    kind, reason = "FSDP2", ""
    try:
        try:
            from torch.distributed.fsdp import fully_shard  # 2.6 and later
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard  # 2.4, 2.5
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,))
    except Exception as e:  # noqa: BLE001
        fully_shard, reason = None, f"{type(e).__name__}: {e}"
    torch.manual_seed(1)  # the same initial weights on every rank (fully_shard keeps each rank's slice)
    if model_name == "mlp":
        model, groups, batch = mlp(), None, 128
        groups = [m for m in model if isinstance(m, torch.nn.Linear)]
        x, y = torch.rand(batch // world, 784), torch.randint(0, 10, (batch // world,))
    else:
        model, batch = GPT(), 16
        groups = list(model.blocks)
        x, y = torch.randint(0, 256, (batch // world, 128)), torch.randint(0, 256, (batch // world, 128))
    if fully_shard is not None:
        try:
            for g in groups:
                fully_shard(g, mesh=mesh)
            fully_shard(model, mesh=mesh)
        except Exception as e:  # noqa: BLE001
            fully_shard, reason = None, f"{type(e).__name__}: {e}"
    if fully_shard is None:  # the fallback peer: DDP (every rank the whole model, gradients all-reduced)
        kind = "DDP"
        model = torch.nn.parallel.DistributedDataParallel(model)
    # ruda-train's optimizer: AdamW, lr 1e-3, weight decay 0.01 (multi-tensor).
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)

    def step():
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, -2), y.flatten())  # mean: FSDP2 averages the gradients
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total

    times = []
    error = ""
    try:
        for i in range(warmup + steps):
            t = time.perf_counter()
            step()
            if i >= warmup:
                times.append((time.perf_counter() - t) * 1e3)
    except Exception as e:  # noqa: BLE001 - e.g. FSDP2 shards but its step fails on CPU/gloo
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    # What gloo's reduce-scatter costs against an all-reduce of the same 4 MB buffer (FSDP2's
    # gradient reduction is one reduce-scatter per group): the same time means it runs as one.
    buf = torch.ones(1 << 20)
    part = torch.empty(buf.numel() // world)
    collectives = {}
    for name, call in (("reduce_scatter_ms", lambda: dist.reduce_scatter_tensor(part, buf)),
                       ("all_reduce_ms", lambda: dist.all_reduce(buf))):
        collectives[name] = median_of(call)
    record = {"rank": rank, "kind": kind, **collectives, "reason": reason, "error": error, "times_ms": times,
              "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "start_rss_kib": start_rss,
              "torch": torch.__version__}
    records = [None] * world
    dist.all_gather_object(records, record)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"model": model_name, "ranks": records}, f)
    dist.barrier()
    # Out without the interpreter's teardown: here gloo's threads can abort it ("terminate called
    # without an active exception", SIGABRT) after the figures are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if error else 0)


def rss(out, command):
    """Runs command (one MPI rank: the child inherits the rank's environment) and writes its peak RSS
    and exit status (the report takes nothing from a rank whose command failed)."""
    rc = subprocess.call(command)
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0"))
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"rank": int(rank), "maxrss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                   "exit_status": rc}, f)
    sys.exit(rc)


def ruda_steps(metrics, first):
    """Each step's time (ms) from ruda-train's metrics. It logs samples/s as a moving average,
    rate_n = 0.9 rate_(n-1) + 0.1 (batch / seconds_n), every step with --log-every 1: each step's own
    time comes back exactly from two consecutive records. Steps before `first` (the overlap trial:
    ruda-train times its first 7 steps both ways) and the final one (its evaluation's peak) are left
    out; peaks are the tensor-byte peaks per rank after the last timed step."""
    records = [json.loads(line) for line in open(metrics)]
    times, prev, peaks = [], None, None
    for r in records[:-1]:
        current = r["samples_per_s"] if prev is None else (r["samples_per_s"] - 0.9 * prev) / 0.1
        prev = r["samples_per_s"]
        if r["step"] >= first:
            times.append(current)
            peaks = r["peak_memory_bytes"]
    return times, peaks


def report(folder):
    """Prints the table; returns 1 when a side failed or left no figures (their cells are '-': no
    ratio is computed from a failed run), 0 otherwise."""
    print("sharded: 2 ranks on this machine, 1 thread each; step medians (rank 0's clock) in ms;"
          " ratio = ruda / PyTorch (time)")
    print(f"{'model':<40} {'ruda ms':>8} {'torch ms':>9} {'ratio':>6} | {'ruda tensor MB':>14} {'ruda RSS MB':>11}"
          f" {'torch RSS MB':>12} {'torch RSS-start':>15} {'RSS ratio':>9}")
    notes = []
    incomplete = False
    for model, label, batch in (("mlp", "MLP 784-1024-1024-10 b128", 128), ("gpt", "GPT d256 L4 H4 T128 b16", 16)):
        try:
            t = json.load(open(f"{folder}/torch-{model}.json"))
        except (OSError, ValueError):
            t = None
        # A failed side (compare-torch leaves <side>-<model>.failed; a rank's error or exit status
        # says so too) gives no figure at all: its partial steps and its RSS would make false ratios.
        ruda_rss = []
        ruda_failed = os.path.exists(f"{folder}/ruda-{model}.failed")
        for rank in (0, 1):
            try:
                r = json.load(open(f"{folder}/ruda-{model}.rss.{rank}"))
                ruda_failed = ruda_failed or r.get("exit_status", 0) != 0
                ruda_rss.append(r["maxrss_kib"] / 1024)
            except (OSError, ValueError, KeyError):
                ruda_failed = True
        ruda_ms, ruda_peaks = [], None
        if ruda_failed:
            notes.append(f"{model}: ruda-train failed (see its output above): no ruda figures")
            ruda_rss = []
        else:
            try:
                rates, ruda_peaks = ruda_steps(f"{folder}/ruda-{model}.jsonl", first=11)
                ruda_ms = [batch / r * 1e3 for r in rates]
                if not ruda_ms or len(ruda_peaks) < 2:
                    raise ValueError("no timed steps")
            except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
                notes.append(f"{model}: no ruda-train figures (see its output above)")
                ruda_ms, ruda_peaks = [], None
        try:
            torch_failed = (os.path.exists(f"{folder}/torch-{model}.failed") or t is None
                            or len(t["ranks"]) < 2 or any(r["error"] for r in t["ranks"])
                            or not t["ranks"][0]["times_ms"])
        except (KeyError, TypeError, IndexError):
            torch_failed, t = True, None
        if torch_failed:
            errors = "; ".join(f"rank {r['rank']}: {r['error']}" for r in t["ranks"] if r["error"]) if t else ""
            notes.append(f"{model}: PyTorch failed: no PyTorch figures"
                         + (f" ({t['ranks'][0]['kind']} step: {errors})" if errors else " (see its output above)"))
            t = None
        incomplete = incomplete or ruda_failed or torch_failed or not ruda_ms
        kind = t["ranks"][0]["kind"] if t else "FSDP2"
        if t and t["ranks"][0]["reason"]:
            notes.append(f"{model}: FSDP2 could not shard here ({t['ranks'][0]['reason']}); the peer is DDP")
        r_med = statistics.median(ruda_ms) if ruda_ms else None
        t_med = statistics.median(t["ranks"][0]["times_ms"]) if t else None
        fmt = lambda v, w, p=2: f"{v:{w}.{p}f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
        ratio = r_med / t_med if r_med and t_med else None
        for rank in (0, 1):
            tr = t["ranks"][rank] if t else None
            tensor = ruda_peaks[rank] / 1e6 if ruda_peaks else None
            rrss = ruda_rss[rank] if rank < len(ruda_rss) else None
            trss = tr["maxrss_kib"] / 1024 if tr else None
            tdelta = (tr["maxrss_kib"] - tr["start_rss_kib"]) / 1024 if tr else None
            name = f"{label}, {kind}, rank {rank}"
            print(f"{name:<40} {fmt(r_med if rank == 0 else None, 8)} {fmt(t_med if rank == 0 else None, 9)}"
                  f" {fmt(ratio if rank == 0 else None, 6, 3)} | {fmt(tensor, 14, 1)} {fmt(rrss, 11, 1)} {fmt(trss, 12, 1)}"
                  f" {fmt(tdelta, 15, 1)} {fmt(rrss / trss if rrss and trss else None, 9, 3)}")
        if ruda_ms and t_med:
            tt = t["ranks"][0]["times_ms"]
            notes.append(f"{model}: ruda {len(ruda_ms)} steps {min(ruda_ms):.1f}-{max(ruda_ms):.1f} ms;"
                         f" PyTorch {len(tt)} steps {min(tt):.1f}-{max(tt):.1f} ms")
    print("notes:")
    print("  ruda: ruda-train over 2 MPI ranks (mpiexec, onednn, f32, defaults: groups, recompute, overlap auto),"
          " steps from 11 on (after its overlap trial); the step is rank 0's clock around loss, backward,"
          " optimizer and the loss's all-reduce; the MLP reads its Fashion-MNIST batch in the step."
          " PyTorch: FSDP2 (fully_shard per Linear / per block, then the root; reshard after forward) over"
          " gloo, torchrun 2 processes, random data, 5 warm-up steps, the same step.")
    print("  gloo has no native reduce-scatter: FSDP2's reduce-scatter of gradients runs as an all-reduce"
          " of the whole gradient buffer on every rank, each keeping its slice, so PyTorch's row moves about"
          " twice the bytes a ring reduce-scatter would (ruda's MPI ring moves (N-1)/N of the buffer):"
          " the row measures FSDP2 as it runs on CPU/gloo, not FSDP2's algorithm at its best.")
    print("  memory: 'ruda tensor MB' is the peak of ruda's tensor bytes per rank (parameters, gradients,"
          " optimizer state, gathered weights, activations; no allocator slack, code or libraries)."
          " 'RSS MB' is the process's peak resident set (getrusage ru_maxrss) per rank on both sides:"
          " code, libraries (PyTorch's alone are hundreds of MB), MPI/gloo buffers, allocator caches and"
          " tensors; 'torch RSS-start' subtracts PyTorch's RSS after import and init_process_group."
          " Only the two RSS columns are the same measure.")
    for model in ("mlp", "gpt"):
        try:
            r0 = json.load(open(f"{folder}/torch-{model}.json"))["ranks"][0]
            rs, ar = r0["reduce_scatter_ms"], r0["all_reduce_ms"]
            # What was measured, not what was expected: about 1 means the reduce-scatter runs as an
            # all-reduce; a ring's would take about half of one.
            notes.append(f"gloo here (rank 0, after the {model} steps), 4 MB f32: reduce_scatter_tensor"
                         f" {rs:.2f} ms, all_reduce {ar:.2f} ms (medians of 15): reduce-scatter / all-reduce"
                         f" = {rs / ar:.2f} (1: it runs as an all-reduce; a ring's would be about 0.5)")
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            pass
    for n in notes:
        print("  " + n)
    print(f"  load average (1 min) of this machine at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
          " (others' work shifts the ratios; MPI ranks poll while they wait, so a rank without a core stalls its peer)")
    return 1 if incomplete else 0


USAGE = """usage: compare_torch_fsdp.py worker --model mlp|gpt --steps N --out FILE
       compare_torch_fsdp.py rss OUT -- COMMAND...
       compare_torch_fsdp.py report DIR"""


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    role = sys.argv[1] if len(sys.argv) > 1 else None
    if role == "worker":
        import argparse
        p = argparse.ArgumentParser(prog="compare_torch_fsdp.py worker")
        p.add_argument("--model", required=True, choices=("mlp", "gpt"))
        p.add_argument("--steps", type=int, default=20)
        p.add_argument("--out", required=True)
        a = p.parse_args(sys.argv[2:])
        if a.steps < 1:
            p.error(f"--steps must be at least 1, got {a.steps}")
        worker(a.model, a.steps, a.out)
    elif role == "rss":
        command = sys.argv[4:] if sys.argv[3:4] == ["--"] else sys.argv[3:]
        if len(sys.argv) < 3 or not command:
            sys.exit(USAGE)
        rss(sys.argv[2], command)
    elif role == "report":
        if len(sys.argv) != 3:
            sys.exit(USAGE)
        sys.exit(report(sys.argv[2]))
    else:
        sys.exit(f"compare_torch_fsdp.py: unknown role {role}\n{USAGE}" if role else USAGE)

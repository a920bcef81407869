#!/usr/bin/env bash
# The README's commands, run through the scripts themselves on the build under test, at a size CI
# affords:   test_scripts.sh CASE BIN_DIR WORK_DIR
#   demo        tools/demo with a short run's options after the script's own (the last value wins),
#               then tools/plot on the metrics it wrote
#   demo-large  tools/demo-large's real configuration refused at 1 rank (nothing large is
#               allocated), then a scaled-down model of the same shape of problem: refused at 1
#               rank, over the limit as configured at 4 MPI ranks, fitted and trained there
#   bench-list  tools/bench --list
#   bench-quick  tools/bench --quick over the single-process suites whose figures the README quotes
#               (all but memory-scale, minutes even when quick): every suite runs and reports
#   bench-mpi-quick  tools/bench --quick --suite collectives-mpi: the MPI suite the README quotes, at
#               2, 3 and 4 ranks
#   fuzz-safetensors  tools/fuzz-safetensors for a few seconds: it builds its fuzzer and finds nothing
set -euo pipefail
case_name=$1
export RUDA_BIN_DIR=$2
work=$3
root=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$work"
mkdir -p "$work"
log=$work/output.txt

fail() {
  echo "FAILED: $*" >&2
  echo "--- output:" >&2
  cat "$log" >&2
  exit 1
}
expect() {  # expect FRAGMENT: the output so far contains it
  grep -qF -- "$1" "$log" || fail "expected '$1' in the output"
}

case "$case_name" in
  demo)
    RUDA_DEMO_DIR=$work/demo "$root/tools/demo" --epochs 1 --limit 1280 --test-limit 500 --batch 64 --log-every 0 \
      >"$log" 2>&1 || fail "tools/demo exited $?"
    expect "fully sharded over 2 mpi ranks"
    expect "epoch 1/1 test_accuracy"  # --epochs 1 overrode the script's --epochs 10
    grep -q "epoch 2/" "$log" && fail "trained more than the one epoch asked for"
    [ -s "$work/demo/metrics.jsonl" ] || fail "no metrics file"
    [ -f "$work/demo/checkpoints/latest" ] || fail "no checkpoint"
    "$root/tools/plot" "$work/demo/metrics.jsonl" "$work/plot.png" >>"$log" 2>&1 || fail "tools/plot exited $?"
    [ "$(head -c 8 "$work/plot.png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] || fail "plot.png is not a PNG"
    # The documented command run again: it trains afresh over the last run's checkpoints (a
    # fresh ruda-train run into a directory holding checkpoints is refused; the script clears its own).
    RUDA_DEMO_DIR=$work/demo "$root/tools/demo" --epochs 1 --limit 1280 --test-limit 500 --batch 64 --log-every 0 \
      >>"$log" 2>&1 || fail "tools/demo exited $? when run a second time"
    [ "$(grep -c "epoch 1/1 test_accuracy" "$log")" = 2 ] || fail "the second run did not train"
    ;;
  demo-large)
    "$root/tools/demo-large" --refuse-only >"$log" 2>&1 || fail "tools/demo-large --refuse-only exited $?"
    expect "needs at least 415 MB per rank at 1 rank before activations"
    expect "limit 256 MB; that much fits at 2 ranks"
    grep -q "memory plan per rank" "$log" && fail "the refusal measured a step: it allocated the model"
    # The same problem at a CI size: 14 MB of state at 1 rank, ~28 MB per rank at 4 as configured,
    # ~12-13 MB with activation checkpointing, under a 13.5 MB limit (at 13 MB a measurement of 13.1
    # MB sometimes took the next rung, micro-batches).
    "$root/tools/demo-large" --memory-limit 13.5MB --d-model 128 --layers 4 --steps 2 >"$log" 2>&1 ||
      fail "the scaled tools/demo-large exited $?"
    expect "needs at least 14.0 MB per rank at 1 rank"
    expect "is over the limit of 13.5 MB; chose"
    expect "activation checkpointing, 2 steps"
    expect "step 2/2"
    expect "fully sharded over 4 mpi ranks"
    grep -q "Primary job" "$log" && fail "OpenMPI's banner after the agreed refusal (mpiexec --quiet)"
    # The README's own configuration, for 2 steps (~40 s, ~1 GB over the 4 ranks): over 256 MB as
    # configured at 4 ranks, it takes the fewest concessions that fit.
    "$root/tools/demo-large" --steps 2 >"$log" 2>&1 || fail "tools/demo-large exited $?"
    expect "with 2 unsharded groups, recompute is over the limit of 256 MB; chose 1 unsharded group"
    expect "step 2/2"
    ;;
  bench-list)
    "$root/tools/bench" --list >"$log" 2>&1 || fail "tools/bench --list exited $?"
    for suite in gemm mlp models train-step checkpoint; do grep -qx "$suite" "$log" || fail "no suite $suite"; done
    # Integer options refuse what CLI11 would saturate (as ruda-train's and ruda-ckpt's do).
    if "$root/tools/bench" --repeats 99999999999999999999 --suite gemm >"$log" 2>&1; then fail "--repeats past int accepted"; fi
    expect "--repeats: must be a whole number"
    if "$root/tools/bench" --repeats 0 --suite gemm >"$log" 2>&1; then fail "--repeats 0 accepted"; fi
    expect "--repeats: must be at least 1, got 0"
    # A parse error is one prefixed line and exit code 2, as ruda-train's (it was CLI11's 105/109).
    rc=0; "$RUDA_BIN_DIR/ruda-bench" --repeats x >"$log" 2>&1 || rc=$?
    [ "$rc" = 2 ] || fail "ruda-bench --repeats x exited $rc, not 2"
    expect "ruda-bench: error: --repeats"
    if "$root/tools/bench" --backend bogus --suite gemm >"$log" 2>&1; then fail "--backend bogus accepted"; fi
    expect "unknown backend 'bogus'"
    grep -q "terminate called" "$log" && fail "an uncaught exception"
    ;;
  bench-quick)
    suites=(kernels attention models layer-norm checkpoint onednn-kernels gemm gemm-onednn op-overhead memory optimizer
      data collectives mlp)
    args=()
    for suite in "${suites[@]}"; do args+=(--suite "$suite"); done
    "$root/tools/bench" --quick "${args[@]}" >"$log" 2>&1 || fail "tools/bench --quick exited $?"
    for suite in "${suites[@]}"; do grep -q "^$suite " "$log" || fail "no rows of suite $suite"; done
    expect "exp ["
    expect "qkvpacked on a [B, T, 3, H, D] projection"
    ;;
  bench-mpi-quick)
    "$root/tools/bench" --quick --suite collectives-mpi >"$log" 2>&1 || fail "tools/bench --suite collectives-mpi exited $?"
    for ranks in 2 3 4; do
      for collective in all_gather reduce_scatter; do
        grep -q "^collectives-mpi  *mpi $collective n=$ranks 4KiB" "$log" || fail "no 4 KiB $collective row at $ranks ranks"
      done
    done
    ;;
  fuzz-safetensors)
    RUDA_FUZZ_DIR=$work/fuzz "$root/tools/fuzz-safetensors" 5 >"$log" 2>&1 || fail "tools/fuzz-safetensors exited $?"
    expect "fuzzed for 5s: 0 failing inputs"
    ;;
  *)
    echo "test_scripts.sh: unknown case $case_name" >&2
    exit 2
    ;;
esac
echo "$case_name: ok"

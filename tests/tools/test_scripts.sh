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
#               but memory-scale and the emulated overlap and hybrid suites: every suite runs and
#               reports
#   bench-scaling-quick  tools/bench --quick over the suites of sharding at scale: memory-scale,
#               overlap and hybrid (each emulated, then over MPI: across tools/cluster-sim's nodes
#               where namespaces can be made, on loopback otherwise) and train-step-mpi
#   bench-mpi-quick  tools/bench --quick --suite collectives-mpi: the MPI suite the README quotes, at
#               2, 3 and 4 ranks
#   mpiexec-signal  the README's graceful stop through mpiexec itself: SIGUSR1 sent to mpiexec
#               reaches both ranks, which save the same step and exit 138; the checkpoint verifies
#   fuzz-safetensors  tools/fuzz-safetensors for a few seconds: it builds its fuzzer and finds nothing
#               (a crash file an earlier run left is not counted as this run's)
#   arguments   the scripts' argument and failure handling, in seconds, on stub binaries and fake
#               commands first on PATH (mpiexec, id, cmake, ctest, dpkg-query): which suites plain
#               tools/bench runs at which rank counts, refused values with a message naming the
#               option (never a bash error), nothing installed or built where RUDA_BIN_DIR is set
#   compare-torch  tools/compare-torch on stubs (a fake PyTorch venv and torchrun, a stub
#               ruda-train under the real mpiexec): a failed side exits non-zero and gives no ratio
# shellcheck disable=SC2016  # the stubs' bodies are single-quoted: they expand when a stub runs
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
# refused CMD...: CMD fails, with a message of its own rather than bash's (an unset variable, a
# syntax error in arithmetic, a line number) or a Python traceback; the output is in $log.
refused() {
  if "$@" >"$log" 2>&1; then fail "'$*' succeeded"; fi
  if grep -qE 'unbound variable|syntax error|invalid arithmetic|line [0-9]+:|Traceback' "$log"; then
    fail "'$*' failed with an error of bash or Python, not a message of its own"
  fi
}
# stub PATH NAME BODY: an executable bash script PATH/NAME running BODY.
stub() {
  mkdir -p "$1"
  printf '#!/usr/bin/env bash\n%s\n' "$3" >"$1/$2"
  chmod +x "$1/$2"
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
    expect "needs at least 407 MB per rank at 1 rank before activations"
    expect "limit 256 MB; that much fits at 2 ranks"
    grep -q "memory plan per rank" "$log" && fail "the refusal measured a step: it allocated the model"
    # The same problem at a CI size: 16.7 MB of state at 1 rank, ~28.6 MB per rank at 4 as
    # configured, ~13.7 MB with activation checkpointing, under a 14.5 MB limit (with less room a
    # measurement a little over took the next rung, micro-batches).
    "$root/tools/demo-large" --memory-limit 14.5MB --d-model 128 --layers 5 --steps 2 >"$log" 2>&1 ||
      fail "the scaled tools/demo-large exited $?"
    expect "needs at least 16.7 MB per rank at 1 rank"
    expect "is over the limit of 14.5 MB; chose"
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
    # --list checks the other arguments too (it listed and exited 0).
    if "$RUDA_BIN_DIR/ruda-bench" --suite nope --list >"$log" 2>&1; then fail "--suite nope --list accepted"; fi
    expect "unknown suite 'nope'"
    # A bad environment variable is one line and exit 2 before any suite; a suite's own failure
    # (its sizes past a memory limit) one line naming the suite and exit 1: both used to end in
    # "terminate called" (exit 134).
    rc=0; RUDA_MEMORY_LIMIT=garbage "$RUDA_BIN_DIR/ruda-bench" --quick --suite gemm >"$log" 2>&1 || rc=$?
    [ "$rc" = 2 ] || fail "RUDA_MEMORY_LIMIT=garbage: exited $rc, not 2"
    expect "ruda-bench: error: RUDA_MEMORY_LIMIT"
    rc=0; RUDA_EMULATE_LINK=garbage "$RUDA_BIN_DIR/ruda-bench" --quick --suite collectives >"$log" 2>&1 || rc=$?
    [ "$rc" = 2 ] || fail "RUDA_EMULATE_LINK=garbage: exited $rc, not 2"
    expect "ruda-bench: error: RUDA_EMULATE_LINK"
    rc=0; RUDA_MEMORY_LIMIT=1KB "$RUDA_BIN_DIR/ruda-bench" --quick --suite gemm >"$log" 2>&1 || rc=$?
    [ "$rc" = 1 ] || fail "a suite over RUDA_MEMORY_LIMIT=1KB exited $rc, not 1"
    expect "ruda-bench: error: suite gemm"
    expect "out of memory"
    grep -q "terminate called" "$log" && fail "an uncaught exception"
    ;;
  bench-quick)
    suites=(kernels attention models layer-norm checkpoint onednn-kernels gemm gemm-onednn op-overhead memory optimizer
      data collectives mlp train-step onednn-ranks)
    args=()
    for suite in "${suites[@]}"; do args+=(--suite "$suite"); done
    "$root/tools/bench" --quick "${args[@]}" >"$log" 2>&1 || fail "tools/bench --quick exited $?"
    for suite in "${suites[@]}"; do grep -q "^$suite " "$log" || fail "no rows of suite $suite"; done
    expect "exp ["
    expect "qkvpacked on a [B, T, 3, H, D] projection"
    expect "causal fwd+bwd with dropout 0.1"
    expect "dropout 0.1 [512, 1024] f32"
    expect "f32 softmax exp pass, 4096 rows of 256"
    expect "dense b8, same threads, two replicas at once"
    expect "adam step, 1M bf16 parameters"
    expect "f16 relu ["
    expect "logsumexp over columns ["
    expect "take_along_axis fwd+bwd axis 1, 64 of ["
    ;;
  bench-scaling-quick)
    "$root/tools/bench" --quick --suite memory-scale --suite overlap --suite hybrid --suite train-step-mpi >"$log" 2>&1 ||
      fail "tools/bench --quick over the scaling suites exited $?"
    grep -q "^memory-scale  *GPT d256 x4, batch 16: measured peak per rank, world 2 (peer: plan)" "$log" ||
      fail "no memory-scale plan row at world 2"
    expect "widest GPT x4 within 64 MB/rank, world 4, activation checkpointing: d_model"
    for model in "GPT d256 x4 b16 t64" "MLP 784-1024-1024-10 b128"; do
      # The emulated rows, then the MPI ones (across cluster-sim's nodes, or on loopback).
      grep -q "^overlap  *$model, 2 ranks, emulated .*: step (groups, prefetch, overlap on)" "$log" ||
        fail "no emulated overlap row of the $model"
      grep -qE "^overlap  *$model, 2 ranks, .*(cluster-sim nodes|loopback).*: communication only" "$log" ||
        fail "no MPI overlap row of the $model"
      grep -q "^hybrid  *$model, 2 nodes x 2 ranks, emulated .*: hybrid: step" "$log" ||
        fail "no emulated hybrid row of the $model"
      grep -qE "^hybrid  *$model, 2 nodes x 2 ranks, .*(cluster-sim|blocks of 2 ranks as nodes).*: hybrid: step" "$log" ||
        fail "no MPI hybrid row of the $model"
    done
    for ranks in 2 4; do
      grep -q "^train-step-mpi  *MLP b128, sharded in groups, overlap auto, $ranks MPI ranks" "$log" ||
        fail "no train-step-mpi row at $ranks ranks"
    done
    ;;
  bench-mpi-quick)
    "$root/tools/bench" --quick --suite collectives-mpi >"$log" 2>&1 || fail "tools/bench --suite collectives-mpi exited $?"
    for ranks in 2 3 4; do
      for collective in all_gather reduce_scatter; do
        grep -q "^collectives-mpi  *mpi $collective n=$ranks 4KiB" "$log" || fail "no 4 KiB $collective row at $ranks ranks"
      done
    done
    ;;
  mpiexec-signal)
    # A run long enough to be signalled mid-training (it stops within a step of the signal).
    signalled_run() {
      rm -rf "$work/c"
      mpiexec -n 2 --oversubscribe --bind-to none -x OMP_NUM_THREADS=1 "$RUDA_BIN_DIR/ruda-train" mlp --hidden 32 \
        --limit 640 --test-limit 64 --batch 64 --epochs 100000 --log-every 1 --checkpoint-dir "$work/c" >"$log" 2>&1 &
      job=$!
      for _ in $(seq 600); do
        grep -q '^step [0-9]*/' "$log" && break
        kill -0 "$job" 2>/dev/null || break
        sleep 0.1
      done
      grep -q '^step [0-9]*/' "$log" || { kill -KILL "$job" 2>/dev/null; fail "ruda-train did not start training"; }
      kill -USR1 "$job"
      rc=0; wait "$job" || rc=$?
    }
    signalled_run
    # OpenMPI 4.1's launcher now and then segfaults in its own teardown (PMIx_server_finalize under
    # orte_finalize) after the ranks have ended, as tests/collectives/check_mpi_exit.cmake says:
    # that crash, and only that one, runs the job once more -- the ranks stopped as asked (the stop
    # line is there) and mpiexec named no rank that failed (a rank's own crash in MPI_Finalize
    # passes through orte_finalize too, and fails at once).
    if [ "$rc" != 138 ] && grep -q PMIx_server_finalize "$log" && grep -q "stopped by SIGUSR1 after step" "$log" &&
      ! grep -q "mpiexec noticed that process rank" "$log"; then
      echo "mpiexec crashed in its own teardown (orte_finalize), after the job: running it again" >&2
      cat "$log" >&2
      signalled_run
    fi
    [ "$rc" = 138 ] || fail "mpiexec signalled with SIGUSR1 exited $rc, not 138"
    expect "stopped by SIGUSR1 after step"
    step=$(sed -n 's/^stopped by SIGUSR1 after step \([0-9]*\),.*/\1/p' "$log")
    [ -n "$step" ] || fail "no step in the stop line"
    "$RUDA_BIN_DIR/ruda-ckpt" verify "$work/c" >>"$log" 2>&1 || fail "ruda-ckpt verify exited $?"
    [ "$(cat "$work/c/latest")" = "$(printf 'step-%08d' "$step")" ] || fail "latest is $(cat "$work/c/latest"), not step $step"
    ;;
  fuzz-safetensors)
    # A crash file an earlier run left behind is neither this run's finding nor copied again.
    mkdir -p "$work/fuzz/crashes"
    echo stale >"$work/fuzz/crashes/crash-0000stale"
    RUDA_FUZZ_DIR=$work/fuzz "$root/tools/fuzz-safetensors" 5 >"$log" 2>&1 || fail "tools/fuzz-safetensors exited $?"
    stale=("$root"/tests/data/safetensors-corpus/regression-crash-0000stale*)
    if [ -e "${stale[0]}" ]; then
      rm -f "${stale[@]}"
      fail "an earlier run's crash file was copied into the corpus again"
    fi
    expect "fuzzed for 5s: 0 failing inputs"
    ;;
  arguments)
    fake=$work/fake bins=$work/bin
    export STUB_CALLS=$work/calls
    # Installing or building would show as a call to one of these (tools/setup asks dpkg-query).
    for c in cmake ctest dpkg-query; do
      stub "$fake" "$c" "echo \"$c \$*\" >>\"\$STUB_CALLS\"; [ $c != dpkg-query ] || echo 'install ok installed'"
    done
    # Not root to tools/bench: it takes the loopback path instead of making a cluster.
    stub "$fake" id 'if [ "${1:-}" = -u ]; then echo 1000; else exec /usr/bin/id "$@"; fi'
    # mpiexec records its rank count and the suites it was given, and runs nothing.
    stub "$fake" mpiexec 'n=$(sed -n "s/.* -n \([0-9]*\) .*/\1/p" <<<" $* ")
echo "mpiexec -n $n $(grep -o -- "--suite [a-z-]*" <<<"$*" | tr "\n" " ")" >>"$STUB_CALLS"'
    stub "$bins" ruda-train 'exit 0'
    stub "$bins" ruda-bench 'if [ "${1:-}" = --list ]; then printf "%s\n" gemm overlap-emulated hybrid-emulated
else echo "ruda-bench $*" >>"$STUB_CALLS"; fi'
    stub "$bins" ruda-bench-mpi '[ "${1:-}" != --list ] || printf "%s\n" cluster-calibrate collectives-mpi hybrid overlap train-step-mpi'
    export PATH=$fake:$PATH
    calls=$STUB_CALLS
    # Plain tools/bench: each MPI suite only at its own rank counts, cluster-calibrate not at all.
    : >"$calls"
    RUDA_BIN_DIR=$bins "$root/tools/bench" >"$log" 2>&1 || fail "plain tools/bench on stubs exited $?"
    expect "overlap: no simulated cluster: not root (network namespaces need root); on loopback"
    cp "$calls" "$log"
    grep -q -- '-n [0-9]* *$' "$calls" && fail "an MPI run named no suite (ruda-bench-mpi then runs them all)"
    grep -q cluster-calibrate "$calls" && fail "plain tools/bench ran cluster-calibrate"
    grep -- '--suite overlap' "$calls" | grep -qv -- '-n 2 ' && fail "overlap ran at another count than 2"
    grep -- '--suite hybrid' "$calls" | grep -qv -- '-n 4 ' && fail "hybrid ran at another count than 4"
    for n in 2 4; do
      grep -qx -- "mpiexec -n $n --suite collectives-mpi --suite train-step-mpi *" "$calls" ||
        fail "collectives-mpi and train-step-mpi did not run together at $n ranks"
    done
    grep -qx -- "mpiexec -n 3 --suite collectives-mpi *" "$calls" || fail "collectives-mpi did not run at 3 ranks"
    grep -qx -- "mpiexec -n 2 --suite overlap *" "$calls" || fail "overlap did not run at 2 ranks"
    grep -qx -- "mpiexec -n 4 --suite hybrid *" "$calls" || fail "hybrid did not run at 4 ranks"
    [ "$(grep -c '^ruda-bench' "$calls")" = 1 ] || fail "ruda-bench ran more than once (the emulated suites again)"
    refused env RUDA_BIN_DIR="$bins" "$root/tools/bench" --suite cluster-calibrate
    expect "tools/cluster-sim calibrate"
    refused env RUDA_BIN_DIR="$bins" "$root/tools/bench" --suite
    expect "--suite needs a name"

    # compare-torch: an option without its value; RUDA_BIN_DIR installs and builds nothing, and
    # says what to run when PyTorch's environment is missing.
    : >"$calls"
    refused "$root/tools/compare-torch" --backend
    expect "compare-torch: --backend needs a name"
    refused "$root/tools/compare-torch" --bogus
    expect "unknown argument '--bogus'"
    refused env RUDA_BIN_DIR="$bins" RUDA_BENCH_VENV="$work/no-venv" "$root/tools/compare-torch"
    expect "run tools/setup --bench"
    [ ! -s "$calls" ] || fail "compare-torch with RUDA_BIN_DIR installed or built: $(cat "$calls")"

    # cluster-sim: values checked (before anything is built or changed), named in the message.
    for rate in 1.5gbit fastgbit 0gbit 200gbit 99999999999999999999gbit; do
      refused "$root/tools/cluster-sim" up --rate "$rate"
      expect "up: --rate: '$rate' is not a link rate"
    done
    refused "$root/tools/cluster-sim" up --rate
    expect "up: --rate needs a rate"
    refused "$root/tools/cluster-sim" up --nodes
    expect "up: --nodes needs a number"
    refused "$root/tools/cluster-sim" rate 1.5gbit
    expect "rate: '1.5gbit' is not a link rate"
    refused "$root/tools/cluster-sim" run 99999999999999999999 true
    expect "ranks per node must be a number from 1 to 64"
    refused env RUDA_SIM_QUEUE_BURSTS=x "$root/tools/cluster-sim" up
    expect "RUDA_SIM_QUEUE_BURSTS: 'x'"
    : >"$calls"
    refused env -u RUDA_BIN_DIR "$root/tools/cluster-sim" calibrate --rates 1gbit,fastgbit
    expect "calibrate: --rates: 'fastgbit' is not a link rate"
    refused env -u RUDA_BIN_DIR "$root/tools/cluster-sim" calibrate --rates
    expect "calibrate: --rates needs a list"
    [ ! -s "$calls" ] || fail "cluster-sim calibrate installed or built before checking its arguments: $(cat "$calls")"

    # tools/check: ctest arguments alone run on release (not taken for a preset); a bad preset is
    # refused before anything is built.
    : >"$calls"
    "$root/tools/check" -R engine >"$log" 2>&1 || fail "tools/check -R engine exited $?"
    grep -qx "ctest --preset release -R engine" "$calls" || fail "tools/check -R engine ran: $(cat "$calls")"
    grep -qx "cmake --build --preset release" "$calls" || fail "tools/check -R engine built: $(cat "$calls")"
    : >"$calls"
    refused "$root/tools/check" releas
    expect "unknown preset 'releas'"
    grep -q '^cmake' "$calls" && fail "tools/check built for an unknown preset"

    # tools/bench and compare-torch: --help prints the usage and runs nothing (tools/bench passed
    # it to every run, clusters included); an unknown option is refused before any build.
    : >"$calls"
    "$root/tools/bench" --help >"$log" 2>&1 || fail "tools/bench --help exited $?"
    expect "tools/bench [--json] [--suite NAME]"
    "$root/tools/compare-torch" --help >"$log" 2>&1 || fail "tools/compare-torch --help exited $?"
    expect "tools/compare-torch --sharded"
    refused "$root/tools/bench" --bogus
    expect "tools/bench: unknown argument '--bogus'"
    # demo and demo-large pass their other arguments to ruda-train, but --help builds nothing
    # (demo-large --help configured the release build).
    "$root/tools/demo" --help >"$log" 2>&1 || fail "tools/demo --help exited $?"
    expect "The main job: trains the Fashion-MNIST MLP"
    "$root/tools/demo-large" -h >"$log" 2>&1 || fail "tools/demo-large -h exited $?"
    expect "tools/demo-large [--refuse-only] [ruda-train options...]"
    [ ! -s "$calls" ] || fail "tools/bench, demo or demo-large --help, or --bogus, ran: $(cat "$calls")"
    # check, setup, fuzz-safetensors and plot too (check ran setup and the build, then gave
    # ctest's own help; fuzz-safetensors took --help for its SECONDS; plot for its metrics file).
    "$root/tools/check" --help >"$log" 2>&1 || fail "tools/check --help exited $?"
    expect "tools/check [PRESET] [ctest args...]"
    "$root/tools/setup" --help >"$log" 2>&1 || fail "tools/setup --help exited $?"
    expect "tools/setup --bench"
    "$root/tools/fuzz-safetensors" -h >"$log" 2>&1 || fail "tools/fuzz-safetensors -h exited $?"
    expect "tools/fuzz-safetensors [SECONDS]"
    "$root/tools/plot" --help >"$log" 2>&1 || fail "tools/plot --help exited $?"
    expect "tools/plot METRICS.jsonl [OUT.png]"
    [ ! -s "$calls" ] || fail "tools/check, setup, fuzz-safetensors or plot --help ran: $(cat "$calls")"

    # The rest: each refuses what it cannot do, with its own message.
    refused "$root/tools/setup" --bnech
    expect "unknown argument '--bnech' (valid: none, or --bench)"
    refused "$root/tools/fuzz-safetensors" 5s
    expect "SECONDS must be a whole number"
    printf '{"step": 1, "loss": 2.5}\n' >"$work/metrics.jsonl"
    if "$root/tools/plot" "$work/metrics.jsonl" "$work/no-such-dir/plot.png" >"$work/plot.stdout" 2>"$log"; then
      fail "tools/plot wrote into a folder that does not exist"
    fi
    [ ! -s "$work/plot.stdout" ] || fail "tools/plot wrote $(wc -c <"$work/plot.stdout") bytes to stdout"
    expect "cannot write $work/no-such-dir/plot.png"
    printf '{"step": 1, "loss": 2.5}\n{"step": 2}\n' >"$work/metrics.jsonl"
    refused "$root/tools/plot" "$work/metrics.jsonl" "$work/plot.png"
    expect 'metrics.jsonl:2: not a ruda-train metrics record (no "loss")'
    # Never over the input (it turned the metrics into a PNG and said "wrote"); a field that is no
    # number, a file that is not UTF-8, a folder: a message of its own, no traceback.
    printf '{"step": 1, "loss": 2.5}\n' >"$work/metrics.jsonl"
    refused "$root/tools/plot" "$work/metrics.jsonl" "$work/metrics.jsonl"
    expect "is the metrics file itself"
    grep -q '"step": 1' "$work/metrics.jsonl" || fail "tools/plot damaged its input"
    printf '{"step": "x", "loss": 2.5}\n' >"$work/string.jsonl"
    refused "$root/tools/plot" "$work/string.jsonl" "$work/plot.png"
    expect '"step" is "x", not a number'
    printf '\xff\xfe\n' >"$work/binary.jsonl"
    refused "$root/tools/plot" "$work/binary.jsonl" "$work/plot.png"
    expect "binary.jsonl:1: not a ruda-train metrics record"
    mkdir -p "$work/folder.jsonl"
    refused "$root/tools/plot" "$work/folder.jsonl"
    expect "not a regular file"
    # The default output is beside the input, named after the file (not cut at a folder's dot).
    mkdir -p "$work/run.v2"
    printf '{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0}\n' >"$work/run.v2/metrics"
    "$root/tools/plot" "$work/run.v2/metrics" >"$log" 2>&1 || fail "tools/plot of run.v2/metrics exited $?"
    [ -f "$work/run.v2/metrics.png" ] || fail "tools/plot did not write run.v2/metrics.png: $(cat "$log")"
    # demo-large: only the memory plan's refusal is the expected one (the real ruda-train).
    refused "$root/tools/demo-large" --refuse-only --bogus-option
    expect "but not with the memory plan's refusal"
    ;;
  compare-torch)
    # A fake PyTorch: the venv's python is the system's with a stub torch module (enough to import
    # compare_torch.py), and torchrun writes figures, failing when told to.
    venv=$work/venv bins=$work/bin
    mkdir -p "$work/stub-torch/torch/nn"
    printf 'from . import nn\n__version__ = "stub"\n' >"$work/stub-torch/torch/__init__.py"
    printf 'class Module:\n    pass\n' >"$work/stub-torch/torch/nn/__init__.py"
    : >"$work/stub-torch/torch/nn/functional.py"
    export STUB_TORCH=$work/stub-torch
    stub "$venv/bin" python 'if [ "${1:-}" = -m ] && [ "${2:-}" = torch.distributed.run ]; then
  out=$(sed -n "s/.* --out \([^ ]*\).*/\1/p" <<<"$*")
  exec /usr/bin/python3 - "$out" "${STUB_TORCH_FAIL:+RuntimeError: stub failure}" <<PY
import json, sys
ranks = [{"rank": r, "kind": "FSDP2", "reason": "", "error": sys.argv[2] if r == 0 else "", "times_ms": [128.0] * 20,
          "maxrss_kib": 204800, "start_rss_kib": 102400, "reduce_scatter_ms": 2.0, "all_reduce_ms": 2.1,
          "torch": "stub"} for r in (0, 1)]
json.dump({"model": "stub", "ranks": ranks}, open(sys.argv[1], "w"))
sys.exit(1 if sys.argv[2] else 0)
PY
fi
PYTHONPATH=$STUB_TORCH exec /usr/bin/python3 "$@"'
    # ruda-train: rank 0 writes 31 steps of metrics at 128 ms a step (the MLP's 128 samples, the
    # GPT's 16), as the stub torchrun reports.
    stub "$bins" ruda-train 'if [ -n "${STUB_RUDA_FAIL:-}" ]; then echo "ruda-train: error: stub failure" >&2; exit 1; fi
metrics=$(sed -n "s/.*--metrics \([^ ]*\).*/\1/p" <<<"$*")
rate=1000.0
[[ " $* " != *" lm "* ]] || rate=125.0
[ "${OMPI_COMM_WORLD_RANK:-0}" = 0 ] || exit 0
for i in $(seq 1 31); do
  echo "{\"step\": $i, \"loss\": 1.0, \"samples_per_s\": $rate, \"peak_memory_bytes\": [1000000, 1000000]}"
done >"$metrics"'
    stub "$bins" ruda-bench 'exit 0'  # no figures at all
    export RUDA_BIN_DIR=$bins RUDA_BENCH_VENV=$venv
    # The table's ratio columns (step, RSS) for each row: "-" where no ratio was computed.
    ratios() { grep -E '^(MLP|GPT) ' "$log" | cut -c41- | awk '{print $3, $9}'; }

    "$root/tools/compare-torch" --sharded >"$log" 2>&1 || fail "compare-torch --sharded on stubs exited $?"
    # Rank 0's rows: a step ratio of 1 (equal stub times); every row: an RSS ratio.
    if ! { [ "$(ratios | awk '{print $1}' | sort -u | tr '\n' ' ')" = "- 1.000 " ] &&
           ratios | awk '$2 !~ /^[0-9]+\.[0-9]+$/ {bad = 1} END {exit bad}'; }; then
      fail "expected step ratios of 1 and RSS ratios from the stubs' figures, got: $(ratios | tr '\n' ' ')"
    fi
    expect "reduce-scatter / all-reduce = 0.95"

    refused env STUB_RUDA_FAIL=1 "$root/tools/compare-torch" --sharded
    expect "compare-torch: ruda-train mlp over 2 MPI ranks failed"
    expect "mlp: ruda-train failed"
    [ "$(ratios | sort -u)" = "- -" ] || fail "a ratio from a failed ruda-train: $(ratios | tr '\n' ' ')"

    refused env STUB_TORCH_FAIL=1 "$root/tools/compare-torch" --sharded
    expect "compare-torch: PyTorch's sharded mlp step failed"
    expect "rank 0: RuntimeError: stub failure"
    [ "$(ratios | sort -u)" = "- -" ] || fail "a ratio from a failed PyTorch run: $(ratios | tr '\n' ' ')"

    # The dense comparison on a figures file without ruda's rows is an error, not a table of '-'.
    refused "$root/tools/compare-torch" --no-compile
    expect "holds no ruda figure for: mlp step, f32"
    refused "$root/tools/compare-torch" --attention
    expect "holds no ruda attention time row"
    refused "$root/tools/compare-torch" --attention --sharded
    expect "compare-torch: --attention takes --backend only"
    ;;
  *)
    echo "test_scripts.sh: unknown case $case_name" >&2
    exit 2
    ;;
esac
echo "$case_name: ok"

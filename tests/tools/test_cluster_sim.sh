#!/usr/bin/env bash
# tools/cluster-sim, end to end (registered with ctest by tests/tools/CMakeLists.txt):
#   test_cluster_sim.sh CLUSTER_SIM RUDA_TRAIN MPIEXEC
# - a failing `up` leaves nothing behind;
# - `up` makes 2 nodes with their own hostnames, `run` starts one rank on each;
# - the sharded MLP trained over the two nodes (TCP through the throttled links) gives exactly the
#   losses of the same job as 2 ranks on one host (shared memory);
# - `run` works from a checkout whose path has a space in it;
# - `calibrate --rates` restores the link setting it found (rate and queue), also when the suite fails;
# - `down` leaves no namespace, interface or file behind, and is idempotent.
# Exit 77 (ctest's SKIP_RETURN_CODE) where network namespaces cannot be made, with the reason.
set -euo pipefail

sim=$1 train=$2 mpiexec=$3
skip() {
  echo "SKIP: $*"
  exit 77
}
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
leftovers() {  # anything of cluster-sim's still on this machine, one per line
  ip netns list | awk '{print $1}' | grep -E '^ruda-(n[0-9]|sw)$' || true
  ip -o link show | awk -F': ' '{print $2}' | grep -E '^ruda-' || true
  [ ! -e /run/ruda-cluster-sim ] || echo /run/ruda-cluster-sim
}

[ "$(id -u)" -eq 0 ] || skip "not root: network namespaces need root"
# What `up` needs, tried in a throwaway namespace that vanishes with the process.
if ! why=$(unshare --net --uts sh -c 'hostname ruda-probe && ip link add ruda-probe0 type veth peer name ruda-probe1 &&
          ip link add ruda-probe2 type bridge && tc qdisc add dev ruda-probe0 root tbf rate 1gbit burst 64kb limit 128kb' 2>&1); then
  skip "cannot make network namespaces, veths, bridges or tbf here: $why"
fi
# One simulated cluster per machine: never take down one that someone else brought up. But a run
# of this test that was killed (ctest's timeout kills it, and no trap runs) left its cluster, with
# its marker naming a process that is gone: that one is this test's to take down, so that the
# next run does not skip for good.
marker=/run/ruda-cluster-sim-test.pid
if [ -n "$(leftovers)" ] && [ -f "$marker" ] && ! kill -0 "$(cat "$marker")" 2>/dev/null; then
  echo "--- taking down the cluster a killed run of this test left (its process $(cat "$marker") is gone)"
  "$sim" down
  rm -f "$marker"
fi
[ -z "$(leftovers)" ] || skip "a cluster-sim cluster (or its leftovers) exists already: $(leftovers | tr '\n' ' ')(tools/cluster-sim down removes it)"

tmp=$(mktemp -d)
echo $$ >"$marker"
trap '"$sim" down; rm -rf "$tmp" "$marker"' EXIT

echo "--- a failing up (a stale node namespace in the way) removes what it made"
ip netns add ruda-n1
if "$sim" up --nodes 2 >"$tmp/up.log" 2>&1; then
  cat "$tmp/up.log"
  fail "up succeeded over a stale ruda-n1"
fi
[ -z "$(leftovers)" ] || fail "a failed up left: $(leftovers | tr '\n' ' ')"

echo "--- up, status, run"
"$sim" up --nodes 2 --rate 1gbit
for ns in ruda-sw ruda-n0 ruda-n1; do ip netns list | grep -q "^$ns\b" || fail "no namespace $ns"; done
hosts=$("$sim" run 1 hostname | sort | tr '\n' ' ')
[ "$hosts" = "ruda-n0 ruda-n1 " ] || fail "run 1 hostname printed '$hosts', not one rank on each node"
if "$sim" run 1 false 2>/dev/null; then fail "run did not pass on a failing job's exit status"; fi

echo "--- the sharded MLP across the two nodes and on one host"
args=(mlp --hidden 32 --limit 512 --test-limit 200 --batch 64 --epochs 1 --seed 5 --log-every 1)
sent() { tc -n ruda-n0 -s qdisc show dev ruda-eth0 | awk '/Sent/ {print $2; exit}'; }
before=$(sent)
OMP_NUM_THREADS=1 RUDA_NUM_THREADS=1 "$sim" run 1 "$train" --metrics "$tmp/cluster.jsonl" "${args[@]}"
after=$(sent)
# A job that silently ran both ranks on one node, or over anything but the link, would not load it:
# the MLP's gathers and reduce-scatters move about 200 kB per step.
[ $((after - before)) -gt 500000 ] || fail "only $((after - before)) bytes crossed node 0's link"
"$mpiexec" -n 2 --oversubscribe --bind-to none --mca btl self,vader -x OMP_NUM_THREADS=1 -x RUDA_NUM_THREADS=1 \
  "$train" --metrics "$tmp/host.jsonl" "${args[@]}"
losses() { grep -o '"loss":[^,}]*\|"step":[0-9]*' "$1" | paste -d' ' - -; }
losses "$tmp/cluster.jsonl" >"$tmp/cluster.loss"
losses "$tmp/host.jsonl" >"$tmp/host.loss"
[ "$(wc -l <"$tmp/host.loss")" -eq 8 ] || fail "expected 8 steps of losses, got: $(cat "$tmp/host.loss")"
diff "$tmp/host.loss" "$tmp/cluster.loss" || fail "the losses across the nodes differ from one host's"

echo "--- hybrid sharding across the two nodes, 2 ranks each: one host's losses, fewer bytes on the link"
# Sharded within a node (its gathers and reduce-scatters over shared memory), replicated across
# nodes (only the reduced shards cross, all-reduced): the same job on one host with
# --ranks-per-node 2 gives the same losses, and far fewer bytes cross than fully sharded over 4.
args4=(mlp --hidden 64 --limit 256 --test-limit 100 --batch 64 --epochs 1 --seed 5 --log-every 1)
# Two ranks' flows per link: the deeper queue README's cluster notes give for that (4 bursts of
# 1 ms beyond the first; tc shows the queue as the latency it adds).
RUDA_SIM_QUEUE_BURSTS=4 "$sim" rate 1gbit
tc -n ruda-n0 qdisc show dev ruda-eth0 | grep -q "lat 4ms" ||
  fail "RUDA_SIM_QUEUE_BURSTS=4 did not set a queue of 5 bursts: $(tc -n ruda-n0 qdisc show dev ruda-eth0)"
before=$(sent)
OMP_NUM_THREADS=1 RUDA_NUM_THREADS=1 "$sim" run 2 "$train" --metrics "$tmp/full4.jsonl" "${args4[@]}"
full_bytes=$(($(sent) - before))
before=$(sent)
OMP_NUM_THREADS=1 RUDA_NUM_THREADS=1 "$sim" run 2 "$train" --hybrid --check-collectives \
  --metrics "$tmp/hybrid.jsonl" "${args4[@]}" | tee "$tmp/hybrid.log"
hybrid_bytes=$(($(sent) - before))
grep -q "hybrid sharded over 2 nodes x 2 ranks (mpi)" "$tmp/hybrid.log" || fail "the hybrid job did not find 2 nodes x 2 ranks"
"$mpiexec" -n 4 --oversubscribe --bind-to none --mca btl self,vader -x OMP_NUM_THREADS=1 -x RUDA_NUM_THREADS=1 \
  "$train" --hybrid --ranks-per-node 2 --metrics "$tmp/hybrid-host.jsonl" "${args4[@]}"
losses "$tmp/hybrid.jsonl" >"$tmp/hybrid.loss"
losses "$tmp/hybrid-host.jsonl" >"$tmp/hybrid-host.loss"
losses "$tmp/full4.jsonl" >"$tmp/full4.loss"
[ "$(wc -l <"$tmp/hybrid.loss")" -eq 4 ] || fail "expected 4 steps of hybrid losses, got: $(cat "$tmp/hybrid.loss")"
diff "$tmp/hybrid-host.loss" "$tmp/hybrid.loss" || fail "the hybrid losses across the nodes differ from one host's"
# And the single-process reference (dense: one rank holds everything), within rounding.
OMP_NUM_THREADS=1 RUDA_NUM_THREADS=1 "$train" --metrics "$tmp/dense.jsonl" "${args4[@]}" >/dev/null
losses "$tmp/dense.jsonl" >"$tmp/dense.loss"
paste "$tmp/dense.loss" "$tmp/hybrid.loss" | awk '{
    split($1, a, ":"); split($3, b, ":"); d = a[2] - b[2]; if (d < 0) d = -d;
    if (d > 1e-5 * (a[2] < 0 ? -a[2] : a[2])) { print "step " NR ": dense " a[2] ", hybrid " b[2]; bad = 1 }
  } END { exit bad }' || fail "the hybrid losses across the nodes differ from the dense ones"
echo "bytes out of node 0 for 4 steps: full shard $full_bytes, hybrid $hybrid_bytes"
[ $((hybrid_bytes * 2)) -lt "$full_bytes" ] || fail "hybrid sent $hybrid_bytes bytes, not under half of full shard's $full_bytes"

echo "--- run from a checkout whose path has a space (OpenMPI splits plm_rsh_agent's value on whitespace)"
spaced="$tmp/a checkout/tools"
mkdir -p "$spaced"
cp "$(dirname "$sim")"/{cluster-sim,cluster-sim-agent,common.sh} "$spaced/"
hosts=$("$spaced/cluster-sim" run 1 hostname | sort | tr '\n' ' ')
[ "$hosts" = "ruda-n0 ruda-n1 " ] || fail "run from '$spaced' printed '$hosts', not one rank on each node"

echo "--- calibrate restores the link setting it found, after a failing suite too"
# Stub ruda-bench-mpi folders (RUDA_BIN_DIR: nothing is built): one whose suite fails, one whose
# suite succeeds. The links are at 1gbit with 4 bursts of queue (set above).
for outcome in fail ok; do
  mkdir -p "$tmp/$outcome-bin"
  ln -s "$train" "$tmp/$outcome-bin/ruda-train"
  printf '#!/bin/sh\nexit %s\n' "$([ $outcome = ok ] && echo 0 || echo 3)" >"$tmp/$outcome-bin/ruda-bench-mpi"
  chmod +x "$tmp/$outcome-bin/ruda-bench-mpi"
  status=0
  RUDA_BIN_DIR=$tmp/$outcome-bin "$sim" calibrate --rates 10gbit >"$tmp/calibrate.log" 2>&1 || status=$?
  if [ $outcome = ok ] && [ $status != 0 ]; then cat "$tmp/calibrate.log"; fail "calibrate exited $status on a suite that succeeded"; fi
  if [ $outcome = fail ] && [ $status = 0 ]; then cat "$tmp/calibrate.log"; fail "calibrate exited 0 on a suite that failed"; fi
  qdisc=$(tc -n ruda-n0 qdisc show dev ruda-eth0)
  if ! grep -q "rate 1Gbit" <<<"$qdisc" || ! grep -q "lat 4ms" <<<"$qdisc"; then
    fail "calibrate ($outcome) left the link at '$qdisc', not 1gbit with 4 bursts of queue"
  fi
done

echo "--- down leaves nothing, twice"
"$sim" down
[ -z "$(leftovers)" ] || fail "down left: $(leftovers | tr '\n' ' ')"
"$sim" down
echo "PASS"

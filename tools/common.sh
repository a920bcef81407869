# Shared by the scripts in tools/: paths, building, and running MPI on this machine.
# Source it: . "$(dirname "$0")/common.sh"

RUDA_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export RUDA_ROOT

# ruda_usage: the calling script's leading comment (its lines after #! up to `set -euo pipefail`)
# without the '#'s, which is what its --help prints.
ruda_usage() {
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
}

# ruda_help_if_asked "$@": with --help (or -h) as the only argument, prints ruda_usage and exits 0,
# before anything is installed or built.
ruda_help_if_asked() {
  if [ $# -eq 1 ] && { [ "$1" = --help ] || [ "$1" = -h ]; }; then
    ruda_usage
    exit 0
  fi
}

# MPI on one machine, as root or not: traffic on loopback only, shared memory between ranks,
# more ranks than cores allowed, no core binding (or every rank's threads share one core).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
export OMPI_MCA_rmaps_base_oversubscribe=1

# ruda_mpiexec N program args...: N ranks here, each with cores/N intra-op threads.
ruda_mpiexec() {
  local ranks=$1
  shift
  local cores
  cores=$(nproc)
  local threads=$(( cores / ranks ))
  [ "$threads" -ge 1 ] || threads=1
  # --quiet: after an error every rank agreed on (each prints nothing or one line and exits non-zero),
  # OpenMPI's "Primary job terminated normally, but 1 process returned a non-zero exit code"
  # banner would only repeat it. The exit code is kept.
  mpiexec --quiet -n "$ranks" --oversubscribe --bind-to none --mca btl self,vader \
    -x OMP_NUM_THREADS="${OMP_NUM_THREADS:-$threads}" -x RUDA_NUM_THREADS="${RUDA_NUM_THREADS:-$threads}" "$@"
}

# ruda_build PRESET: configure (once) and build a CMake preset, quietly unless it fails. The output
# is held in memory, not in a temporary file: a file would be left behind when the build is
# interrupted (INT, TERM), and a trap here would replace the calling script's own.
ruda_build() {
  local preset=$1
  local out
  if ! out=$({ cmake --preset "$preset" -S "$RUDA_ROOT" && cmake --build --preset "$preset"; } 2>&1); then
    printf '%s\n' "$out" >&2
    echo "ruda: the $preset build failed (output above)" >&2
    return 1
  fi
}

# ruda_release_bin: prints the folder of release binaries a script runs. With RUDA_BIN_DIR set, that
# already built folder, untouched (the tests run the scripts on the build they test); otherwise
# build/release/bin, after installing what is missing and building it.
ruda_release_bin() {
  if [ -n "${RUDA_BIN_DIR:-}" ]; then
    if [ ! -x "$RUDA_BIN_DIR/ruda-train" ]; then
      echo "ruda: RUDA_BIN_DIR=$RUDA_BIN_DIR holds no ruda-train" >&2
      return 1
    fi
    echo "$RUDA_BIN_DIR"
    return 0
  fi
  "$RUDA_ROOT/tools/setup" >&2
  ruda_build release >&2
  echo "$RUDA_ROOT/build/release/bin"
}

#!/usr/bin/env bash
# Builds and runs the peers that `gin-bench cuda --peer-json` compares
# gin-rs against, in the same job (issue 22; docs/cuda.md, "Peers in the same
# job"). Called by run.sh (full suite) before gin-bench cuda, under run.sh's
# MPS daemon when the machine has one GPU.
#
# usage: peers.sh RESULTS_DIR
# Writes RESULTS_DIR/peer-nvshmem.json, or RESULTS_DIR/peer-nvshmem.why (one
# line: why there is none), and the build and PE logs beside them; and
# RESULTS_DIR/peer-nccl.why, as there is no NCCL peer program (yet). Fails
# softly: a peer that cannot be built or run leaves its reason and the script
# still exits 0; gin-bench prints the reason in the peer's column.
#
# Environment (all optional):
#   GIN_NVCC                 nvcc (default /usr/local/cuda/bin/nvcc, then PATH)
#   GIN_NVSHMEM_DIR          NVSHMEM's root, holding include/nvshmem.h and
#                            lib/ (default: found in a Python environment's
#                            nvidia/nvshmem, as the nvidia-nvshmem-cu* wheels
#                            install it)
#   GIN_PEER_NVSHMEM_ARGS    the PEs' options (default: gin-bench cuda's
#                            full-suite shapes, block coop at 512 and 1024)
#   GIN_PEER_TIMEOUT         seconds each PE may run (default 300)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: peers.sh RESULTS_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
json="$out/peer-nvshmem.json"
why="$out/peer-nvshmem.why"
rm -f "$json" "$why" "$out"/peer-nvshmem-*.log "$out/peer-nccl.json" "$out/peer-nccl.why"
# The binary and the unique-id file stay out of the results.
build="$(mktemp -d /tmp/gin-peers.XXXXXX)" || { echo "no temporary directory" > "$why"; exit 0; }
trap 'rm -rf "$build"' EXIT

# NCCL: no peer program. On one GPU there cannot be one: NCCL 2.28's
# communicator init refuses two ranks on one GPU of one host ("Duplicate GPU
# detected", ncclInvalidUsage; src/init.cc).
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if [ "${ngpu:-0}" -eq 1 ]; then
  echo "NCCL refuses two ranks on one GPU (Duplicate GPU detected), so it cannot run beside gin-rs here" > "$out/peer-nccl.why"
else
  echo "no NCCL peer program yet (only NVSHMEM's is built)" > "$out/peer-nccl.why"
fi
echo "peer nccl: none: $(cat "$out/peer-nccl.why")"

missing() {
  echo "$*" > "$why"
  echo "peer nvshmem: none: $*"
  exit 0
}

nvcc="${GIN_NVCC:-}"
[ -n "$nvcc" ] || { [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc; }
[ -n "$nvcc" ] || nvcc="$(command -v nvcc || true)"
[ -n "$nvcc" ] || missing "no nvcc on this machine (looked in /usr/local/cuda/bin and PATH; set GIN_NVCC)"
[ -x "$nvcc" ] || missing "GIN_NVCC=$nvcc is not an executable"

root="${GIN_NVSHMEM_DIR:-}"
if [ -z "$root" ]; then
  h=$(find /opt /usr /root /home -xdev -path '*/nvidia/nvshmem/include/nvshmem.h' 2>/dev/null | head -1)
  [ -n "$h" ] && root="$(dirname "$(dirname "$h")")"
fi
[ -n "$root" ] && [ -f "$root/include/nvshmem.h" ] ||
  missing "no NVSHMEM found (no */nvidia/nvshmem/include/nvshmem.h under /opt /usr /root /home; set GIN_NVSHMEM_DIR)"
lib="$root/lib"
[ -d "$lib" ] || lib="$root/lib64"
host=$(ls "$lib"/libnvshmem_host.so* 2>/dev/null | head -1)
[ -n "$host" ] && [ -f "$lib/libnvshmem_device.a" ] ||
  missing "NVSHMEM at $root has no libnvshmem_host.so* and libnvshmem_device.a in $lib"

# This GPU's architecture (compute capability 9.0 -> sm_90).
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
arch="sm_${cc:-90}"
bin="$build/nvshmem_pingpong"
echo "building the NVSHMEM peer: $nvcc, $arch, NVSHMEM at $root"
if ! "$nvcc" -std=c++17 -rdc=true -arch="$arch" -I "$root/include" "$here/nvshmem_pingpong.cu" \
  -o "$bin" -L "$lib" -lnvshmem_device "-l:$(basename "$host")" -Xlinker "-rpath,$lib" \
  > "$out/peer-nvshmem-build.log" 2>&1; then
  err=$(grep -m1 -E 'error|cannot find|undefined reference' "$out/peer-nvshmem-build.log" || tail -n 1 "$out/peer-nvshmem-build.log")
  missing "the NVSHMEM peer did not build with $nvcc against $root: $err (peer-nvshmem-build.log)"
fi

if [ "${ngpu:-0}" -eq 1 ] && [ -z "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
  missing "one GPU and no MPS daemon: its two PEs would be time-sliced, so their figures would measure the slices"
fi
# The unique-id bootstrap listens on loopback (its default skips lo, and the
# machine may have no other interface); no NIC transports; on one GPU under
# MPS both PEs use all SMs, as gin-rs's two ranks do, so NVSHMEM is told to
# ignore the active-thread percentages (otherwise it limits what it supports).
env_=(NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="${NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME:-lo}"
      NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_SYMMETRIC_SIZE=64m NVSHMEM_DISABLE_NVLS=1)
[ "${ngpu:-0}" -eq 1 ] && env_+=(NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1)
read -r -a args <<< "${GIN_PEER_NVSHMEM_ARGS:---sizes 8,1k,64k,1m --coops thread,warp,block --block-threads 512,1024 --iters 2000 --runs 5 --bw-bytes 4m --blocks 16,32,66,132 --threads 512}"
limit="${GIN_PEER_TIMEOUT:-300}"
uid="$build/nvshmem.uid"
echo "running 2 PEs: ${env_[*]} nvshmem_pingpong --pe {0,1} --uid-file $uid ${args[*]}"
timeout "$limit" env "${env_[@]}" "$bin" --pe 1 --uid-file "$uid" --timeout 60 "${args[@]}" \
  > "$out/peer-nvshmem-pe1.log" 2>&1 &
pe1=$!
timeout "$limit" env "${env_[@]}" "$bin" --pe 0 --uid-file "$uid" --json "$json" "${args[@]}" \
  > "$out/peer-nvshmem-pe0.log" 2>&1
r0=$?
# PE 0 failed: PE 1 would wait for it until its timeout.
[ "$r0" -ne 0 ] && kill "$pe1" 2>/dev/null
wait "$pe1"
r1=$?
cat "$out/peer-nvshmem-pe0.log"
if [ "$r0" -ne 0 ] || [ "$r1" -ne 0 ] || [ ! -s "$json" ]; then
  rm -f "$json"
  said() {
    if [ "$2" -eq 124 ]; then echo "PE $1 timed out after $limit s"
    elif [ "$1" -eq 1 ] && [ "$r0" -ne 0 ] && [ "$2" -eq 143 ]; then echo "PE 1 stopped after PE 0 failed"
    else echo "PE $1 exit $2: $(grep -v '^\s*$' "$out/peer-nvshmem-pe$1.log" | tail -n 1)"; fi
  }
  missing "the NVSHMEM peer failed to run: $(said 0 "$r0"); $(said 1 "$r1") (peer-nvshmem-pe0.log, peer-nvshmem-pe1.log)"
fi
echo "peer nvshmem: wrote $json"

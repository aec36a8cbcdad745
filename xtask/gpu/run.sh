#!/usr/bin/env bash
# Runs gin-rs's CUDA tests and benchmarks on a GPU machine that has a CUDA
# driver and NVRTC but no Rust toolchain. Made by `cargo xtask gpu-package`;
# usage: ./run.sh RESULTS_DIR [quick|full]. Every step's output goes to
# RESULTS_DIR/<step>.log; the exit status is non-zero if any step failed.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: run.sh RESULTS_DIR [quick|full]}"
suite="${2:-full}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
# Never use NVLink multicast on shared machines.
export GIN_DEBUG="${GIN_DEBUG:-info}"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# NVRTC: from the CUDA toolkit or a Python wheel (nvidia-cuda-nvrtc).
if [ -z "${GIN_NVRTC_DIR:-}" ]; then
  lib=$(ls /usr/local/cuda/lib64/libnvrtc.so.1* 2>/dev/null | head -1)
  [ -n "$lib" ] || lib=$(find / -xdev -name 'libnvrtc.so.13*' -not -path '*/proc/*' 2>/dev/null | head -1)
  GIN_NVRTC_DIR=$(dirname "${lib:-/nonexistent/x}")
fi
export LD_LIBRARY_PATH="$GIN_NVRTC_DIR:${LD_LIBRARY_PATH:-}"
echo "NVRTC from $GIN_NVRTC_DIR"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$out/gpus.txt"
nvidia-smi topo -m > "$out/topo.txt" 2>&1 || true
# (GPUs only: under MIG, nvidia-smi -L lists the instances too.)
ngpu=$(nvidia-smi -L | grep -c '^GPU ')
fail=0
# One GPU: the ranks share it, and without MPS the GPU time-slices their
# processes, so the benchmarks would measure the slices. Start a private MPS
# daemon for this script's processes (its own pipe directory; the card's
# settings are untouched) and stop it on exit. GIN_NO_MPS=1 keeps it off.
if [ "$ngpu" -eq 1 ] && [ -z "${GIN_NO_MPS:-}" ] && command -v nvidia-cuda-mps-control > /dev/null; then
  # (A short pipe path: it holds a Unix socket. Never the system's default
  # directory: quitting would stop someone else's daemon.)
  if pipe="$(mktemp -d /tmp/gin-mps.XXXXXX)"; then
    export CUDA_MPS_PIPE_DIRECTORY="$pipe" CUDA_MPS_LOG_DIRECTORY="$out/mps-log"
    mkdir -p "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
      trap 'echo quit | nvidia-cuda-mps-control; rm -rf "$CUDA_MPS_PIPE_DIRECTORY"' EXIT
      echo "one GPU: MPS started for this run ($CUDA_MPS_PIPE_DIRECTORY)"
    else
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
      rm -rf "$pipe"
      echo "one GPU: MPS did not start; the ranks will be time-sliced and the benchmarks say so"
    fi
  else
    echo "one GPU: no temporary directory for MPS; the ranks will be time-sliced"
  fi
fi
step() {
  local name="$1"; shift
  echo "== $name: $*"
  if "$@" > "$out/$name.log" 2>&1; then
    tail -n 40 "$out/$name.log"
  else
    echo "FAILED ($name), last lines:"; tail -n 60 "$out/$name.log"; fail=1
  fi
}
expect_die() {
  # The victim aborts; the survivor must report an error naming it, and
  # the launcher must not hang.
  local name="$1"; shift
  echo "== $name: $*"
  timeout 120 "$@" > "$out/$name.log" 2>&1
  if grep -q "FAILED: .*rank 1 died" "$out/$name.log"; then
    grep -E "FAILED" "$out/$name.log" | head -5
  else
    echo "FAILED ($name): no error naming the dead peer"; tail -n 40 "$out/$name.log"; fail=1
  fi
}
expect_refused() {
  # A choice this machine cannot serve must fail on every rank with an
  # error naming it, promptly.
  local name="$1" want="$2"; shift 2
  echo "== $name: $*"
  timeout 60 "$@" > "$out/$name.log" 2>&1
  if grep -q "$want" "$out/$name.log"; then
    grep -m1 "$want" "$out/$name.log"
  else
    echo "FAILED ($name): no error saying '$want'"; tail -n 20 "$out/$name.log"; fail=1
  fi
}
st="$here/gin-cuda-selftest"
for backend in auto proxy gdaki; do
  step "selftest-$backend" env GIN_BACKEND=$backend "$st" all --ranks 2
  step "badinput-$backend" env GIN_BACKEND=$backend GIN_TIMEOUT=2s "$st" badinput --ranks 2
  expect_die "die-$backend" env GIN_BACKEND=$backend GIN_TIMEOUT=60s "$st" die 1 --ranks 2
done
# NCCL's GIN all-to-all kernel, in NCCL's names, through gin/nccl_compat.cuh.
for backend in auto proxy gdaki; do
  step "nccl-alltoall-$backend" env GIN_BACKEND=$backend "$st" nccl-alltoall --ranks 2
done
# The shallowest queues each backend accepts: credit and wraparound all the time.
step "selftest-proxy-depth2" env GIN_BACKEND=proxy GIN_SELFTEST_QUEUE_DEPTH=2 "$st" all --ranks 2
step "selftest-gdaki-depth4" env GIN_BACKEND=gdaki GIN_SELFTEST_QUEUE_DEPTH=4 "$st" all --ranks 2
# Peers over TCP: GPU memory staged through host memory (what CUDA ranks on
# different hosts do). GIN_TRANSPORT=tcp puts every peer on TCP; --hosts 2
# emulates two hosts, so auto mixes load/store (same host) and the proxy.
for backend in proxy gdaki; do
  step "selftest-tcp-$backend" env GIN_TRANSPORT=tcp GIN_BACKEND=$backend "$st" all --ranks 2
  step "badinput-tcp-$backend" env GIN_TRANSPORT=tcp GIN_BACKEND=$backend GIN_TIMEOUT=2s "$st" badinput --ranks 2
  step "dropped-tcp-$backend" env GIN_TRANSPORT=tcp GIN_BACKEND=$backend "$st" dropped --ranks 2
done
expect_die "die-tcp-proxy" env GIN_TRANSPORT=tcp GIN_BACKEND=proxy GIN_TIMEOUT=60s "$st" die 1 --ranks 2
for backend in auto proxy gdaki; do
  step "selftest-2hosts-$backend" env GIN_BACKEND=$backend "$st" all --ranks 4 --hosts 2
done
# The mlx5 hardware path: rdma-core loaded at run time, no ConnectX here.
expect_refused "mlx5-refused" "GIN_NIC=mlx5 is not available" \
  env GIN_BACKEND=gdaki GIN_NIC=mlx5 "$st" ring --ranks 2
if [ "$ngpu" -ge 4 ]; then
  for backend in auto proxy gdaki; do
    step "selftest-4ranks-$backend" env GIN_BACKEND=$backend "$st" all --ranks 4
  done
fi
# gin-ep's low-latency mode on CUDA ranks (kernels/ll.cu through NVRTC):
# DeepEP's oracle (exact tokens, ordered per-source blocks, weights,
# per-expert counts, combine within calc_diff, repeats bit-identical) with 2
# and 4 ranks (one GPU: shared under MPS), on each backend, at DeepEP's
# low-latency shape, and on two emulated hosts (the other host's peers over
# TCP through the proxy).
ep="$here/gin-ep-selftest"
for n in 2 4; do
  for backend in auto proxy gdaki; do
    step "ep-ll-cuda-${n}ranks-$backend" env GIN_BACKEND=$backend "$ep" ll device=cuda ranks=$n
  done
done
step "ep-ll-cuda-2ranks-deepep-shape" "$ep" ll device=cuda ranks=2 tokens=128 hidden=7168 topk=8 experts=32 repeats=5
step "ep-ll-cuda-4ranks-2hosts" "$ep" ll device=cuda ranks=4 hosts=2
if [ "$suite" = full ]; then
  # Low-latency dispatch + combine on CUDA ranks beside the same-job floor
  # (DeepEP's shape: 128 tokens, hidden 7168, top-8, 32 experts per rank).
  for n in 2 4; do
    step "bench-moe-cuda-${n}ranks" "$here/gin-bench" moe --device cuda --ranks $n --json "$out/moe-cuda-${n}ranks.json"
  done
  # Peers in the same job (issue 22): NVSHMEM's put-with-signal ping-pong and
  # put bandwidth, built here with this machine's nvcc against its NVSHMEM and
  # run with 2 PEs (one GPU: under this MPS daemon). Fails softly: without
  # them peer-nvshmem.why says why, and gin-bench's column prints it.
  step "peers" bash "$here/peers/peers.sh" "$out"
  # NVSHMEM's block figures are usually for 1024-thread blocks: the block
  # coop's ping-pong at 1024 too, beside the peer's 1024-thread rows.
  step "bench-cuda-block1024" "$here/gin-bench" cuda --tests pingpong --paths loadstore --coops block \
    --block-threads 1024 --json "$out/cuda-block1024.json" --peer-json "$out/peer-nvshmem.json"
  step "bench-cuda" "$here/gin-bench" cuda --json "$out/cuda.json" --csv "$out/cuda.csv" \
    --peer-json "$out/peer-nvshmem.json" --peer-json "$out/peer-nccl.json"
  # The suite's common flags reach the same measurements.
  step "pingpong-device-cuda" "$here/gin-bench" pingpong --device cuda --sizes 8,64k --coop block --iters 500 --runs 3
  step "bench-cuda-tcp" env GIN_TRANSPORT=tcp "$here/gin-bench" cuda --tests pingpong,bandwidth --paths proxy,gdaki --sizes 8,1k,64k,1m --blocks 16 --runs 3 --json "$out/cuda-tcp.json"
else
  step "bench-cuda" "$here/gin-bench" cuda --sizes 8,64k --coops block --iters 500 --runs 3 --blocks 32 --json "$out/cuda.json"
fi
# A/B against another build (GIN_AB_BASE=path/to/its/gin-bench), in ABBA
# order so drift over the run falls on both alike: the round trips and
# bandwidths the one-engine refactor must not slow down.
if [ -n "${GIN_AB_BASE:-}" ]; then
  ab=(cuda --tests pingpong,bandwidth --paths loadstore,proxy,gdaki --sizes 8,64k --coops block
      --iters 1000 --blocks 16,66 --runs 5)
  i=0
  for who in base new new base; do
    i=$((i + 1))
    if [ "$who" = base ]; then bin="$GIN_AB_BASE"; else bin="$here/gin-bench"; fi
    step "ab-$i-$who" "$bin" "${ab[@]}" --json "$out/ab-$i-$who.json"
  done
fi
exit $fail

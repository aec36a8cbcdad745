#!/usr/bin/env bash
# Runs gin-rs's CUDA tests and benchmarks on a GPU machine that has a CUDA
# driver and NVRTC but no Rust toolchain. Made by `cargo xtask gpu-package`;
# usage: ./run.sh RESULTS_DIR [quick|check|bench|full]. Every step's output
# goes to RESULTS_DIR/<step>.log; the exit status is non-zero if any step
# failed. Suites: `check` runs every correctness step (selftests, bad input,
# dead peers, NCCL's kernel, parity, the fused example, gin-ep's oracle, the
# UCX selftests); `bench` runs every benchmark (gin-bench cuda and moe, the
# peers built here, the UCX benchmarks and ucx_perftest floor); `full` is
# both (it takes longer than a ten-minute slot: run check and bench as two
# calls there); `quick` is check without UCX plus a short benchmark.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: run.sh RESULTS_DIR [quick|check|bench|full]}"
suite="${2:-full}"
case "$suite" in
  quick | check | bench | full) ;;
  *) echo "unknown suite '$suite': quick, check, bench or full" >&2; exit 2 ;;
esac
checks="" benches="" ucx=""
[ "$suite" = bench ] || checks=1
[ "$suite" = bench ] || [ "$suite" = full ] && benches=1
[ "$suite" = quick ] || ucx=1
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
# Cleanup on exit: the MPS daemon this script started, UCX's unpacked copy.
mps_up="" ucx_tmp=""
on_exit() {
  if [ -n "$mps_up" ]; then echo quit | nvidia-cuda-mps-control; rm -rf "$CUDA_MPS_PIPE_DIRECTORY"; fi
  if [ -n "$ucx_tmp" ]; then rm -rf "$ucx_tmp"; fi
}
trap on_exit EXIT
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
      mps_up=1
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
# GIN_STEPS=REGEX runs only the steps whose names match (bash regex), e.g.
# GIN_STEPS='^ep-ht' to rerun one group in a short device slot.
wanted() { [ -z "${GIN_STEPS:-}" ] || [[ "$1" =~ $GIN_STEPS ]]; }
step() {
  local name="$1" t0=$SECONDS; shift
  wanted "$name" || return 0
  echo "== $name: $*"
  if "$@" > "$out/$name.log" 2>&1; then
    tail -n 40 "$out/$name.log"
    echo "-- $name: ok in $((SECONDS - t0)) s"
  else
    echo "FAILED ($name) after $((SECONDS - t0)) s, last lines:"; tail -n 60 "$out/$name.log"; fail=1
  fi
}
expect_die() {
  # The victim aborts; the survivor must report an error naming it, and
  # the launcher must not hang.
  local name="$1"; shift
  wanted "$name" || return 0
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
  wanted "$name" || return 0
  echo "== $name: $*"
  timeout 60 "$@" > "$out/$name.log" 2>&1
  if grep -q "$want" "$out/$name.log"; then
    grep -m1 "$want" "$out/$name.log"
  else
    echo "FAILED ($name): no error saying '$want'"; tail -n 20 "$out/$name.log"; fail=1
  fi
}
expect_refused_by() {
  # As expect_refused, but each of the first N ranks must print its own
  # refusal: a line "FAILED: rank R <want>" for every R (the launcher
  # prefixes each with "[rank R] ").
  local name="$1" n="$2" want="$3" r missing=""; shift 3
  wanted "$name" || return 0
  echo "== $name: $*"
  timeout 60 "$@" > "$out/$name.log" 2>&1
  for r in $(seq 0 $((n - 1))); do
    grep -q "FAILED: rank $r $want" "$out/$name.log" || missing="$missing $r"
  done
  if [ -z "$missing" ]; then
    grep -o "FAILED: rank [0-9]* $want" "$out/$name.log" | cut -c1-240 | head -n "$n"
  else
    echo "FAILED ($name): no error saying '$want' from rank(s)$missing"; tail -n 20 "$out/$name.log"; fail=1
  fi
}
st="$here/gin-cuda-selftest"
ep="$here/gin-ep-selftest"
if [ -n "$checks" ]; then
for backend in auto proxy gdaki; do
  step "selftest-$backend" env GIN_BACKEND=$backend "$st" all --ranks 2
  step "badinput-$backend" env GIN_BACKEND=$backend GIN_TIMEOUT=2s "$st" badinput --ranks 2
  expect_die "die-$backend" env GIN_BACKEND=$backend GIN_TIMEOUT=60s "$st" die 1 --ranks 2
  # Kernels compiled with the load/store path alone (GIN_QUEUE_PATHS=0):
  # verified where every peer is load/store (auto), refused naming the peer
  # and the path where a queue path reaches it (proxy, gdaki).
  step "queue-paths-$backend" env GIN_BACKEND=$backend "$st" queue-paths --ranks 2
done
# NCCL's GIN all-to-all kernel, in NCCL's names, through gin/nccl_compat.cuh.
for backend in auto proxy gdaki; do
  step "nccl-alltoall-$backend" env GIN_BACKEND=$backend "$st" nccl-alltoall --ranks 2
done
# Header parity with the Rust API (issue 21): 1/2/4/8-byte put_value, weak
# and VA signals, per-call timeouts, flush_async/wait and barrier fences on
# every coop; the copy-engine paths must refuse what they cannot apply.
for backend in auto proxy gdaki; do
  step "parity-$backend" env GIN_BACKEND=$backend "$st" parity --ranks 2
done
# CUDA ranks as a library (issue 21): a user's fused all-to-all + reduction
# kernel on the user's cudarc stream with the user's memory as windows,
# launched through cudarc's builder or CudaDevComm::launch_on, watched by
# the watcher thread; and a rank that dies under it.
fa="$here/fused-alltoall"
step "fused-cudarc" "$fa" --ranks 2
step "fused-launch-on-nvrtc" "$fa" --ranks 2 --launcher gin --nvrtc
step "fused-cooperative" "$fa" --ranks 2 --cooperative
step "fused-launch-on-cooperative" "$fa" --ranks 2 --launcher gin --cooperative
for backend in proxy gdaki; do
  step "fused-$backend" env GIN_BACKEND=$backend "$fa" --ranks 2
done
step "fused-tcp-proxy" env GIN_TRANSPORT=tcp GIN_BACKEND=proxy "$fa" --ranks 2
expect_die "fused-die" env GIN_TIMEOUT=60s "$fa" --ranks 2 --die 1
# Users' VMM memory as windows (issue 21): the windows' buffers from the
# user's own cuMemCreate allocator, requesting the POSIX file descriptor
# handle type; same-host peers import each part from the descriptor its
# rank hands over a Unix socket, and the all-to-all is verified as above
# (over TCP nothing is exported: the part is served through staging).
# Without that handle type every rank must refuse its memory, saying what
# to request.
for backend in auto proxy gdaki; do
  step "fused-vmm-$backend" env GIN_BACKEND=$backend "$fa" --ranks 2 --memory vmm
done
step "fused-vmm-tcp-proxy" env GIN_TRANSPORT=tcp GIN_BACKEND=proxy "$fa" --ranks 2 --memory vmm
expect_refused_by "fused-vmm-no-fd" 2 "cannot register .*created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR" \
  "$fa" --ranks 2 --memory vmm-no-fd
# CUDA graphs (issue 21): the replayable fused kernel captured once on the
# user's cudarc stream (cudarc's builder, or launch_on on the capturing
# stream), replayed 20 times, each replay watched, checked and verified;
# each log ends with what check() does inside a capture (the "probe:" part).
step "fused-graph-cudarc" timeout 300 "$fa" --ranks 2 --graph --iters 20
step "fused-graph-launch-on" timeout 300 "$fa" --ranks 2 --graph --iters 20 --launcher gin
step "fused-graph-launch-on-nvrtc" timeout 300 "$fa" --ranks 2 --graph --launcher gin --nvrtc
for backend in proxy gdaki; do
  step "fused-graph-$backend" env GIN_BACKEND=$backend timeout 300 "$fa" --ranks 2 --graph --iters 20
done
step "fused-graph-tcp-proxy" env GIN_TRANSPORT=tcp GIN_BACKEND=proxy timeout 300 "$fa" --ranks 2 --graph --iters 20
step "fused-graph-cooperative" timeout 300 "$fa" --ranks 2 --graph --cooperative
# Three ranks on one GPU: where one signal per sender matters (both kernels).
# Four rounds queued at once on each rank's stream: the engine's copies must
# not share a hardware work queue with the user's waiting kernels, and under
# MPS the clients share one small pool of them (docs/cuda.md, "Hardware work
# queues"): at the default this deadlocks until the kernels time out; with
# 16 connections per client it runs.
step "fused-3ranks-proxy" env CUDA_DEVICE_MAX_CONNECTIONS=16 GIN_BACKEND=proxy GIN_TIMEOUT=20s timeout 120 "$fa" --ranks 3
step "fused-3ranks-gdaki" env CUDA_DEVICE_MAX_CONNECTIONS=16 GIN_BACKEND=gdaki GIN_TIMEOUT=20s timeout 120 "$fa" --ranks 3
step "fused-graph-3ranks-proxy" env GIN_BACKEND=proxy GIN_TIMEOUT=20s timeout 120 "$fa" --ranks 3 --graph --iters 20
# At the default work queues the same run either passes or fails naming the
# engine's stalled stream and CUDA_DEVICE_MAX_CONNECTIONS: never a bare
# timeout, and never a hang.
for backend in proxy gdaki; do
  name="fused-3ranks-$backend-default-queues"
  wanted "$name" || continue
  echo "== $name"
  t0=$SECONDS
  timeout 120 env -u CUDA_DEVICE_MAX_CONNECTIONS GIN_BACKEND=$backend GIN_TIMEOUT=20s "$fa" --ranks 3 > "$out/$name.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    echo "-- $name: ok in $((SECONDS - t0)) s (no stall this time)"
  elif grep -q "stalled: work it queued.*CUDA_DEVICE_MAX_CONNECTIONS" "$out/$name.log" && [ $rc -ne 124 ]; then
    grep -m1 -o "cause: .*stalled: work it queued[^(]*" "$out/$name.log" | cut -c1-200
    echo "-- $name: ok in $((SECONDS - t0)) s (the stall was named)"
  else
    echo "FAILED ($name) after $((SECONDS - t0)) s: neither verified nor a named stall"; tail -n 30 "$out/$name.log"; fail=1
  fi
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
for n in 2 4; do
  for backend in auto proxy gdaki; do
    step "ep-ll-cuda-${n}ranks-$backend" env GIN_BACKEND=$backend "$ep" ll device=cuda ranks=$n
  done
done
step "ep-ll-cuda-2ranks-deepep-shape" "$ep" ll device=cuda ranks=2 tokens=128 hidden=7168 topk=8 experts=32 repeats=5
step "ep-ll-cuda-4ranks-2hosts" "$ep" ll device=cuda ranks=4 hosts=2
# FP8 dispatch (payloads checked byte for byte against gin-ep's num.rs),
# the combine by puts everywhere (GIN_EP_COMBINE=put), and CPU ranks.
for n in 2 4; do
  step "ep-ll-cuda-${n}ranks-fp8" "$ep" ll device=cuda ranks=$n fp8=1
  step "ep-ll-cuda-${n}ranks-combine-put" env GIN_EP_COMBINE=put "$ep" ll device=cuda ranks=$n
  step "ep-ll-cpu-${n}ranks" "$ep" ll ranks=$n
done
step "ep-ll-cuda-2ranks-deepep-shape-fp8" "$ep" ll device=cuda ranks=2 tokens=128 hidden=7168 topk=8 experts=32 repeats=5 fp8=1
step "ep-ll-cuda-4ranks-2hosts-fp8" "$ep" ll device=cuda ranks=4 hosts=2 fp8=1
# Inputs and outputs in GPU memory (no host copy in the step): on gin's
# stream (inputs=device) and queued on the caller's stream (inputs=stream:
# synchronised after the expert, where the received tokens are read back,
# and after the combine); the same oracle, and (below) the same digests as
# host inputs. inputs=queued queues every repeat back to back, each with
# inputs of its own, synchronised once: the device-side counters and the
# grid barrier carry the steps; each step's combine is checked against its
# own inputs, and step 0's digest joins the comparisons below. Bad inputs
# in GPU memory (bad=1: rank 1's expert id out of range at token 1, slot 1,
# found by its dispatch kernel): the victim names its entry, every other
# rank PeerRefused naming rank 1, within half the job timeout, and then
# every buffer takes the next steps, which verify with the oracle (the
# -bad-named and -bad-agree steps below): on gin's stream (inputs=device,
# the dispatch returns the refusal), queued on a stream (inputs=stream:
# the expert queued after the refused dispatch ran goes ahead, check
# reports the refusal, the step's combine is queued and checks clean), and
# as the middle of three steps queued back to back (inputs=queued: every
# call goes ahead, one check reports it, the other two steps verify).
for n in 2 4; do
  step "ep-ll-cuda-${n}ranks-inputs-device" "$ep" ll device=cuda ranks=$n inputs=device
  step "ep-ll-cuda-${n}ranks-inputs-stream" "$ep" ll device=cuda ranks=$n inputs=stream
  step "ep-ll-cuda-${n}ranks-inputs-queued" "$ep" ll device=cuda ranks=$n inputs=queued
  step "ep-ll-cuda-${n}ranks-inputs-queued-fp8" "$ep" ll device=cuda ranks=$n inputs=queued fp8=1
  step "ep-ll-cuda-${n}ranks-inputs-device-fp8" "$ep" ll device=cuda ranks=$n inputs=device fp8=1
  step "ep-ll-cuda-${n}ranks-inputs-device-bad" "$ep" ll device=cuda ranks=$n inputs=device bad=1
  step "ep-ll-cuda-${n}ranks-inputs-stream-bad" "$ep" ll device=cuda ranks=$n inputs=stream bad=1
  step "ep-ll-cuda-${n}ranks-inputs-queued-bad" "$ep" ll device=cuda ranks=$n inputs=queued bad=1
  # Bad inputs in host memory: refused by the host's checks, the victim's
  # dispatch kernel still runs, poisoned (no token, POISON counts), and
  # every rank ends the step; the victim names its entry, every other rank
  # the victim at once, and the steps after it verify on every buffer.
  step "ep-ll-cuda-${n}ranks-bad" "$ep" ll device=cuda ranks=$n bad=1
  # Inputs in GPU memory refused by the host's check before anything is
  # launched (bad=tokens: rank 1 passes one token more than the buffer's
  # maximum): still a step every rank ends at once, whether the victim's
  # call waits (inputs=device), is queued (inputs=stream) or is the middle
  # one of three queued back to back (inputs=queued; the queued call queues
  # the refused step to its end and returns the error). Before, the victim
  # returned its error without launching anything, and every peer waited
  # for its count until the job timeout, which then broke its buffer.
  for kind in device stream queued; do
    step "ep-ll-cuda-${n}ranks-inputs-${kind}-bad-tokens" "$ep" ll device=cuda ranks=$n inputs=$kind bad=tokens
  done
  # A refused step whose combine goes by puts only (GIN_EP_COMBINE=put:
  # no read in place), queued back to back; and waited calls on even ranks
  # beside queued calls on odd ones (inputs=mixed), alone, with rank 1's
  # bad entry (a queued victim) or token count, and with rank 2's bad entry
  # (a waited victim; 4 ranks).
  step "ep-ll-cuda-${n}ranks-inputs-queued-bad-combine-put" env GIN_EP_COMBINE=put "$ep" ll device=cuda ranks=$n inputs=queued bad=1
  step "ep-ll-cuda-${n}ranks-inputs-mixed" "$ep" ll device=cuda ranks=$n inputs=mixed
  step "ep-ll-cuda-${n}ranks-inputs-mixed-bad" "$ep" ll device=cuda ranks=$n inputs=mixed bad=1
  step "ep-ll-cuda-${n}ranks-inputs-mixed-bad-tokens" "$ep" ll device=cuda ranks=$n inputs=mixed bad=tokens
  # The expert outputs in the caller's tensor (ll_combine_from_*).
  step "ep-ll-cuda-${n}ranks-inputs-device-expert-tensor" "$ep" ll device=cuda ranks=$n inputs=device expert=tensor
  step "ep-ll-cuda-${n}ranks-inputs-stream-expert-tensor" "$ep" ll device=cuda ranks=$n inputs=stream expert=tensor
  # A combine's tensor refused by the host's checks on rank 1 (one element
  # short), after a dispatch from host memory (-bad-combine-*), on gin's
  # stream, queued, the middle of three steps queued back to back, and
  # mixed: its output (bad=combine-out: its combine still runs in full into
  # the buffer's own memory, every other rank's result verifies) or its
  # expert outputs (bad=combine-in, ll_combine_from_*: the combine is
  # refused collectively, every other rank is told naming rank 1, its
  # output untouched). Either way rank 1's call returns Shape naming the
  # tensor, within half the job timeout, and the steps after it verify
  # (the -named and -agree steps below). Before, rank 1 returned at once
  # launching nothing, and every other rank's combine waited for its
  # signals until the job timeout, then refused every later step.
  for what in combine-out combine-in; do
    step "ep-ll-cuda-${n}ranks-bad-${what}" "$ep" ll device=cuda ranks=$n bad=$what
    for kind in device stream queued mixed; do
      step "ep-ll-cuda-${n}ranks-inputs-${kind}-bad-${what}" "$ep" ll device=cuda ranks=$n inputs=$kind bad=$what
    done
  done
  # A refused combine (rank 1's expert outputs) and, in the next step, a
  # refused dispatch (then=entry: rank 1's expert id out of range): the
  # dispatch accounts the combine's poison in the combine targets, and must
  # still end its own refusal as a step every rank ends; from host memory,
  # mixed (waited and queued ranks) and queued back to back.
  step "ep-ll-cuda-${n}ranks-bad-combine-in-then-entry" "$ep" ll device=cuda ranks=$n bad=combine-in then=entry
  for kind in mixed queued; do
    step "ep-ll-cuda-${n}ranks-inputs-${kind}-bad-combine-in-then-entry" "$ep" ll device=cuda ranks=$n inputs=$kind bad=combine-in then=entry
  done
done
# Two ranks refusing their combine's tensor in the same step (victims=1,2
# of 4): from host memory, mixed (rank 1 queued, rank 2 waited) and queued
# back to back. Each victim's call returns Shape naming its tensor; with
# refused expert outputs the other two ranks name rank 1 (the lowest),
# and each victim's own combine, a source of the other's poisoned
# signals, records nothing of it.
for what in combine-out combine-in; do
  step "ep-ll-cuda-4ranks-bad-${what}-victims12" "$ep" ll device=cuda ranks=4 bad=$what victims=1,2
  for kind in mixed queued; do
    step "ep-ll-cuda-4ranks-inputs-${kind}-bad-${what}-victims12" "$ep" ll device=cuda ranks=4 inputs=$kind bad=$what victims=1,2
  done
done
# A rank killed between two steps queued on the caller's stream: the
# watcher CudaBuffer starts with the queued launches aborts the survivor's
# waits at once (within run.sh's 60 s, against a 120 s job timeout), and
# check's error names the dead rank.
expect_refused "ep-ll-cuda-2ranks-inputs-stream-die" "queued kernel failed.*rank 1 died" \
  env GIN_TIMEOUT=120s "$ep" kill device=cuda ranks=2
step "ep-ll-cuda-2ranks-deepep-shape-inputs-stream" "$ep" ll device=cuda ranks=2 tokens=128 hidden=7168 topk=8 experts=32 repeats=5 inputs=stream
step "ep-ll-cuda-4ranks-inputs-mixed-bad-victim2" "$ep" ll device=cuda ranks=4 inputs=mixed bad=1 victim=2
step "ep-ll-cuda-4ranks-2hosts-inputs-device" "$ep" ll device=cuda ranks=4 hosts=2 inputs=device
step "ep-ll-cuda-2ranks-deepep-shape-inputs-queued" "$ep" ll device=cuda ranks=2 tokens=128 hidden=7168 topk=8 experts=32 repeats=5 inputs=queued
step "ep-ll-cuda-4ranks-2hosts-inputs-queued" "$ep" ll device=cuda ranks=4 hosts=2 inputs=queued
# The combine's result must not depend on its path: read in place (auto),
# put (proxy, GIN_EP_COMBINE=put), or CPU ranks: every rank's digest agrees.
ep_digests() { sed -n 's/.*rank \([0-9]*\) of [0-9]*: ll ok.*combine digest \([0-9a-f]*\).*/\1 \2/p' "$out/$1.log" | sort; }
ep_same_digests() {
  local ref l; ref=$(ep_digests "$1"); [ -n "$ref" ] || { echo "no digests in $1"; return 1; }
  shift; for l in "$@"; do [ "$(ep_digests "$l")" = "$ref" ] || { echo "$l differs from the first"; return 1; }; done; echo "$ref"
}
for n in 2 4; do
  step "ep-ll-${n}ranks-combine-paths-agree" ep_same_digests "ep-ll-cuda-${n}ranks-auto" "ep-ll-cuda-${n}ranks-proxy" "ep-ll-cuda-${n}ranks-combine-put" "ep-ll-cpu-${n}ranks" \
    "ep-ll-cuda-${n}ranks-inputs-device" "ep-ll-cuda-${n}ranks-inputs-stream" "ep-ll-cuda-${n}ranks-inputs-queued" \
    "ep-ll-cuda-${n}ranks-inputs-device-expert-tensor" "ep-ll-cuda-${n}ranks-inputs-stream-expert-tensor"
  step "ep-ll-${n}ranks-fp8-inputs-agree" ep_same_digests "ep-ll-cuda-${n}ranks-fp8" "ep-ll-cuda-${n}ranks-inputs-device-fp8" "ep-ll-cuda-${n}ranks-inputs-queued-fp8"
done
# After a refused step (from host inputs; in GPU memory on gin's stream,
# queued on a stream, queued back to back): rank 1 named its entry, each of
# the other n-1 ranks rank 1 (each line is an "ll ok" line: the rank's
# buffer took the verified steps after the refusal), and the steps after it
# combine bit for bit as without the refusal. Before the fix of a refusal
# of device-resident or queued inputs, those buffers refused every later
# step: no "ll ok" line, no digest.
# ep_ll_refused_named LOG N SUBJECT WHERE OWN [VICTIM]: the victim's line
# says OWN (its refusal), each other rank's that it was told.
ep_ll_refused_named() {
  local log="$out/$1.log" n=$2 subject=$3 where=$4 own=$5 vic=${6:-1} v t
  v=$(grep -c "rank $vic of $n: ll ok.*rank $vic's $subject $where: $own" "$log")
  t=$(grep -c "rank [0-9]* of $n: ll ok.*rank $vic's $subject $where: told that rank $vic's inputs were refused" "$log")
  [ "$v" = 1 ] && [ "$t" = $((n - 1)) ] || { echo "$1: victim lines $v (1 expected), told lines $t ($((n - 1)) expected)"; return 1; }
  echo "$1: rank $vic named its refusal, $t other rank(s) named rank $vic"
}
ep_ll_bad_named() { ep_ll_refused_named "$1" "$2" "bad expert id" "$3" "refused its expert" "${4:-1}"; }
ep_ll_tokens_named() { ep_ll_refused_named "$1" "$2" "token count above the maximum" "$3" "refused its [0-9]* tokens"; }
for n in 2 4; do
  step "ep-ll-${n}ranks-bad-named" ep_ll_bad_named "ep-ll-cuda-${n}ranks-bad" "$n" "in host memory"
  step "ep-ll-${n}ranks-bad-agree" ep_same_digests "ep-ll-cuda-${n}ranks-auto" "ep-ll-cuda-${n}ranks-bad"
  step "ep-ll-${n}ranks-inputs-device-bad-named" ep_ll_bad_named "ep-ll-cuda-${n}ranks-inputs-device-bad" "$n" "in GPU memory"
  step "ep-ll-${n}ranks-inputs-stream-bad-named" ep_ll_bad_named "ep-ll-cuda-${n}ranks-inputs-stream-bad" "$n" "in GPU memory, its step queued on a stream"
  step "ep-ll-${n}ranks-inputs-queued-bad-named" ep_ll_bad_named "ep-ll-cuda-${n}ranks-inputs-queued-bad" "$n" "in GPU memory, step 1 of 3 queued back to back"
  for kind in device stream queued; do
    step "ep-ll-${n}ranks-inputs-${kind}-bad-agree" ep_same_digests "ep-ll-cuda-${n}ranks-auto" "ep-ll-cuda-${n}ranks-inputs-${kind}-bad"
  done
  # The token count refused by the host's check (bad=tokens), a refusal
  # whose combine goes by puts, and mixed call kinds (waited on even ranks,
  # queued on odd ones): the same counts of lines, the same digests.
  step "ep-ll-${n}ranks-inputs-device-bad-tokens-named" ep_ll_tokens_named "ep-ll-cuda-${n}ranks-inputs-device-bad-tokens" "$n" "in GPU memory"
  step "ep-ll-${n}ranks-inputs-stream-bad-tokens-named" ep_ll_tokens_named "ep-ll-cuda-${n}ranks-inputs-stream-bad-tokens" "$n" "in GPU memory, its step queued on a stream"
  step "ep-ll-${n}ranks-inputs-queued-bad-tokens-named" ep_ll_tokens_named "ep-ll-cuda-${n}ranks-inputs-queued-bad-tokens" "$n" "in GPU memory, step 1 of 3 queued back to back"
  step "ep-ll-${n}ranks-inputs-queued-bad-combine-put-named" ep_ll_bad_named "ep-ll-cuda-${n}ranks-inputs-queued-bad-combine-put" "$n" "in GPU memory, step 1 of 3 queued back to back"
  step "ep-ll-${n}ranks-inputs-mixed-bad-named" ep_ll_bad_named "ep-ll-cuda-${n}ranks-inputs-mixed-bad" "$n" "in GPU memory[^:]*"
  step "ep-ll-${n}ranks-inputs-mixed-bad-tokens-named" ep_ll_tokens_named "ep-ll-cuda-${n}ranks-inputs-mixed-bad-tokens" "$n" "in GPU memory[^:]*"
  step "ep-ll-${n}ranks-inputs-refusals-agree" ep_same_digests "ep-ll-cuda-${n}ranks-auto" \
    "ep-ll-cuda-${n}ranks-inputs-device-bad-tokens" "ep-ll-cuda-${n}ranks-inputs-stream-bad-tokens" "ep-ll-cuda-${n}ranks-inputs-queued-bad-tokens" \
    "ep-ll-cuda-${n}ranks-inputs-queued-bad-combine-put" "ep-ll-cuda-${n}ranks-inputs-mixed" "ep-ll-cuda-${n}ranks-inputs-mixed-bad" "ep-ll-cuda-${n}ranks-inputs-mixed-bad-tokens"
done
step "ep-ll-4ranks-inputs-mixed-bad-victim2-named" ep_ll_bad_named "ep-ll-cuda-4ranks-inputs-mixed-bad-victim2" 4 "in GPU memory[^:]*" 2
step "ep-ll-4ranks-inputs-mixed-bad-victim2-agree" ep_same_digests "ep-ll-cuda-4ranks-auto" "ep-ll-cuda-4ranks-inputs-mixed-bad-victim2"
# A combine's refused tensor (bad=combine-out, bad=combine-in): rank 1's
# line says it refused its tensor, each of the other n-1 ranks' that it
# combined normally (its result verified) or was told naming rank 1 (its
# output untouched); every line is an "ll ok" line (the steps after it
# verified), and those steps combine bit for bit as without the refusal.
# ep_combine_named LOG N MODE TENSOR WHERE PEERS [WHO VRANKS NV] (MODE ll
# or ht: the high-throughput block below uses it too; WHO the victims as
# the lines name them, "rank 1" or "ranks 1,2", VRANKS a pattern of their
# ranks, NV how many).
ep_combine_named() {
  local log="$out/$1.log" n=$2 mode=$3 tensor=$4 where=$5 peers=$6 who=${7:-rank 1} vr=${8:-1} nv=${9:-1} v t
  v=$(grep -c "rank $vr of $n: $mode ok.*$who's $tensor $where: refused its $tensor" "$log")
  t=$(grep -c "rank [0-9]* of $n: $mode ok.*$who's $tensor $where: $peers" "$log")
  [ "$v" = "$nv" ] && [ "$t" = $((n - nv)) ] || { echo "$1: victim lines $v ($nv expected), peer lines $t ($((n - nv)) expected)"; return 1; }
  echo "$1: $who refused the $tensor, $t other rank(s): $peers"
}
# ep_ll_combine_named LOG N WHAT WHERE [WHO VRANKS NV]
ep_ll_combine_named() {
  local who=${5:-rank 1}
  case "$3" in
    combine-out) ep_combine_named "$1" "$2" ll "combine output" "$4" "combined normally beside $who's refused output" "$who" "${6:-1}" "${7:-1}" ;;
    *) ep_combine_named "$1" "$2" ll "expert outputs" "$4" "told that rank 1 refused the combine, its output untouched" "$who" "${6:-1}" "${7:-1}" ;;
  esac
}
# A refused combine, then a refused dispatch in the next step (then=entry):
# each line names both, the combine's refusal and rank 1's entry.
ep_ll_combine_then_named() {
  ep_ll_combine_named "$1" "$2" combine-in "$3" && ep_ll_bad_named "$1" "$2" "in [^:]*"
}
for n in 2 4; do
  for what in combine-out combine-in; do
    step "ep-ll-${n}ranks-bad-${what}-named" ep_ll_combine_named "ep-ll-cuda-${n}ranks-bad-${what}" "$n" "$what" "after a dispatch from host memory"
    step "ep-ll-${n}ranks-inputs-device-bad-${what}-named" ep_ll_combine_named "ep-ll-cuda-${n}ranks-inputs-device-bad-${what}" "$n" "$what" "in GPU memory"
    step "ep-ll-${n}ranks-inputs-stream-bad-${what}-named" ep_ll_combine_named "ep-ll-cuda-${n}ranks-inputs-stream-bad-${what}" "$n" "$what" "in GPU memory, its step queued on a stream"
    step "ep-ll-${n}ranks-inputs-queued-bad-${what}-named" ep_ll_combine_named "ep-ll-cuda-${n}ranks-inputs-queued-bad-${what}" "$n" "$what" "in GPU memory, step 1 of 3 queued back to back"
    step "ep-ll-${n}ranks-inputs-mixed-bad-${what}-named" ep_ll_combine_named "ep-ll-cuda-${n}ranks-inputs-mixed-bad-${what}" "$n" "$what" "in GPU memory[^:]*"
    step "ep-ll-${n}ranks-bad-${what}-agree" ep_same_digests "ep-ll-cuda-${n}ranks-auto" "ep-ll-cuda-${n}ranks-bad-${what}" \
      "ep-ll-cuda-${n}ranks-inputs-device-bad-${what}" "ep-ll-cuda-${n}ranks-inputs-stream-bad-${what}" \
      "ep-ll-cuda-${n}ranks-inputs-queued-bad-${what}" "ep-ll-cuda-${n}ranks-inputs-mixed-bad-${what}"
  done
  step "ep-ll-${n}ranks-bad-combine-in-then-entry-named" ep_ll_combine_then_named "ep-ll-cuda-${n}ranks-bad-combine-in-then-entry" "$n" "after a dispatch from host memory"
  step "ep-ll-${n}ranks-inputs-mixed-bad-combine-in-then-entry-named" ep_ll_combine_then_named "ep-ll-cuda-${n}ranks-inputs-mixed-bad-combine-in-then-entry" "$n" "in GPU memory[^:]*"
  step "ep-ll-${n}ranks-inputs-queued-bad-combine-in-then-entry-named" ep_ll_combine_then_named "ep-ll-cuda-${n}ranks-inputs-queued-bad-combine-in-then-entry" "$n" "in GPU memory, step 1 of 3 queued back to back"
  step "ep-ll-${n}ranks-bad-combine-in-then-entry-agree" ep_same_digests "ep-ll-cuda-${n}ranks-auto" "ep-ll-cuda-${n}ranks-bad-combine-in-then-entry" \
    "ep-ll-cuda-${n}ranks-inputs-mixed-bad-combine-in-then-entry" "ep-ll-cuda-${n}ranks-inputs-queued-bad-combine-in-then-entry"
done
for what in combine-out combine-in; do
  step "ep-ll-4ranks-bad-${what}-victims12-named" ep_ll_combine_named "ep-ll-cuda-4ranks-bad-${what}-victims12" 4 "$what" "after a dispatch from host memory" "ranks 1,2" "[12]" 2
  step "ep-ll-4ranks-inputs-mixed-bad-${what}-victims12-named" ep_ll_combine_named "ep-ll-cuda-4ranks-inputs-mixed-bad-${what}-victims12" 4 "$what" "in GPU memory[^:]*" "ranks 1,2" "[12]" 2
  step "ep-ll-4ranks-inputs-queued-bad-${what}-victims12-named" ep_ll_combine_named "ep-ll-cuda-4ranks-inputs-queued-bad-${what}-victims12" 4 "$what" "in GPU memory, step 1 of 3 queued back to back" "ranks 1,2" "[12]" 2
  step "ep-ll-4ranks-bad-${what}-victims12-agree" ep_same_digests "ep-ll-cuda-4ranks-auto" "ep-ll-cuda-4ranks-bad-${what}-victims12" \
    "ep-ll-cuda-4ranks-inputs-mixed-bad-${what}-victims12" "ep-ll-cuda-4ranks-inputs-queued-bad-${what}-victims12"
done
fi
# gin-ep's high-throughput mode on CUDA ranks (kernels/ht.cu after ll.cu
# through NVRTC; host inputs): DeepEP's oracle (exact tokens, ordered
# per-source blocks, local weights, per-expert counts, combine within
# calc_diff, repeats bit-identical) with 2 and 4 ranks on one host (load/
# store), on two emulated hosts (between hosts only to the rank of the same
# local index, the proxy over TCP; within a host forwarded by load/store),
# through 2-slot rings on 3 channels (credits wrap many times a step), on
# the proxy everywhere (rows fetched by get), and with FP8 payloads. The
# kernels run the CPU ranks' protocol and reduction order: each rank's
# dispatch and combine digests must equal CPU ranks' with the same
# arguments ("ht ok ... dispatch digest D, combine digest C").
if [ -n "$checks" ]; then
  for n in 2 4; do
    step "ep-ht-cuda-${n}ranks" "$ep" ht device=cuda ranks=$n
    step "ep-ht-cpu-${n}ranks" "$ep" ht ranks=$n
  done
  step "ep-ht-cuda-4ranks-2hosts" "$ep" ht device=cuda ranks=4 hosts=2
  step "ep-ht-cpu-4ranks-2hosts" "$ep" ht ranks=4 hosts=2
  step "ep-ht-cuda-2ranks-2hosts" "$ep" ht device=cuda ranks=2 hosts=2
  step "ep-ht-cuda-4ranks-2hosts-ring2" "$ep" ht device=cuda ranks=4 hosts=2 tokens=40 ring=2 channels=3 repeats=5
  step "ep-ht-cpu-4ranks-2hosts-ring2" "$ep" ht ranks=4 hosts=2 tokens=40 ring=2 channels=3 repeats=5
  step "ep-ht-cuda-4ranks-proxy" env GIN_BACKEND=proxy "$ep" ht device=cuda ranks=4 hosts=2
  step "ep-ht-cuda-2ranks-fp8" "$ep" ht device=cuda ranks=2 fp8=1
  step "ep-ht-cuda-4ranks-2hosts-deepep-shape" "$ep" ht device=cuda ranks=4 hosts=2 tokens=512 hidden=7168 topk=8 experts=32 repeats=3
  # Inputs and output in GPU memory (ht_dispatch_device, ht_combine_device):
  # the same oracle, and (below) the same digests as host inputs and CPU
  # ranks. bad=1 (host inputs, or in GPU memory): rank 1's bad expert id is
  # refused naming its entry, every other rank is told at once by rank 1's
  # refused notify row (a protocol error naming rank 1, well within the job
  # timeout), nothing is sent, and the steps after it verify on every rank
  # (the -bad-named steps count those lines; the -bad-agree steps compare
  # the later steps' digests with CPU ranks').
  for n in 2 4; do
    step "ep-ht-cuda-${n}ranks-inputs-device" "$ep" ht device=cuda ranks=$n inputs=device
    step "ep-ht-cuda-${n}ranks-inputs-device-bad" "$ep" ht device=cuda ranks=$n inputs=device bad=1
    step "ep-ht-cuda-${n}ranks-bad" "$ep" ht device=cuda ranks=$n bad=1
    # Rank 1's ht_combine_device output one element short: its combine
    # runs in full into the buffer's own memory and returns Shape; every
    # other rank's combine verifies, then every buffer's later steps.
    step "ep-ht-cuda-${n}ranks-inputs-device-bad-combine-out" "$ep" ht device=cuda ranks=$n inputs=device bad=combine-out
  done
  # Two ranks' outputs refused in the same step (victims=1,2 of 4).
  step "ep-ht-cuda-4ranks-inputs-device-bad-combine-out-victims12" "$ep" ht device=cuda ranks=4 inputs=device bad=combine-out victims=1,2
  step "ep-ht-cuda-4ranks-2hosts-inputs-device" "$ep" ht device=cuda ranks=4 hosts=2 inputs=device
  step "ep-ht-cuda-4ranks-2hosts-ring2-inputs-device" "$ep" ht device=cuda ranks=4 hosts=2 tokens=40 ring=2 channels=3 repeats=5 inputs=device
  step "ep-ht-cuda-2ranks-fp8-inputs-device" "$ep" ht device=cuda ranks=2 fp8=1 inputs=device
  # Over several of ep_ht_layout's 512-token tiles (tokens=1100: ranks of
  # 1100, 825 and 550 tokens, three and two tiles), beside CPU ranks with the
  # same arguments; and on the proxy everywhere (the tokens copied into XIN
  # for the queued puts).
  for n in 2 4; do
    step "ep-ht-cuda-${n}ranks-tokens1100-inputs-device" "$ep" ht device=cuda ranks=$n tokens=1100 inputs=device
    step "ep-ht-cpu-${n}ranks-tokens1100" "$ep" ht ranks=$n tokens=1100
  done
  step "ep-ht-cuda-4ranks-2hosts-tokens1100-inputs-device" "$ep" ht device=cuda ranks=4 hosts=2 tokens=1100 inputs=device
  step "ep-ht-cpu-4ranks-2hosts-tokens1100" "$ep" ht ranks=4 hosts=2 tokens=1100
  step "ep-ht-cuda-4ranks-proxy-inputs-device" env GIN_BACKEND=proxy "$ep" ht device=cuda ranks=4 hosts=2 inputs=device
  # Over two of ep_ht_layout's chunks of 32 tiles (16384 tokens): tokens=17000
  # (ranks of 17000 and 12750 on one host; 4 ranks on 2 hosts down to 8500,
  # one chunk there) with 5 repeats, beside CPU ranks.
  step "ep-ht-cuda-2ranks-tokens17000-inputs-device" "$ep" ht device=cuda ranks=2 tokens=17000 repeats=5 inputs=device
  step "ep-ht-cpu-2ranks-tokens17000" "$ep" ht ranks=2 tokens=17000 repeats=5
  step "ep-ht-cuda-4ranks-2hosts-tokens17000-inputs-device" "$ep" ht device=cuda ranks=4 hosts=2 tokens=17000 repeats=5 inputs=device
  step "ep-ht-cpu-4ranks-2hosts-tokens17000" "$ep" ht ranks=4 hosts=2 tokens=17000 repeats=5
  # 32 channels (CUDA ranks' default, gin_ep::CUDA_HT_CHANNELS, which the
  # benchmarks use), beside CPU ranks with as many lanes: load/store, two
  # hosts, and the proxy everywhere.
  step "ep-ht-cuda-2ranks-tokens1100-channels32-inputs-device" "$ep" ht device=cuda ranks=2 tokens=1100 channels=32 inputs=device
  step "ep-ht-cpu-2ranks-tokens1100-channels32" "$ep" ht ranks=2 tokens=1100 channels=32
  step "ep-ht-cuda-4ranks-2hosts-tokens1100-channels32-inputs-device" "$ep" ht device=cuda ranks=4 hosts=2 tokens=1100 channels=32 inputs=device
  step "ep-ht-cuda-4ranks-2hosts-proxy-tokens1100-channels32-inputs-device" env GIN_BACKEND=proxy "$ep" ht device=cuda ranks=4 hosts=2 tokens=1100 channels=32 inputs=device
  step "ep-ht-cpu-4ranks-2hosts-tokens1100-channels32" "$ep" ht ranks=4 hosts=2 tokens=1100 channels=32
  ep_ht_digests() { sed -n 's/.*rank \([0-9]*\) of [0-9]*: ht ok.*dispatch digest \([0-9a-f]*\), combine digest \([0-9a-f]*\).*/\1 \2 \3/p' "$out/$1.log" | sort; }
  ep_ht_agree() {
    local a b; a=$(ep_ht_digests "$1"); b=$(ep_ht_digests "$2")
    [ -n "$a" ] || { echo "no digests in $1"; return 1; }
    [ "$a" = "$b" ] || { echo "$1 and $2 differ:"; echo "$a"; echo "$b"; return 1; }
    echo "$a"; echo "oracle ok: $1 and $2 agree bit for bit"
  }
  for n in 2 4; do
    step "ep-ht-${n}ranks-cuda-cpu-agree" ep_ht_agree "ep-ht-cuda-${n}ranks" "ep-ht-cpu-${n}ranks"
  done
  step "ep-ht-4ranks-2hosts-cuda-cpu-agree" ep_ht_agree "ep-ht-cuda-4ranks-2hosts" "ep-ht-cpu-4ranks-2hosts"
  step "ep-ht-4ranks-2hosts-ring2-cuda-cpu-agree" ep_ht_agree "ep-ht-cuda-4ranks-2hosts-ring2" "ep-ht-cpu-4ranks-2hosts-ring2"
  step "ep-ht-4ranks-2hosts-proxy-agrees" ep_ht_agree "ep-ht-cuda-4ranks-proxy" "ep-ht-cpu-4ranks-2hosts"
  for n in 2 4; do
    step "ep-ht-${n}ranks-inputs-device-agree" ep_ht_agree "ep-ht-cuda-${n}ranks-inputs-device" "ep-ht-cpu-${n}ranks"
  done
  step "ep-ht-4ranks-2hosts-inputs-device-agree" ep_ht_agree "ep-ht-cuda-4ranks-2hosts-inputs-device" "ep-ht-cpu-4ranks-2hosts"
  step "ep-ht-4ranks-2hosts-ring2-inputs-device-agree" ep_ht_agree "ep-ht-cuda-4ranks-2hosts-ring2-inputs-device" "ep-ht-cpu-4ranks-2hosts-ring2"
  step "ep-ht-2ranks-fp8-inputs-device-agree" ep_ht_agree "ep-ht-cuda-2ranks-fp8-inputs-device" "ep-ht-cuda-2ranks-fp8"
  for n in 2 4; do
    step "ep-ht-${n}ranks-tokens1100-inputs-device-agree" ep_ht_agree "ep-ht-cuda-${n}ranks-tokens1100-inputs-device" "ep-ht-cpu-${n}ranks-tokens1100"
  done
  step "ep-ht-4ranks-2hosts-tokens1100-inputs-device-agree" ep_ht_agree "ep-ht-cuda-4ranks-2hosts-tokens1100-inputs-device" "ep-ht-cpu-4ranks-2hosts-tokens1100"
  step "ep-ht-2ranks-tokens17000-inputs-device-agree" ep_ht_agree "ep-ht-cuda-2ranks-tokens17000-inputs-device" "ep-ht-cpu-2ranks-tokens17000"
  step "ep-ht-4ranks-2hosts-tokens17000-inputs-device-agree" ep_ht_agree "ep-ht-cuda-4ranks-2hosts-tokens17000-inputs-device" "ep-ht-cpu-4ranks-2hosts-tokens17000"
  step "ep-ht-4ranks-2hosts-proxy-inputs-device-agrees" ep_ht_agree "ep-ht-cuda-4ranks-proxy-inputs-device" "ep-ht-cpu-4ranks-2hosts"
  step "ep-ht-2ranks-tokens1100-channels32-inputs-device-agree" ep_ht_agree "ep-ht-cuda-2ranks-tokens1100-channels32-inputs-device" "ep-ht-cpu-2ranks-tokens1100-channels32"
  step "ep-ht-4ranks-2hosts-tokens1100-channels32-inputs-device-agree" ep_ht_agree "ep-ht-cuda-4ranks-2hosts-tokens1100-channels32-inputs-device" "ep-ht-cpu-4ranks-2hosts-tokens1100-channels32"
  step "ep-ht-4ranks-2hosts-proxy-tokens1100-channels32-inputs-device-agrees" ep_ht_agree "ep-ht-cuda-4ranks-2hosts-proxy-tokens1100-channels32-inputs-device" "ep-ht-cpu-4ranks-2hosts-tokens1100-channels32"
  # The victim (rank 1) names its entry, each of the other n-1 ranks rank 1.
  ep_ht_bad_named() {
    local log="$out/$1.log" n=$2 v t
    v=$(grep -c "rank 1 of $n: ht ok.*rank 1's bad expert id.*: refused its expert" "$log")
    t=$(grep -c "rank [0-9]* of $n: ht ok.*told that rank 1's inputs were refused" "$log")
    [ "$v" = 1 ] && [ "$t" = $((n - 1)) ] || { echo "$1: victim lines $v (1 expected), told lines $t ($((n - 1)) expected)"; return 1; }
    echo "$1: rank 1 named its entry, $t other rank(s) named rank 1"
  }
  for n in 2 4; do
    for kind in inputs-device-bad bad; do
      step "ep-ht-${n}ranks-${kind}-named" ep_ht_bad_named "ep-ht-cuda-${n}ranks-${kind}" "$n"
      step "ep-ht-${n}ranks-${kind}-agree" ep_ht_agree "ep-ht-cuda-${n}ranks-${kind}" "ep-ht-cpu-${n}ranks"
    done
    step "ep-ht-${n}ranks-inputs-device-bad-combine-out-named" ep_combine_named "ep-ht-cuda-${n}ranks-inputs-device-bad-combine-out" "$n" ht \
      "combine output" "in GPU memory" "combined normally beside rank 1's refused output"
    step "ep-ht-${n}ranks-inputs-device-bad-combine-out-agree" ep_ht_agree "ep-ht-cuda-${n}ranks-inputs-device-bad-combine-out" "ep-ht-cpu-${n}ranks"
  done
  step "ep-ht-4ranks-inputs-device-bad-combine-out-victims12-named" ep_combine_named "ep-ht-cuda-4ranks-inputs-device-bad-combine-out-victims12" 4 ht \
    "combine output" "in GPU memory" "combined normally beside ranks 1,2's refused output" "ranks 1,2" "[12]" 2
  step "ep-ht-4ranks-inputs-device-bad-combine-out-victims12-agree" ep_ht_agree "ep-ht-cuda-4ranks-inputs-device-bad-combine-out-victims12" "ep-ht-cpu-4ranks"
fi
if [ -n "$benches" ]; then
  # High-throughput dispatch + combine on CUDA ranks at DeepEP's shape
  # (4096 tokens, hidden 7168, top-8, 32 experts per rank) beside the
  # same-job floor, on one host and on two emulated hosts.
  step "bench-moe-ht-cuda-2ranks" "$here/gin-bench" moe --device cuda --mode ht --tokens 4096 --ranks 2 --iters 5 --runs 3 --json "$out/moe-ht-cuda-2ranks.json"
  step "bench-moe-ht-cuda-4ranks-2hosts" "$here/gin-bench" moe --device cuda --mode ht --tokens 4096 --ranks 4 --hosts 2 --iters 5 --runs 3 --json "$out/moe-ht-cuda-4ranks-2hosts.json"
  # The same from inputs in GPU memory (ht_dispatch_device / ht_combine_device).
  step "bench-moe-ht-cuda-2ranks-inputs-device" "$here/gin-bench" moe --device cuda --mode ht --tokens 4096 --ranks 2 --inputs device --iters 5 --runs 3 --json "$out/moe-ht-cuda-2ranks-inputs-device.json"
  step "bench-moe-ht-cuda-4ranks-inputs-device" "$here/gin-bench" moe --device cuda --mode ht --tokens 4096 --ranks 4 --inputs device --iters 5 --runs 3 --json "$out/moe-ht-cuda-4ranks-inputs-device.json"
fi
if [ -n "$benches" ]; then
  # Low-latency dispatch + combine on CUDA ranks beside the same-job floor
  # (DeepEP's shape: 128 tokens, hidden 7168, top-8, 32 experts per rank).
  for n in 2 4; do
    step "bench-moe-cuda-${n}ranks" "$here/gin-bench" moe --device cuda --ranks $n --json "$out/moe-cuda-${n}ranks.json"
    step "bench-moe-cuda-${n}ranks-fp8" "$here/gin-bench" moe --device cuda --ranks $n --fp8 --json "$out/moe-cuda-${n}ranks-fp8.json"
    step "bench-moe-cuda-${n}ranks-combine-put" env GIN_EP_COMBINE=put "$here/gin-bench" moe --device cuda --ranks $n --json "$out/moe-cuda-${n}ranks-combine-put.json"
    step "bench-moe-cuda-${n}ranks-inputs-device" "$here/gin-bench" moe --device cuda --ranks $n --inputs device --json "$out/moe-cuda-${n}ranks-inputs-device.json"
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
  # The load/store ping-pong with the default kernels (every coop), then
  # with kernels built for load/store peers alone (GIN_QUEUE_PATHS=0: no
  # proxy or GDAKI code inlined), every coop, 512- and 1024-thread blocks,
  # beside the same NVSHMEM rows.
  step "bench-cuda-loadstore" "$here/gin-bench" cuda --tests pingpong --paths loadstore \
    --json "$out/cuda-loadstore.json" --peer-json "$out/peer-nvshmem.json"
  step "bench-cuda-lsa-only" "$here/gin-bench" cuda --tests pingpong --paths loadstore --queue-paths none \
    --json "$out/cuda-lsa-only.json" --peer-json "$out/peer-nvshmem.json"
  step "bench-cuda-block1024-lsa-only" "$here/gin-bench" cuda --tests pingpong --paths loadstore --coops block \
    --block-threads 1024 --queue-paths none --json "$out/cuda-block1024-lsa-only.json" --peer-json "$out/peer-nvshmem.json"
  step "bench-cuda" "$here/gin-bench" cuda --json "$out/cuda.json" --csv "$out/cuda.csv" \
    --peer-json "$out/peer-nvshmem.json" --peer-json "$out/peer-nccl.json"
  # The suite's common flags reach the same measurements.
  step "pingpong-device-cuda" "$here/gin-bench" pingpong --device cuda --sizes 8,64k --coop block --iters 500 --runs 3
  step "bench-cuda-tcp" env GIN_TRANSPORT=tcp "$here/gin-bench" cuda --tests pingpong,bandwidth --paths proxy,gdaki --sizes 8,1k,64k,1m --blocks 16 --runs 3 --json "$out/cuda-tcp.json"
elif [ "$suite" = quick ]; then
  step "bench-cuda" "$here/gin-bench" cuda --sizes 8,64k --coops block --iters 500 --runs 3 --blocks 32 --json "$out/cuda.json"
fi
# CUDA ranks over UCX (issue 24): the pinned libucx-cu13 wheel's subset
# (ucx.tgz, made by `cargo xtask gpu-package`), unpacked into a temporary
# folder; only these steps see it (GIN_UCX_LIB, LD_LIBRARY_PATH). GPU memory
# goes to UCX directly (cuda_ipc between the ranks' processes, one GPU under
# MPS), signals and counters as running totals put after the data. Where UCX
# cannot run here (no ucx.tgz, no CUDA transports), each step says why and
# is skipped without failing the run.
if [ -n "$ucx" ]; then
  ucx_why=""
  if [ ! -f "$here/ucx.tgz" ]; then
    ucx_why="no ucx.tgz in the package (cargo xtask gpu-package packs it from cargo xtask wheels)"
  elif ! ucx_tmp="$(mktemp -d /tmp/gin-ucx.XXXXXX)"; then
    ucx_tmp="" ucx_why="no temporary directory to unpack UCX into"
  elif ! tar xzf "$here/ucx.tgz" -C "$ucx_tmp"; then
    ucx_why="ucx.tgz did not unpack"
  fi
  ucx_lib="$ucx_tmp/libucx/lib" ucx_bin="$ucx_tmp/libucx/bin"
  # A short timeout: a path that does not work fails in seconds, not in the
  # default five minutes, and the rest of the run goes on.
  ucx_env=(env GIN_UCX_LIB="$ucx_lib/libucp.so.0" LD_LIBRARY_PATH="$ucx_lib:$LD_LIBRARY_PATH"
    GIN_TIMEOUT="${GIN_UCX_TIMEOUT:-20s}")
  if [ -z "$ucx_why" ]; then
    # Which transports and memory domains UCX finds here: cuda_copy and
    # cuda_ipc (GPU memory), posix, sysv, cma (shared memory), tcp.
    echo "== ucx-info: ucx_info -v -d"
    if "${ucx_env[@]}" "$ucx_bin/ucx_info" -v -d > "$out/ucx-info.log" 2>&1; then
      grep -E "Library version|Transport:" "$out/ucx-info.log" | sort | uniq -c
      for tl in cuda_copy cuda_ipc; do
        grep -q "Transport: $tl" "$out/ucx-info.log" || ucx_why="UCX lists no $tl transport here (see ucx-info.log)"
      done
    else
      ucx_why="ucx_info failed (see ucx-info.log)"; tail -n 20 "$out/ucx-info.log"
    fi
  fi
  [ -z "$ucx_why" ] || echo "UCX steps skipped: $ucx_why"
  ustep() {
    # A step over UCX, or its skip with the reason.
    local name="$1"; shift
    wanted "$name" || return 0
    if [ -n "$ucx_why" ]; then
      echo "== $name: SKIPPED ($ucx_why)"; echo "SKIPPED: $ucx_why" > "$out/$name.log"
    else
      step "$name" "${ucx_env[@]}" GIN_TRANSPORT=ucx "$@"
    fi
  }
  # Correctness first. UCX_PROTO_INFO=y logs which UCX protocol and
  # transport carries each kind of request (look for cuda_ipc).
  if [ -n "$checks" ]; then
  for backend in auto proxy gdaki; do
    ustep "selftest-ucx-$backend" env UCX_PROTO_INFO=y GIN_BACKEND=$backend "$st" all --ranks 2
  done
  for backend in proxy gdaki; do
    ustep "badinput-ucx-$backend" env GIN_BACKEND=$backend GIN_TIMEOUT=2s "$st" badinput --ranks 2
    ustep "dropped-ucx-$backend" env GIN_BACKEND=$backend "$st" dropped --ranks 2
    # A signal's total ordered after pipelined puts from GPU memory by
    # UCX's endpoint fence alone (the default waits for the puts first):
    # the ring scenario checks every byte once the signal arrived, so a
    # fence that does not order cuda_ipc's copies fails here.
    ustep "selftest-ucx-fence-$backend" env GIN_UCX_GPU_ORDER=fence GIN_BACKEND=$backend "$st" all --ranks 2
    # The fused kernel captured in a global-mode graph over UCX, whose
    # progress thread makes CUDA calls (it runs relaxed, so a capture is
    # neither refused nor invalidated by them: docs/reliability.md); a smoke
    # run beside fused-graph-tcp-proxy.
    ustep "fused-graph-ucx-$backend" env GIN_BACKEND=$backend timeout 300 "$fa" --ranks 2 --graph --iters 20
  done
  fi
  # Round trips and bandwidth (4 MiB: target >= 30 GB/s, 10x bench-cuda-tcp)
  # with exactly bench-cuda-tcp's arguments, so the two compare row by row;
  # then the same with GPU memory staged through pinned host memory
  # (GIN_UCX_DEVICE=0), which isolates what the direct path buys.
  if [ -n "$benches" ]; then
  ustep "bench-cuda-ucx" "$here/gin-bench" cuda --tests pingpong,bandwidth --paths proxy,gdaki --sizes 8,1k,64k,1m --blocks 16 --runs 3 --json "$out/cuda-ucx.json"
  # Bandwidth with signals ordered by UCX's fence alone (see the
  # selftest-ucx-fence steps, which must pass for these figures to count).
  ustep "bench-cuda-ucx-fence" env GIN_UCX_GPU_ORDER=fence "$here/gin-bench" cuda --tests bandwidth --paths proxy,gdaki --blocks 16 --runs 3 --json "$out/cuda-ucx-fence.json"
  # Bandwidth with 16, 32 and 66 blocks: puts from GPU memory that continue
  # one another go to UCX as one put (the default), and each alone
  # (GIN_PUT_MERGE_MAX=0), which UCX's ~6 us per cuda_ipc put bounds.
  ustep "bench-cuda-ucx-blocks" "$here/gin-bench" cuda --tests bandwidth --paths proxy,gdaki --blocks 16,32,66 --runs 5 --json "$out/cuda-ucx-blocks.json"
  ustep "bench-cuda-ucx-blocks-unmerged" env GIN_PUT_MERGE_MAX=0 "$here/gin-bench" cuda --tests bandwidth --paths proxy,gdaki --blocks 16,32,66 --runs 5 --json "$out/cuda-ucx-blocks-unmerged.json"
  # Round trips (one put each) with and without merging: a lone put waits
  # for the end of its engine's pass before it starts.
  ustep "bench-cuda-ucx-rt" "$here/gin-bench" cuda --tests pingpong --paths proxy,gdaki --sizes 8,64k,1m --runs 5 --json "$out/cuda-ucx-rt.json"
  ustep "bench-cuda-ucx-rt-unmerged" env GIN_PUT_MERGE_MAX=0 "$here/gin-bench" cuda --tests pingpong --paths proxy,gdaki --sizes 8,64k,1m --runs 5 --json "$out/cuda-ucx-rt-unmerged.json"
  ustep "bench-cuda-ucx-staged" env GIN_UCX_DEVICE=0 "$here/gin-bench" cuda --tests pingpong,bandwidth --paths proxy --sizes 8,64k,1m --blocks 16 --runs 3 --json "$out/cuda-ucx-staged.json"
  # The raw UCX floor in the same job: ucx_perftest between two processes on
  # loopback, GPU memory on both sides (-m cuda,cuda), the same UCX.
  ucx_perf() {
    local name="$1"; shift
    wanted "$name" || return 0
    if [ -n "$ucx_why" ]; then
      echo "== $name: SKIPPED ($ucx_why)"; echo "SKIPPED: $ucx_why" > "$out/$name.log"; return
    fi
    local port=$((20000 + RANDOM % 20000)) try
    echo "== $name: ucx_perftest $*"
    "${ucx_env[@]}" timeout 90 "$ucx_bin/ucx_perftest" -p "$port" > "$out/$name-server.log" 2>&1 &
    local server=$!
    for try in 1 2 3 4 5; do
      sleep 1 # (the server must be listening before the client connects)
      if "${ucx_env[@]}" timeout 60 "$ucx_bin/ucx_perftest" 127.0.0.1 -p "$port" "$@" > "$out/$name.log" 2>&1; then
        tail -n 8 "$out/$name.log"; wait "$server"; return
      fi
      grep -qi "refused" "$out/$name.log" || break
    done
    echo "FAILED ($name), last lines:"; tail -n 30 "$out/$name.log"; tail -n 10 "$out/$name-server.log"; fail=1
    kill "$server" 2> /dev/null; wait "$server" 2> /dev/null
  }
  for size in 8 65536 1048576; do
    ucx_perf "ucx-perftest-put-lat-$size" -t ucp_put_lat -m cuda,cuda -s "$size" -n 10000 -w 1000
  done
  ucx_perf "ucx-perftest-put-bw-4m" -t ucp_put_bw -m cuda,cuda -s 4194304 -n 2000 -w 100
  ucx_perf "ucx-perftest-put-bw-4m-o16" -t ucp_put_bw -m cuda,cuda -s 4194304 -n 2000 -w 100 -O 16
  fi
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

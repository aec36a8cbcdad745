// A user's fused kernel: an all-to-all of a buffer followed, in the same
// kernel, by a reduction of what arrived. Launched by the fused-alltoall
// example on the user's own stream, with the user's own device memory as the
// windows (registered with CudaComm::register_window).
//
// Round `round` (one block per peer at least): block b < nranks puts this
// rank's chunk b (`count` floats of `send`) to rank b, at chunk `rank` of the
// recv half `round % 2`, with signal `rank`: one signal per sender. Every
// block then waits until each rank q's put of this round has arrived (signal
// q reaches round + 1), and the grid reduces: out[round * count + i] =
// FUSED_SCALE * sum over ranks q of recv[half][q][i]. One signal counting
// every arrival would not do: a peer one round ahead (it finished round r
// once every put to it landed) adds its round r + 1 arrival, which could
// stand in for another sender's round r put still in flight. Two halves: a
// peer in round r + 2 writes a half again only after this rank's round r + 1
// put, which the stream orders after this rank's round r reduction.
#include "gin/gin.cuh"
#include "fused/op.cuh"

using namespace gin;

// out[i] = FUSED_SCALE * sum over ranks q of in[q][i], for i < count, by the
// whole grid.
__device__ void reduce(const float* in, u32 n, u64 count, float* out) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count;
       i += (u64)blockDim.x * gridDim.x) {
    float acc = 0.f;
    for (u32 q = 0; q < n; ++q) acc = fused::add(acc, in[(u64)q * count + i]);
    out[i] = fused::finish(acc);
  }
}

extern "C" __global__ void fused_alltoall(DevComm dc, Window send, Window recv,
                                          unsigned long long count, unsigned int round,
                                          float* out) {
  const u32 n = dc.nranks;
  const u64 half = (u64)(round % 2) * n * count * sizeof(float);
  const u64 chunk = count * sizeof(float);
  int e = 0;
  if (blockIdx.x < n) {
    const u32 p = blockIdx.x;
    e = put(dc, 0, p, recv, half + (u64)dc.rank * chunk, send, (u64)p * chunk, chunk,
            signal_inc(dc.rank), no_counter(), CTA);
  }
  for (u32 q = 0; q < n && !e; ++q) e = wait_signal(dc, 0, q, (u64)round + 1, CTA);
  if (!e && blockIdx.x < n) e = flush(dc, 0, CTA);
  // An error is in the error word (the host's check() reports it).
  if (e) return;
  reduce((const float*)(recv.local_base + half), n, count, out + (u64)round * count);
}

// The replayable form, for a CUDA graph: captured once and launched many
// times with the same arguments, so nothing may depend on a host-side
// round. The replay number, the epoch, lives in device memory the kernel
// advances itself: state[0] is read by every block at the start, and the
// last block out (counted in state[1]) stores epoch + 1, once every block
// has read it. The next replay, in stream order, finds it there.
//
// Replay e (state[0] at launch): block b < nranks adds 1 to this rank's
// chunk b of `send` (the input changes every replay, so a stale result
// cannot pass) and puts it to rank b, at chunk `rank` of the recv half
// e % 2, with signal `rank`: one signal per sender. Every block waits until
// each rank q's signal q reaches e + 1 (q's replay-e put has arrived), and
// the grid reduces into out[0, count).
//
// Why one signal per sender and not one counting every arrival: a peer can
// be one replay ahead (it finished replay e once every rank's put *to it*
// had arrived, which says nothing about the puts to this rank), and its
// replay-(e+1) arrival must not stand in for another sender's replay-e put
// still in flight. It is never two ahead (its replay e+2 needs this rank's
// replay-(e+1) put), and what it sends in replay e+1 lands in the other
// half.
extern "C" __global__ void fused_alltoall_replay(DevComm dc, Window send, Window recv,
                                                 unsigned long long count,
                                                 unsigned long long* state, float* out) {
  const u32 n = dc.nranks;
  __shared__ u64 epoch_s;
  if (threadIdx.x == 0) epoch_s = *(volatile const u64*)&state[0];
  __syncthreads();
  const u64 epoch = epoch_s;
  const u64 half = (epoch % 2) * n * count * sizeof(float);
  const u64 chunk = count * sizeof(float);
  int e = 0;
  if (blockIdx.x < n) {
    const u32 p = blockIdx.x;
    // The coop put starts with the block's barrier: these stores are sent.
    float* mine = (float*)(send.local_base + (u64)p * chunk);
    for (u64 i = threadIdx.x; i < count; i += blockDim.x) mine[i] += 1.f;
    e = put(dc, 0, p, recv, half + (u64)dc.rank * chunk, send, (u64)p * chunk, chunk,
            signal_inc(dc.rank), no_counter(), CTA);
  }
  for (u32 q = 0; q < n && !e; ++q) e = wait_signal(dc, 0, q, epoch + 1, CTA);
  if (!e && blockIdx.x < n) e = flush(dc, 0, CTA);
  // An error is in the error word (the host's check() reports it); the
  // block still counts itself out below, so the epoch stays consistent.
  if (!e) reduce((const float*)(recv.local_base + half), n, count, out);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&state[1], 1ull) == gridDim.x - 1ull) {
      state[1] = 0;
      state[0] = epoch + 1;
    }
  }
}

// A user's fused kernel: an all-to-all of a buffer followed, in the same
// kernel, by a reduction of what arrived. Launched by the fused-alltoall
// example on the user's own stream, with the user's own device memory as the
// windows (registered with CudaComm::register_window).
//
// Round `round` (one block per peer at least): block b < nranks puts this
// rank's chunk b (`count` floats of `send`) to rank b, at chunk `rank` of the
// recv half `round % 2`, with signal 0. Every block then waits until the
// nranks puts of this round have arrived (signal 0 reaches
// nranks * (round + 1)), and the grid reduces: out[round * count + i] =
// FUSED_SCALE * sum over ranks q of recv[half][q][i]. Two halves: a peer in
// round r + 2 writes a half again only after this rank's round r + 1 put,
// which the stream orders after this rank's round r reduction.
#include "gin/gin.cuh"
#include "fused/op.cuh"

using namespace gin;

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
            signal_inc(0), no_counter(), CTA);
  }
  if (!e) e = wait_signal(dc, 0, 0, (u64)n * (round + 1), CTA);
  if (!e && blockIdx.x < n) e = flush(dc, 0, CTA);
  // An error is in the error word (the host's check() reports it).
  if (e) return;
  const float* in = (const float*)(recv.local_base + half);
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count;
       i += (u64)blockDim.x * gridDim.x) {
    float acc = 0.f;
    for (u32 q = 0; q < n; ++q) acc = fused::add(acc, in[(u64)q * count + i]);
    out[(u64)round * count + i] = fused::finish(acc);
  }
}

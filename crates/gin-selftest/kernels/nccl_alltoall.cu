// An all-to-all written against NCCL's GIN device API only, compiled
// against gin-rs through gin/nccl_compat.cuh: the logic of NCCL's
// published GIN all-to-all example (docs/examples/06_device_api/
// 02_alltoall_gin in the NCCL repository), written anew for gin-rs, with
// no gin name in the kernel. gin-cuda-selftest's `nccl-alltoall` mode runs
// it and checks every byte received.
//
// Each rank sends `count` elements to every rank (itself included): block
// `dst` of its send window goes to block `src` of the receiver's receive
// window. One thread of the grid per destination puts the whole block,
// with a weak signal increment on the signal its own block owns; the block
// that owns a rank's sending thread is, at every receiver, the one whose
// signal collects all nRanks increments, so only that block waits.
#include "gin/nccl_compat.cuh"

template <typename T>
__device__ void allToAll(ncclWindow_t sendWin, size_t sendOffset, ncclWindow_t recvWin,
                         size_t recvOffset, size_t count, ncclDevComm const& devComm) {
  ncclGin net{devComm, 0};
  // One signal and one world barrier per block.
  const ncclGinSignal_t sig = blockIdx.x;
  // Read before the barrier: no peer puts to this rank before every rank
  // has entered it, so the signal cannot have moved yet.
  const uint64_t base = net.readSignal(sig);

  ncclGinBarrierSession<ncclCoopCta> bar{ncclCoopCta(), net, ncclTeamTagWorld(), blockIdx.x};
  bar.sync(ncclCoopCta(), cuda::memory_order_acquire, ncclGinFenceLevel::None);

  const int thread = (int)(blockIdx.x * blockDim.x + threadIdx.x);
  const int threads = (int)(blockDim.x * gridDim.x);
  const size_t bytes = count * sizeof(T);
  const ncclTeam world = ncclTeamWorld(devComm);
  for (int peer = thread; peer < devComm.nRanks; peer += threads) {
    net.put(world, peer, recvWin, recvOffset + (size_t)devComm.rank * bytes, sendWin,
            sendOffset + (size_t)peer * bytes, bytes, ncclGin_WeakSignalInc{sig});
  }

  // Every sender reaches this rank from the thread numbered by this rank,
  // so the signal of that thread's block counts all nRanks puts.
  const unsigned owner = (unsigned)(devComm.rank % threads) / blockDim.x;
  if (blockIdx.x == owner) net.waitSignal(ncclCoopCta(), sig, base + (uint64_t)devComm.nRanks);

  // The send buffer may be reused once the puts completed locally; the
  // closing barrier keeps every rank in the kernel until all have landed.
  net.flush(ncclCoopCta());
  bar.sync(ncclCoopCta(), cuda::memory_order_release, ncclGinFenceLevel::None);
}

// The example's element type is float; NVRTC finds the kernel by this name.
extern "C" __global__ void nccl_alltoall(ncclWindow_t sendWin, size_t sendOffset,
                                         ncclWindow_t recvWin, size_t recvOffset, size_t count,
                                         ncclDevComm devComm) {
  allToAll<float>(sendWin, sendOffset, recvWin, recvOffset, count, devComm);
}

// Not run: every name the compatibility header maps, used once as NCCL's
// documentation shows, so that CI's compilers (nvcc for sm_90 and sm_80,
// NVRTC) check the whole mapping and not only what the all-to-all needs.
extern "C" __global__ void nccl_compat_names(ncclWindow_t win, ncclDevComm devComm,
                                             unsigned long long* out) {
  ncclGin net{devComm, 0, NCCL_GIN_RESOURCE_SHARING_CTA};
  const ncclTeam world = ncclTeamWorld(devComm);
  const ncclTeam rail = ncclTeamRail(devComm);
  const int peer = (devComm.rank + 1) % devComm.nRanks;
  const int railPeer = (rail.rank + 1) % rail.nRanks;
  net.put(world, peer, win, 0, win, 64, 64, ncclGin_StrongSignalInc{0}, ncclGin_WeakCounterInc{0},
          ncclCoopWarp());
  net.put(world, peer, win, 0, win, 64, 64, ncclGin_SignalAdd{1, 3}, ncclGin_CounterInc{1},
          ncclCoopCta(), ncclGin_None{}, cuda::thread_scope_thread, cuda::thread_scope_device,
          ncclGinOptFlagsDefault, ncclGin_SegmentDevice{});
  net.put(rail, railPeer, win, 0, win, 64, 8, ncclGin_WeakSignalAdd{2, 5});
  net.put(world, peer, win, 0, win, 64, 8, ncclGin_StrongSignalAdd{2, 5});
  net.put(world, peer, win, 0, win, 64, 8, ncclGin_SignalInc{3});
  net.putValue(world, peer, win, 128, (uint64_t)42, ncclGin_WeakSignalInc{0}, ncclCoopThread());
  net.putValue(world, peer, win, 136, 1.5);
  net.signal(world, peer, ncclGin_StrongSignalInc{0}, ncclCoopWarp());
  net.get(world, peer, win, 256, win, 512, 64, ncclCoopCta());
  net.flush(ncclCoopCta());
  ncclGinRequest_t req;
  net.flushAsync(world, (uint32_t)peer, &req, ncclCoopWarp());
  net.wait(req, ncclCoopWarp());
  net.waitSignal(ncclCoopWarp(), 0, net.readSignal(0) + 1);
  net.waitSignal(ncclCoopThread(), 1, net.readSignal(1, 16) + 3, 16, cuda::memory_order_relaxed);
  net.waitCounter(ncclCoopCta(), 0, net.readCounter(0) + 1);
  net.waitCounter(ncclCoopThread(), 1, net.readCounter(1, 20) + 1, 20);
  if (threadIdx.x == 0) {
    net.resetSignal(0);
    net.resetCounter(0);
  }
  ncclGinBarrierSession<ncclCoopCta> bar{ncclCoopCta(), net, ncclTeamTagRail(), 0};
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
  ncclGinBarrierSession<ncclCoopWarp> all{ncclCoopWarp(), ncclGinAllContexts(devComm),
                                          ncclTeamTagWorld(), 1};
  all.sync(ncclCoopWarp(), cuda::memory_order_seq_cst,
           ncclGinFenceLevel::Put | ncclGinFenceLevel::Get);
  ncclGinBarrier(ncclCoopCta(), net, ncclTeamTagWorld(), 2);
  ncclCoopLanes lanes{0xffu};
  ncclCoopTile<8> tile;
  out[threadIdx.x] = (unsigned long long)ncclGetLocalPointer(win, 0) + (unsigned)lanes.size() +
                     (unsigned)tile.thread_rank() + (unsigned)ncclTeamRankToWorld(devComm, rail, 0);
}

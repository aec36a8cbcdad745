// kernels/ll.cu's grid barrier (ep::barrier::arrival and passed, as
// grid_sync uses them) compiled as host C++ and run over a counter the way
// the GPU's atomicAdd runs it: launch after launch, on one counter that
// nothing resets (as in a CUDA graph replayed many times), with grids of
// varying sizes (1 to 64 blocks; set_blocks changes the grid between steps)
// and the blocks arriving in random orders. For every launch: no block that
// arrived sees the barrier passed before the last block arrived, every
// block sees it passed from then on (whatever it read on arrival), and the
// counter's low 31 bits are back to 0. Exits 0 when all hold, else prints
// the first failure and exits 1.
#include <cstdio>
#include <vector>

#include "../kernels/ll.cu"

int main() {
  u32 bar = 0;
  u64 seed = 0x9e3779b97f4a7c15ull;
  auto next = [&]() {
    seed ^= seed >> 12;
    seed ^= seed << 25;
    seed ^= seed >> 27;
    return seed * 0x2545f4914f6cdd1dull;
  };
  const u32 launches = 20000;
  for (u32 launch = 0; launch < launches; ++launch) {
    // Mostly a repeated grid (replays), now and then another size.
    const u32 grid = launch % 7 == 0 ? 1 + (u32)(next() % 64) : 32;
    std::vector<u32> order(grid);
    for (u32 b = 0; b < grid; ++b) order[b] = b;
    for (u32 i = grid; i > 1; --i) {
      const u32 j = (u32)(next() % i);
      const u32 t = order[i - 1];
      order[i - 1] = order[j];
      order[j] = t;
    }
    std::vector<u32> old;
    for (u32 i = 0; i < grid; ++i) {
      old.push_back(bar);
      bar += ep::barrier::arrival(order[i], grid);
      const bool last = i + 1 == grid;
      for (u32 a = 0; a <= i; ++a) {
        if (ep::barrier::passed(old[a], bar) != last) {
          std::printf("launch %u (grid %u): after %u of %u arrivals, block %u %s\n", launch, grid,
                      i + 1, grid, order[a], last ? "does not see the barrier passed" : "passed early");
          return 1;
        }
      }
    }
    if ((bar & 0x7fffffffu) != 0) {
      std::printf("launch %u (grid %u): the counter's low bits are %#x after it\n", launch, grid,
                  bar & 0x7fffffffu);
      return 1;
    }
  }
  std::printf("%u launches passed\n", launches);
  return 0;
}

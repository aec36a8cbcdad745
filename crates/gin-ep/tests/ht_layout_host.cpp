// kernels/ht.cu's layout of inputs in GPU memory (ep_ht_layout) compiled as
// host C++: the kernel's per-token, per-tile and per-destination steps
// (ep::ht's layout_dest, layout_goes_wide, layout_tile_scan, layout_before,
// layout_token, layout_count_bound, layout_count_word, layout_finish;
// ep::input's entry_key and error_of; meta_word) run in the
// kernel's order, each destination's tokens LAYOUT_TILES tiles of 512 (a
// block's threads) at a time, the block's threads and warp ballots
// emulated one after another, so tokens past the first tile count the
// earlier tiles' (base) as the kernel's do, and past the first
// LAYOUT_TILES tiles the earlier chunks'. Reads the cases
// src/cuda/ht/layout_tests.rs wrote to argv[1] (little-endian: u32 count,
// then per case the 15 shape words, u32 tokens, r u32 of the active mask,
// tokens x k i64 top-k ids, tokens x k u32 weights' bits) and writes to
// argv[2], per case, what the kernel leaves: the notify row (u32 words:
// mask, then per destination and channel), every word of every token's
// metadata (u32), and the LO_WORDS u64 the host reads.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "../kernels/ht.cu"

namespace {

// Threads per block of ep_ht_layout's launch (ll.cu's EP_THREADS, cuda.rs's
// THREADS; layout_tests.rs checks they agree).
constexpr u32 THREADS = 512;

void layout(const ep::ht::Shape& s, u32 tokens, const u32* active, const i64* idx,
            const u32* wbits, std::vector<u32>& row, std::vector<u32>& meta, u64 out[]) {
  using namespace ep::ht;
  const u32 words = s.mm / 4, dests = layout_dests(s);
  // Garbage where the kernel must write: a word it skips shows.
  row.assign((s.r + 31) / 32 + dests * s.chans, 0xdeadbeefu);
  meta.assign((size_t)tokens * words, 0xdeadbeefu);
  for (u64 i = 0; i < (u64)tokens * words; ++i) {
    const u32 w = (u32)(i % words);
    if (!is_slot_word(s, w)) meta[i] = meta_word(s, idx, wbits, nullptr, nullptr, (u32)(i / words), w);
  }
  u64 key = ~0ull;
  for (u64 e = 0; e < (u64)tokens * s.k; ++e) {
    const u32 tok = (u32)(e / s.k), j = (u32)(e % s.k);
    const u64 k = ep::input::entry_key(idx + (u64)tok * s.k,
                                       (const float*)(const void*)(wbits + (u64)tok * s.k), tok, j,
                                       s.r * s.lexp);
    if (k < key) key = k;
  }
  // The kernel's loop over each destination's tokens, LAYOUT_TILES tiles
  // of THREADS tokens at a time (a block's threads: thread i of a tile is
  // lane i % 32 of warp i / 32): whether each goes (layout_goes_wide), every
  // tile's warp ballots and counts, every tile's scan of them
  // (layout_tile_scan), then every tile's layout_before and layout_token,
  // and the channels' bounds and counts, as the block runs them.
  const u32 warps = THREADS / 32;
  for (u32 d = 0; d < dests; ++d) {
    u32 pre[65];
    for (u32& p : pre) p = 0xdeadbeefu;
    const LayoutDest dest = layout_dest(s, active, d);
    u32 base = 0;
    for (u32 lo = 0; lo < tokens; lo += LAYOUT_TILES * THREADS) {
      const u32 tiles = std::min(LAYOUT_TILES, (tokens - lo + THREADS - 1) / THREADS);
      std::vector<u32> ballot((size_t)tiles * warps, 0), warp_sum((size_t)tiles * warps);
      for (u32 i = 0; i < THREADS; ++i) {
        // Thread i's tokens, LAYOUT_WIDE tiles at a time (past the last
        // tile the last tile's token, past the last token the last token:
        // judged, and the verdict dropped).
        const auto ids_of = [&](u32 tile) {
          return idx + (u64)std::min(lo + tile * THREADS + i, tokens - 1) * s.k;
        };
        for (u32 tile = 0; tile < tiles; tile += LAYOUT_WIDE) {
          const i64* ids[LAYOUT_WIDE];
          for (u32 w = 0; w < LAYOUT_WIDE; ++w) ids[w] = ids_of(std::min(tile + w, tiles - 1));
          const u32 bits = layout_goes_wide(s, ids, active, dest);
          for (u32 w = 0; w < LAYOUT_WIDE && tile + w < tiles; ++w)
            if ((bits >> w) & 1u && lo + (tile + w) * THREADS + i < tokens)
              ballot[(tile + w) * warps + i / 32] |= 1u << (i % 32);
        }
      }
      for (u32 j = 0; j < tiles * warps; ++j) warp_sum[j] = layout_popc(ballot[j]);
      std::vector<u32> tile_sum(tiles);
      for (u32 tile = 0; tile < tiles; ++tile)
        tile_sum[tile] = layout_tile_scan(&warp_sum[tile * warps], warps);
      for (u32 tile = 0; tile < tiles; ++tile) {
        for (u32 i = 0; i < THREADS; ++i) {
          const u32 t = lo + tile * THREADS + i;
          const u32 m = ballot[tile * warps + i / 32];
          const u32 before = layout_before(base, &warp_sum[tile * warps], m, i % 32, i / 32);
          if (t < tokens) layout_token(s, tokens, t, d, (m >> (i % 32)) & 1u, before, meta.data(), pre);
        }
        base += tile_sum[tile];
      }
    }
    for (u32 c = 0; c <= s.chans; ++c) layout_count_bound(s, tokens, c, base, pre);
    for (u32 c = 0; c < s.chans; ++c) layout_count_word(s, d, c, pre, row.data());
  }
  const bool refused = key != ~0ull;
  layout_finish(s, active, refused, row.data());
  u64 w[4] = {0, 0, 0, 0};
  if (refused)
    ep::input::error_of(key, idx, (const float*)(const void*)wbits, s.k, s.r * s.lexp, w);
  out[LO_REFUSED] = refused ? 1 : 0;
  out[LO_KEY] = key;
  for (u32 i = 0; i < 4; ++i) out[LO_ERR + i] = w[i];
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 3;
  std::vector<unsigned char> buf;
  unsigned char chunk[4096];
  size_t n;
  while ((n = std::fread(chunk, 1, sizeof chunk, in)) > 0) buf.insert(buf.end(), chunk, chunk + n);
  std::fclose(in);
  size_t at = 0;
  auto take = [&](void* dst, size_t bytes) {
    if (at + bytes > buf.size()) return false;
    std::memcpy(dst, buf.data() + at, bytes);
    at += bytes;
    return true;
  };
  u32 cases = 0;
  if (!take(&cases, 4)) return 4;
  std::vector<unsigned char> outb;
  auto emit = [&](const void* p, size_t bytes) {
    const unsigned char* b = (const unsigned char*)p;
    outb.insert(outb.end(), b, b + bytes);
  };
  for (u32 c = 0; c < cases; ++c) {
    u32 sw[ep::ht::SW_WORDS];
    u32 tokens = 0;
    if (!take(sw, sizeof sw) || !take(&tokens, 4)) return 5;
    const ep::ht::Shape s = ep::ht::shape_of(sw);
    if (s.chans > 64) return 6;
    std::vector<u32> active(s.r);
    std::vector<i64> idx((size_t)tokens * s.k);
    std::vector<u32> wbits((size_t)tokens * s.k);
    if (!take(active.data(), 4 * active.size()) || !take(idx.data(), 8 * idx.size()) ||
        !take(wbits.data(), 4 * wbits.size()))
      return 7;
    std::vector<u32> row, meta;
    u64 out[ep::ht::LO_WORDS];
    layout(s, tokens, active.data(), idx.data(), wbits.data(), row, meta, out);
    emit(row.data(), 4 * row.size());
    emit(meta.data(), 4 * meta.size());
    emit(out, sizeof out);
  }
  if (at != buf.size()) return 8;
  FILE* o = std::fopen(argv[2], "wb");
  if (!o) return 9;
  if (std::fwrite(outb.data(), 1, outb.size(), o) != outb.size()) return 10;
  return std::fclose(o) == 0 ? 0 : 11;
}

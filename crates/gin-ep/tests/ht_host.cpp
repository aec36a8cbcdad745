// kernels/ht.cu's index arithmetic (ep::ht) compiled as host C++: reads the
// cases src/cuda/ht/tests.rs wrote to argv[1] (whitespace-separated
// numbers: per case the 15 shape words, a token count, the plan's table
// length and words, then that many tokens' routing: top-k ids (i64),
// weights' bits, host slots, rank slots) and prints, per case, every signal
// id, metadata offset, channel bound, plan lookup and place the kernels
// compute, and every word ep_ht_stage_meta writes, one number a line, in
// the order the Rust test computes them from the CPU ranks' plan and
// plan::meta_word.
#include <cstdio>
#include <vector>

#include "../kernels/ht.cu"

namespace {

void put(unsigned long long v) { std::printf("%llu\n", v); }

// A token's routing, as ep_ht_stage_meta reads it.
struct Routing {
  std::vector<i64> idx;
  std::vector<u32> wbits, host_slot, rank_slot;
};

void one(const ep::ht::Shape& s, u32 tokens, const std::vector<u32>& tables, const Routing& rt) {
  using namespace ep::ht;
  const Tables tb{tables.data(), s};
  put(signals(s));
  for (u32 src = 0; src < s.r; ++src) {
    put(sig_notify(s, src));
    put(sig_tail(s, src));
    put(sig_dtail(s, src));
    put(sig_head(s, src));
  }
  for (u32 l = 0; l < s.l; ++l) {
    put(sig_fwd(s, l));
    put(sig_cready(s, l));
  }
  for (u32 h = 0; h < s.h; ++h) put(sig_ctail(s, h));
  put(w_ids(s));
  put(w_weights(s));
  for (u32 h = 0; h < s.h; ++h) put(w_host_slot(s, h));
  for (u32 r = 0; r < s.r; ++r) put(w_rank_slot(s, r));
  for (u32 c = 0; c <= s.chans; ++c) put(chan_lo(s, tokens, c));
  put(tb.words());
  for (u32 src = 0; src < s.r; ++src)
    for (u32 dst = 0; dst < s.r; ++dst) {
      for (u32 ch = 0; ch < s.chans; ++ch) {
        put(tb.rank_chan(src, dst, ch));
        put(tb.rank_chan_start(src, dst, ch));
      }
      put(tb.count(src, dst));
    }
  for (u32 src = 0; src < s.r; ++src)
    for (u32 h = 0; h < s.h; ++h)
      for (u32 ch = 0; ch < s.chans; ++ch) {
        put(tb.host_chan(src, h, ch));
        put(tb.host_chan_start(src, h, ch));
      }
  for (u32 dst = 0; dst < s.r; ++dst)
    for (u32 src = 0; src <= s.r; ++src) put(tb.recv_start(dst, src));
  for (u32 src = 0; src < s.r; ++src)
    for (u32 h = 0; h < s.h; ++h) put(tb.forwarder(src, h));
  for (u32 fwd = 0; fwd < s.r; ++fwd)
    for (u32 src = 0; src < s.r; ++src) put(tb.forwards(fwd, src) ? 1 : 0);
  for (u32 src = 0; src < s.r; ++src)
    for (u32 me = 0; me < s.r; ++me)
      for (u32 ch = 0; ch < s.chans; ++ch) {
        put(tb.ring_expect(src, me, ch));
        put(tb.direct_expect(src, me, ch));
      }
  const unsigned long long seqs[4] = {0, 1, s.ring, 3ull * s.ring + 1};
  for (u32 ch = 0; ch < s.chans; ++ch)
    for (u32 src = 0; src < s.r; ++src)
      for (unsigned long long q : seqs) put(ring_slot(s, ch, src, q));
  for (u32 h = 0; h < s.h; ++h) {
    put(crdma_off(s, h, 0));
    put(crdma_off(s, h, s.t - 1));
  }
  for (u32 src = 0; src < s.r; ++src)
    for (u32 l = 0; l < s.l; ++l) {
      put(contrib_at(s, src, 0, l));
      put(contrib_at(s, src, s.t - 1, l));
    }
  for (u32 ch = 0; ch < s.chans; ++ch) {
    put(stage_off(s, ch, 0));
    put(stage_off(s, ch, STAGE - 1));
    // CGET as CudaBuffer::new sizes it (cuda/ht.rs's cget_bytes).
    const u64 rows = cget_rows(s, (u64)s.chans * cget_rows_for(s.l) * s.h2);
    put(rows);
    for (u64 i = 0; i < rows; ++i) put(cget_off(s, rows, ch, i));
  }
  // Whether CGET of l rows, l - 1 rows, none (every same-host peer mapped)
  // and as sized holds enough rows where any is fetched (cget_enough).
  const u64 per = (u64)s.chans * s.h2;
  const u64 sizes[4] = {per * s.l, per * (s.l - 1), 0, per * cget_rows_for(s.l)};
  for (u64 b : sizes) put(cget_enough(s, b) ? 1 : 0);
  put(lane_words(s));
  for (u32 t = 0; t < tokens; ++t)
    for (u32 i = 0; i < s.mm / 4; ++i)
      put(meta_word(s, rt.idx.data(), rt.wbits.data(), rt.host_slot.data(), rt.rank_slot.data(),
                    t, i));
}

bool read_u32s(FILE* in, std::vector<u32>& v, size_t n) {
  v.resize(n);
  for (size_t i = 0; i < n; ++i)
    if (std::fscanf(in, "%u", &v[i]) != 1) return false;
  return true;
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  FILE* in = std::fopen(argv[1], "r");
  if (!in) return 3;
  for (;;) {
    u32 w[ep::ht::SW_WORDS];
    bool ok = true;
    for (u32 i = 0; i < ep::ht::SW_WORDS && ok; ++i) ok = std::fscanf(in, "%u", &w[i]) == 1;
    if (!ok) break;
    u32 tokens = 0, n = 0;
    if (std::fscanf(in, "%u %u", &tokens, &n) != 2) return 4;
    std::vector<u32> tables;
    if (!read_u32s(in, tables, n)) return 5;
    const ep::ht::Shape s = ep::ht::shape_of(w);
    Routing rt;
    rt.idx.resize((size_t)tokens * s.k);
    for (auto& v : rt.idx)
      if (std::fscanf(in, "%lld", &v) != 1) return 6;
    if (!read_u32s(in, rt.wbits, (size_t)tokens * s.k) ||
        !read_u32s(in, rt.host_slot, (size_t)tokens * s.h) ||
        !read_u32s(in, rt.rank_slot, (size_t)tokens * s.r))
      return 7;
    one(s, tokens, tables, rt);
    std::printf("--\n");
  }
  std::fclose(in);
  return 0;
}

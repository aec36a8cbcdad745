// kernels/ht.cu's plan on the GPU (ep::ht's plan_word, plan_recv_starts and
// plan_item_bad, as ep_ht_notify runs them over its threads; a word neither
// writes stays 0xdeadbeef) compiled as host C++: reads the
// cases src/cuda/ht/plan_tests.rs wrote to argv[1] (whitespace-separated
// numbers: per case the 15 shape words, r words of the active mask (1:
// active), then r notify rows of notify_row_words u32) and prints, per
// case, whether any check refuses the rows (1 or 0), the table's length and
// every word of it, one number a line, then "--".
#include <cstdio>
#include <vector>

#include "../kernels/ht.cu"

namespace {

void put(unsigned long long v) { std::printf("%llu\n", v); }

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
    const ep::ht::Shape s = ep::ht::shape_of(w);
    std::vector<u32> active, rows;
    if (!read_u32s(in, active, s.r) ||
        !read_u32s(in, rows, (size_t)s.r * ep::ht::notify_row_words(s)))
      return 4;
    const u32* r = rows.data();
    bool bad = false;
    for (u32 i = 0; i < ep::ht::plan_checks(s); ++i)
      bad = bad || ep::ht::plan_item_bad(s, r, active.data(), i);
    put(bad ? 1 : 0);
    const ep::ht::Tables tb{nullptr, s};
    put(tb.words());
    std::vector<u32> table(tb.words(), 0xdeadbeefu);
    for (u32 i = 0; i < tb.words(); ++i)
      if (!ep::ht::plan_is_recv_start(s, i)) table[i] = ep::ht::plan_word(s, r, active.data(), i);
    for (u32 dst = 0; dst < s.r; ++dst) ep::ht::plan_recv_starts(s, r, active.data(), dst, table.data());
    for (u32 w : table) put(w);
    std::printf("--\n");
  }
  std::fclose(in);
  return 0;
}

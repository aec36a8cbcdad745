// The CUDA header compiled as host C++: prints the ABI layout and the bytes
// its encoders produce for the cases the Rust test (cuda_header.rs) encodes
// too. One "name value" per line, hex without prefix.
#include <cstdio>
#include <cstring>

#include "gin/gin.cuh"

using namespace gin;

static void hex(const char* name, const u8* b, unsigned n) {
  std::printf("%s ", name);
  for (unsigned i = 0; i < n; ++i) std::printf("%02x", b[i]);
  std::printf("\n");
}

static void desc(const char* name, const proxy::Desc& d, u64 seq, u32 log2) {
  u64 q[8];
  proxy::encode(d, seq, log2, q);
  std::printf("%s", name);
  for (int i = 0; i < 8; ++i) std::printf(" %016llx", (unsigned long long)q[i]);
  std::printf("\n");
}

static proxy::Desc blank(u32 op) {
  proxy::Desc d;
  std::memset(&d, 0, sizeof d);
  d.op = op;
  return d;
}

// xorshift64*, the same sequence as the Rust test's.
static u64 state = 0x9e3779b97f4a7c15ull;
static u64 next() {
  state ^= state >> 12;
  state ^= state << 25;
  state ^= state >> 27;
  return state * 0x2545f4914f6cdd1dull;
}

int main() {
  std::printf("flag.STRONG_SIGNALS %u\n", FLAG_STRONG_SIGNALS);
  std::printf("flag.VA_SIGNALS %u\n", FLAG_VA_SIGNALS);
  std::printf("flag.EXCLUSIVE_CTX %u\n", FLAG_EXCLUSIVE_CTX);
  std::printf("flag.SENDER_SLOTS %u\n", FLAG_SENDER_SLOTS);
  std::printf("flag.CTA_CTX %u\n", FLAG_CTA_CTX);
  std::printf("flag.LSA_ONLY %u\n", FLAG_LSA_ONLY);
  std::printf("flag.QUEUE_ATOMICS %u\n", FLAG_QUEUE_ATOMICS);
  std::printf("fence.NONE %u\nfence.CONTEXT %u\nfence.ALL_CONTEXTS %u\n", (unsigned)FENCE_NONE,
              (unsigned)FENCE_CONTEXT, (unsigned)FENCE_ALL_CONTEXTS);
  std::printf("backend.NONE %u\nbackend.PROXY %u\nbackend.GDAKI %u\n", BACKEND_NONE, BACKEND_PROXY,
              BACKEND_GDAKI);
  std::printf("sizeof.DevComm %zu\n", sizeof(DevComm));
  std::printf("sizeof.Window %zu\n", sizeof(Window));
  std::printf("sizeof.ProxyRingAbi %zu\n", sizeof(ProxyRingAbi));
  std::printf("offset.DevComm.timeout_ticks %zu\n", __builtin_offsetof(DevComm, timeout_ticks));
  std::printf("offset.DevComm.error_word %zu\n", __builtin_offsetof(DevComm, error_word));
  std::printf("offset.Window.sizes %zu\n", __builtin_offsetof(Window, sizes));
  std::printf("offset.DevComm.rings %zu\n", __builtin_offsetof(DevComm, rings));
  std::printf("offset.DevComm.signal_window %zu\n", __builtin_offsetof(DevComm, signal_window));
  std::printf("offset.DevComm.backend_kind %zu\n", __builtin_offsetof(DevComm, backend_kind));
  std::printf("offset.DevComm.lsa %zu\n", __builtin_offsetof(DevComm, lsa));
  std::printf("offset.DevComm.signal_peers %zu\n", __builtin_offsetof(DevComm, signal_peers));
  std::printf("offset.ProxyRingAbi.head %zu\n", __builtin_offsetof(ProxyRingAbi, head));
  std::printf("sizeof.GdakiSqAbi %zu\n", sizeof(GdakiSqAbi));
  std::printf("sizeof.GdakiQpAbi %zu\n", sizeof(GdakiQpAbi));
  std::printf("offset.GdakiSqAbi.indices %zu\n", __builtin_offsetof(GdakiSqAbi, indices));
  std::printf("offset.GdakiSqAbi.log2 %zu\n", __builtin_offsetof(GdakiSqAbi, log2));
  std::printf("offset.GdakiQpAbi.companion %zu\n", __builtin_offsetof(GdakiQpAbi, companion));
  std::printf("offset.GdakiQpAbi.counter_key %zu\n", __builtin_offsetof(GdakiQpAbi, counter_key));
  std::printf("offset.GdakiQpAbi.sink_key %zu\n", __builtin_offsetof(GdakiQpAbi, sink_key));
  std::printf("errkind.WQE_ERROR %u\n", (unsigned)WQE_ERROR);
  std::printf("errkind.COPY_ENGINE %u\n", (unsigned)COPY_ENGINE);
  std::printf("errkind.PATH_NOT_BUILT %u\n", (unsigned)PATH_NOT_BUILT);
  std::printf("queue_paths.default %u\n", (unsigned)GIN_QUEUE_PATHS);

  // Descriptors: the Rust golden cases, then random ones.
  proxy::Desc d = blank(proxy::OP_PUT);
  d.bytes = 4096;
  d.dst_window = 3;
  d.dst_offset = 0x100;
  d.src_window = 2;
  d.src_offset = 0x40;
  d.has_signal = 1;
  d.sig_window = 1;
  d.sig_offset = 0x18;
  d.sig_add = 1;
  d.sig_strong = 1;
  d.has_counter = 1;
  d.counter = 5;
  desc("desc.golden_put", d, 5, 2);
  proxy::Desc v = blank(proxy::OP_PUT);
  v.bytes = 8;
  v.dst_window = 7;
  v.dst_offset = 8;
  v.has_inline = 1;
  v.inline_value = 0x80000000000000ffull;
  desc("desc.golden_inline", v, 0, 4);
  proxy::Desc g = blank(proxy::OP_PUT);
  g.dst_window = 1;
  g.has_signal = 1;
  g.sig_window = 1;
  g.sig_offset = 0x18;
  g.sig_add = 0x8000000000000005ull;
  g.sig_strong = 1;
  desc("desc.golden_signal_top", g, 0, 2);
  // put_value of 2 bytes with a weak VA signal (a signal in window 4, not
  // the signal window), as put_value_sized posts it.
  proxy::Desc pv = blank(proxy::OP_PUT);
  pv.bytes = 2;
  pv.dst_window = 6;
  pv.dst_offset = 0x22;
  pv.has_inline = 1;
  pv.inline_value = 0xbeef;
  pv.has_signal = 1;
  pv.sig_window = 4;
  pv.sig_offset = 0x40;
  pv.sig_add = 3;
  pv.sig_strong = 0;
  desc("desc.golden_value2_va", pv, 9, 3);
  for (int i = 0; i < 64; ++i) {
    proxy::Desc r = blank((next() & 1) ? proxy::OP_PUT : proxy::OP_GET);
    r.bytes = next() & proxy::MAX_BYTES;
    r.dst_window = (u32)(next() & proxy::MAX_ID);
    r.src_window = (u32)(next() & proxy::MAX_ID);
    r.dst_offset = next() & proxy::LOW63;
    r.src_offset = next() & proxy::LOW63;
    r.has_inline = r.op == proxy::OP_PUT && (next() & 1);
    r.inline_value = r.has_inline ? next() : 0;
    r.has_signal = next() & 1;
    if (r.has_signal) {
      r.sig_window = (u32)(next() & proxy::MAX_ID);
      r.sig_offset = next() & proxy::LOW63;
      r.sig_add = next();
      r.sig_strong = next() & 1;
    }
    r.has_counter = next() & 1;
    r.counter = r.has_counter ? (u32)(next() & proxy::MAX_ID) : 0;
    u64 seq = next();
    u32 log2 = (u32)(next() % 20);
    char name[32];
    std::snprintf(name, sizeof name, "desc.random%d", i);
    desc(name, r, seq, log2);
  }

  // WQEs: the Rust golden cases.
  u8 b[64];
  gdaki::write(b, 0x1234, 0xabcdef, gdaki::CQ_UPDATE, 0x1122334455667788ull, 0xaabbccdd,
               0x00007f0000001000ull, 0x01020304, 4096);
  hex("wqe.write", b, 64);
  gdaki::write(b, 7, 0x42, gdaki::CQ_UPDATE, 0x1000, 9, 0x2000, 10, 64, true);
  hex("wqe.read", b, 64);
  gdaki::fetch_add(b, 0xffff, 5, gdaki::CQ_UPDATE | gdaki::FM_STRONG_ORDERING, 0x10, 7, 1, 0x20, 9);
  hex("wqe.fetch_add", b, 64);
  gdaki::compare_swap(b, 3, 5, gdaki::CQ_UPDATE, 0x18, 7, 11, 12, 0x28, 9);
  hex("wqe.compare_swap", b, 64);
  const u8 data[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  gdaki::write_inline(b, 2, 1, gdaki::CQ_UPDATE, 0x40, 3, data, 8);
  hex("wqe.inline", b, 64);
  // A 1, 2 and 4-byte put_value's inline write (put_value_sized), as
  // kernels build it: from the value in a register (the bytes of `data`,
  // little-endian), the bytes past the size left zero.
  const u64 value = 0x0807060504030201ull;
  gdaki::write_inline_value(b, 4, 1, gdaki::CQ_UPDATE, 0x41, 3, value, 1);
  hex("wqe.inline1", b, 64);
  gdaki::write_inline_value(b, 5, 1, gdaki::CQ_UPDATE, 0x42, 3, value, 2);
  hex("wqe.inline2", b, 64);
  gdaki::write_inline_value(b, 6, 1, gdaki::CQ_UPDATE, 0x44, 3, value, 4);
  hex("wqe.inline4", b, 64);
  // The 8-byte one both ways: the same bytes.
  gdaki::write_inline_value(b, 2, 1, gdaki::CQ_UPDATE, 0x40, 3, value, 8);
  hex("wqe.inline_value8", b, 64);
  gdaki::wait(b, 9, 2, gdaki::CQ_UPDATE, 0x10203, 0x42);
  hex("wqe.wait", b, 64);

  // Collapsed-CQE reading and 16-bit unwrapping, as kernels poll: random
  // tails and (counter, near) pairs from a fresh sequence.
  state = 0x243f6a8885a308d3ull;
  for (int i = 0; i < 64; ++i) {
    const u64 tail = next();
    const u16 c = (u16)next();
    const u64 near = next();
    std::printf("cqe.%d %016llx %u %u %016llx\n", i, tail, gdaki::cqe_opcode(tail),
                (unsigned)gdaki::cqe_wqe_counter(tail), gdaki::unwrap16(c, near));
  }
  gdaki::nop(b, 0x55, 0x77, 0);
  hex("wqe.nop", b, 64);
  std::printf("doorbell %016llx\n", (unsigned long long)gdaki::doorbell(0x0102, 0xabcdef));
  std::printf("errword %016llx\n", (unsigned long long)error_word(OUT_OF_WINDOW, 3, 7, 0xdeadbeef));
  std::printf("errword_none %016llx\n", (unsigned long long)error_word(ABORTED, 1000, NO_PEER, 1));
  std::printf("errword_copy_engine %016llx\n",
              (unsigned long long)error_word(COPY_ENGINE, 0, 1, 9));
  return 0;
}

// kernels/ll.cu's number formats compiled as host C++: writes, to the file
// named by argv[1], what its FP8 and BF16 functions produce for the cases
// fp8_host.rs enumerates in the same order, which compares them byte for byte
// with num.rs. Every section is a run of bytes (u8 codes, little-endian u16
// and u32).
#include <cstdio>
#include <vector>

#include "../kernels/ll.cu"

using namespace ep::fp8;

static std::vector<unsigned char> out;
static void u8_(u8 v) { out.push_back(v); }
static void u16_(u16 v) {
  out.push_back((unsigned char)v);
  out.push_back((unsigned char)(v >> 8));
}
static void u32_(u32 v) {
  for (int i = 0; i < 4; ++i) out.push_back((unsigned char)(v >> (8 * i)));
}

// The block largest magnitudes whose scales the cases use (f32 bits).
static const u32 AMAX[] = {0x00000000u, 0x3f800000u, 0x43e00000u, 0x40400000u, 0x3dcccccdu,
                           0x0d000000u, 0x72000000u, 0x40f00000u, 0x42f6cccdu, 0x00010000u,
                           0x7f7f0000u, 0x3ebd70a4u};

// xorshift64*, as fp8_host.rs's.
static u64 state = 0x9e3779b97f4a7c15ull;
static u64 next() {
  state ^= state >> 12;
  state ^= state << 25;
  state ^= state >> 27;
  return state * 0x2545f4914f6cdd1dull;
}

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  // 1. The scales.
  std::vector<float> scales;
  for (u32 a : AMAX) scales.push_back(scale_of(float_of(a)));
  for (float s : scales) u32_(bits_of(s));
  // 2. Every BF16 value quantised with every scale.
  for (float s : scales)
    for (u32 b = 0; b < 65536; ++b) u8_(quantize(from_bf16((u16)b), s));
  // 3. f32 codes: every top half with a few bottom halves.
  const u32 LOW[] = {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, 0x1234u, 0xabcdu};
  for (u32 hi = 0; hi < 65536; ++hi)
    for (u32 lo : LOW) u8_(e4m3_of(float_of(hi << 16 | lo)));
  // 4. Around every midpoint between neighbouring codes, both signs.
  for (u32 c = 0; c < 0x7e; ++c) {
    const float mid = (e4m3_value((u8)c) + e4m3_value((u8)(c + 1))) / 2.0f;
    for (int d = -2; d <= 2; ++d) {
      const u32 m = bits_of(mid) + (u32)d;
      u8_(e4m3_of(float_of(m)));
      u8_(e4m3_of(float_of(m | 0x80000000u)));
    }
  }
  // 5. Every code decoded (f32 bits) and dequantised with every scale.
  for (u32 c = 0; c < 256; ++c) u32_(bits_of(e4m3_value((u8)c)));
  for (float s : scales)
    for (u32 c = 0; c < 256; ++c) u16_(dequantize((u8)c, s));
  // 6. Whole tokens (hidden 512) as the dispatch kernel quantises them:
  // per block of 128, the largest magnitude, its scale, each element; laid
  // out as a message's payload (the codes, then the scales).
  for (int t = 0; t < 64; ++t) {
    u16 x[512];
    for (int i = 0; i < 512; ++i) {
      const u64 r = next();
      // Mostly ordinary values over 40 binades, some raw bit patterns (NaN,
      // infinity, denormals), some all-zero blocks (either sign).
      if (t % 8 == 7) x[i] = (u16)(r & 0x8000u);
      else if (r % 16 == 0) x[i] = (u16)(r >> 16);
      else x[i] = (u16)((r >> 63) << 15 | (100 + (r >> 8) % 40) << 7 | (r >> 20 & 0x7f));
    }
    u8 codes[512];
    u32 sbits[4];
    for (int b = 0; b < 4; ++b) {
      float amax = 0.0f;
      for (int i = 0; i < 128; ++i) amax = absmax(amax, from_bf16(x[128 * b + i]));
      const float s = scale_of(amax);
      for (int i = 0; i < 128; ++i) codes[128 * b + i] = quantize(from_bf16(x[128 * b + i]), s);
      sbits[b] = bits_of(s);
    }
    for (u8 c : codes) u8_(c);
    for (u32 s : sbits) u32_(s);
  }
  FILE* f = std::fopen(argv[1], "wb");
  if (!f || std::fwrite(out.data(), 1, out.size(), f) != out.size() || std::fclose(f) != 0) return 1;
  return 0;
}

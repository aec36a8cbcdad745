// gin-ep's high-throughput mode on CUDA ranks: the count exchange (notify),
// dispatch, the identity expert and combine, on gin/gin.cuh's put, get,
// signal and flush. The protocol, windows, signal numbering and message
// layout are the CPU ranks' (src/ht: plan.rs, lane.rs, combine.rs;
// docs/ep.md): hosts of l ranks, rank = host * l + local index; each rank's
// tokens split into `chans` contiguous ranges (channels), channel c on
// context c with its own rings, credits and signals.
//
// Each step stages the notify row (NSEND), every token's payload (XIN: the
// caller's BF16, or FP8 quantised from it by ep_ht_quantize; from GPU memory
// BF16 payloads are read in place by the dispatch kernel unless a
// destination is queued) and metadata (MIN: source index, top-k ids and
// weights, its slot among this rank's tokens for every host and every rank,
// NONE where it does not go). For host inputs the host writes the row and
// ep_ht_stage_meta the metadata beside the notify kernel; for inputs in GPU
// memory ep_ht_layout writes both, queued right before the notify kernel.
// The notify kernel, once it holds every rank's row (this round's half of
// NRECV), builds the step's plan from them as one table of u32 words (the
// count matrix per channel, each receiver's block starts, the forwarders:
// plan.rs's Plan::tables) and judges the rows as the host's checks do; the
// dispatch kernel, queued right after it on the same stream, moves runs of
// tokens by that table, with no host step between the two. The notify
// kernel also copies the rows into pinned host memory, where the host reads
// them after the dispatch kernel and builds the same plan with the CPU
// ranks' code (for the combine and the read-back).
//
// A channel is one block (DeepEP's channel is one SM), a state machine as
// the CPU ranks' lane: warp 0 decides what can move without waiting (a
// batch of puts, gets, flushes, signals and row sums: thread 0 the
// protocol's steps, the whole warp this rank's own tokens 32 at a time,
// consecutive places merged into one put or get), the whole block carries
// the batch out (a run of puts to load/store peers as one copy spread over
// all its warps, a run of row sums likewise, anything else by gin's
// CTA-wide calls), and so on until the channel's part of the step is done.
// Thread 0 reads signals without waiting; when nothing moved for the job
// timeout, or gin's abort flag is raised (a watcher saw a peer die), it
// records the failure in gin's error word naming the peer it waits for
// (the host's error names it). Every block only polls, so no block waits
// for another's progress while holding up its own.
//
// Dispatch (channel c, rank me on host H):
// - sender: for each other host, its tokens for that host go to the host's
//   forwarder for me (the rank with my local index, or the next active
//   one) in runs of consecutive tokens, one put of payloads and one of
//   metadata carrying the signal: straight into their final place when the
//   forwarder receives them itself (dtail), else into the forwarder's ring
//   for (c, me), within the credits (tail counts messages in; head, back at
//   the sender, messages consumed);
// - own host: its tokens for ranks of H go into their final place at each
//   of them, consecutive tokens with consecutive places there in one put of
//   payloads and one of metadata;
// - forwarder: what arrives from other hosts' sources (in the ring, or in
//   its own final place) goes on to the other ranks of H that receive it;
//   the ring's credits go back once the copies are complete; where each
//   receiver holds each token is recorded for the combine (contrib:
//   DeepEP's send_nvl_head);
// - receiver: finally it tells each rank of H how many tokens it delivered
//   there, and waits for the same from each of them; the totals must match
//   the count matrix.
// Combine (channel c): every rank tells the ranks of its host its rows are
// written (cready); a forwarder sums its host's rows of every token it
// forwarded (read in place where mapped, else fetched by get) and puts one
// row per token back to the source in runs counted by ctail; a source
// reduces each token once every host it went to has delivered, its own
// host's rows read in place (or fetched by get, consecutive places in one
// get, one flush for many tokens), in the CPU ranks' order (so the result
// is theirs bit for bit).
//
// Compiled after ll.cu, in one NVRTC source (cuda::HT_KERNELS); nvcc
// compiles this file alone, including ll.cu. As host C++ (no __CUDACC__)
// only the index arithmetic in ep::ht is visible (tests cross-check it
// against the Rust plan).
#ifndef GIN_EP_LL_CU
#include "ll.cu"
#endif

namespace ep {

// The error kind of high-throughput mode beside ll.cu's ERR_*: a peer broke
// the protocol; word 1 is what (ht::HT_*) | the channel << 32, words 2-3
// the values it names.
constexpr u64 ERR_HT = 8;

namespace ht {

// "Not there" in the metadata's slots and the plan's forwarders
// (layout::NONE).
constexpr u32 NONE = 0xffffffffu;

// Messages one put into a ring carries at most, messages or rows one put
// carries where no ring bounds it, and combine rows a channel stages before
// it flushes (plan.rs's CHUNK, RUN, STAGE).
constexpr u32 CHUNK = 16;
constexpr u32 RUN = 64;
constexpr u32 STAGE = 64;
// Rows of CGET per channel CudaBuffer::new allocates where a same-host
// peer's rows are fetched by get (cuda/ht.rs's cget_bytes; none where
// every one is mapped): at least one per local rank, and FETCH_ROWS so
// that one flush covers the fetches of many tokens (a get and a flush per token were
// the proxy combine's cost).
constexpr u32 FETCH_ROWS = 64;

// Window indices (plan.rs): every high-throughput kernel takes the twelve
// windows in this order.
constexpr u32 NSEND = 0, NRECV = 1, XIN = 2, MIN = 3, RINGX = 4, RINGM = 5, RECVX = 6,
              RECVM = 7, CSEND = 8, CSTAGE = 9, CRDMA = 10, CGET = 11, WINDOWS = 12;

// The shape words (cuda/ht.rs's shape_words): where each value lies.
constexpr u32 SW_R = 0;      // ranks
constexpr u32 SW_H = 1;      // hosts
constexpr u32 SW_L = 2;      // ranks per host
constexpr u32 SW_T = 3;      // max tokens per rank
constexpr u32 SW_K = 4;      // top-k
constexpr u32 SW_P = 5;      // payload bytes of a token
constexpr u32 SW_MM = 6;     // metadata bytes of a token
constexpr u32 SW_H2 = 7;     // bytes of a combine row
constexpr u32 SW_RING = 8;   // slots of each (channel, source) ring
constexpr u32 SW_CHANS = 9;  // channels
constexpr u32 SW_RANK = 10;  // this rank
constexpr u32 SW_HIDDEN = 11;
constexpr u32 SW_LEXP = 12;  // experts per rank
constexpr u32 SW_FP8 = 13;   // 1: FP8 payloads
constexpr u32 SW_NSIG = 14;  // signals per context
constexpr u32 SW_WORDS = 15;
static_assert(SW_NSIG + 1 == SW_WORDS, "ep::ht: shape words");

struct Shape {
  u32 r, h, l, t, k, p, mm, h2, ring, chans, rank, hidden, lexp, fp8, nsig;
};

EP_FN Shape shape_of(const u32* w) {
  return Shape{w[SW_R],  w[SW_H],    w[SW_L],     w[SW_T],    w[SW_K],
               w[SW_P],  w[SW_MM],   w[SW_H2],    w[SW_RING], w[SW_CHANS],
               w[SW_RANK], w[SW_HIDDEN], w[SW_LEXP], w[SW_FP8], w[SW_NSIG]};
}

// Signal ids, the same in every context (plan.rs's Shape).
EP_FN u32 sig_notify(const Shape&, u32 src) { return src; }
EP_FN u32 sig_tail(const Shape& s, u32 src) { return s.r + src; }
EP_FN u32 sig_dtail(const Shape& s, u32 src) { return 2 * s.r + src; }
EP_FN u32 sig_head(const Shape& s, u32 fwd) { return 3 * s.r + fwd; }
EP_FN u32 sig_fwd(const Shape& s, u32 local) { return 4 * s.r + local; }
EP_FN u32 sig_cready(const Shape& s, u32 local) { return 4 * s.r + s.l + local; }
EP_FN u32 sig_ctail(const Shape& s, u32 host) { return 4 * s.r + 2 * s.l + host; }
EP_FN u32 signals(const Shape& s) { return 4 * s.r + 2 * s.l + s.h; }

// Word offsets in a token's metadata.
EP_FN u32 w_ids(const Shape&) { return 1; }
EP_FN u32 w_weights(const Shape& s) { return 1 + s.k; }
EP_FN u32 w_host_slot(const Shape& s, u32 host) { return 1 + 2 * s.k + host; }
EP_FN u32 w_rank_slot(const Shape& s, u32 rank) { return 1 + 2 * s.k + s.h + rank; }

// Word i of this rank's token t's metadata (plan.rs's meta_word): its
// index, its top-k ids (i64 entries as i32) and the weights' bits (idx and
// wbits: tokens x k), its slot for every host (host_slot: tokens x h) and
// every rank (rank_slot: tokens x r; NONE where it does not go), zero
// padding. ep_ht_stage_meta writes MIN with it.
EP_FN u32 meta_word(const Shape& s, const i64* idx, const u32* wbits, const u32* host_slot,
                    const u32* rank_slot, u32 t, u32 i) {
  const u64 k = s.k;
  if (i == 0) return t;
  if (i < w_weights(s)) return (u32)(u64)idx[t * k + i - w_ids(s)];
  if (i < w_host_slot(s, 0)) return wbits[t * k + i - w_weights(s)];
  if (i < w_rank_slot(s, 0)) return host_slot[(u64)t * s.h + i - w_host_slot(s, 0)];
  if (i < w_rank_slot(s, s.r)) return rank_slot[(u64)t * s.r + i - w_rank_slot(s, 0)];
  return 0;
}

// Channel c's share of `tokens` tokens: [chan_lo(c), chan_lo(c + 1)).
// a / b, with 32-bit division where a fits 32 bits (64-bit division is a
// call of a hundred-odd instructions on the GPU).
EP_FN u64 div_u64(u64 a, u32 b) { return a <= 0xffffffffull ? (u64)((u32)a / b) : a / b; }

EP_FN u32 chan_lo(const Shape& s, u32 tokens, u32 c) {
  return (u32)((u64)tokens * c / s.chans);
}

// The plan's table (plan.rs's Plan::tables, TableAt).
struct Tables {
  const u32* w;
  Shape s;
  EP_FN u32 at_host_chan() const { return s.r * s.r * s.chans; }
  EP_FN u32 at_recv_pre() const { return at_host_chan() + s.r * s.h * s.chans; }
  EP_FN u32 at_fwd_of() const { return at_recv_pre() + s.r * (s.r + 1); }
  EP_FN u32 words() const { return at_fwd_of() + s.r * s.h; }
  // Tokens from src to dst in channel ch, and in the channels before ch.
  EP_FN u32 rank_chan(u32 src, u32 dst, u32 ch) const {
    return w[(src * s.r + dst) * s.chans + ch];
  }
  EP_FN u32 rank_chan_start(u32 src, u32 dst, u32 ch) const {
    u32 n = 0;
    for (u32 c = 0; c < ch; ++c) n += rank_chan(src, dst, c);
    return n;
  }
  EP_FN u32 count(u32 src, u32 dst) const { return rank_chan_start(src, dst, s.chans); }
  // Tokens from src to host in channel ch, and in the channels before ch.
  EP_FN u32 host_chan(u32 src, u32 host, u32 ch) const {
    return w[at_host_chan() + (src * s.h + host) * s.chans + ch];
  }
  EP_FN u32 host_chan_start(u32 src, u32 host, u32 ch) const {
    u32 n = 0;
    for (u32 c = 0; c < ch; ++c) n += host_chan(src, host, c);
    return n;
  }
  // Where src's block starts among dst's received tokens.
  EP_FN u32 recv_start(u32 dst, u32 src) const { return w[at_recv_pre() + dst * (s.r + 1) + src]; }
  // The rank forwarding src's tokens on host (NONE: none).
  EP_FN u32 forwarder(u32 src, u32 host) const { return w[at_fwd_of() + src * s.h + host]; }
  // Whether `fwd` forwards src's tokens on its host (src on another host).
  EP_FN bool forwards(u32 fwd, u32 src) const {
    return src / s.l != fwd / s.l && forwarder(src, fwd / s.l) == fwd;
  }
  // At forwarder `me`: messages src puts into its ring in channel ch, and
  // straight into their final place here.
  EP_FN u32 ring_expect(u32 src, u32 me, u32 ch) const {
    const u32 n = host_chan(src, me / s.l, ch), d = rank_chan(src, me, ch);
    return n - (d < n ? d : n);
  }
  EP_FN u32 direct_expect(u32 src, u32 me, u32 ch) const { return rank_chan(src, me, ch); }
};

// The step's plan built from every rank's notify row, on the GPU, by the
// notify kernel once it holds them all (plan.rs's Plan::new and
// Plan::tables, word for word), so that the dispatch kernel can follow it
// on the same stream with no host step between the two. `rows`: r rows of
// notify_row_words(s) u32 (this round's half of NRECV); `active`: u32 per
// rank, 1 active. A masked rank's row is stale: its counts read as zero.
EP_FN u32 notify_mask_words(const Shape& s) { return (s.r + 31) / 32; }
EP_FN u32 notify_row_words(const Shape& s) { return notify_mask_words(s) + (s.r + s.h) * s.chans; }
// The rank forwarding src's tokens on host (plan.rs's forwarder): src on
// its own host; elsewhere the rank with src's local index, or the next
// active one in cyclic order; NONE where no rank there is active.
EP_FN u32 forwarder_of(const Shape& s, const u32* active, u32 src, u32 host) {
  if (host == src / s.l) return active[src] ? src : NONE;
  for (u32 i = 0; i < s.l; ++i) {
    const u32 cand = host * s.l + (src % s.l + i) % s.l;
    if (active[cand]) return cand;
  }
  return NONE;
}
// Word i (< Tables::words()) of the plan's table, outside the block starts
// (plan_recv_starts writes those: a running sum per destination).
template <class Rows>
EP_FN u32 plan_word(const Shape& s, Rows rows, const u32* active, u32 i) {
  const Tables tb{nullptr, s};
  const u32 rw = notify_row_words(s), mw = notify_mask_words(s), c = s.chans;
  if (i < tb.at_recv_pre()) {
    // The counts per (source, destination, channel), then per (source,
    // host, channel): each source's row after its mask, as it came.
    const bool by_rank = i < tb.at_host_chan();
    const u32 j = by_rank ? i : i - tb.at_host_chan();
    const u32 per = (by_rank ? s.r : s.h) * c, src = j / per;
    if (!active[src]) return 0;
    return rows[(u64)src * rw + mw + (by_rank ? 0 : s.r * c) + j % per];
  }
  const u32 j = i - tb.at_fwd_of();
  return forwarder_of(s, active, j / s.h, j % s.h);
}
// Whether word i of the table is one of the block starts.
EP_FN bool plan_is_recv_start(const Shape& s, u32 i) {
  const Tables tb{nullptr, s};
  return i >= tb.at_recv_pre() && i < tb.at_fwd_of();
}
// dst's block starts (r + 1 words of the table from at_recv_pre() + dst *
// (r + 1)): where each source's tokens start among dst's, the tokens of
// every active source before it, then the total; one pass over the
// sources' counts for dst.
template <class Rows>
EP_FN void plan_recv_starts(const Shape& s, Rows rows, const u32* active, u32 dst, u32* table) {
  const Tables tb{nullptr, s};
  const u32 rw = notify_row_words(s), mw = notify_mask_words(s), c = s.chans;
  u32* const at = table + tb.at_recv_pre() + dst * (s.r + 1);
  u32 n = 0;
  for (u32 src = 0; src < s.r; ++src) {
    at[src] = n;
    if (!active[src]) continue;
    for (u32 ch = 0; ch < c; ++ch) n += rows[(u64)src * rw + mw + dst * c + ch];
  }
  at[s.r] = n;
}
// The checks the host makes of the rows before it builds a plan
// (cuda/ht.rs's notify_rows with plan.rs's check_row), one item each:
// plan_checks(s) items, each active source's count of every destination
// and every host (at most t: a refused row's counts, u32::MAX, are above
// any buffer's maximum) and every bit of its active mask (this rank's).
// The plan holds iff no item is bad.
EP_FN u32 plan_checks(const Shape& s) { return s.r * (2 * s.r + s.h); }
template <class Rows>
EP_FN bool plan_item_bad(const Shape& s, Rows rows, const u32* active, u32 item) {
  const u32 per = 2 * s.r + s.h, src = item / per, g = item % per;
  if (!active[src]) return false;
  const u64 at = (u64)src * notify_row_words(s);
  if (g < s.r + s.h) {
    u64 n = 0;
    for (u32 ch = 0; ch < s.chans; ++ch) n += rows[at + notify_mask_words(s) + (u64)g * s.chans + ch];
    return n > s.t;
  }
  const u32 p = g - (s.r + s.h);
  return ((rows[at + p / 32] >> (p % 32) & 1u) != 0) != (active[p] != 0);
}

// Where things lie: a slot of the (ch, src) ring for the message with
// sequence number seq, a row of CRDMA, an entry of the forwarder's record,
// a staging row, a row fetched by get.
EP_FN u64 ring_slot(const Shape& s, u32 ch, u32 src, u64 seq) {
  return ((u64)ch * s.r + src) * s.ring + seq % s.ring;
}
EP_FN u64 crdma_off(const Shape& s, u32 host, u32 hs) { return ((u64)host * s.t + hs) * s.h2; }
EP_FN u64 contrib_at(const Shape& s, u32 src, u32 hs, u32 local) {
  return ((u64)src * s.t + hs) * s.l + local;
}
EP_FN u64 stage_off(const Shape& s, u32 ch, u32 i) { return ((u64)ch * STAGE + i) * s.h2; }
// CGET holds `rows` rows per channel (cget_rows: none where every
// same-host peer is mapped here, else max(l, FETCH_ROWS) as CudaBuffer::new
// sizes it; at least l is required, cget_enough; more let one flush cover
// the fetches of several tokens).
EP_FN u64 cget_rows_for(u32 l) { return l > FETCH_ROWS ? l : FETCH_ROWS; }
EP_FN u64 cget_rows(const Shape& s, u64 cget_bytes) { return cget_bytes / ((u64)s.chans * s.h2); }
EP_FN u64 cget_off(const Shape& s, u64 rows, u32 ch, u64 i) { return ((u64)ch * rows + i) * s.h2; }
// Whether CGET of cget_bytes holds enough rows where any is fetched: one of
// each local rank a channel (a forwarder's sum fetches rows 0 .. l of its
// channel, a token's reduction up to l; fewer would write into the next
// channel's rows, or never let a token's fetches through). cuda/ht.rs's
// check_cget refuses a smaller one at CudaBuffer::new, the combine kernel
// too (cget_short).
EP_FN bool cget_enough(const Shape& s, u64 cget_bytes) { return cget_rows(s, cget_bytes) >= s.l; }

// The per-channel scratch of a kernel's warp 0 (u64 words, in shared
// memory where it fits: lane_of): where each part starts, and its length.
EP_FN u32 lane_words(const Shape& s) { return 2 * s.h + 2 * s.r + 3 * s.l + 16; }
// Dispatch: per host the send cursor and the messages sent into its ring;
// per source the ring and direct messages forwarded; per local rank the
// tokens delivered there, the count heard from it, whether heard; the
// local-writes cursor; whether the delivered counts went out.
EP_FN u32 l_send_cur(const Shape&) { return 0; }
EP_FN u32 l_send_ring(const Shape& s) { return s.h; }
EP_FN u32 l_ring_done(const Shape& s) { return 2 * s.h; }
EP_FN u32 l_direct_done(const Shape& s) { return 2 * s.h + s.r; }
EP_FN u32 l_delivered(const Shape& s) { return 2 * s.h + 2 * s.r; }
EP_FN u32 l_heard(const Shape& s) { return 2 * s.h + 2 * s.r + s.l; }
EP_FN u32 l_heard_ok(const Shape& s) { return 2 * s.h + 2 * s.r + 2 * s.l; }
EP_FN u32 l_misc(const Shape& s) { return 2 * s.h + 2 * s.r + 3 * s.l; }
// Combine: per host the rows arrived; then the forwarded source and token
// under way, staging rows used, the next token to reduce.
EP_FN u32 c_got(const Shape&) { return 0; }
EP_FN u32 c_misc(const Shape& s) { return s.h; }

// Protocol errors a high-throughput kernel records (word 1 of ERR_HT: the
// code | the channel << 32; words 2 and 3 the values named), cuda/dev.rs's
// decode_error.
constexpr u64 HT_STREAM_AHEAD = 1;  // signal value, messages expected
constexpr u64 HT_TOKEN_OUTSIDE = 2; // token, host slot
constexpr u64 HT_RANK_SLOT = 3;     // rank slot, destination rank
constexpr u64 HT_WRONG_PLACE = 4;   // place landed, place its slot says
constexpr u64 HT_RING_FOR_SELF = 5; // token
constexpr u64 HT_DELIVERED = 6;     // tokens delivered, the counts say
constexpr u64 HT_ROWS_AHEAD = 7;    // rows arrived, rows expected

// The layout of inputs in GPU memory (ep_ht_layout: layout.rs's Layout and
// plan.rs's notify_row, computed where the routing is). A destination is a
// rank d < r or a host d - r; a token goes to it where a live slot of it
// (an expert in 0 .. r x lexp whose rank is active: a masked rank's slots
// count as empty) names an expert of that rank or host. Entries the checks
// refuse (input::entry_key) count for nothing: the row is then refused.
EP_FN u32 layout_dests(const Shape& s) { return s.r + s.h; }

// What a destination's block judges its tokens against: d's experts are
// one range [lo, hi) (hosts are of equal size, their ranks numbered host
// by host), and whether every rank owning one of them is active (then no
// slot's owner needs looking up; a rank destination has one owner, d).
struct LayoutDest {
  i64 lo, hi;
  bool all_active;
};

EP_FN LayoutDest layout_dest(const Shape& s, const u32* active, u32 d) {
  const i64 experts = (i64)s.r * (i64)s.lexp;
  const bool rank = d < s.r;
  const i64 lo = rank ? (i64)d * s.lexp : (i64)(d - s.r) * s.l * s.lexp;
  const i64 hi = lo + (rank ? (i64)s.lexp : (i64)s.l * s.lexp);
  const u32 first = rank ? d : (d - s.r) * s.l, owners = rank ? 1u : s.l;
  bool all = true;
  for (u32 q = first; q < first + owners && q < s.r; ++q) all = all && active[q] != 0;
  return LayoutDest{lo, hi < experts ? hi : experts, all};
}

// Whether a slot naming expert e goes to the destination `dest` describes:
// its expert lies in the range and its rank (owner) is active.
EP_FN bool layout_slot_goes(const Shape& s, i64 e, const u32* active, const LayoutDest& dest) {
  return e >= dest.lo && e < dest.hi && (dest.all_active || active[(u32)e / s.lexp] != 0);
}

// Tiles whose ids ep_ht_layout's threads load at once (a token of each).
constexpr u32 LAYOUT_WIDE = 4;

// Whether each of LAYOUT_WIDE tokens (ids[i]: its k top-k ids) goes to the
// destination: bit i for token i. Every slot is judged, with no early exit
// and no 64-bit division, four ids of each token, sixteen loads, in flight
// together. (On the H200 a destination's block judged its 4096 tokens in
// 13.0 us with eight ids one at a time prefetched into L1 (76362c4), 14.5
// with one token's four ids in flight, and 12.2 with sixteen: what the
// judging waits on is not known.)
EP_FN u32 layout_goes_wide(const Shape& s, const i64* const ids[LAYOUT_WIDE], const u32* active,
                           const LayoutDest& dest) {
  bool goes[LAYOUT_WIDE] = {};
  u32 j = 0;
  for (; j + 4 <= s.k; j += 4) {
    i64 e[LAYOUT_WIDE][4];
    for (u32 i = 0; i < LAYOUT_WIDE; ++i)
      for (u32 q = 0; q < 4; ++q) e[i][q] = ids[i][j + q];
    for (u32 i = 0; i < LAYOUT_WIDE; ++i)
      for (u32 q = 0; q < 4; ++q) goes[i] = goes[i] | layout_slot_goes(s, e[i][q], active, dest);
  }
  for (; j < s.k; ++j)
    for (u32 i = 0; i < LAYOUT_WIDE; ++i)
      goes[i] = goes[i] | layout_slot_goes(s, ids[i][j], active, dest);
  u32 bits = 0;
  for (u32 i = 0; i < LAYOUT_WIDE; ++i) bits |= (goes[i] ? 1u : 0u) << i;
  return bits;
}

// The metadata word that holds a token's slot for destination d
// (w_rank_slot, w_host_slot).
EP_FN u32 layout_slot_word(const Shape& s, u32 d) {
  return d < s.r ? w_rank_slot(s, d) : w_host_slot(s, d - s.r);
}

// Whether word i of a token's metadata is one of its slots (written per
// destination; the other words from the routing alone: meta_word).
EP_FN bool is_slot_word(const Shape& s, u32 i) {
  return i >= w_host_slot(s, 0) && i < w_rank_slot(s, s.r);
}

// Token t (t < tokens) goes to a destination after `before` of this rank's
// earlier tokens did: every channel that starts at t starts its count
// there (pre: chans + 1 entries; a channel starts at its chan_lo).
EP_FN void layout_bounds(const Shape& s, u32 tokens, u32 t, u32 before, u32* pre) {
  // The first channel c with chan_lo(c) >= t.
  u32 c = (u32)div_u64((u64)t * s.chans + tokens - 1, tokens);
  // (chan_lo, with div_u64: this runs per token and destination.)
  for (; c < s.chans && (u32)div_u64((u64)tokens * c, s.chans) == t; ++c) pre[c] = before;
}

// Destination d's count bounds, once every token was through layout_bounds
// and `total` tokens go to d: channel c (c <= chans) that starts at the end
// (empty, or the bound after the last) starts at the total. The block's
// threads take a channel each.
EP_FN void layout_count_bound(const Shape& s, u32 tokens, u32 c, u32 total, u32* pre) {
  // (chan_lo, with div_u64: one per channel and destination.)
  if ((u32)div_u64((u64)tokens * c, s.chans) == tokens) pre[c] = total;
}

// Channel c's (c < chans) count of destination d's tokens into its word of
// the notify row, once every bound is in pre.
EP_FN void layout_count_word(const Shape& s, u32 d, u32 c, const u32* pre, u32* row) {
  row[(s.r + 31) / 32 + d * s.chans + c] = pre[c + 1] - pre[c];
}

// The bits set in m (a warp's ballot).
#if defined(__CUDACC__)
EP_FN u32 layout_popc(u32 m) { return __popc(m); }
#else
EP_FN u32 layout_popc(u32 m) { return (u32)__builtin_popcount(m); }
#endif

// One tile's warp counts (sums: one per warp of the block, warps of them)
// into each warp's count of the tile's tokens before it, in place; returns
// the tile's count. ep_ht_layout runs it once per tile, a thread each,
// between the ballots and the slots.
EP_FN u32 layout_tile_scan(u32* sums, u32 warps) {
  u32 n = 0;
  for (u32 v = 0; v < warps; ++v) {
    const u32 c = sums[v];
    sums[v] = n;
    n += c;
  }
  return n;
}

// How many of this rank's tokens before the one of thread `lane` of warp
// `warp` go to the destination: the earlier tiles' (base), the earlier
// warps' of its tile (pre: layout_tile_scan's), and its warp's earlier
// lanes' (m: its warp's ballot).
EP_FN u32 layout_before(u32 base, const u32* pre, u32 m, u32 lane, u32 warp) {
  return base + pre[warp] + layout_popc(m & ((1u << lane) - 1u));
}

// Token t's part (t < tokens) for destination d, once its count of earlier
// tokens that go (before) is known: its slot word in its metadata (meta:
// tokens x mm bytes; NONE where it does not go) and the bounds of the
// channels that start at it (layout_bounds).
EP_FN void layout_token(const Shape& s, u32 tokens, u32 t, u32 d, bool goes, u32 before, u32* meta,
                        u32* pre) {
  meta[(u64)t * (s.mm / 4) + layout_slot_word(s, d)] = goes ? before : NONE;
  layout_bounds(s, tokens, t, before, pre);
}

// Tiles (of a block's threads, a token each) ep_ht_layout judges before it
// lays them out: bits of a thread's u32.
constexpr u32 LAYOUT_TILES = 32;

// Every count word of a refused notify row (plan.rs's REFUSED).
constexpr u32 REFUSED = 0xffffffffu;

// The notify row's mask words (the active ranks), and where this rank's
// inputs were refused every count word REFUSED (plan.rs's refused_row).
EP_FN void layout_finish(const Shape& s, const u32* active, bool refused, u32* row) {
  const u32 mw = (s.r + 31) / 32;
  for (u32 i = 0; i < mw; ++i) row[i] = 0;
  for (u32 p = 0; p < s.r; ++p)
    if (active[p]) row[p / 32] |= 1u << (p % 32);
  if (refused)
    for (u32 i = mw; i < mw + layout_dests(s) * s.chans; ++i) row[i] = REFUSED;
}

// What ep_ht_layout leaves for the host (u64 words of pinned host memory,
// cuda/ht.rs's LayoutOut): whether the row went out refused, the first bad
// entry's key (input::entry_key, ~0 none) and its four error words
// (input::error_of: ERR_EXPERT_RANGE, ERR_DUPLICATE or ERR_WEIGHT, as
// cuda/dev.rs's decode_error reads them).
constexpr u32 LO_REFUSED = 0, LO_KEY = 1, LO_ERR = 2, LO_WORDS = 6;
static_assert(LO_ERR + 4 == LO_WORDS, "ep::ht: the layout's words for the host");

} // namespace ht
} // namespace ep

#if defined(__CUDACC__)

namespace ep {
namespace ht {

// What a batch holds: puts, gets, flushes, bare signals, row sums.
constexpr u32 OP_PUT = 1, OP_GET = 2, OP_FLUSH = 3, OP_SIGNAL = 4, OP_SUM = 5;
// Ops and row pointers one batch holds at most (a token's forwarding needs
// 2 (l - 1) puts, and 32 of this rank's own tokens at most 2 l puts each,
// l <= 64; a reduction l + h - 1 rows).
constexpr u32 MAX_OPS = 160;
constexpr u32 MAX_ROWS = 320;

// One thing the block does. OP_PUT: bytes from window src at src_off here
// to window dst at dst_off of peer, then signal sig += add there (add 0: no
// signal). OP_GET: bytes from window src at src_off of peer to window dst
// at dst_off here. OP_SIGNAL: sig += add at peer. OP_SUM: rows[row0 ..
// row0 + nrows) summed into the row at address dst_off (a BF16 row of
// hidden elements).
struct Op {
  u32 kind, peer, dst, src;
  u64 dst_off, src_off, bytes;
  u32 sig, row0, nrows, pad;
  u64 add;
};

// Where a dispatch's payloads are read: XIN, or in place from the caller's
// tokens (x: `bytes` bytes, the payloads at XIN's offsets; null: XIN), as
// ep_ht_dispatch's `x` says.
struct Tokens {
  const u8* x;
  u64 bytes;
};

// A batch, filled by warp 0, carried out by the block.
struct Batch {
  Op ops[MAX_OPS];
  const u8* rows[MAX_ROWS];
  u32 nops, nrows;
  // 1: the channel's part is done (or failed): leave the loop.
  u32 stop;
  // Where puts from XIN read (set once a launch, before the first batch:
  // in shared memory, not in registers live across the batches).
  Tokens xs;
};

EP_FN bool room(const Batch& b, u32 ops, u32 rows) {
  return b.nops + ops <= MAX_OPS && b.nrows + rows <= MAX_ROWS;
}

__device__ __forceinline__ void add_put(Batch& b, u32 peer, u32 dst, u64 dst_off, u32 src,
                                        u64 src_off, u64 bytes, u32 sig, u64 add) {
  b.ops[b.nops++] = Op{OP_PUT, peer, dst, src, dst_off, src_off, bytes, sig, 0, 0, 0, add};
}
__device__ __forceinline__ void add_get(Batch& b, u32 peer, u32 dst, u64 dst_off, u32 src,
                                        u64 src_off, u64 bytes) {
  b.ops[b.nops++] = Op{OP_GET, peer, dst, src, dst_off, src_off, bytes, 0, 0, 0, 0, 0};
}
__device__ __forceinline__ void add_flush(Batch& b) {
  b.ops[b.nops++] = Op{OP_FLUSH, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
}
__device__ __forceinline__ void add_signal(Batch& b, u32 peer, u32 sig, u64 add) {
  b.ops[b.nops++] = Op{OP_SIGNAL, peer, 0, 0, 0, 0, 0, sig, 0, 0, 0, add};
}
__device__ __forceinline__ void add_sum(Batch& b, u8* out, u32 row0, u32 nrows) {
  b.ops[b.nops++] = Op{OP_SUM, 0, 0, 0, (u64)out, 0, 0, 0, row0, nrows, 0, 0};
}

// Threads of a warp; the mask of all of them.
constexpr u32 WARP = 32;
constexpr u32 FULL = 0xffffffffu;

// Items (16-byte pieces of one sum's output) a thread carries in lockstep in
// sum_ops: their loads of one row are in flight together.
constexpr u32 SUM_ITEMS = 4;

// Block-wide: the row sums ops[i0, i1) of a batch (consecutive OP_SUMs:
// independent, their rows ready) at once, each into its out (BF16, h
// elements) as num.rs's sum_bf16_rows: none gives zeros, one is copied,
// more are added in f32 in order and rounded once (no contraction:
// __fadd_rn). Every thread takes 16-byte pieces (8 columns) of any of the
// sums, SUM_ITEMS at a time, and loads the pieces' rows r and r + 1
// together before adding them (row r first), so that a block keeps 2 x
// SUM_ITEMS x 16 bytes a thread in flight (a two-row sum, one host of two
// ranks, waits for its loads once, not once per row); each piece still
// meets its rows in order, with the same __fadd_rn sums and one rounding
// (bit for bit num.rs).
// One barrier pair for the whole run of sums, not two per sum.
// h is a multiple of 8 (Config::validate refuses any other hidden size,
// tested), so every row is whole 16-byte pieces.
__device__ __noinline__ void sum_ops(const Op* ops, const u8* const* rows, u32 i0, u32 i1,
                                     u32 h) {
  const u32 per = h / 8, items = (i1 - i0) * per;
  for (u32 base = threadIdx.x; base < items; base += SUM_ITEMS * blockDim.x) {
    const u8* const* rs[SUM_ITEMS];  // the piece's rows
    u8* dst[SUM_ITEMS];              // where its 16 bytes go
    u32 col[SUM_ITEMS];              // its byte offset in a row
    u32 n[SUM_ITEMS];                // its rows (0: no piece)
    bool live[SUM_ITEMS];
    u32 nmax = 0;
#pragma unroll
    for (u32 u = 0; u < SUM_ITEMS; ++u) {
      const u32 it = base + u * blockDim.x;
      live[u] = it < items;
      const Op& o = ops[i0 + (live[u] ? it / per : 0)];
      col[u] = 16 * (live[u] ? it % per : 0);
      rs[u] = rows + o.row0;
      n[u] = live[u] ? o.nrows : 0;
      dst[u] = (u8*)o.dst_off + col[u];
      nmax = n[u] > nmax ? n[u] : nmax;
    }
    float acc[SUM_ITEMS][8];
#pragma unroll
    for (u32 u = 0; u < SUM_ITEMS; ++u)
#pragma unroll
      for (u32 c = 0; c < 8; ++c) acc[u][c] = 0.0f;
    for (u32 r = 0; r < nmax; r += 2) {
      uint4 v[2][SUM_ITEMS];
#pragma unroll
      for (u32 q = 0; q < 2; ++q)
#pragma unroll
        for (u32 u = 0; u < SUM_ITEMS; ++u)
          v[q][u] = r + q < n[u] ? *(const uint4*)(rs[u][r + q] + col[u]) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (u32 q = 0; q < 2; ++q) {
#pragma unroll
        for (u32 u = 0; u < SUM_ITEMS; ++u) {
          if (r + q >= n[u]) continue;
          if (n[u] == 1) {
            *(uint4*)dst[u] = v[q][u];  // one row: copied
            continue;
          }
          const u32 words[4] = {v[q][u].x, v[q][u].y, v[q][u].z, v[q][u].w};
#pragma unroll
          for (u32 c = 0; c < 8; ++c) {
            const float x = fp8::from_bf16((u16)(words[c / 2] >> (16 * (c % 2))));
            acc[u][c] = r + q == 0 ? x : __fadd_rn(acc[u][c], x);
          }
        }
      }
    }
#pragma unroll
    for (u32 u = 0; u < SUM_ITEMS; ++u) {
      if (!live[u] || n[u] == 1) continue;
      u32 o[4] = {0, 0, 0, 0};
      if (n[u] > 1) {
#pragma unroll
        for (u32 c = 0; c < 4; ++c)
          o[c] = (u32)fp8::to_bf16(acc[u][2 * c]) | ((u32)fp8::to_bf16(acc[u][2 * c + 1]) << 16);
      }
      *(uint4*)dst[u] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
}

// Pieces a thread carries in sum_pairs: their loads of both rows are in
// flight together (2 x SUM_PAIR_ITEMS x 16 bytes a thread).
constexpr u32 SUM_PAIR_ITEMS = 8;

// Block-wide: sum_ops for a run whose sums have at most two rows each (one
// host of up to two ranks: the common case), with twice the pieces a
// thread in flight: no f32 accumulator lives across the loads (a sum of
// two rows is its first row's values plus its second's, __fadd_rn, rounded
// once: sum_ops' arithmetic in sum_ops' order, bit for bit), so the
// registers hold SUM_PAIR_ITEMS pieces' two rows instead of SUM_ITEMS'.
__device__ __noinline__ void sum_pairs(const Op* ops, const u8* const* rows, u32 i0, u32 i1,
                                       u32 h) {
  const u32 per = h / 8, items = (i1 - i0) * per;
  for (u32 base = threadIdx.x; base < items; base += SUM_PAIR_ITEMS * blockDim.x) {
    uint4 v[2][SUM_PAIR_ITEMS];
#pragma unroll
    for (u32 u = 0; u < SUM_PAIR_ITEMS; ++u) {
      const u32 it = base + u * blockDim.x;
      const Op& o = ops[i0 + (it < items ? it / per : 0)];
      const u32 n = it < items ? o.nrows : 0, col = 16 * (it % per);
      v[0][u] = n > 0 ? *(const uint4*)(rows[o.row0] + col) : make_uint4(0, 0, 0, 0);
      v[1][u] = n > 1 ? *(const uint4*)(rows[o.row0 + 1] + col) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (u32 u = 0; u < SUM_PAIR_ITEMS; ++u) {
      const u32 it = base + u * blockDim.x;
      if (it >= items) continue;
      const Op& o = ops[i0 + it / per];
      uint4* dst = (uint4*)((u8*)o.dst_off + 16 * (it % per));
      if (o.nrows < 2) {
        *dst = v[0][u];  // one row: copied (none: v[0][u] is zeros)
        continue;
      }
      const u32 a[4] = {v[0][u].x, v[0][u].y, v[0][u].z, v[0][u].w};
      const u32 b[4] = {v[1][u].x, v[1][u].y, v[1][u].z, v[1][u].w};
      u32 w[4];
#pragma unroll
      for (u32 c = 0; c < 4; ++c) {
        const float lo = __fadd_rn(fp8::from_bf16((u16)a[c]), fp8::from_bf16((u16)b[c]));
        const float hi =
            __fadd_rn(fp8::from_bf16((u16)(a[c] >> 16)), fp8::from_bf16((u16)(b[c] >> 16)));
        w[c] = (u32)fp8::to_bf16(lo) | ((u32)fp8::to_bf16(hi) << 16);
      }
      *dst = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// Whether the block carries op o as part of a run of load/store puts
// (put_run): a put of whole 16-byte vectors to a peer mapped here. Others
// (queued peers, a peer out of range, which gin::put then names, an FP8
// payload of a hidden size that is not a multiple of 128) go one by one
// through gin's calls.
__device__ __forceinline__ bool lsa_put(const DevComm& dc, const Op& o) {
  return o.kind == OP_PUT && ((o.dst_off | o.src_off | o.bytes) & 15) == 0 &&
         o.peer < dc.nranks && gin::detail::is_lsa(dc, o.peer);
}

// What put_run resolved of each op of its run: where the bytes go and come
// from, 16-byte vectors (0: a window's base not 16-byte aligned, copied
// byte by byte), the peer's signal window as mapped here (its signal).
struct Flat {
  u8* dst[MAX_OPS];
  const u8* src[MAX_OPS];
  u64* sig[MAX_OPS];
  u64 vecs[MAX_OPS];
};

// One thread: gin::put's checks of op o (a put to load/store peer o.peer),
// in its order and with its errors (recorded in gin's error word naming the
// context, the peer and the window or signal), and where its bytes go. A
// put from XIN reads the caller's tokens in place where xs holds them
// (checked against their size as gin::put checks a window's, named as XIN).
__device__ int lsa_check(const DevComm& dc, u32 ctx, const Window* const* W, const Op& o,
                         const Tokens& xs, Flat& f, u32 k) {
  using namespace gin::detail;
  const Remote rem = o.add ? signal_add(o.sig, o.add) : no_signal();
  const Window& dst = *W[o.dst];
  const Window& src = *W[o.src];
  const bool in_place = o.src == XIN && xs.x != nullptr;
  int e = check_ctx(dc, ctx);
  if (!e) e = check_actions(dc, ctx, o.peer, rem, no_counter());
  if (e) return e;
  if (!range_ok(o.src_off, o.bytes, in_place ? xs.bytes : src.local_size))
    return fail(dc, OUT_OF_WINDOW, ctx, o.peer, src.id);
  const u64 dst_size = ((const u64*)dst.sizes)[o.peer];
  u8* const d = (u8*)((const u64*)dst.peer_bases)[o.peer];
  u64* const sig = lsa_signal_base(dc, o.peer, rem);
  if (!range_ok(o.dst_off, o.bytes, dst_size)) return fail(dc, OUT_OF_WINDOW, ctx, o.peer, dst.id);
  if (!d || (rem.kind != 0 && !sig)) return fail(dc, UNSUPPORTED, ctx, o.peer, dst.id);
  f.dst[k] = d + o.dst_off;
  f.src[k] = (in_place ? xs.x : (const u8*)src.local_base) + o.src_off;
  f.sig[k] = sig;
  f.vecs[k] = (((u64)f.dst[k] | (u64)f.src[k]) & 15) == 0 ? o.bytes / 16 : 0;
  return OK;
}

// Vectors a thread loads before it stores them in put_run's copy: as
// gin::detail::coop_copy keeps in flight.
constexpr u32 FLAT_DEPTH = 8;
// 16-byte vectors of one piece of flat_copy: a warp's FLAT_DEPTH rounds.
constexpr u32 PIECE = 32 * FLAT_DEPTH;

// Block-wide: the 16-byte vectors of f's first n puts, cut into pieces of
// PIECE vectors (4 KiB; a put's last piece may be shorter), the pieces of
// all the puts dealt to the block's warps in turn (warp w takes pieces w,
// w + warps, ... across the puts' boundaries). A warp loads a piece's
// FLAT_DEPTH vectors a lane at once, then stores them. Puts of any sizes
// keep the whole block busy: a block moves a batch's bytes at once, not
// one put (and two barriers) at a time.
__device__ void flat_copy(const Flat& f, u32 n) {
  const u32 lane = gin::detail::lane(), warps = blockDim.x / WARP;
  u32 k = 0;
  u64 piece = threadIdx.x / WARP;
  const auto settle = [&] {
    while (k < n && piece * PIECE >= f.vecs[k]) piece -= (f.vecs[k++] + PIECE - 1) / PIECE;
  };
  settle();
  while (k < n) {
    const u64 first = piece * PIECE, left = f.vecs[k] - first;
    const uint4* src = (const uint4*)f.src[k] + first;
    uint4* dst = (uint4*)f.dst[k] + first;
    // Every vector set on every path (zeros past the put's end): a vector
    // set only where it is loaded reads, to ptxas, as carried over from
    // the previous piece, live across the loop (and spilled).
    uint4 v[FLAT_DEPTH];
#pragma unroll
    for (u32 q = 0; q < FLAT_DEPTH; ++q)
      v[q] = lane + WARP * q < left ? src[lane + WARP * q] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (u32 q = 0; q < FLAT_DEPTH; ++q)
      if (lane + WARP * q < left) dst[lane + WARP * q] = v[q];
    piece += warps;
    settle();
  }
}

// Block-wide: ops[i0, i1), a run of puts to load/store peers (lsa_put), as
// gin::put would carry them one after another, with the same checks and
// errors, the same bytes and the same signals after their data: every put
// is checked (a thread each), all their bytes copied by the whole block at
// once (flat_copy),
// then, after one barrier, thread 0 adds their signals in order (a release
// each, as gin::put's leader: every thread's stores are ordered before it
// by the barrier). A signal thus comes after its own put's bytes and every
// earlier put's, as gin's strong signal asks, and a later put's bytes may
// land before it, which no receiver reads before its own signal. The puts
// of a run are independent: distinct places, and sources written before
// the batch or by the row sums before the run (a sum, get or flush ends a
// run). Puts from XIN read the caller's tokens in place where the batch
// says (b.xs). Returns gin's status (the same on every thread).
__device__ int put_run(const DevComm& dc, u32 ctx, const Window* const* W, const Batch& b, u32 i0,
                       u32 i1) {
  const Op* ops = b.ops;
  __shared__ Flat f;
  __shared__ int status;
  const u32 n = i1 - i0;
  // The previous run's thread 0 has read f (its signals); every thread's
  // stores to this run's sources (a sum) precede its loads.
  if (threadIdx.x == 0) status = OK;
  __syncthreads();
  for (u32 k = threadIdx.x; k < n; k += blockDim.x) {
    const int e = lsa_check(dc, ctx, W, ops[i0 + k], b.xs, f, k);
    if (e) status = e;
  }
  __syncthreads();
  if (status != OK) {
    const int e = status;
    // Nobody rewrites `status` (the next run) before everyone has read it.
    __syncthreads();
    return e;
  }
  flat_copy(f, n);
  // (Cold: cuMemAlloc and CUDA IPC give aligned windows.)
  for (u32 k = 0; k < n; ++k) {
    if (f.vecs[k] != 0) continue;
    const u64 bytes = ops[i0 + k].bytes;
    for (u64 i = threadIdx.x; i < bytes; i += blockDim.x) f.dst[k][i] = f.src[k][i];
  }
  // Every thread's loads of the sources and stores precede the signals; no
  // thread reads a source after this barrier.
  __syncthreads();
  if (threadIdx.x == 0) {
    for (u32 k = 0; k < n; ++k) {
      const Op& o = ops[i0 + k];
      if (o.add == 0) continue;
      gin::detail::lsa_actions(dc, ctx, o.peer, f.sig[k], signal_add(o.sig, o.add), no_counter(),
                               gin::detail::same_gpu(dc, o.peer));
    }
  }
  return OK;
}

// Block-wide: one op of a batch other than a run of load/store puts or
// sums, by gin's CTA-wide call (a put or get to a queued peer, or one that
// is not whole 16-byte vectors, a flush, a bare signal). Not inlined: gin's
// calls carry their own load/store copies, which would otherwise share the
// kernel's registers with put_run's and sum_ops' (spills, measured with
// ptxas). The batch's op i; a put from XIN where the host left the tokens
// in place (b.xs) is refused (UNSUPPORTED, naming the peer and XIN): XIN
// was not written.
__device__ __noinline__ int gin_op(const DevComm& dc, u32 ctx, const Window* const* W,
                                   const Batch& b, u32 i) {
  const Op& o = b.ops[i];
  if (o.kind == OP_PUT && o.src == XIN && b.xs.x != nullptr)
    return gin::detail::fail(dc, UNSUPPORTED, ctx, o.peer, W[XIN]->id);
  const Remote rem = o.add ? signal_add(o.sig, o.add) : no_signal();
  if (o.kind == OP_PUT)
    return put(dc, ctx, o.peer, *W[o.dst], o.dst_off, *W[o.src], o.src_off, o.bytes, rem,
               no_counter(), CTA);
  if (o.kind == OP_GET)
    return get(dc, ctx, o.peer, *W[o.src], o.src_off, *W[o.dst], o.dst_off, o.bytes, CTA);
  if (o.kind == OP_FLUSH) return flush(dc, ctx, CTA);
  if (o.kind == OP_SIGNAL) return signal(dc, ctx, o.peer, rem, CTA);
  return OK;
}

// Block-wide: carries out the batch on context ctx, puts from XIN to
// load/store peers reading the caller's tokens in place where b.xs holds
// them (the host then left XIN unwritten, which a queued put would send:
// none is, since the host copies the tokens into XIN whenever one of this
// step's destinations is queued; one that came anyway fails as
// UNSUPPORTED, naming the peer and XIN). Returns gin's status (the same on
// every thread).
__device__ int run_batch(const DevComm& dc, u32 ctx, const Window* const* W, const Batch& b,
                         u32 hidden) {
  for (u32 i = 0; i < b.nops; ++i) {
    const Op& o = b.ops[i];
    int e = OK;
    if (lsa_put(dc, o)) {
      u32 j = i + 1;
      while (j < b.nops && lsa_put(dc, b.ops[j])) ++j;
      e = put_run(dc, ctx, W, b, i, j);
      i = j - 1;
    } else if (o.kind == OP_SUM) {
      // The rows were written by peers (acquired by thread 0's signal reads
      // before this batch), by gets (completed by the flush before), or by
      // an earlier launch. A run of consecutive sums reads none of its own
      // outputs (each writes its own staging row or output token; a get
      // or flush ends the run), so the run is summed at once.
      // Sums of at most two rows each (one host of up to two ranks) take
      // sum_pairs, with twice the loads in flight; the barrier that orders
      // the rows' writes before the loads also finds that out.
      u32 j = i + 1;
      while (j < b.nops && b.ops[j].kind == OP_SUM) ++j;
      bool pairs = true;
      for (u32 k = i + threadIdx.x; k < j; k += blockDim.x) pairs &= b.ops[k].nrows <= 2;
      if (__syncthreads_and(pairs))
        sum_pairs(b.ops, b.rows, i, j, hidden);
      else
        sum_ops(b.ops, b.rows, i, j, hidden);
      __syncthreads();
      i = j - 1;
    } else {
      e = gin_op(dc, ctx, W, b, i);
    }
    if (e) return e;
  }
  return OK;
}

// Signal id of context ctx, read with an acquire (what its sender released
// before it is visible to this thread, and through the block's barrier to
// the block).
__device__ __forceinline__ u64 read_acq(const DevComm& dc, u32 ctx, u32 id) {
  return gin::detail::signal_sum_acquire(dc, gin::detail::signal_slot(dc, ctx, id));
}

// Thread 0, between batches: nothing moved. Fails the launch once nothing
// moved for the job timeout, or at once when gin's abort flag is up (a
// watcher saw a peer die or a transport fail), naming in gin's error word
// the peer waited for and the signal id; true to leave the loop (also when
// another block or launch failed, or a protocol error was recorded).
__device__ bool idle(const DevComm& dc, u32 ctx, u64& since, u32 peer, u32 id, const u64* err) {
  if (gin_failed(dc) || (err && *(volatile const u64*)err != 0)) return true;
  if (dc.abort_flag && *(volatile const u32*)dc.abort_flag != 0) {
    gin::detail::fail(dc, ABORTED, ctx, peer, id);
    return true;
  }
  const u64 now = proxy::globaltimer();
  if (since == 0) since = now;
  if (dc.timeout_ticks && now - since > dc.timeout_ticks) {
    gin::detail::fail(dc, SIGNAL_TIMEOUT, ctx, peer, id);
    return true;
  }
  __nanosleep(64);
  return false;
}

// Thread 0: records a protocol error of peer (the first of the buffer).
__device__ void protocol(u64* err, u64* errh, u32 peer, u64 code, u32 ch, u64 a, u64 b) {
  record(err, errh, ERR_HT | (u64)peer << 8, code | (u64)ch << 32, a, b);
}

// The arguments every high-throughput kernel shares.
struct Args {
  DevComm dc;
  const Window* W[WINDOWS];
  Shape s;
  Tables tb;
  u64* seen;  // [ch * nsig + id]: the value of each signal accounted for
  u64* lane;  // [ch * lane_words + i]: warp 0's scratch, where shared memory cannot hold it
  u32* contrib;
  u64* err;
  u64* errh;
};

// ------------------------------------------------------------- dispatch

// The metadata of this rank's token t (MIN).
__device__ __forceinline__ const u32* my_meta(const Args& a, u32 t) {
  return (const u32*)((const u8*)a.W[MIN]->local_base + (u64)t * a.s.mm);
}

// Thread 0: runs of this channel's tokens to host `host`'s forwarder, as far
// as credits and the batch allow.
__device__ void send_runs(const Args& a, Batch& b, u32 ch, u32 host, u32 end, u64* L) {
  const Shape& s = a.s;
  const u32 me = s.rank, fwd = a.tb.forwarder(me, host);
  if (fwd == NONE) return;
  u64* seen = a.seen + (u64)ch * s.nsig;
  for (u32 rep = 0; rep < 4 && room(b, 2, 0); ++rep) {
    u32 t0 = (u32)L[l_send_cur(s) + host];
    while (t0 < end && my_meta(a, t0)[w_host_slot(s, host)] == NONE) ++t0;
    L[l_send_cur(s) + host] = t0;
    if (t0 == end) return;
    const bool direct = my_meta(a, t0)[w_rank_slot(s, fwd)] != NONE;
    u32 limit, sig;
    u64 slot;
    if (direct) {
      limit = RUN;
      slot = a.tb.recv_start(fwd, me) + my_meta(a, t0)[w_rank_slot(s, fwd)];
      sig = sig_dtail(s, me);
    } else {
      const u64 sent = seen[sig_head(s, fwd)] + L[l_send_ring(s) + host];
      const u64 head = read_acq(a.dc, ch, sig_head(s, fwd));
      const u64 used = sent - head;
      const u64 credits = used >= s.ring ? 0 : s.ring - used;
      if (credits == 0) return;
      const u64 at = sent % s.ring;
      u64 lim = credits < s.ring - at ? credits : s.ring - at;
      limit = (u32)(lim < CHUNK ? lim : CHUNK);
      slot = ((u64)ch * s.r + me) * s.ring + at;
      sig = sig_tail(s, me);
    }
    u32 n = 1;
    while (n < limit && t0 + n < end && my_meta(a, t0 + n)[w_host_slot(s, host)] != NONE &&
           (my_meta(a, t0 + n)[w_rank_slot(s, fwd)] != NONE) == direct)
      ++n;
    add_put(b, fwd, direct ? RECVX : RINGX, slot * s.p, XIN, (u64)t0 * s.p, (u64)n * s.p, 0, 0);
    add_put(b, fwd, direct ? RECVM : RINGM, slot * s.mm, MIN, (u64)t0 * s.mm, (u64)n * s.mm, sig,
            n);
    if (!direct) L[l_send_ring(s) + host] += n;
    L[l_send_cur(s) + host] = t0 + n;
  }
}

// Thread 0: forwards one message from src (in window mw/xw at `slot`) to
// the ranks of this host that receive it, and records where each holds it.
// `at_recv` is its place here when it came straight into it (NONE: from the
// ring). Returns false after recording a protocol error.
__device__ bool deliver(const Args& a, Batch& b, u32 ch, u32 src, u32 xw, u32 mw, u64 slot,
                        u32 at_recv, u64* L, bool& queued) {
  const Shape& s = a.s;
  const u32 me = s.rank, host = me / s.l;
  const u32* meta = (const u32*)((const u8*)a.W[mw]->local_base + slot * s.mm);
  const u32 tok = meta[0], hs = meta[w_host_slot(s, host)];
  const u32 hs0 = a.tb.host_chan_start(src, host, ch), n = a.tb.host_chan(src, host, ch);
  if (tok >= s.t || hs < hs0 || hs - hs0 >= n) {
    protocol(a.err, a.errh, src, HT_TOKEN_OUTSIDE, ch, tok, hs);
    return false;
  }
  for (u32 dl = 0; dl < s.l; ++dl) {
    const u32 dst = host * s.l + dl, rs = meta[w_rank_slot(s, dst)];
    u32* c = a.contrib + contrib_at(s, src, hs, dl);
    if (rs == NONE) {
      *c = NONE;
      continue;
    }
    if (a.tb.forwarder(dst, host) != dst || rs >= a.tb.count(src, dst)) {
      protocol(a.err, a.errh, src, HT_RANK_SLOT, ch, rs, dst);
      return false;
    }
    const u32 j = a.tb.recv_start(dst, src) + rs;
    *c = j;
    if (dst == me) {
      if (at_recv == NONE) {
        protocol(a.err, a.errh, src, HT_RING_FOR_SELF, ch, tok, 0);
        return false;
      }
      if (j != at_recv) {
        protocol(a.err, a.errh, src, HT_WRONG_PLACE, ch, at_recv, j);
        return false;
      }
      continue;
    }
    add_put(b, dst, RECVX, (u64)j * s.p, xw, slot * s.p, s.p, 0, 0);
    add_put(b, dst, RECVM, (u64)j * s.mm, mw, slot * s.mm, s.mm, 0, 0);
    queued |= !gin::detail::is_lsa(a.dc, dst);
    L[l_delivered(s) + dl] += 1;
  }
  return true;
}

// Thread 0: messages newly arrived on a stream of src (value less base),
// at most `most`; more is src's protocol error (returns ~0).
__device__ u64 arrived(const Args& a, u32 ch, u32 src, u64 value, u64 base, u64 most) {
  const u64 avail = value - base;
  if (avail > most) {
    protocol(a.err, a.errh, src, HT_STREAM_AHEAD, ch, value, most);
    return ~0ull;
  }
  return avail;
}

// Thread 0: forwards what arrived from other hosts' sources, as far as the
// batch allows (`moved` set if anything arrived: a token only this rank
// receives needs no op). False after a protocol error.
__device__ bool forward(const Args& a, Batch& b, u32 ch, u64* L, bool& moved) {
  const Shape& s = a.s;
  const u32 me = s.rank, need = 2 * s.l + 2;
  u64* seen = a.seen + (u64)ch * s.nsig;
  for (u32 src = 0; src < s.r; ++src) {
    if (!a.tb.forwards(me, src)) continue;
    u64& dd = L[l_direct_done(s) + src];
    const u64 dexp = a.tb.direct_expect(src, me, ch);
    if (dd < dexp && room(b, need, 0)) {
      const u64 base = seen[sig_dtail(s, src)] + dd;
      u64 avail = arrived(a, ch, src, read_acq(a.dc, ch, sig_dtail(s, src)), base, dexp - dd);
      if (avail == ~0ull) return false;
      moved |= avail > 0;
      bool queued = false;
      for (; avail > 0 && room(b, need, 0); --avail) {
        const u32 j = a.tb.recv_start(me, src) + a.tb.rank_chan_start(src, me, ch) + (u32)dd;
        if (!deliver(a, b, ch, src, RECVX, RECVM, j, j, L, queued)) return false;
        ++dd;
      }
    }
    u64& rd = L[l_ring_done(s) + src];
    const u64 rexp = a.tb.ring_expect(src, me, ch);
    if (rd < rexp && room(b, need, 0)) {
      const u64 base = seen[sig_tail(s, src)] + rd;
      const u64 most = rexp - rd < s.ring ? rexp - rd : s.ring;
      u64 avail = arrived(a, ch, src, read_acq(a.dc, ch, sig_tail(s, src)), base, most);
      if (avail == ~0ull) return false;
      moved |= avail > 0;
      bool queued = false;
      u64 done = 0;
      for (; avail > 0 && room(b, need, 0); --avail, ++done) {
        const u64 seq = seen[sig_tail(s, src)] + rd;
        if (!deliver(a, b, ch, src, RINGX, RINGM, ring_slot(s, ch, src, seq), NONE, L, queued))
          return false;
        ++rd;
      }
      if (done > 0) {
        // The credits go back once no put reads the slots any more.
        if (queued) add_flush(b);
        add_signal(b, src, sig_head(s, me), done);
      }
    }
  }
  return true;
}

// Warp-wide helpers of the batch builders: every lane of the warp calls
// them (full mask).
// The lanes below this one.
__device__ __forceinline__ u32 lanes_below() {
  u32 m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}
// The sum of v over this lane and the lanes below it.
__device__ __forceinline__ u32 warp_incl_sum(u32 v) {
  const u32 lane = gin::detail::lane();
#pragma unroll
  for (u32 d = 1; d < WARP; d <<= 1) {
    const u32 t = __shfl_up_sync(FULL, v, d);
    if (lane >= d) v += t;
  }
  return v;
}
// Whether a token whose slot at some rank is rs (NONE: it does not go
// there) starts a run of places there: the lane below's token does not
// hold the place before it (lane 0 always starts one).
__device__ __forceinline__ bool run_start(u32 rs) {
  const u32 prev = __shfl_up_sync(FULL, rs, 1);
  return rs != NONE && (gin::detail::lane() == 0 || prev == NONE || rs != prev + 1);
}
// A run starting at this lane: this lane and the lanes above it that
// continue it (bits of `cont`, which holds the lanes whose token continues
// the run of the lane below).
__device__ __forceinline__ u32 run_length(u32 cont) {
  return (u32)__ffsll((long long)~((u64)cont >> (gin::detail::lane() + 1)));
}

// This rank's own tokens a dispatch batch takes at most (local_writes).
constexpr u32 LOCAL_TOKENS = 128;

// Warp 0: writes this channel's tokens into their final place at the ranks
// of this host that receive them, WARP tokens at a time (a lane each), up
// to LOCAL_TOKENS as far as the batch allows. For each rank, consecutive
// tokens with consecutive slots there (consecutive places there,
// consecutive sources here) are one put of their payloads and one of their
// metadata, as the sender's runs to other hosts are: a handful of large
// puts instead of two per token and rank. True on every lane if the cursor
// moved (a token for other hosts only needs no op).
__device__ bool local_writes(const Args& a, Batch& b, u32 end, u64* L) {
  const Shape& s = a.s;
  const u32 me = s.rank, host = me / s.l, lane = gin::detail::lane(), below = lanes_below();
  const u32 from = (u32)L[l_misc(s) + 0];
  u32 cur = from, nops = b.nops;
  while (cur < end && cur - from < LOCAL_TOKENS) {
    const u32 w = end - cur < WARP ? end - cur : WARP;
    const u32* meta = my_meta(a, lane < w ? cur + lane : cur);
    const bool here = lane < w && meta[w_host_slot(s, host)] != NONE;
    // The ops of the runs starting at each token; the tokens that fit.
    u32 need = 0;
    for (u32 dl = 0; dl < s.l; ++dl)
      need += run_start(here ? meta[w_rank_slot(s, host * s.l + dl)] : NONE) ? 2 : 0;
    const u32 upto = warp_incl_sum(need);
    const u32 n = __popc(__ballot_sync(FULL, lane < w && upto <= MAX_OPS - nops));
    if (n == 0) break;
    for (u32 dl = 0; dl < s.l; ++dl) {
      const u32 dst = host * s.l + dl;
      const u32 rs = here && lane < n ? meta[w_rank_slot(s, dst)] : NONE;
      const bool start = run_start(rs);
      const u32 cont = __ballot_sync(FULL, rs != NONE && !start);
      const u32 starts = __ballot_sync(FULL, start);
      const u32 goes = __ballot_sync(FULL, rs != NONE);
      if (start) {
        const u64 t = cur + lane, len = run_length(cont), j = a.tb.recv_start(dst, me) + rs;
        Op* o = b.ops + nops + 2 * __popc(starts & below);
        o[0] = Op{OP_PUT, dst, RECVX, XIN, j * s.p, t * s.p, len * s.p, 0, 0, 0, 0, 0};
        o[1] = Op{OP_PUT, dst, RECVM, MIN, j * s.mm, t * s.mm, len * s.mm, 0, 0, 0, 0, 0};
      }
      nops += 2 * __popc(starts);
      if (lane == 0) L[l_delivered(s) + dl] += __popc(goes);
    }
    cur += n;
  }
  __syncwarp();
  if (lane == 0) {
    b.nops = nops;
    L[l_misc(s) + 0] = cur;
  }
  __syncwarp();
  return cur != from;
}

// Thread 0: everything of the channel sent and forwarded.
__device__ bool sent_all(const Args& a, u32 ch, u32 end, const u64* L, const u32* active) {
  const Shape& s = a.s;
  if (L[l_misc(s) + 0] != end) return false;
  for (u32 host = 0; host < s.h; ++host)
    if (host != s.rank / s.l && a.tb.forwarder(s.rank, host) != NONE &&
        L[l_send_cur(s) + host] != end)
      return false;
  for (u32 src = 0; src < s.r; ++src) {
    if (!a.tb.forwards(s.rank, src) || !active[src]) continue;
    if (L[l_ring_done(s) + src] != a.tb.ring_expect(src, s.rank, ch)) return false;
    if (L[l_direct_done(s) + src] != a.tb.direct_expect(src, s.rank, ch)) return false;
  }
  return true;
}

// Thread 0: collects the other forwarders' counts; checks the total once
// all are in. False after a protocol error.
__device__ bool hear(const Args& a, u32 ch, u64* L, const u32* active, bool& moved) {
  const Shape& s = a.s;
  const u32 me = s.rank, host = me / s.l;
  u64* seen = a.seen + (u64)ch * s.nsig;
  bool all = true;
  for (u32 fl = 0; fl < s.l; ++fl) {
    if (L[l_heard_ok(s) + fl]) continue;
    if (!active[host * s.l + fl]) {
      L[l_heard_ok(s) + fl] = 1;
      continue;
    }
    const u32 id = sig_fwd(s, fl);
    const u64 v = read_acq(a.dc, ch, id);
    if (signal_reached(v, seen[id] + 1)) {
      L[l_heard(s) + fl] = v - seen[id] - 1;
      L[l_heard_ok(s) + fl] = 1;
      seen[id] = v;
      moved = true;
    } else {
      all = false;
    }
  }
  if (!all || !moved) return true;
  u64 got = 0, want = 0;
  for (u32 fl = 0; fl < s.l; ++fl) got += L[l_heard(s) + fl];
  for (u32 src = 0; src < s.r; ++src) {
    if (a.tb.forwards(me, src)) got += a.tb.direct_expect(src, me, ch);
    want += a.tb.rank_chan(src, me, ch);
  }
  if (got != want) {
    protocol(a.err, a.errh, host * s.l, HT_DELIVERED, ch, got, want);
    return false;
  }
  return true;
}

// Thread 0: what the channel waits for (the peer, the signal id), for a
// timeout's error: as the CPU lane's `waiting`.
__device__ void waiting(const Args& a, u32 ch, u32 end, const u64* L, const u32* active,
                        u32& peer, u32& id) {
  const Shape& s = a.s;
  const u32 me = s.rank, host = me / s.l;
  for (u32 h = 0; h < s.h; ++h) {
    const u32 fwd = a.tb.forwarder(me, h);
    if (h != host && fwd != NONE && L[l_send_cur(s) + h] < end) {
      peer = fwd;
      id = sig_head(s, fwd);
      return;
    }
  }
  for (u32 src = 0; src < s.r; ++src) {
    if (!a.tb.forwards(me, src)) continue;
    if (L[l_direct_done(s) + src] < a.tb.direct_expect(src, me, ch)) {
      peer = src;
      id = sig_dtail(s, src);
      return;
    }
    if (L[l_ring_done(s) + src] < a.tb.ring_expect(src, me, ch)) {
      peer = src;
      id = sig_tail(s, src);
      return;
    }
  }
  for (u32 fl = 0; fl < s.l; ++fl) {
    if (!L[l_heard_ok(s) + fl] && active[host * s.l + fl]) {
      peer = host * s.l + fl;
      id = sig_fwd(s, fl);
      return;
    }
  }
  peer = NO_PEER;
  id = 0;
}

// Warp 0: the next batch of channel ch's dispatch. Thread 0 decides the
// sends to other hosts, the forwarding and the end of the step, the warp
// this rank's own tokens for its host (local_writes). L: the channel's
// scratch (lane_words u64).
__device__ __noinline__ void dispatch_batch(const Args& a, Batch& b, u32 ch, u32 tokens, const u32* active,
                               u64* L, u64& since) {
  const Shape& s = a.s;
  const u32 me = s.rank, host = me / s.l;
  const bool lead = gin::detail::lane() == 0;
  u64* seen = a.seen + (u64)ch * s.nsig;
  const u32 end = chan_lo(s, tokens, ch + 1);
  bool moved = false;
  int ok = 1;
  if (lead) {
    b.nops = b.nrows = b.stop = 0;
    for (u32 h = 0; h < s.h; ++h)
      if (h != host) send_runs(a, b, ch, h, end, L);
    if (!forward(a, b, ch, L, moved)) {
      b.stop = 1;
      ok = 0;
    }
  }
  // Thread 0's ops and cursors before the warp's.
  if (!__shfl_sync(FULL, ok, 0)) return;
  __syncwarp();
  const bool wrote = local_writes(a, b, end, L);
  if (!lead) return;
  moved |= wrote;
  moved |= b.nops > 0;
  u64& signalled = L[l_misc(s) + 1];
  if (!signalled && b.nops == 0 && sent_all(a, ch, end, L, active)) {
    for (u32 dl = 0; dl < s.l; ++dl)
      if (active[host * s.l + dl])
        add_signal(b, host * s.l + dl, sig_fwd(s, me % s.l), L[l_delivered(s) + dl] + 1);
    for (u32 h = 0; h < s.h; ++h) {
      const u32 fwd = a.tb.forwarder(me, h);
      if (h != host && fwd != NONE) seen[sig_head(s, fwd)] += L[l_send_ring(s) + h];
    }
    for (u32 src = 0; src < s.r; ++src) {
      if (!a.tb.forwards(me, src)) continue;
      seen[sig_tail(s, src)] += L[l_ring_done(s) + src];
      seen[sig_dtail(s, src)] += L[l_direct_done(s) + src];
    }
    signalled = 1;
    moved = true;
  }
  if (signalled) {
    if (!hear(a, ch, L, active, moved)) {
      b.stop = 1;
      return;
    }
    bool all = true;
    for (u32 fl = 0; fl < s.l; ++fl) all &= L[l_heard_ok(s) + fl] != 0;
    // Done once the delivered counts went out (carried out in this batch).
    if (all) b.stop = 2;
  }
  if (moved) {
    since = 0;
    return;
  }
  u32 peer, id;
  waiting(a, ch, end, L, active, peer, id);
  if (idle(a.dc, ch, since, peer, id, a.err)) b.stop = 1;
}

// Block-wide hint: brings `bytes` at p into this SM's L1 (prefetch, no
// effect on what is read): thread 0 walks the channel's metadata and the
// plan's table one dependent load after another, each otherwise a trip to
// L2 or memory while the other threads wait for its batch.
__device__ __forceinline__ void prefetch_l1(const void* p, u64 bytes) {
  for (u64 off = 128ull * threadIdx.x; off < bytes; off += 128ull * blockDim.x)
    asm volatile("prefetch.global.L1 [%0];" ::"l"((const u8*)p + off));
}

// Block-wide: prefetches what thread 0 reads of channel ch's tokens [lo,
// end) (their metadata in MIN) and the plan's table.
__device__ void prefetch_channel(const Args& a, u32 lo, u32 end) {
  prefetch_l1((const u8*)a.W[MIN]->local_base + (u64)lo * a.s.mm, (u64)(end - lo) * a.s.mm);
  prefetch_l1(a.tb.w, 4ull * a.tb.words());
}

// Scratch words a channel keeps in shared memory (lane_of); a larger job's
// scratch stays in device memory.
constexpr u32 LANE_SMEM = 1024;

// The channel's scratch: in shared memory where it fits (`smem`,
// LANE_SMEM words), else channel ch's part of `lane` (device memory). It
// lives for one launch (clear_lane), and warp 0 reads and writes its words
// for every batch one dependent access after another: shared memory
// answers each in a few cycles.
__device__ __forceinline__ u64* lane_of(const Shape& s, u64* lane, u32 ch, u64* smem) {
  return lane_words(s) <= LANE_SMEM ? smem : lane + (u64)ch * lane_words(s);
}

// Thread 0: the channel's scratch L, zeroed, its cursors at `lo` (the
// channel's first token): the dispatch's send and local-writes cursors
// (`dispatch`), or the combine's next token to reduce.
__device__ void clear_lane(const Shape& s, u64* L, u32 lo, bool dispatch) {
  for (u32 i = 0; i < lane_words(s); ++i) L[i] = 0;
  if (dispatch) {
    for (u32 h = 0; h < s.h; ++h) L[l_send_cur(s) + h] = lo;
    L[l_misc(s) + 0] = lo;
  } else {
    L[c_misc(s) + 3] = lo;
  }
}

} // namespace ht
} // namespace ep

// The twelve windows of a high-throughput buffer, in plan.rs's order.
#define EP_HT_WINDOWS                                                                       \
  Window nsend, Window nrecv, Window xin, Window xmeta, Window ringx, Window ringm,              \
      Window recvx, Window recvm, Window csend, Window cstage, Window crdma, Window cget
#define EP_HT_WINDOW_TABLE                                                                  \
  { &nsend, &nrecv, &xin, &xmeta, &ringx, &ringm, &recvx, &recvm, &csend, &cstage, &crdma, &cget }

// The count exchange (one block, context 0): this rank's notify row (NSEND,
// `width` bytes, staged by the host or written by ep_ht_layout before this
// launch) goes to every active rank's NRECV at (parity * r + rank) * width
// with signal notify(rank) += 1; then the block waits (bounded, naming the
// rank) for each active rank's row, exactly one round each (a faster rank
// may be a round ahead: rows alternate between the two halves of NRECV),
// and copies this round's half (r rows of width bytes) into rows (pinned
// host memory, mapped), which the host reads after the dispatch kernel.
// From those rows it builds the step's plan (tables: Tables::words() u32,
// plan.rs's Plan::tables word for word) and judges them as the host's
// checks do (plan_item_bad): one more word of tables, copied after the rows
// in `rows` too, says 1 where they refuse the step (a refused row, a count
// above the maximum, an active mask that differs from this rank's), and
// the dispatch kernel queued after this one on the same stream then sends
// nothing; the host reads the rows, names why and checks that it agrees.
extern "C" __global__ void __launch_bounds__(EP_THREADS) ep_ht_notify(DevComm dc, EP_HT_WINDOWS, u32 width, u32 parity,
                                        const u32* shape, const u32* active, u64* seen,
                                        u64* clock, u32* rows, u32* tables) {
  if (ep::failed_before(dc)) return;
  ep::clock_start(clock);
  const ep::ht::Shape s = ep::ht::shape_of(shape);
  const u32 me = s.rank;
  const Window* W[ep::ht::WINDOWS] = EP_HT_WINDOW_TABLE;
  // NRECV must hold both halves' rows (the host checks it at the buffer's
  // creation: cuda/ht.rs's check_notify_windows): else the launch fails
  // before anything is sent, naming NRECV, rather than leave the host an
  // earlier round's rows to read.
  // The rows are notify rows of this shape (the plan reads them so).
  if (2ull * s.r * width > nrecv.local_size || width != 4 * ep::ht::notify_row_words(s)) {
    if (threadIdx.x == 0) gin::detail::fail(dc, OUT_OF_WINDOW, 0, NO_PEER, nrecv.id);
    return;
  }
  for (u32 p = 0; p < s.r; ++p) {
    if (!active[p]) continue;
    if (put(dc, 0, p, *W[ep::ht::NRECV], ((u64)parity * s.r + me) * width, *W[ep::ht::NSEND], 0,
            width,
            signal_add(ep::ht::sig_notify(s, me), 1), no_counter(), CTA))
      return;
  }
  // NSEND is rewritten before the next step (by the host, or by the next
  // step's ep_ht_layout, queued after this launch).
  if (flush(dc, 0, CTA)) return;
  for (u32 src = 0; src < s.r; ++src) {
    if (!active[src]) continue;
    const u32 id = ep::ht::sig_notify(s, src);
    if (ep::wait_from(dc, id, seen[id] + 1, src)) return;
    __syncthreads();
    if (threadIdx.x == 0) seen[id] += 1;
  }
  // Every active rank's row is visible to the block (wait_from); the others'
  // are stale and the host does not read them. (NRECV holds 2 x r rows:
  // checked above.)
  const volatile u32* half =
      (const volatile u32*)((const u8*)nrecv.local_base + (u64)parity * s.r * width);
  for (u64 i = threadIdx.x; i < (u64)s.r * width / 4; i += blockDim.x) rows[i] = half[i];
  // The plan, and the verdict on the rows.
  const ep::ht::Tables tb{tables, s};
  for (u32 i = threadIdx.x; i < tb.words(); i += blockDim.x)
    if (!ep::ht::plan_is_recv_start(s, i)) tables[i] = ep::ht::plan_word(s, half, active, i);
  for (u32 dst = threadIdx.x; dst < s.r; dst += blockDim.x)
    ep::ht::plan_recv_starts(s, half, active, dst, tables);
  bool bad = false;
  for (u32 i = threadIdx.x; i < ep::ht::plan_checks(s); i += blockDim.x)
    bad = bad || ep::ht::plan_item_bad(s, half, active, i);
  const u32 refused = __syncthreads_or(bad) ? 1u : 0u;
  if (threadIdx.x == 0) {
    tables[tb.words()] = refused;
    rows[(u64)s.r * width / 4] = refused;
  }
  __threadfence_system();
  ep::clock_end(clock);
}

// High-throughput dispatch: block ch runs channel ch (context ch) to the
// end of its part of the step (see the top of this file). `tokens`: this
// rank's tokens, staged in XIN and MIN. tables: the step's plan, which the
// notify kernel built, and its verdict (the word after it: 1, the rows
// refuse the step, and nothing is sent); active
// (u32 per rank, 1 active) as the plan's; seen, lane: per channel, the
// signals' accounted values and warp 0's scratch (lane_of: used only where
// shared memory cannot hold it); contrib (r x t x l
// u32): per forwarded (source, host slot, local rank), where that rank holds
// the token (NONE: not there), for the combine. x, xbytes: the caller's
// tokens (BF16, xbytes = tokens x p bytes, 16-byte aligned) where this step
// reads them in place (puts to load/store peers copy from there, and XIN is
// not written), or null and 0 where the host staged them in XIN.
extern "C" __global__ void __launch_bounds__(EP_THREADS) ep_ht_dispatch(DevComm dc, EP_HT_WINDOWS, u32 tokens, const u32* shape, const u32* tables, const u32* active, u64* seen, u64* lane, u32* contrib, u64* err, u64* errh,
                   u64* clock, const u8* x, u64 xbytes) {
  if (ep::failed_before(dc)) return;
  ep::clock_start(clock);
  __shared__ ep::ht::Batch b;
  const ep::ht::Shape s = ep::ht::shape_of(shape);
  if (tables[ep::ht::Tables{tables, s}.words()] != 0) {
    ep::clock_end(clock);
    return;
  }
  const Window* W[ep::ht::WINDOWS] = EP_HT_WINDOW_TABLE;
  const ep::ht::Args a{dc, {W[0], W[1], W[2], W[3], W[4], W[5], W[6], W[7], W[8], W[9], W[10],
                            W[11]},
                       s, ep::ht::Tables{tables, s}, seen, lane, contrib, err, errh};
  const u32 ch = blockIdx.x;
  if (ch >= s.chans) return;
  __shared__ u64 lane_smem[ep::ht::LANE_SMEM];
  u64* const L = ep::ht::lane_of(s, lane, ch, lane_smem);
  if (threadIdx.x == 0) {
    ep::ht::clear_lane(s, L, ep::ht::chan_lo(s, tokens, ch), true);
    b.xs = ep::ht::Tokens{x, xbytes};
  }
  ep::ht::prefetch_channel(a, ep::ht::chan_lo(s, tokens, ch), ep::ht::chan_lo(s, tokens, ch + 1));
  // The scratch is cleared before warp 0 reads it.
  __syncthreads();
  u64 since = 0;
  for (;;) {
    if (threadIdx.x < ep::ht::WARP) ep::ht::dispatch_batch(a, b, ch, tokens, active, L, since);
    __syncthreads();
    if (b.stop == 1) return;
    if (ep::ht::run_batch(dc, ch, a.W, b, s.hidden)) return;
    const bool done = b.stop == 2;
    __syncthreads();
    if (done) break;
  }
  // The send windows and ring slots are rewritten in the next step.
  if (flush(dc, ch, CTA)) return;
  ep::clock_end(clock);
}

// The identity expert: each received token (RECVX, j < received) times the
// sum of its weights for this rank's experts (from RECVM, in top-k order)
// into its combine row (CSEND), as the CPU ranks' ht_echo: FP8 payloads
// dequantised first (num.rs's dequantize_fp8), each product rounded to BF16.
extern "C" __global__ void __launch_bounds__(EP_THREADS) ep_ht_echo(EP_HT_WINDOWS, u32 received, const u32* shape) {
  const ep::ht::Shape s = ep::ht::shape_of(shape);
  const u32 lo = s.rank * s.lexp, hi = lo + s.lexp, h = s.hidden;
  __shared__ float w;
  for (u32 j = blockIdx.x; j < received; j += gridDim.x) {
    if (threadIdx.x == 0) {
      const u32* meta = (const u32*)((const u8*)recvm.local_base + (u64)j * s.mm);
      float acc = 0.0f;
      for (u32 i = 0; i < s.k; ++i) {
        const int e = (int)meta[ep::ht::w_ids(s) + i];
        if (e >= 0 && (u32)e >= lo && (u32)e < hi)
          acc = __fadd_rn(acc, __uint_as_float(meta[ep::ht::w_weights(s) + i]));
      }
      w = acc;
    }
    __syncthreads();
    const u8* x = (const u8*)recvx.local_base + (u64)j * s.p;
    u16* out = (u16*)((u8*)csend.local_base + (u64)j * s.h2);
    for (u32 c = threadIdx.x; c < h; c += blockDim.x) {
      const u16 v = s.fp8 ? ep::fp8::dequantize(x[c], ((const float*)(x + h))[c / ep::fp8::BLOCK])
                          : ((const u16*)x)[c];
      out[c] = ep::fp8::to_bf16(__fmul_rn(ep::fp8::from_bf16(v), w));
    }
    __syncthreads();
  }
}

// The metadata of this rank's `tokens` tokens into MIN (mm bytes each:
// ep::ht::meta_word, plan.rs's meta_word), one word a thread, from the
// routing (idx: tokens x k i64, wbits: the weights' f32 bits, tokens x k;
// the caller's GPU memory, or pinned host memory the host staged host
// inputs in) and the slots the host's layout gave (host_slot: tokens x h,
// rank_slot: tokens x r, pinned host memory). Queued by the host before the
// notify kernel, on a stream of the buffer's own: nothing reads MIN before
// the dispatch kernel, launched after the host waited for that stream.
extern "C" __global__ void __launch_bounds__(EP_THREADS) ep_ht_stage_meta(Window xmeta, const i64* idx, const u32* wbits, const u32* host_slot, const u32* rank_slot, u32 tokens, const u32* shape) {
  const ep::ht::Shape s = ep::ht::shape_of(shape);
  const u32 words = s.mm / 4;
  const u64 n = (u64)tokens * words;
  // (The host sizes MIN for t tokens and stages at most t.)
  if (4 * n > xmeta.local_size) return;
  u32* out = (u32*)xmeta.local_base;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
    out[i] = ep::ht::meta_word(s, idx, wbits, host_slot, rank_slot, (u32)(i / words),
                               (u32)(i % words));
}

// The layout of inputs in GPU memory, on gin's stream right before the
// notify kernel (no host round trip between them): checks every top-k entry
// as the host does (input::entry_key: the weights of live slots first, then
// every entry in order; the smallest key is the first error), writes this
// rank's notify row into NSEND (the mask, then per destination and channel
// the tokens going there: plan.rs's notify_row; refused_row where an entry
// is bad, so that every peer ends the step naming this rank) and every
// token's metadata into MIN (ep_ht_stage_meta's words, the slots from the
// prefix sums over tokens: layout.rs's rank_slot and host_slot). idx, wbits:
// the caller's top-k ids (i64) and weights' bits, tokens x k; active: u32
// per rank. The counts take a block per destination (looping where the
// grid is smaller), its tokens LAYOUT_TILES tiles of the block's threads
// at a time, each thread one token of a tile: first whether each goes (a
// bit per tile), then every tile's warp ballots and the warps' sums, which
// give each token its count of earlier ones. The metadata and the entries'
// checks take the blocks past the destinations where the grid has more
// (the host launches a block per 64 tokens, up to its block limit), else
// every block before its destinations. rec (device, two u64): the smallest
// key (atomicMin) and the blocks that finished; the last block to finish
// writes the mask (and the refusal), copies what the host reads into out
// (pinned host memory, LO_WORDS u64) and resets rec for the next step. clock: this kernel's own
// pair of the step's launch clocks (earliest start, latest end).
extern "C" __global__ void __launch_bounds__(EP_THREADS) ep_ht_layout(Window nsend, Window xmeta, const i64* idx, const u32* wbits, u32 tokens, const u32* shape, const u32* active, u64* rec, u64* out, u64* clock) {
  ep::clock_start(clock);
  using namespace ep::ht;
  const Shape s = shape_of(shape);
  const u32 words = s.mm / 4, dests = layout_dests(s);
  const u32 row_words = (s.r + 31) / 32 + dests * s.chans;
  // (The host sizes MIN for t tokens, NSEND for one row, and checked
  // tokens <= t; Config::validate bounds the channels by 64: pre below.)
  // Where something does not fit, nothing is laid out and the host reads a
  // refusal naming no entry (an error, LayoutOut::refusal); a row that does
  // not fit NSEND is not written at all (the notify kernel's put of it then
  // fails too, out of NSEND).
  const bool row_fits = 4ull * row_words <= nsend.local_size;
  const bool fits = tokens <= s.t && s.chans <= 64 && (u64)tokens * s.mm <= xmeta.local_size && row_fits;
  u32* row = (u32*)nsend.local_base;
  u32* meta = (u32*)xmeta.local_base;
  // Where the grid has more blocks than destinations, blocks 0 .. dests
  // each lay out one destination while the others write the metadata and
  // check the entries; else every block does both, one after the other.
  const u32 split = gridDim.x > dests ? dests : 0;
  if (blockIdx.x >= split) {
    const u64 n = fits ? (u64)tokens * words : 0;
    const u64 stride = (u64)(gridDim.x - split) * blockDim.x;
    const u64 first = (u64)(blockIdx.x - split) * blockDim.x + threadIdx.x;
    // Four words a pass, their loads in flight together (a load then its
    // store, one word at a time, waited on the memory's latency per word);
    // each thread walks its words' (token, word) by the stride, dividing
    // once.
    const u32 st_tok = (u32)(stride / words), st_w = (u32)(stride % words);
    u32 tok = (u32)(first / words), w = (u32)(first % words);
    for (u64 i0 = first; i0 < n; i0 += 4 * stride) {
      u32 v[4];
      bool put[4];
#pragma unroll
      for (u32 q = 0; q < 4; ++q) {
        put[q] = i0 + q * stride < n && !is_slot_word(s, w);
        v[q] = put[q] ? meta_word(s, idx, wbits, nullptr, nullptr, tok, w) : 0u;
        tok += st_tok;
        w += st_w;
        if (w >= words) {
          w -= words;
          ++tok;
        }
      }
#pragma unroll
      for (u32 q = 0; q < 4; ++q)
        if (put[q]) meta[i0 + q * stride] = v[q];
    }
    u64 bad = ~0ull;
    for (u64 e = first; e < (u64)tokens * s.k; e += stride) {
      const u32 tok = (u32)(e / s.k), j = (u32)(e % s.k);
      bad = min(bad, ep::input::entry_key(idx + (u64)tok * s.k, (const float*)wbits + (u64)tok * s.k,
                                          tok, j, s.r * s.lexp));
    }
    for (u32 o = 16; o > 0; o >>= 1) bad = min(bad, (u64)__shfl_xor_sync(0xffffffffu, bad, o));
    if ((threadIdx.x & 31u) == 0 && bad != ~0ull) atomicMin((unsigned long long*)&rec[0], bad);
  }
  // A destination's tokens, LAYOUT_TILES tiles of the block's threads (a
  // token each) at a time: first whether each of a thread's tokens goes
  // (bit i: tile i; LAYOUT_WIDE tiles' loads in flight together), then each
  // warp's count per tile, a barrier, every tile's scan of them (a thread
  // per tile), a barrier, and every tile's prefix and slots.
  // (Before, a tile's ids were read, judged and laid out before the next
  // tile's were read: each tile waited on the memory's latency once per
  // top-k slot.)
  __shared__ u32 pre[65];
  __shared__ u32 warp_sum[LAYOUT_TILES][EP_THREADS / 32];
  __shared__ u32 tile_sum[LAYOUT_TILES];
  const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (u32 d = blockIdx.x; fits && d < dests; d += gridDim.x) {
    const LayoutDest dest = layout_dest(s, active, d);
    u32 base = 0;
    for (u32 lo = 0; lo < tokens; lo += LAYOUT_TILES * blockDim.x) {
      const u32 tiles = min(LAYOUT_TILES, (tokens - lo + blockDim.x - 1) / blockDim.x);
      // This thread's token of tile i (past the last token, the last
      // token: read and not used, no branch around the loads).
      const auto ids_of = [&](u32 i) {
        return idx + (u64)min(lo + i * blockDim.x + threadIdx.x, tokens - 1) * s.k;
      };
      // LAYOUT_WIDE tiles at a time, their tokens' ids loaded together
      // (past the last tile, the last tile's token: read and dropped).
      u32 bits = 0;
      for (u32 i = 0; i < tiles; i += LAYOUT_WIDE) {
        const i64* ids[LAYOUT_WIDE];
#pragma unroll
        for (u32 w = 0; w < LAYOUT_WIDE; ++w) ids[w] = ids_of(min(i + w, tiles - 1));
        bits |= layout_goes_wide(s, ids, active, dest) << i;
      }
      // Only tokens before `tokens` go (the last tile's threads past them
      // judged the last token); bits past `tiles` are never read, cleared
      // all the same.
      for (u32 i = 0; i < tiles; ++i)
        if (lo + i * blockDim.x + threadIdx.x >= tokens) bits &= ~(1u << i);
      if (tiles < 32) bits &= (1u << tiles) - 1u;
      for (u32 i = 0; i < tiles; ++i) {
        const u32 m = __ballot_sync(0xffffffffu, (bits >> i) & 1u);
        if (lane == 0) warp_sum[i][warp] = layout_popc(m);
      }
      __syncthreads();
      // Every tile's warp counts into prefixes at once, a thread per tile
      // (each thread summing all warps' counts of every tile, one tile
      // after another: the ballots, sums and slots took 7.2 us on the H200,
      // with the scans 5.4).
      if (threadIdx.x < tiles) tile_sum[threadIdx.x] = layout_tile_scan(warp_sum[threadIdx.x], warps);
      __syncthreads();
      for (u32 i = 0; i < tiles; ++i) {
        const u32 t = lo + i * blockDim.x + threadIdx.x;
        const u32 m = __ballot_sync(0xffffffffu, (bits >> i) & 1u);
        const u32 before = layout_before(base, warp_sum[i], m, lane, warp);
        if (t < tokens) layout_token(s, tokens, t, d, ((bits >> i) & 1u) != 0, before, meta, pre);
        base += tile_sum[i];
      }
      // warp_sum and tile_sum are rewritten by the next tiles; pre is read
      // below.
      __syncthreads();
    }
    // The channels' bounds and counts, a thread per channel (thread 0
    // alone, a 64-bit division per channel, took 4.6 us; now 0.3).
    if (threadIdx.x <= s.chans) layout_count_bound(s, tokens, threadIdx.x, base, pre);
    __syncthreads();
    if (threadIdx.x < s.chans) layout_count_word(s, d, threadIdx.x, pre, row);
    // pre is rewritten for the next destination.
    __syncthreads();
  }
  // The last block to finish sees every block's writes and key.
  __threadfence();
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) last = atomicAdd((u32*)&rec[1], 1u) == gridDim.x - 1;
  __syncthreads();
  if (last && threadIdx.x == 0) {
    __threadfence();
    const u64 key = *(volatile u64*)&rec[0];
    const bool refused = key != ~0ull || !fits;
    if (row_fits) layout_finish(s, active, refused, row);
    u64 w[4] = {0, 0, 0, 0};
    if (key != ~0ull) ep::input::error_of(key, idx, (const float*)wbits, s.k, s.r * s.lexp, w);
    volatile u64* o = out;
    o[LO_REFUSED] = refused ? 1 : 0;
    o[LO_KEY] = key;
    for (u32 i = 0; i < 4; ++i) o[LO_ERR + i] = w[i];
    rec[0] = ~0ull;
    *(volatile u32*)&rec[1] = 0;
  }
  ep::clock_end(clock);
}

// FP8 dispatch: the BF16 tokens (xbf: tokens x h u16; host inputs uploaded
// while the notify kernel runs, then this kernel after it; inputs in GPU
// memory the caller's, this kernel queued beside the notify kernel) are
// quantised into XIN's payloads (p bytes each: the FP8 codes, then one f32
// scale per 128 elements), bit for bit as num.rs's quantize_fp8: ll.cu's
// quantize_tokens with the message stride p.
extern "C" __global__ void __launch_bounds__(EP_THREADS) ep_ht_quantize(Window xin, const u16* xbf, u32 tokens, u32 p, u32 h) {
  ep::quantize_tokens(xin, xbf, tokens, p, h);
}

// -------------------------------------------------------------- combine

namespace ep {
namespace ht {

// Block-wide wait for signal id of context ctx to reach target, bounded by
// the job timeout and the abort flag (and given up once gin's error word
// is set); a failure is recorded naming peer. The same status on every
// thread; what the signal announced is visible to the block afterwards.
__device__ int wait_ctx(const DevComm& dc, u32 ctx, u32 id, u64 target, u32 peer) {
  __shared__ int status;
  if (threadIdx.x == 0) {
    int st = OK;
    if (id >= dc.nsignals) {
      st = gin::detail::fail(dc, BAD_SIGNAL, ctx, peer, id);
    } else {
      const u64 slot = gin::detail::signal_slot(dc, ctx, id);
      const u32 k = poll_unless_failed(dc, SIGNAL_TIMEOUT, [&] {
        return signal_reached(gin::detail::signal_sum_acquire(dc, slot), target);
      });
      if (k) st = gin::detail::fail(dc, k, ctx, peer, id);
    }
    status = st;
  }
  __syncthreads();
  const int st = status;
  __syncthreads();
  return st;
}

// One thread: where the combine row of the token `j`th among dst's
// received tokens lies, read in place (dst's combine rows mapped here, or
// this rank's own). Null after recording a failure (a place outside dst's
// window: a broken invariant).
__device__ const u8* in_place(const Args& a, u32 ch, u32 dst, u32 j) {
  const Shape& s = a.s;
  const Window& cs = *a.W[CSEND];
  const u64 off = (u64)j * s.h2;
  const u8* base =
      dst == s.rank ? (const u8*)cs.local_base : (const u8*)((const u64*)cs.peer_bases)[dst];
  if (!base || !gin::detail::range_ok(off, s.h2, ((const u64*)cs.sizes)[dst])) {
    gin::detail::fail(a.dc, OUT_OF_WINDOW, ch, dst, cs.id);
    return nullptr;
  }
  return base + off;
}

// Thread 0 of the combine: whether rows are fetched by get (a same-host
// peer's not mapped here) into a CGET too small for them (cget_enough);
// then records a get past CGET (OUT_OF_WINDOW on context ch) naming the
// first such peer and CGET, rather than a batch that never fits (a stall
// until the timeout, naming an unrelated peer) or rows in the next
// channel's part.
__device__ bool cget_short(const Args& a, const u32* direct, u32 ch) {
  const Shape& s = a.s;
  if (cget_enough(s, a.W[CGET]->local_size)) return false;
  const u32 host = s.rank / s.l;
  for (u32 dl = 0; dl < s.l; ++dl) {
    const u32 p = host * s.l + dl;
    if (direct[p]) continue;
    gin::detail::fail(a.dc, OUT_OF_WINDOW, ch, p, a.W[CGET]->id);
    return true;
  }
  return false;
}

// Thread 0: the combine row of the token `j`th among dst's received tokens
// for the batch's row list: read in place where dst's combine rows are
// mapped here (direct[dst]), else fetched by get into this channel's row
// `i` of CGET (the caller flushes before the rows are read). Null after
// recording a failure (a place outside dst's window: a broken invariant).
__device__ const u8* row_of(const Args& a, Batch& b, const u32* direct, u32 ch, u32 dst, u32 j,
                            u32 i, bool& fetched) {
  const Shape& s = a.s;
  if (direct[dst]) return in_place(a, ch, dst, j);
  const u64 at = cget_off(s, cget_rows(s, a.W[CGET]->local_size), ch, i);
  add_get(b, dst, CGET, at, CSEND, (u64)j * s.h2, s.h2);
  fetched = true;
  return (const u8*)a.W[CGET]->local_base + at;
}

// A run of combined rows for one put: n rows from window win at src_off
// here to CRDMA at dst_off of `to`.
struct RowRun {
  u32 to, win, n;
  u64 src_off, dst_off;
};

// Thread 0: puts the pending run back to its source, its signal counting
// the rows.
__device__ void issue(const Args& a, Batch& b, RowRun& run) {
  if (run.n == 0) return;
  const Shape& s = a.s;
  add_put(b, run.to, CRDMA, run.dst_off, run.win, run.src_off, (u64)run.n * s.h2,
          sig_ctail(s, s.rank / s.l), run.n);
  run.n = 0;
}

// Thread 0: adds one row to the pending run, or issues it and starts
// another.
__device__ void append(const Args& a, Batch& b, RowRun& run, u32 to, u32 win, u64 src_off,
                       u64 dst_off) {
  const u64 h2 = a.s.h2;
  if (run.n > 0 && run.to == to && run.win == win && run.src_off + run.n * h2 == src_off &&
      run.dst_off + run.n * h2 == dst_off && run.n < RUN) {
    ++run.n;
    return;
  }
  issue(a, b, run);
  run = RowRun{to, win, 1, src_off, dst_off};
}

// Thread 0: sums and sends back the rows of the tokens this rank forwarded
// in channel ch, as far as the batch allows; true if any. False in `ok`
// after a failure.
__device__ bool forward_rows(const Args& a, Batch& b, u32 ch, const u32* direct, u64* L,
                             bool& ok) {
  const Shape& s = a.s;
  const u32 me = s.rank, host = me / s.l;
  u64 &src = L[c_misc(s) + 0], &pos = L[c_misc(s) + 1], &staged = L[c_misc(s) + 2];
  RowRun run{0, 0, 0, 0, 0};
  u32 done = 0;
  while (src < s.r && done < RUN && room(b, s.l + 6, s.l)) {
    const u32 n = a.tb.forwards(me, (u32)src) ? a.tb.host_chan((u32)src, host, ch) : 0;
    if (pos >= n) {
      ++src;
      pos = 0;
      continue;
    }
    const u32 hs = a.tb.host_chan_start((u32)src, host, ch) + (u32)pos;
    const u64 dst_off = crdma_off(s, host, hs);
    u32 pairs = 0, only = NONE, only_j = 0;
    for (u32 dl = 0; dl < s.l; ++dl) {
      const u32 j = a.contrib[contrib_at(s, (u32)src, hs, dl)];
      if (j == NONE) continue;
      ++pairs;
      only = host * s.l + dl;
      only_j = j;
    }
    if (pairs == 1 && only == me) {
      append(a, b, run, (u32)src, CSEND, (u64)only_j * s.h2, dst_off);
    } else {
      if (staged == STAGE) {
        // Every staging row is in use: complete the puts reading them.
        issue(a, b, run);
        add_flush(b);
        staged = 0;
      }
      const u64 g = stage_off(s, ch, (u32)staged);
      ++staged;
      const u32 row0 = b.nrows;
      bool fetched = false;
      u32 i = 0;
      for (u32 dl = 0; dl < s.l; ++dl) {
        const u32 j = a.contrib[contrib_at(s, (u32)src, hs, dl)];
        if (j == NONE) continue;
        const u8* r = row_of(a, b, direct, ch, host * s.l + dl, j, i++, fetched);
        if (!r) {
          ok = false;
          return false;
        }
        b.rows[b.nrows++] = r;
      }
      if (fetched) add_flush(b);
      add_sum(b, (u8*)a.W[CSTAGE]->local_base + g, row0, b.nrows - row0);
      append(a, b, run, (u32)src, CSTAGE, g, dst_off);
    }
    ++pos;
    ++done;
  }
  issue(a, b, run);
  return done > 0;
}

// Tokens a combine batch reduces at most (reduce).
constexpr u32 REDUCE_TOKENS = 128;

// Warp 0: whether other hosts' rows of the tokens of the lanes below `w`
// have arrived (for each other host hh the token went to, ctail of hh up
// to its place); read again where a token needs more than the scratch
// says. False on every lane (and `ok` false) after recording the
// forwarder's protocol error (rows ahead of the plan).
__device__ bool arrived_rows(const Args& a, u32 ch, const u32* meta, u32 w, u64* L, bool& ok) {
  const Shape& s = a.s;
  const u32 me = s.rank, host = me / s.l, lane = gin::detail::lane();
  u64* seen = a.seen + (u64)ch * s.nsig;
  bool ready = lane < w;
  for (u32 hh = 0; hh < s.h; ++hh) {
    if (hh == host) continue;
    const u32 hs = lane < w ? meta[w_host_slot(s, hh)] : NONE;
    const u64 need = hs == NONE ? 0 : (u64)(hs - a.tb.host_chan_start(me, hh, ch)) + 1;
    if (__any_sync(FULL, need > L[c_got(s) + hh])) {
      int bad = 0;
      if (lane == 0) {
        const u32 id = sig_ctail(s, hh);
        const u64 got = read_acq(a.dc, ch, id) - seen[id];
        const u64 want = a.tb.host_chan(me, hh, ch);
        if (got > want) {
          const u32 fwd = a.tb.forwarder(me, hh);
          protocol(a.err, a.errh, fwd == NONE ? hh * s.l : fwd, HT_ROWS_AHEAD, ch, got, want);
          bad = 1;
        } else {
          L[c_got(s) + hh] = got;
        }
      }
      if (__shfl_sync(FULL, bad, 0)) {
        ok = false;
        return false;
      }
      __syncwarp();
    }
    ready &= need <= L[c_got(s) + hh];
  }
  return ready;
}

// Warp 0: reduces this channel's tokens in order, WARP at a time (a lane
// each), while every host each went to has delivered, up to REDUCE_TOKENS
// as far as the batch allows; true on every lane if any. A token's rows are
// its host's by local index (read in place where mapped, else fetched by
// get into the channel's rows of CGET: consecutive places of one rank in
// one get, one flush for the gets of 32 tokens), then other hosts' (CRDMA),
// summed by one OP_SUM into its row of `out` (tokens x hidden BF16). False
// in `ok` on every lane after a failure.
__device__ bool reduce(const Args& a, Batch& b, u32 ch, u32 end, const u32* direct, u8* out,
                       u64* L, bool& ok) {
  const Shape& s = a.s;
  const u32 me = s.rank, host = me / s.l, lane = gin::detail::lane(), below = lanes_below();
  const u64 cap = cget_rows(s, a.W[CGET]->local_size);
  const u32 from = (u32)L[c_misc(s) + 3];
  u32 next = from, nops = b.nops, nrows = b.nrows;
  u64 fetched = 0;
  while (next < end && next - from < REDUCE_TOKENS) {
    const u32 w = end - next < WARP ? end - next : WARP;
    const u32* meta = my_meta(a, lane < w ? next + lane : next);
    const u32 ready = __ballot_sync(FULL, arrived_rows(a, ch, meta, w, L, ok));
    if (!ok) return false;
    const u32 k = ready == FULL ? WARP : __ffs(~ready) - 1;
    // The rows, fetched rows and ops (its gets, its sum) of each token of
    // the ready ones; the tokens that fit the batch (a flush after gets).
    u32 rows = 0, fetch = 0, ops = 1;
    for (u32 dl = 0; dl < s.l; ++dl) {
      const u32 dst = host * s.l + dl, rs = lane < k ? meta[w_rank_slot(s, dst)] : NONE;
      const bool get = rs != NONE && !direct[dst];
      rows += rs != NONE;
      fetch += get;
      ops += run_start(get ? rs : NONE);
    }
    for (u32 hh = 0; hh < s.h; ++hh)
      rows += hh != host && lane < k && meta[w_host_slot(s, hh)] != NONE;
    const u32 rows_upto = warp_incl_sum(rows), fetch_upto = warp_incl_sum(fetch);
    const u32 ops_upto = warp_incl_sum(ops) + (fetch_upto > 0);
    const u32 n = __popc(__ballot_sync(FULL, lane < k && nrows + rows_upto <= MAX_ROWS &&
                                                 fetched + fetch_upto <= cap &&
                                                 nops + ops_upto <= MAX_OPS));
    if (n == 0) break;
    const bool in = lane < n;
    const u32 row0 = nrows + rows_upto - rows;
    u32 r = row0;
    u64 f = fetched;
    bool bad = false;
    for (u32 dl = 0; dl < s.l; ++dl) {
      const u32 dst = host * s.l + dl, rs = in ? meta[w_rank_slot(s, dst)] : NONE;
      const bool get = rs != NONE && !direct[dst], start = run_start(get ? rs : NONE);
      const u32 cont = __ballot_sync(FULL, get && !start);
      const u32 starts = __ballot_sync(FULL, start), gets = __ballot_sync(FULL, get);
      const u32 j = rs == NONE ? 0 : a.tb.recv_start(dst, me) + rs;
      if (get) {
        const u64 at = cget_off(s, cap, ch, f + __popc(gets & below));
        if (start)
          b.ops[nops + __popc(starts & below)] =
              Op{OP_GET, dst, CGET, CSEND, at, (u64)j * s.h2, run_length(cont) * (u64)s.h2,
                 0, 0, 0, 0, 0};
        b.rows[r++] = (const u8*)a.W[CGET]->local_base + at;
      } else if (rs != NONE) {
        const u8* p = in_place(a, ch, dst, j);
        bad |= p == nullptr;
        b.rows[r++] = p;
      }
      nops += __popc(starts);
      f += __popc(gets);
    }
    for (u32 hh = 0; hh < s.h; ++hh) {
      const u32 hs = in && hh != host ? meta[w_host_slot(s, hh)] : NONE;
      if (hs != NONE) b.rows[r++] = (const u8*)a.W[CRDMA]->local_base + crdma_off(s, hh, hs);
    }
    if (__any_sync(FULL, bad)) {
      ok = false;
      return false;
    }
    // The gets complete before the sums read their rows.
    if (f != fetched) {
      if (lane == 0) b.ops[nops] = Op{OP_FLUSH, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
      ++nops;
    }
    if (in)
      b.ops[nops + lane] =
          Op{OP_SUM, 0, 0, 0, (u64)(out + (u64)(next + lane) * s.h2), 0, 0, 0, row0, r - row0, 0, 0};
    nops += n;
    nrows += __shfl_sync(FULL, rows_upto, n - 1);
    fetched = f;
    next += n;
  }
  __syncwarp();
  if (lane == 0) {
    b.nops = nops;
    b.nrows = nrows;
    L[c_misc(s) + 3] = next;
  }
  __syncwarp();
  return next != from;
}

// Warp 0: the next batch of channel ch's combine. Thread 0 decides the
// forwarded tokens' sums (forward_rows) and the end of the step, the warp
// the reduction of this rank's tokens (reduce). L: the channel's scratch.
__device__ __noinline__ void combine_batch(const Args& a, Batch& b, u32 ch, u32 tokens, const u32* direct,
                              u8* out, u64* L, u64& since) {
  const Shape& s = a.s;
  const u32 me = s.rank, host = me / s.l;
  const bool lead = gin::detail::lane() == 0;
  u64* seen = a.seen + (u64)ch * s.nsig;
  const u32 end = chan_lo(s, tokens, ch + 1);
  bool ok = true, moved = false;
  if (lead) {
    b.nops = b.nrows = b.stop = 0;
    moved = forward_rows(a, b, ch, direct, L, ok);
  }
  // Thread 0's ops and scratch before the warp's.
  ok = __shfl_sync(FULL, ok ? 1 : 0, 0) != 0;
  __syncwarp();
  if (ok) moved |= reduce(a, b, ch, end, direct, out, L, ok);
  if (!lead) return;
  if (!ok) {
    b.stop = 1;
    return;
  }
  if (L[c_misc(s) + 0] >= s.r && L[c_misc(s) + 3] >= end) {
    for (u32 hh = 0; hh < s.h; ++hh)
      if (hh != host) seen[sig_ctail(s, hh)] += a.tb.host_chan(me, hh, ch);
    b.stop = 2;
    return;
  }
  if (moved) {
    since = 0;
    return;
  }
  // What the next token waits for: the first other host it went to.
  const u32 t = (u32)L[c_misc(s) + 3];
  u32 peer = NO_PEER, id = 0;
  for (u32 hh = 0; hh < s.h && t < end; ++hh) {
    if (hh == host || my_meta(a, t)[w_host_slot(s, hh)] == NONE) continue;
    peer = a.tb.forwarder(me, hh);
    id = sig_ctail(s, hh);
    break;
  }
  if (idle(a.dc, ch, since, peer, id, a.err)) b.stop = 1;
}

} // namespace ht
} // namespace ep

// High-throughput combine: block ch runs channel ch (context ch). First it
// tells every active rank of this host that this rank's combine rows
// (CSEND, written by earlier launches) are ready, and waits for the same
// from each of them (cready, bounded, naming the rank); then it forwards
// and reduces (see the top of this file). out: tokens x hidden BF16;
// direct (u32 per rank): 1 where this rank reads that rank's combine rows
// in place (itself, and load/store peers of its host).
extern "C" __global__ void __launch_bounds__(EP_THREADS) ep_ht_combine(DevComm dc, EP_HT_WINDOWS, u32 tokens, const u32* shape, const u32* tables, const u32* active, const u32* direct, u64* seen, u64* lane, u32* contrib,
                  u16* out, u64* err, u64* errh, u64* clock) {
  if (ep::failed_before(dc)) return;
  ep::clock_start(clock);
  __shared__ ep::ht::Batch b;
  const ep::ht::Shape s = ep::ht::shape_of(shape);
  const Window* W[ep::ht::WINDOWS] = EP_HT_WINDOW_TABLE;
  const ep::ht::Args a{dc, {W[0], W[1], W[2], W[3], W[4], W[5], W[6], W[7], W[8], W[9], W[10],
                            W[11]},
                       s, ep::ht::Tables{tables, s}, seen, lane, contrib, err, errh};
  const u32 ch = blockIdx.x;
  if (ch >= s.chans) return;
  const u32 me = s.rank, host = me / s.l;
  __shared__ u64 lane_smem[ep::ht::LANE_SMEM];
  u64* const L = ep::ht::lane_of(s, lane, ch, lane_smem);
  if (threadIdx.x == 0) {
    ep::ht::clear_lane(s, L, ep::ht::chan_lo(s, tokens, ch), false);
    b.xs = ep::ht::Tokens{nullptr, 0};
    b.stop = ep::ht::cget_short(a, direct, ch) ? 1 : 0;
  }
  __syncthreads();
  if (b.stop) return;
  ep::ht::prefetch_channel(a, ep::ht::chan_lo(s, tokens, ch), ep::ht::chan_lo(s, tokens, ch + 1));
  for (u32 dl = 0; dl < s.l; ++dl) {
    const u32 p = host * s.l + dl;
    if (active[p] && signal(dc, ch, p, signal_add(ep::ht::sig_cready(s, me % s.l), 1), CTA))
      return;
  }
  u64* seen_ch = seen + (u64)ch * s.nsig;
  // The scratch is cleared before warp 0 reads it.
  __syncthreads();
  for (u32 dl = 0; dl < s.l; ++dl) {
    const u32 p = host * s.l + dl, id = ep::ht::sig_cready(s, dl);
    if (!active[p]) continue;
    if (ep::ht::wait_ctx(dc, ch, id, seen_ch[id] + 1, p)) return;
    if (threadIdx.x == 0) seen_ch[id] += 1;
    __syncthreads();
  }
  u64 since = 0;
  for (;;) {
    if (threadIdx.x < ep::ht::WARP)
      ep::ht::combine_batch(a, b, ch, tokens, direct, (u8*)out, L, since);
    __syncthreads();
    if (b.stop == 1) return;
    if (ep::ht::run_batch(dc, ch, a.W, b, s.hidden)) return;
    const bool done = b.stop == 2;
    __syncthreads();
    if (done) break;
  }
  // CSTAGE and CSEND are rewritten in the next step.
  if (flush(dc, ch, CTA)) return;
  ep::clock_end(clock);
}

#endif // __CUDACC__

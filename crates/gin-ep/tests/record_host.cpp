// kernels/ll.cu's error records (ep::rec::record, count_error,
// combine_error and is_refusal) compiled as host C++ and run single-threaded over err and its
// mirror errh (a CAS that claims a free word 0), as the host reads them
// (cuda/dev.rs's Record): slot 0 holds the first error of any kind, slot 1
// the first that is not a refusal, whatever came before it, so that a
// refusal recorded first (a peer's refused inputs in one of the steps
// queued since the last check) can never hide a broken protocol recorded
// after it (a count above the maximum in a later step: what a late signal
// taken with the next step's looks like). A refused rank records a count
// above the maximum too. Exits 0 when every check holds, else prints each
// failure and exits 1.
#include <cstdio>

#include "../kernels/ll.cu"

namespace {

int failures = 0;

void expect(bool ok, const char* what, int line) {
  if (!ok) {
    std::printf("line %d: %s\n", line, what);
    ++failures;
  }
}
#define EXPECT(c) expect((c), #c, __LINE__)

// One buffer's err (device memory) and errh (its pinned mirror).
struct Words {
  u64 err[ep::rec::WORDS * ep::rec::SLOTS] = {};
  u64 errh[ep::rec::WORDS * ep::rec::SLOTS] = {};
  int fences = 0;

  void record(u64 w0, u64 w1, u64 w2, u64 w3, bool mirror = true) {
    const u64 w[ep::rec::WORDS] = {w0, w1, w2, w3};
    ep::rec::record(
        err, mirror ? errh : nullptr, w,
        [](u64* p, u64 v) {
          if (*p != 0) return false;
          *p = v;
          return true;
        },
        [this] { ++fences; });
  }
  // Slot s's words as the host reads them (the mirror), equal to err's.
  bool slot(u32 s, u64 w0, u64 w1, u64 w2, u64 w3) const {
    const u64 w[ep::rec::WORDS] = {w0, w1, w2, w3};
    for (u32 i = 0; i < ep::rec::WORDS; ++i)
      if (errh[s * ep::rec::WORDS + i] != w[i] || err[s * ep::rec::WORDS + i] != w[i]) return false;
    return true;
  }
  bool empty(u32 s) const { return slot(s, 0, 0, 0, 0); }
  // The host's clear of a reported refusal (cuda/dev.rs's forget_refusal):
  // the mirror's slot 0 first, then err's word 0 (words 1-3 of err are
  // rewritten by the next claim; the host reads the mirror).
  void forget_refusal() {
    for (u32 i = 0; i < ep::rec::WORDS; ++i) {
      errh[i] = 0;
      err[i] = 0;
    }
  }
};

constexpr u64 T = 16;
constexpr u64 POISONED = ep::POISON - 1;  // c of a signal that moved by POISON

u64 peer(u64 kind, u64 p) { return kind | p << 8; }

}  // namespace

int main() {
  using namespace ep;
  // The kinds that are refusals: a peer's, and this rank's own entries.
  EXPECT(rec::is_refusal(peer(ERR_PEER_BAD_INPUT, 3)));
  EXPECT(rec::is_refusal(ERR_EXPERT_RANGE) && rec::is_refusal(ERR_DUPLICATE) &&
         rec::is_refusal(ERR_WEIGHT));
  EXPECT(!rec::is_refusal(peer(ERR_COUNT_OVER_MAX, 1)) && !rec::is_refusal(peer(ERR_TOKEN_RANGE, 1)) &&
         !rec::is_refusal(peer(ERR_NOT_NAMED, 1)) && !rec::is_refusal(peer(8, 1)));

  // What a receiver records of a source's count: a refusal unless its own
  // inputs were refused; above the maximum on every rank (a refused rank
  // too); a poisoned signal that moved further (a late count with it) is no
  // refusal but a count above the maximum.
  EXPECT(rec::count_error(POISONED, T, false) == ERR_PEER_BAD_INPUT);
  EXPECT(rec::count_error(POISONED, T, true) == 0);
  EXPECT(rec::count_error(T + 1, T, false) == ERR_COUNT_OVER_MAX);
  EXPECT(rec::count_error(T + 1, T, true) == ERR_COUNT_OVER_MAX);
  EXPECT(rec::count_error(POISONED + 3, T, true) == ERR_COUNT_OVER_MAX);
  EXPECT(rec::count_error(T, T, false) == 0 && rec::count_error(0, T, true) == 0);

  // An expert rank's combine signal, the step's 1 in its target: moved 0
  // past it (a full combine), or POISON (the expert rank refused the
  // combine: its expert outputs were refused by its host). A refusal, which
  // a rank refusing the combine itself does not record; never a broken
  // protocol (it never claims slot 1).
  // What the combine kernel passes (wait_experts' `moved`): the signal's
  // value v less its target, the accounted value plus the step's 1; the
  // accounted value here already holds an earlier refused combine's
  // POISON (the next dispatch added it to the target), so the moved value
  // is counted from it, not from the signal's raw value.
  const u64 accounted = 7 + 2 * POISON, target = accounted + 1;
  const u64 full = (accounted + 1) - target, refused = (accounted + 1 + POISON) - target;
  EXPECT(full == 0 && refused == POISON);
  EXPECT(!rec::combine_refused(full) && rec::combine_error(full, false) == 0);
  EXPECT(!rec::combine_refused(full) && rec::combine_error(full, true) == 0);
  EXPECT(rec::combine_refused(refused) && rec::combine_error(refused, false) == ERR_PEER_REFUSED_COMBINE);
  EXPECT(rec::combine_error(refused, true) == 0);
  // Judged from the raw value instead (the poison not accounted), a full
  // combine after a refused one would read as refused again.
  EXPECT(rec::combine_refused((accounted + 1) - (7 + 1)));
  EXPECT(rec::is_refusal(peer(ERR_PEER_REFUSED_COMBINE, 2)) && !rec::claims(1, peer(ERR_PEER_REFUSED_COMBINE, 2)));
  EXPECT(ERR_PEER_REFUSED_COMBINE != ERR_PEER_BAD_INPUT && ERR_PEER_REFUSED_COMBINE != 8);
  {
    // Steps queued back to back: step 1's combine refused by rank 2 (this
    // rank records it, slot 0), step 2's dispatch refused at rank 3 (slot 0
    // taken: the first refusal is reported), then rank 1's count above the
    // maximum (slot 1 keeps it whatever slot 0 holds).
    Words r;
    // (As the combine kernel records it: expert 9, moved POISON.)
    r.record(peer(rec::combine_error(refused, false), 2), 9, refused, 0);
    EXPECT(r.slot(0, peer(ERR_PEER_REFUSED_COMBINE, 2), 9, POISON, 0) && r.empty(1));
    r.record(peer(rec::count_error(POISONED, T, false), 3), 5, POISONED, 0);
    EXPECT(r.slot(0, peer(ERR_PEER_REFUSED_COMBINE, 2), 9, POISON, 0) && r.empty(1));
    r.record(peer(ERR_COUNT_OVER_MAX, 1), 4, 30, 0);
    EXPECT(r.slot(0, peer(ERR_PEER_REFUSED_COMBINE, 2), 9, POISON, 0));
    EXPECT(r.slot(1, peer(ERR_COUNT_OVER_MAX, 1), 4, 30, 0));
    // Reported and cleared (a waited combine, or check): the next refused
    // combine takes slot 0 again.
    r.forget_refusal();
    r.record(peer(rec::combine_error(refused, false), 3), 12, refused, 0);
    EXPECT(r.slot(0, peer(ERR_PEER_REFUSED_COMBINE, 3), 12, POISON, 0));
  }
  {
    // Steps queued back to back: step 1 refused at rank 2 (this rank
    // records PeerRefused), then in step 2 rank 3's count for expert 5 is
    // 40 (above 16): slot 1 keeps it, and the host fails the buffer on it.
    Words r;
    r.record(peer(rec::count_error(POISONED, T, false), 2), 5, POISONED, 0);
    EXPECT(r.slot(0, peer(ERR_PEER_BAD_INPUT, 2), 5, POISONED, 0) && r.empty(1));
    r.record(peer(rec::count_error(40, T, false), 3), 5, 40, 0);
    EXPECT(r.slot(0, peer(ERR_PEER_BAD_INPUT, 2), 5, POISONED, 0));
    EXPECT(r.slot(1, peer(ERR_COUNT_OVER_MAX, 3), 5, 40, 0));
    // A token index out of range afterwards: both slots keep the first.
    r.record(peer(ERR_TOKEN_RANGE, 1), 4, 99, 0);
    EXPECT(r.slot(1, peer(ERR_COUNT_OVER_MAX, 3), 5, 40, 0));
    // The host clears the refusal it reported: the broken protocol stays,
    // and a later refusal takes slot 0 again.
    r.forget_refusal();
    EXPECT(r.empty(0) && r.slot(1, peer(ERR_COUNT_OVER_MAX, 3), 5, 40, 0));
    r.record(peer(ERR_PEER_BAD_INPUT, 1), 6, POISONED, 0);
    EXPECT(r.slot(0, peer(ERR_PEER_BAD_INPUT, 1), 6, POISONED, 0));
    EXPECT(r.slot(1, peer(ERR_COUNT_OVER_MAX, 3), 5, 40, 0));
  }
  {
    // This rank's own entry refused on the GPU, then a source's token index
    // out of range in a later step.
    Words r;
    r.record(ERR_EXPERT_RANGE, 1, 1, 35);
    r.record(peer(ERR_TOKEN_RANGE, 1), 7, 20, 0);
    EXPECT(r.slot(0, ERR_EXPERT_RANGE, 1, 1, 35) && r.slot(1, peer(ERR_TOKEN_RANGE, 1), 7, 20, 0));
  }
  {
    // A broken protocol first: both slots hold it, a later refusal none.
    Words r;
    r.record(peer(ERR_NOT_NAMED, 2), 3, 9, 0);
    r.record(peer(ERR_PEER_BAD_INPUT, 1), 3, POISONED, 0);
    EXPECT(r.slot(0, peer(ERR_NOT_NAMED, 2), 3, 9, 0) && r.slot(1, peer(ERR_NOT_NAMED, 2), 3, 9, 0));
  }
  {
    // Refusals alone: the first wins slot 0, slot 1 stays empty (the
    // buffer outlives them).
    Words r;
    r.record(peer(ERR_PEER_BAD_INPUT, 1), 0, POISONED, 0);
    r.record(ERR_WEIGHT, 2, 0, 0x7fc00000);
    EXPECT(r.slot(0, peer(ERR_PEER_BAD_INPUT, 1), 0, POISONED, 0) && r.empty(1));
    // The slot's mirror is published with a fence before and after word 0.
    EXPECT(r.fences == 2);
  }
  {
    // No mirror (a kernel given none): err alone.
    Words r;
    r.record(peer(ERR_PEER_BAD_INPUT, 1), 0, POISONED, 0, false);
    r.record(peer(ERR_COUNT_OVER_MAX, 2), 0, 17, 0, false);
    EXPECT(r.err[0] == peer(ERR_PEER_BAD_INPUT, 1) && r.err[4] == peer(ERR_COUNT_OVER_MAX, 2));
    EXPECT(r.errh[0] == 0 && r.errh[4] == 0 && r.fences == 0);
  }
  if (failures == 0) std::printf("every record check passed\n");
  return failures == 0 ? 0 : 1;
}

//! Where a CUDA buffer's steps stand on the host, and what each call
//! requires of it: pure state, so that the rules are tested without a GPU.
//!
//! A step is a dispatch launch (the step begins: [`Steps::begin`]), the
//! expert, and a combine launch (it ends: [`Steps::combined`]). Launches
//! queued on a caller's stream are unchecked until [`Steps::checked`]
//! (after the caller synchronised the stream): meanwhile nothing may run on
//! gin's stream (not ordered after the caller's), read GPU memory those
//! launches write, change what they read, or free the buffer. A failure
//! (a kernel's, a recorded error, a refused read-back) is sticky.
//!
//! What the kernels record ([`Recorded`]) is judged by where the host
//! looks ([`Look`], [`Steps::judge`]): a refusal (a rank's inputs refused,
//! on its host or its GPU) is a step every rank runs to its end, so it
//! never fails the buffer; anything else recorded (a broken protocol) does,
//! whatever was recorded before it (the kernels keep the first broken
//! protocol apart: [`super::dev::Record`]).

use crate::error::EpError;

/// Where a CUDA buffer's step stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Between steps (before the first dispatch, after a combine).
    Idle,
    /// A dispatch was launched; its combine is next.
    Dispatched,
}

/// The host side of a CUDA buffer's steps.
#[derive(Debug, Clone)]
pub(crate) struct Steps {
    rank: usize,
    /// Dispatches launched (the current step's number; 0 before the first).
    pub(crate) step: u64,
    pub(crate) phase: Phase,
    /// Tokens this rank dispatched in the current step.
    pub(crate) tokens: usize,
    /// Launches were queued on a caller's stream and not checked since.
    pub(crate) queued: bool,
    /// A kernel or step failed: every later call is refused.
    pub(crate) failed: bool,
}

/// A call of one mode's steps on a buffer of `have`: refused on a buffer
/// sized for the other mode (every rank refuses alike: the configuration
/// is agreed).
pub(crate) fn expect_mode(
    rank: usize,
    call: &'static str,
    want: crate::Mode,
    have: crate::Mode,
) -> Result<(), EpError> {
    if want == have {
        return Ok(());
    }
    let name = |m: crate::Mode| match m {
        crate::Mode::LowLatency => "low-latency",
        crate::Mode::HighThroughput => "high-throughput",
    };
    Err(EpError::Mode {
        rank,
        what: format!(
            "{call} is a {} call, on a buffer sized for {} mode",
            name(want),
            name(have)
        ),
    })
}

const QUEUED: &str = "holding launches queued on a stream (synchronise it, then call check)";

/// What the kernels recorded (`ep::record`), as the host's rules take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// Nothing.
    Nothing,
    /// A refusal alone ([`super::dev::is_refusal`]): this rank's inputs
    /// found bad on the GPU, or a source's refused (its counts poisoned).
    /// The dispatch consumed every source's signal of the step and counted
    /// 0 tokens for a refused source: no rank broke the protocol, and every
    /// rank can end the step alike.
    Refusal,
    /// A source broke the protocol (or a high-throughput kernel's error):
    /// peers may be anywhere in the step. `refused`: a refusal was recorded
    /// too (before it, in this step or an earlier queued one), so that the
    /// other ranks are ending a refused step.
    Broken { refused: bool },
}

impl Recorded {
    /// What a record holds: a broken protocol (slot 1) whatever slot 0
    /// holds, else slot 0's kind.
    pub(crate) fn of(r: &super::dev::Record) -> Self {
        if r.broken[0] != 0 || (r.first[0] != 0 && !r.refused()) {
            Self::Broken {
                refused: r.refused(),
            }
        } else if r.refused() {
            Self::Refusal
        } else {
            Self::Nothing
        }
    }
}

/// Where the host looks at what the kernels recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Look {
    /// Before or after a launch on gin's stream, nothing queued unchecked:
    /// every refusal was dealt with where it was found (a waited dispatch,
    /// or `check`), so one here cannot be placed in a step.
    Waited,
    /// After a waited dispatch's kernel finished: a refusal ends the step
    /// here, on every rank alike (the combine's signals without data).
    AfterWaitedDispatch,
    /// After a waited combine's kernel finished (nothing queued
    /// unchecked): a refusal is this step's, an expert rank's refused
    /// combine (its combine signals poisoned), and the step is over on
    /// every rank; it is reported and cleared, and the buffer takes the
    /// next step. (Before, no combine was refused collectively: any
    /// refusal here failed the buffer, as at [`Look::Waited`].)
    AfterWaitedCombine,
    /// Before a launch queued on a caller's stream: the host cannot tell
    /// which queued step a refusal belongs to, and every peer goes on with
    /// its launches (its host does not know yet either), so the refusal is
    /// left for `check` and the launch goes ahead.
    Queued,
    /// `check`, after the caller synchronised the stream: a refusal
    /// recorded by a step queued since the last check is reported and
    /// cleared; the step under way (if any) is finished as usual.
    Check,
}

/// What the host does with a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Nothing to report (nothing recorded, or a refusal left for `check`).
    Go,
    /// A refusal found by a waited dispatch: end the step (the combine
    /// without data, as every rank does), clear the record, report it.
    EndStep,
    /// A broken protocol found by a waited dispatch beside a refusal (the
    /// other ranks are ending the refused step): end the step as
    /// [`Verdict::EndStep`] does, so that no peer waits for this rank's
    /// signals until the job timeout, then report the broken protocol; the
    /// buffer refuses further steps.
    EndStepThenFail,
    /// A refusal found by `check`, or by a waited combine (the step
    /// ended): clear the record and report it; the buffer stays where it
    /// is (idle, or holding the step's dispatch whose combine is next) and
    /// takes further steps.
    Report,
    /// Report it; the buffer refuses further steps.
    Fail,
}

impl Steps {
    pub(crate) fn new(rank: usize) -> Self {
        Self {
            rank,
            step: 0,
            phase: Phase::Idle,
            tokens: 0,
            queued: false,
            failed: false,
        }
    }

    /// Refused after a failure.
    pub(crate) fn usable(&self, call: &'static str) -> Result<(), EpError> {
        if self.failed {
            return Err(EpError::Mode {
                rank: self.rank,
                what: format!(
                    "{call}: an earlier kernel or step of this buffer failed; destroy it"
                ),
            });
        }
        Ok(())
    }

    /// Refused while queued launches are unchecked.
    pub(crate) fn unqueued(&self, call: &'static str) -> Result<(), EpError> {
        if self.queued {
            return Err(EpError::Phase {
                rank: self.rank,
                call,
                phase: QUEUED,
            });
        }
        Ok(())
    }

    /// Between steps.
    pub(crate) fn idle(&self, call: &'static str) -> Result<(), EpError> {
        self.usable(call)?;
        if self.phase == Phase::Idle {
            Ok(())
        } else {
            Err(EpError::Phase {
                rank: self.rank,
                call,
                phase: "holding a dispatch (combine next)",
            })
        }
    }

    /// Within step `step`, its combine not launched yet.
    pub(crate) fn dispatched(&self, call: &'static str, step: u64) -> Result<(), EpError> {
        self.usable(call)?;
        if self.phase != Phase::Dispatched {
            return Err(EpError::Phase {
                rank: self.rank,
                call,
                phase: "idle",
            });
        }
        self.latest(call, step)
    }

    /// `step` is the latest step (its combine may have been launched).
    fn latest(&self, call: &'static str, step: u64) -> Result<(), EpError> {
        self.usable(call)?;
        if step == 0 || step != self.step {
            return Err(EpError::StaleHandle {
                rank: self.rank,
                handle_step: step,
                step: self.step,
            });
        }
        Ok(())
    }

    /// `set_active`: between steps, nothing queued (the kernels read the
    /// mask the host rewrites).
    pub(crate) fn for_set_active(&self) -> Result<(), EpError> {
        self.idle("set_active")?;
        self.unqueued("set_active")
    }

    /// Reading the received tokens (this rank's receive window): only
    /// within the step, before its combine is launched. From then on a
    /// peer that received this rank's combine signal may finish its own
    /// combine and dispatch its next step into these slots.
    pub(crate) fn for_received(&self, call: &'static str, step: u64) -> Result<(), EpError> {
        self.dispatched(call, step)?;
        self.unqueued(call)
    }

    /// Reading the counts and metadata (this rank's own memory, rewritten
    /// only by its next dispatch): the latest step, after its combine too.
    pub(crate) fn for_read_back(&self, call: &'static str, step: u64) -> Result<(), EpError> {
        self.latest(call, step)?;
        self.unqueued(call)
    }

    /// `destroy`: nothing queued unchecked (the kernels may still use the
    /// buffer's memory; gin-core offers no event that would say they have
    /// finished).
    pub(crate) fn for_destroy(&self) -> Result<(), EpError> {
        self.unqueued("destroy")
    }

    /// A dispatch of `tokens` tokens is about to be launched: the step
    /// begins.
    pub(crate) fn begin(&mut self, tokens: usize) {
        self.step += 1;
        self.tokens = tokens;
    }

    /// How a launch went: a failure fails the buffer; a launch queued on a
    /// caller's stream is to be checked.
    pub(crate) fn launched(&mut self, queued: bool, ok: bool) {
        if !ok {
            self.failed = true;
        } else if queued {
            self.queued = true;
        }
    }

    /// The dispatch was launched.
    pub(crate) fn dispatched_now(&mut self) {
        self.phase = Phase::Dispatched;
    }

    /// The combine was launched: the step ends.
    pub(crate) fn combined(&mut self) {
        self.phase = Phase::Idle;
    }

    /// The queued launches were checked (the caller synchronised their
    /// stream), `ok` or not.
    pub(crate) fn checked(&mut self, ok: bool) {
        self.queued = false;
        if !ok {
            self.failed = true;
        }
    }

    /// A failure found outside a launch (a recorded error, a refused
    /// read-back).
    pub(crate) fn fail(&mut self) {
        self.failed = true;
    }

    /// A refused step (this rank's inputs, refused by the host's checks or
    /// on the GPU, or a source's) was ended as every rank ends it: its
    /// dispatch launched (poisoned, or receiving the poison), then the
    /// combine without data. The buffer is idle and the step's number
    /// spent: no handle names it, an earlier one is stale. `usable`: the
    /// combine without data ran (every rank's signals and counters
    /// advanced alike) and the buffer takes the next step, whatever its
    /// call was (host inputs, inputs in GPU memory); otherwise the step
    /// failed midway (a timeout, a lost peer: its late signals would be
    /// taken for the next step's) and the buffer refuses further steps.
    pub(crate) fn refused(&mut self, usable: bool) {
        self.phase = Phase::Idle;
        self.tokens = 0;
        if !usable {
            self.failed = true;
        }
    }

    /// What to do with what the kernels recorded, found where `look` says
    /// (see [`Verdict`]); a [`Verdict::Fail`] or
    /// [`Verdict::EndStepThenFail`] fails the buffer here. A refusal alone
    /// never fails it: a waited dispatch ends the step, a waited combine
    /// and `check` report it, a queued call leaves it for `check`. Seen anywhere else (a waited
    /// call, nothing queued unchecked) it cannot be placed in a step, and
    /// fails the buffer as a broken protocol does. A broken protocol always
    /// fails it, whatever was recorded before it; a waited dispatch that
    /// finds one beside a refusal first ends the refused step.
    pub(crate) fn judge(&mut self, rec: Recorded, look: Look) -> Verdict {
        let v = match (rec, look) {
            (Recorded::Nothing, _) | (Recorded::Refusal, Look::Queued) => Verdict::Go,
            (Recorded::Refusal, Look::AfterWaitedDispatch) => Verdict::EndStep,
            (Recorded::Refusal, Look::Check | Look::AfterWaitedCombine) => Verdict::Report,
            (Recorded::Broken { refused: true }, Look::AfterWaitedDispatch) => {
                Verdict::EndStepThenFail
            }
            (Recorded::Refusal, Look::Waited) | (Recorded::Broken { .. }, _) => Verdict::Fail,
        };
        if matches!(v, Verdict::Fail | Verdict::EndStepThenFail) {
            self.failed = true;
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::super::dev::Record;
    use super::*;

    fn phase_of(r: Result<(), EpError>) -> Option<&'static str> {
        match r {
            Err(EpError::Phase { phase, .. }) => Some(phase),
            _ => None,
        }
    }

    /// One queued step: dispatch, expert, combine on the caller's stream.
    fn queued_step(s: &mut Steps, tokens: usize) {
        s.idle("ll_dispatch_on").unwrap();
        s.begin(tokens);
        s.launched(true, true);
        s.dispatched_now();
        s.dispatched("ll_echo_on", s.step).unwrap();
        s.launched(true, true);
        s.dispatched("ll_combine_on", s.step).unwrap();
        s.launched(true, true);
        s.combined();
    }

    /// A call of one mode on a buffer sized for the other is refused,
    /// naming both; the mode's own calls pass.
    #[test]
    fn calls_of_the_other_mode_are_refused() {
        use crate::Mode::{HighThroughput, LowLatency};
        assert!(expect_mode(2, "ht_dispatch", HighThroughput, HighThroughput).is_ok());
        assert!(expect_mode(2, "ll_dispatch", LowLatency, LowLatency).is_ok());
        for (call, want, have) in [
            ("ht_dispatch", HighThroughput, LowLatency),
            ("ll_dispatch", LowLatency, HighThroughput),
        ] {
            match expect_mode(2, call, want, have) {
                Err(EpError::Mode { rank: 2, what }) => {
                    assert!(what.starts_with(call), "{what}");
                    assert!(
                        what.contains("low-latency") && what.contains("high-throughput"),
                        "{what}"
                    );
                }
                other => panic!("{call}: {other:?}"),
            }
        }
    }

    #[test]
    fn set_active_is_refused_while_launches_are_queued() {
        let mut s = Steps::new(1);
        s.for_set_active().unwrap();
        queued_step(&mut s, 4);
        assert_eq!(phase_of(s.for_set_active()), Some(QUEUED));
        s.checked(true);
        s.for_set_active().unwrap();
    }

    #[test]
    fn set_active_is_refused_within_a_step() {
        let mut s = Steps::new(0);
        s.begin(3);
        s.launched(false, true);
        s.dispatched_now();
        assert!(phase_of(s.for_set_active()).is_some_and(|p| p.contains("dispatch")));
    }

    /// Received tokens are readable only before the step's combine is
    /// launched (a peer's next dispatch may overwrite them after it);
    /// counts and metadata, this rank's own memory, until the next
    /// dispatch.
    #[test]
    fn received_tokens_are_readable_only_before_the_combine() {
        let mut s = Steps::new(0);
        s.begin(5);
        s.launched(false, true);
        s.dispatched_now();
        let step = s.step;
        s.for_received("ll_received", step).unwrap();
        s.for_read_back("ll_read_back", step).unwrap();
        s.launched(false, true);
        s.combined();
        assert_eq!(phase_of(s.for_received("ll_received", step)), Some("idle"));
        s.for_read_back("ll_read_back", step).unwrap();
        s.begin(5);
        assert!(matches!(
            s.for_read_back("ll_read_back", step),
            Err(EpError::StaleHandle {
                handle_step: 1,
                step: 2,
                ..
            })
        ));
    }

    #[test]
    fn received_tokens_of_queued_launches_wait_for_the_check() {
        let mut s = Steps::new(0);
        s.begin(2);
        s.launched(true, true);
        s.dispatched_now();
        let step = s.step;
        assert_eq!(phase_of(s.for_received("ll_received", step)), Some(QUEUED));
        assert_eq!(
            phase_of(s.for_read_back("ll_read_back", step)),
            Some(QUEUED)
        );
        s.checked(true);
        s.for_received("ll_received", step).unwrap();
    }

    #[test]
    fn destroy_is_refused_while_launches_are_queued() {
        let mut s = Steps::new(2);
        s.for_destroy().unwrap();
        queued_step(&mut s, 1);
        queued_step(&mut s, 1);
        assert_eq!(phase_of(s.for_destroy()), Some(QUEUED));
        s.checked(false);
        // A failed check still lets the buffer be destroyed.
        s.for_destroy().unwrap();
        assert!(s.idle("ll_dispatch_on").is_err());
    }

    /// Steps queued back to back advance the host's step count without a
    /// check between them; a handle of an earlier one is stale.
    #[test]
    fn queued_steps_chain_without_a_check() {
        let mut s = Steps::new(0);
        for i in 1..=5 {
            queued_step(&mut s, i);
            assert_eq!((s.step, s.tokens, s.queued), (i as u64, i, true));
        }
        s.begin(1);
        s.launched(true, true);
        s.dispatched_now();
        assert!(matches!(
            s.dispatched("ll_combine_on", 5),
            Err(EpError::StaleHandle {
                handle_step: 5,
                step: 6,
                ..
            })
        ));
    }

    /// A refused step from host inputs: the poisoned dispatch (0 tokens)
    /// and the combine without data, then the buffer takes the next step,
    /// whose number follows the refused one's; a handle of the step before
    /// the refusal is stale. A refused step whose end failed midway leaves
    /// the buffer refusing further steps, yet it can be destroyed.
    #[test]
    fn a_refused_step_ends_and_the_next_one_follows() {
        let mut s = Steps::new(1);
        s.begin(4);
        s.launched(false, true);
        s.dispatched_now();
        s.launched(false, true);
        s.combined();
        let before = s.step;
        // Refused: this rank's poisoned dispatch of 0 tokens.
        s.idle("ll_dispatch").unwrap();
        s.begin(0);
        s.launched(false, true);
        s.dispatched_now();
        s.launched(false, true);
        s.refused(true);
        assert_eq!(
            (s.step, s.phase, s.tokens, s.failed),
            (2, Phase::Idle, 0, false)
        );
        assert!(matches!(
            s.for_read_back("ll_read_back", before),
            Err(EpError::StaleHandle {
                handle_step: 1,
                step: 2,
                ..
            })
        ));
        s.idle("ll_dispatch").unwrap();
        s.begin(3);
        s.launched(false, true);
        s.dispatched_now();
        s.for_received("ll_received", 3).unwrap();
        s.launched(false, true);
        s.combined();
        // A peer's refusal found by this rank's dispatch (it had 3 tokens).
        s.begin(3);
        s.launched(false, true);
        s.dispatched_now();
        s.refused(true);
        assert_eq!((s.step, s.phase, s.tokens), (4, Phase::Idle, 0));
        s.idle("ll_dispatch").unwrap();
        // A refused step whose end failed midway (its combine without data
        // timed out): ended here, then refused.
        s.begin(2);
        s.launched(false, true);
        s.dispatched_now();
        s.refused(false);
        assert_eq!(s.phase, Phase::Idle);
        assert!(matches!(
            s.idle("ll_dispatch_device"),
            Err(EpError::Mode { rank: 1, .. })
        ));
        s.for_destroy().unwrap();
    }

    /// A record whose slot 0 word 0 is `w0`, and whose slot 1 holds it
    /// too where it is no refusal (as `ep::rec::record` leaves them).
    fn rec(w0: u64) -> Record {
        let mut r = Record::default();
        r.first[0] = w0;
        if w0 != 0 && !super::super::dev::is_refusal(w0) {
            r.broken[0] = w0;
        }
        r
    }

    /// Every (record, place) pair: a refusal never fails the buffer (a
    /// waited dispatch ends the step, `check` reports it, a queued call
    /// goes ahead), except where it cannot be placed in a step (a waited
    /// call with nothing queued); a broken protocol always fails it, and
    /// a waited dispatch that finds one beside a refusal ends the refused
    /// step first.
    #[test]
    fn a_recorded_refusal_never_fails_the_buffer_a_broken_protocol_does() {
        use super::super::dev::code;
        assert_eq!(Recorded::of(&rec(0)), Recorded::Nothing);
        assert_eq!(
            Recorded::of(&rec(code::PEER_BAD_INPUT | 3 << 8)),
            Recorded::Refusal
        );
        assert_eq!(Recorded::of(&rec(code::EXPERT_RANGE)), Recorded::Refusal);
        let broken = Recorded::Broken { refused: false };
        assert_eq!(Recorded::of(&rec(code::TOKEN_RANGE | 1 << 8)), broken);
        assert_eq!(Recorded::of(&rec(code::HT | 2 << 8)), broken);
        // Slot 0 alone holding a broken protocol (no slot 1) is broken too.
        let mut first_only = Record::default();
        first_only.first[0] = code::NOT_NAMED | 1 << 8;
        assert_eq!(Recorded::of(&first_only), broken);
        let looks = [
            Look::Waited,
            Look::AfterWaitedDispatch,
            Look::AfterWaitedCombine,
            Look::Queued,
            Look::Check,
        ];
        for look in looks {
            for (rec, want) in [
                (Recorded::Nothing, Verdict::Go),
                (
                    Recorded::Refusal,
                    match look {
                        Look::Waited => Verdict::Fail,
                        Look::AfterWaitedDispatch => Verdict::EndStep,
                        Look::Queued => Verdict::Go,
                        Look::Check | Look::AfterWaitedCombine => Verdict::Report,
                    },
                ),
                (broken, Verdict::Fail),
                (
                    Recorded::Broken { refused: true },
                    if look == Look::AfterWaitedDispatch {
                        Verdict::EndStepThenFail
                    } else {
                        Verdict::Fail
                    },
                ),
            ] {
                let mut s = Steps::new(2);
                assert_eq!(s.judge(rec, look), want, "{rec:?} at {look:?}");
                assert_eq!(
                    s.failed,
                    matches!(want, Verdict::Fail | Verdict::EndStepThenFail),
                    "{rec:?} at {look:?}"
                );
            }
        }
    }

    /// A combine refused collectively (an expert rank's expert outputs
    /// refused by its host): every rank's combine kernel ran to its end,
    /// so the step is over everywhere. A waited combine that finds the
    /// refusal reports it and the buffer takes the next step (before, the
    /// refusal at a waited call failed the buffer: no combine was refused
    /// collectively); the refusing rank's own combine (launched in its
    /// refusing form, its error the host's) leaves its buffer idle and
    /// usable; one whose launch failed (a wait timed out, a peer was
    /// lost) leaves it refusing steps; a queued one is reported by
    /// `check`, the steps queued after it going ahead.
    #[test]
    fn a_refused_combine_is_reported_and_the_next_step_follows() {
        let waited_step = |s: &mut Steps| {
            s.idle("ll_dispatch_device").unwrap();
            s.begin(4);
            s.launched(false, true);
            s.dispatched_now();
            assert_eq!(
                s.judge(Recorded::Nothing, Look::AfterWaitedDispatch),
                Verdict::Go
            );
            s.dispatched("ll_combine_device", s.step).unwrap();
            s.launched(false, true);
            s.combined();
        };
        // A peer of the refusing rank, waited.
        let mut s = Steps::new(0);
        waited_step(&mut s);
        assert_eq!(
            s.judge(Recorded::Refusal, Look::AfterWaitedCombine),
            Verdict::Report
        );
        assert_eq!((s.phase, s.failed), (Phase::Idle, false));
        waited_step(&mut s);
        assert_eq!(
            s.judge(Recorded::Nothing, Look::AfterWaitedCombine),
            Verdict::Go
        );
        assert_eq!((s.step, s.failed), (2, false));
        // A broken protocol found there fails the buffer, refusal or not.
        let mut s = Steps::new(0);
        waited_step(&mut s);
        assert_eq!(
            s.judge(Recorded::Broken { refused: true }, Look::AfterWaitedCombine),
            Verdict::Fail
        );
        assert!(s.idle("ll_dispatch_device").is_err());
        // The refusing rank: its combine launched and waited for, nothing
        // recorded (its kernel records no refusal of its own), its call's
        // error the host's; the next step follows.
        let mut s = Steps::new(1);
        waited_step(&mut s);
        assert_eq!(
            s.judge(Recorded::Nothing, Look::AfterWaitedCombine),
            Verdict::Go
        );
        waited_step(&mut s);
        assert!(!s.failed);
        // Its refusing combine failed midway: the buffer refuses steps.
        s.idle("ll_dispatch_device").unwrap();
        s.begin(4);
        s.launched(false, true);
        s.dispatched_now();
        s.launched(false, false);
        assert!(matches!(
            s.idle("ll_dispatch_device"),
            Err(EpError::Mode { rank: 1, .. })
        ));
        // Queued: the refused combine's step and the one after it queued,
        // the record found on the way (the calls go ahead), `check`
        // reports it, the buffer takes the next step.
        let mut s = Steps::new(2);
        queued_step(&mut s, 3);
        assert_eq!(s.judge(Recorded::Refusal, Look::Queued), Verdict::Go);
        queued_step(&mut s, 3);
        s.checked(true);
        assert_eq!(s.judge(Recorded::Refusal, Look::Check), Verdict::Report);
        assert_eq!((s.phase, s.queued, s.failed), (Phase::Idle, false, false));
        queued_step(&mut s, 3);
        assert_eq!(s.step, 3);
    }

    /// Three steps queued between two checks: step 1 refused at rank 2
    /// (this rank records `PeerRefused`, slot 0), then in step 2 rank 3's
    /// count above the maximum (what a late signal taken with the next
    /// step's looks like: slot 1, though slot 0 is taken). The calls
    /// queued meanwhile go ahead on the refusal alone, stop at the broken
    /// protocol, and `check` fails the buffer naming rank 3, rather than
    /// report the refusal, clear it and leave the buffer taking the
    /// following steps' counts. (Before the kernels kept slot 1, the
    /// count was dropped: slot 0 was taken, `check` reported the refusal
    /// and the buffer went on.)
    #[test]
    fn a_broken_protocol_after_a_queued_refusal_fails_the_buffer() {
        use super::super::dev::{code, decode_error};
        let cfg = crate::Config::low_latency(256, 16, 8, 4);
        let refused = [code::PEER_BAD_INPUT | 2 << 8, 5, (1 << 32) - 1, 0];
        let over = [code::COUNT_OVER_MAX | 3 << 8, 5, 40, 0];
        let both = Record {
            first: refused,
            broken: over,
        };
        let only_refused = Record {
            first: refused,
            ..Record::default()
        };
        // All three queued before the kernels recorded anything; check.
        let mut s = Steps::new(1);
        for _ in 0..3 {
            assert_eq!(
                s.judge(Recorded::of(&Record::default()), Look::Queued),
                Verdict::Go
            );
            queued_step(&mut s, 4);
        }
        s.checked(true);
        assert_eq!(s.judge(Recorded::of(&both), Look::Check), Verdict::Fail);
        assert!(s.idle("ll_dispatch_on").is_err());
        s.for_destroy().unwrap();
        // The host looks while the kernels record: step 2's calls go ahead
        // on step 1's refusal; a fourth step's dispatch finds the broken
        // protocol and is refused.
        let mut s = Steps::new(1);
        queued_step(&mut s, 4);
        queued_step(&mut s, 4);
        assert_eq!(
            s.judge(Recorded::of(&only_refused), Look::Queued),
            Verdict::Go
        );
        queued_step(&mut s, 4);
        assert_eq!(s.judge(Recorded::of(&both), Look::Queued), Verdict::Fail);
        assert!(s.idle("ll_dispatch_on").is_err());
        assert!(matches!(
            both.reported().and_then(|w| decode_error(1, &cfg, w)),
            Some(EpError::Protocol {
                rank: 1,
                peer: 3,
                ..
            })
        ));
    }

    /// A device-resident dispatch on gin's stream that finds a refusal
    /// (its own inputs, or a source's) ends the step and takes the next
    /// one, as from host inputs: the refused step's number is spent.
    #[test]
    fn a_waited_device_dispatch_outlives_a_refusal() {
        let mut s = Steps::new(0);
        for own in [true, false] {
            s.idle("ll_dispatch_device").unwrap();
            s.begin(6);
            s.launched(false, true);
            s.dispatched_now();
            let refused = s.step;
            assert_eq!(
                s.judge(Recorded::Refusal, Look::AfterWaitedDispatch),
                Verdict::EndStep,
                "own inputs: {own}"
            );
            // The combine without data (waited), then the record cleared.
            s.launched(false, true);
            s.combined();
            s.refused(true);
            assert_eq!((s.phase, s.tokens, s.failed), (Phase::Idle, 0, false));
            assert!(matches!(
                s.dispatched("ll_echo_device", refused),
                Err(EpError::Phase { phase: "idle", .. })
            ));
            // The next step runs as usual.
            assert_eq!(s.judge(Recorded::Nothing, Look::Waited), Verdict::Go);
            s.idle("ll_dispatch_device").unwrap();
            s.begin(6);
            s.launched(false, true);
            s.dispatched_now();
            assert_eq!(s.step, refused + 1);
            s.dispatched("ll_combine_device", refused + 1).unwrap();
            s.launched(false, true);
            s.combined();
        }
    }

    /// Steps queued back to back, one of them refused: every queued call
    /// goes ahead (the refusal is recorded while they are queued), `check`
    /// reports it and leaves the buffer usable; the next steps follow.
    #[test]
    fn a_queued_refusal_is_reported_by_check_and_steps_go_on() {
        let mut s = Steps::new(1);
        for i in 0..3 {
            // From the second step on, the refusal is recorded already.
            let rec = if i == 0 {
                Recorded::Nothing
            } else {
                Recorded::Refusal
            };
            assert_eq!(s.judge(rec, Look::Queued), Verdict::Go);
            queued_step(&mut s, 4);
            assert_eq!(s.judge(rec, Look::Queued), Verdict::Go);
        }
        assert_eq!(
            phase_of(s.idle("ll_dispatch").and(s.unqueued("ll_dispatch"))),
            Some(QUEUED)
        );
        s.checked(true);
        assert_eq!(s.judge(Recorded::Refusal, Look::Check), Verdict::Report);
        assert_eq!(
            (s.phase, s.queued, s.failed, s.step),
            (Phase::Idle, false, false, 3)
        );
        // The record was cleared: the next steps, queued or waited, go.
        queued_step(&mut s, 2);
        s.checked(true);
        assert_eq!(s.judge(Recorded::Nothing, Look::Check), Verdict::Go);
        s.idle("ll_dispatch").unwrap();
        s.unqueued("ll_dispatch").unwrap();
    }

    /// `check` between a queued dispatch and its combine reports the
    /// refusal and leaves the step under way: its combine is the only step
    /// call the buffer takes (every peer's combine waits for this rank's
    /// signals), then the next step.
    #[test]
    fn a_refusal_checked_mid_step_leaves_the_combine_to_queue() {
        let mut s = Steps::new(3);
        s.begin(5);
        s.launched(true, true);
        s.dispatched_now();
        let step = s.step;
        s.checked(true);
        assert_eq!(s.judge(Recorded::Refusal, Look::Check), Verdict::Report);
        assert_eq!(s.phase, Phase::Dispatched);
        assert!(phase_of(s.idle("ll_dispatch_on")).is_some_and(|p| p.contains("combine next")));
        s.for_read_back("ll_read_back", step).unwrap();
        assert_eq!(s.judge(Recorded::Nothing, Look::Queued), Verdict::Go);
        s.dispatched("ll_echo_on", step).unwrap();
        s.launched(true, true);
        s.dispatched("ll_combine_on", step).unwrap();
        s.launched(true, true);
        s.combined();
        s.checked(true);
        assert_eq!(s.judge(Recorded::Nothing, Look::Check), Verdict::Go);
        queued_step(&mut s, 5);
        assert_eq!((s.step, s.failed), (step + 1, false));
    }

    /// A queued refused step that fails midway (a wait timed out, a peer
    /// was lost: `check` finds gin's error) leaves the buffer refusing
    /// steps, as on CPU ranks: its late signals would be taken for the
    /// next step's. It can still be destroyed.
    #[test]
    fn a_queued_refused_step_that_fails_midway_breaks_the_buffer() {
        let mut s = Steps::new(1);
        assert_eq!(s.judge(Recorded::Refusal, Look::Queued), Verdict::Go);
        queued_step(&mut s, 3);
        s.checked(false);
        assert!(matches!(
            s.idle("ll_dispatch_on"),
            Err(EpError::Mode { rank: 1, .. })
        ));
        s.for_destroy().unwrap();
    }

    #[test]
    fn a_failed_launch_fails_every_later_call() {
        let mut s = Steps::new(3);
        s.begin(1);
        s.launched(true, false);
        assert!(!s.queued, "nothing was queued by a failed launch");
        assert!(matches!(
            s.idle("ll_dispatch_on"),
            Err(EpError::Mode { rank: 3, .. })
        ));
        assert!(s.dispatched("ll_combine_on", 1).is_err());
    }
}

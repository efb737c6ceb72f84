//! Screening: exploration judges each program of a round with a short
//! timing first ([`WorkerSettings::screen`]) and gives the full KernelBench
//! protocol only to those within a margin of the fastest screened program
//! of their problem so far (one rung of successive halving). The full
//! protocol decides every figure: a program screened out is
//! [`Status::Screened`], which no report counts.
//!
//! [`WorkerSettings::screen`]: mtmc_env::evaluator::WorkerSettings::screen

use mtmc_env::outcome::{Outcome, Status};

/// How a run screens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Screening {
    /// Timed calls of a screen.
    pub calls: u32,
    /// A screened program goes on to the full protocol when its time is at
    /// most `1 + margin` times the fastest screened one's.
    pub margin: f64,
}

impl Screening {
    /// Exploration's default: ten timed calls, within 10 % of the fastest.
    pub const DEFAULT: Screening = Screening {
        calls: 10,
        margin: 0.10,
    };
}

/// A screened program's time a call, where it passed the screen. Zero is
/// a time: a call shorter than the judge's call that does nothing reads 0
/// once that call's span is taken off.
fn screened_ms(o: &Outcome) -> Option<f64> {
    (o.status == Status::Correct && o.screen.is_some())
        .then(|| o.runtime.as_ref().map(|r| r.mean_ms))
        .flatten()
        .filter(|ms| ms.is_finite() && *ms >= 0.0)
}

/// Which of a round's screens go on to the full protocol: every one that
/// passed whose time is within `margin` of the fastest of `fastest` (the
/// problem's fastest screen before the round) and the round's own. Returns
/// the choice per screen and the problem's fastest screen after the round.
/// A screen that failed (a wrong value, an error) is its program's outcome
/// already.
pub fn promoted(
    screens: &[Outcome],
    fastest: Option<f64>,
    margin: f64,
) -> (Vec<bool>, Option<f64>) {
    let fastest = screens
        .iter()
        .filter_map(screened_ms)
        .chain(fastest)
        .reduce(f64::min);
    let chosen = screens
        .iter()
        .map(|o| screened_ms(o).is_some_and(|ms| fastest.is_some_and(|f| ms <= f * (1.0 + margin))))
        .collect();
    (chosen, fastest)
}

/// A screen that passed and was not promoted, as its program's outcome:
/// [`Status::Screened`], with its time and the fastest screen's in `why`.
pub fn screened_out(mut o: Outcome, fastest: f64, margin: f64) -> Outcome {
    if let Some(ms) = screened_ms(&o) {
        o.status = Status::Screened;
        o.why = Some(format!(
            "screened out: {ms:.4} ms a call over {} timed call(s), more than {:.2}x the fastest screened program of the problem ({fastest:.4} ms); not judged in full",
            o.screen.unwrap_or(0),
            1.0 + margin
        ));
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use mtmc_env::outcome::{EvaluatorKind, Timing};

    fn screen(status: Status, ms: f64) -> Outcome {
        let mut o = Outcome::new(EvaluatorKind::Worker, status);
        o.screen = Some(10);
        o.runtime = Some(Timing::constant(ms, 10, "judge"));
        o
    }

    #[test]
    fn the_fast_screens_go_on_and_the_slow_are_screened_out() {
        let round = [
            screen(Status::Correct, 2.0),
            screen(Status::Correct, 2.15),
            screen(Status::Correct, 2.3),
            screen(Status::Incorrect, 0.5),
        ];
        // The round's own fastest is the bar when the problem has none.
        let (chosen, fastest) = promoted(&round, None, 0.10);
        assert_eq!(chosen, [true, true, false, false]);
        assert_eq!(fastest, Some(2.0));
        // A faster screen before the round raises the bar.
        let (chosen, fastest) = promoted(&round, Some(1.5), 0.10);
        assert_eq!(chosen, [false, false, false, false]);
        assert_eq!(fastest, Some(1.5));
        // A wrong program is never promoted nor screened out: its screen's
        // verdict stands.
        let out = screened_out(round[3].clone(), 2.0, 0.10);
        assert_eq!(out.status, Status::Incorrect);
        let out = screened_out(round[2].clone(), 2.0, 0.10);
        assert_eq!(out.status, Status::Screened);
        assert!(
            out.why.as_deref().unwrap().contains("1.10x the fastest"),
            "{:?}",
            out.why
        );
        assert_eq!(out.speedup_vs("eager"), None);
    }

    #[test]
    fn a_full_outcome_or_an_untimed_screen_sets_no_bar() {
        let mut full = screen(Status::Correct, 1.0);
        full.screen = None;
        let mut untimed = screen(Status::Correct, 1.0);
        untimed.runtime = None;
        let (chosen, fastest) =
            promoted(&[full, untimed, screen(Status::Correct, 3.0)], None, 0.10);
        assert_eq!(chosen, [false, false, true]);
        assert_eq!(fastest, Some(3.0));
        // A screen at 0 ms (shorter than the call that does nothing) is
        // the fastest, and goes on.
        let (chosen, fastest) = promoted(
            &[screen(Status::Correct, 0.0), screen(Status::Correct, 3.0)],
            None,
            0.10,
        );
        assert_eq!(chosen, [true, false]);
        assert_eq!(fastest, Some(0.0));
    }
}

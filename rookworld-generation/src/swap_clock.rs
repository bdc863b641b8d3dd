//! What a weight swap costs the decode loop, measured by the engine thread: how long the
//! new weights waited to go into use, how many steps ran meanwhile with no work admitted
//! (under [`crate::SwapPolicy::Drain`]), and how long decoding stood still around the
//! swap itself, in seconds and in decode steps.
//!
//! ```text
//!   step k (old)        swap        step k+1 (new)
//! |=============|....[#####]....|===============|
//!               ^ pause from                     ^ pause to: the next step's start
//! ```
//!
//! The pause runs from the end of the last step on the old weights (or from the swap's
//! staging, when that came later: the loop's time before it was no swap's doing) to the
//! start of the first step on the new (or to the swap's end when no work waits); its unit
//! is the last step's duration before the swap.

use std::time::Instant;

/// One swap's cost to the decode loop.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SwapTiming {
    /// The weight version swapped in.
    pub version: u64,
    /// From the (first) staging of a swap — the call, so the step the engine was running
    /// then counts — to the new weights in use, seconds (under `Drain`, the sequences in
    /// flight finishing on the old weights).
    pub wait_seconds: f64,
    /// Steps run on the old weights meanwhile with no new work admitted (`Drain` only).
    pub held_steps: u32,
    /// Decoding stood still this long for the swap: from the end of the last step on the
    /// old weights (or the staging, if later) to the start of the first on the new.
    pub pause_seconds: f64,
    /// The last step on the old weights, seconds (0: no step ran before the swap).
    pub step_seconds: f64,
}

impl SwapTiming {
    /// The pause in decode steps, `pause_seconds / step_seconds` (0 when no step ran
    /// before the swap: nothing was decoding).
    pub fn pause_steps(&self) -> f64 {
        if self.step_seconds > 0.0 {
            self.pause_seconds / self.step_seconds
        } else {
            0.0
        }
    }
}

/// The engine thread's record of the swap under way, fed the loop's events in order.
#[derive(Debug, Default)]
pub struct SwapClock {
    /// When the swap waiting now was first staged, and the steps held since.
    staged: Option<(Instant, u32)>,
    /// The last step's end and duration.
    last_step: Option<(Instant, f64)>,
    /// A swap done whose pause ends with the next step's start.
    swapped: Option<(SwapTiming, Instant)>,
}

impl SwapClock {
    /// A swap was staged at `now`, when it was sent (a newer one replacing a staged one
    /// keeps the first's clock: the loop has been held since then).
    pub fn staged(&mut self, now: Instant) {
        self.staged.get_or_insert((now, 0));
    }

    /// The staged swap was withdrawn and nothing replaced it: no swap waits.
    pub fn cancel(&mut self) {
        self.staged = None;
    }

    /// A step ran from `start` to `end`, with work admitted or not (`held`: a swap
    /// waits). Returns the timing of a swap made before it, now complete.
    pub fn stepped(&mut self, start: Instant, end: Instant, held: bool) -> Option<SwapTiming> {
        let done = self.swapped.take().map(|(mut t, from)| {
            t.pause_seconds = start.saturating_duration_since(from).as_secs_f64();
            t
        });
        if held && let Some((_, steps)) = self.staged.as_mut() {
            *steps += 1;
        }
        self.last_step = Some((end, end.saturating_duration_since(start).as_secs_f64()));
        done
    }

    /// Version `version` went into use at `now`; its timing completes at the next step
    /// ([`Self::stepped`]) or, when no work waits, at [`Self::idle`].
    pub fn swapped(&mut self, version: u64, now: Instant) {
        let (since, held_steps) = self.staged.take().unwrap_or((now, 0));
        let (from, step_seconds) = self.last_step.unwrap_or((since, 0.0));
        let timing = SwapTiming {
            version,
            wait_seconds: now.saturating_duration_since(since).as_secs_f64(),
            held_steps,
            pause_seconds: 0.0,
            step_seconds,
        };
        // A pause runs from the last step on the old weights, or from the staging when
        // that step ended before it (the loop's time until then was no swap's doing).
        self.swapped = Some((timing, from.max(since)));
    }

    /// No work follows the swap at `now`: its pause ends here (the swap's own time).
    pub fn idle(&mut self, now: Instant) -> Option<SwapTiming> {
        self.last_step = None;
        self.swapped.take().map(|(mut t, from)| {
            t.pause_seconds = now.saturating_duration_since(from).as_secs_f64();
            t
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    /// Draining: staged during a step, two held steps, the swap between steps; the pause
    /// is the loop's time between the last old step and the first new one.
    #[test]
    fn a_drained_swap_counts_its_held_steps_and_the_gap_between_steps() {
        let t0 = Instant::now();
        let mut c = SwapClock::default();
        assert_eq!(c.stepped(at(t0, 0), at(t0, 10), false), None);
        c.staged(at(t0, 12));
        assert_eq!(c.stepped(at(t0, 13), at(t0, 23), true), None);
        c.staged(at(t0, 20)); // a newer version replaces the staged one
        assert_eq!(c.stepped(at(t0, 24), at(t0, 34), true), None);
        c.swapped(3, at(t0, 35));
        let t = c.stepped(at(t0, 36), at(t0, 46), false).expect("complete");
        assert_eq!((t.version, t.held_steps), (3, 2));
        assert!((t.wait_seconds - 0.023).abs() < 1e-9, "{t:?}");
        assert!((t.pause_seconds - 0.002).abs() < 1e-9, "{t:?}");
        assert!((t.step_seconds - 0.010).abs() < 1e-9, "{t:?}");
        assert!((t.pause_steps() - 0.2).abs() < 1e-9);
        // The next swap starts afresh.
        c.swapped(4, at(t0, 50));
        let t = c.stepped(at(t0, 51), at(t0, 60), false).unwrap();
        assert_eq!((t.held_steps, t.wait_seconds), (0, 0.0));
    }

    /// A swap at once (`Continue`, `Restart`) waits for no step; one into an idle loop
    /// pauses nothing that was decoding, and ends at the swap.
    #[test]
    fn a_swap_at_once_holds_no_step_and_an_idle_one_pauses_nothing() {
        let t0 = Instant::now();
        let mut c = SwapClock::default();
        c.stepped(at(t0, 0), at(t0, 8), false);
        c.staged(at(t0, 9));
        c.swapped(2, at(t0, 9));
        let t = c.stepped(at(t0, 11), at(t0, 19), false).unwrap();
        assert_eq!(t.held_steps, 0);
        // From the staging: the loop's millisecond before it was no swap's doing.
        assert!((t.pause_seconds - 0.002).abs() < 1e-9, "{t:?}");
        assert!((t.pause_steps() - 0.25).abs() < 1e-9);

        // Idle long before the swap: the pause runs from the staging, not the old step.
        c.idle(at(t0, 20));
        c.staged(at(t0, 500));
        c.swapped(3, at(t0, 501));
        let t = c.idle(at(t0, 501)).unwrap();
        assert!((t.pause_seconds - 0.001).abs() < 1e-9, "{t:?}");
        assert_eq!((t.step_seconds, t.pause_steps()), (0.0, 0.0));
    }
}

//! The stall watchdog: a run whose steps stop coming says why, and exits.
//!
//! The clock runs while the learner waits for scored groups, from when it is ready (and
//! again from the end of each step). From half of `--stall-timeout` on, one ERROR line a
//! minute gives the counts that explain a stall — workers and their pushes, groups dropped,
//! submissions refused, leases outstanding; once the timeout passes the run checkpoints
//! and exits non-zero. `learner_seconds_since_last_step` shows the same clock to
//! Prometheus (`deploy/prometheus/alerts.yml` fires on it).

use std::time::{Duration, Instant};

use crate::push::Fleet;
use crate::queue::Queue;

/// What the watchdog says at a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Steps are coming, or it is too early to say.
    Fine,
    /// No step for this long: report why (and go on waiting).
    Report(Duration),
    /// No step for this long, past the timeout: stop the run.
    Stalled(Duration),
}

/// The stall clock of one run.
#[derive(Debug)]
pub struct Watchdog {
    /// `None`: off (the gauge still runs).
    timeout: Option<Duration>,
    last_step: Instant,
    next_report: Instant,
}

impl Watchdog {
    /// A clock started at `now`; a zero `timeout` turns stopping (and reports) off.
    pub fn new(timeout: Duration, now: Instant) -> Self {
        let timeout = (!timeout.is_zero()).then_some(timeout);
        let mut w = Self {
            timeout,
            last_step: now,
            next_report: now,
        };
        w.stepped(now);
        w
    }

    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// A step completed at `now`: the clock starts again.
    pub fn stepped(&mut self, now: Instant) {
        self.last_step = now;
        self.next_report = now + self.timeout.map_or(Duration::MAX / 4, |t| t / 2);
        metrics::gauge!("learner_seconds_since_last_step").set(0.0);
    }

    /// Where the run stands at `now`: reports begin at half the timeout, one a minute
    /// (or one every half timeout, if that is shorter) until the timeout.
    pub fn check(&mut self, now: Instant) -> Verdict {
        let idle = now.saturating_duration_since(self.last_step);
        metrics::gauge!("learner_seconds_since_last_step").set(idle.as_secs_f64());
        let Some(timeout) = self.timeout else {
            return Verdict::Fine;
        };
        if idle >= timeout {
            Verdict::Stalled(idle)
        } else if now >= self.next_report {
            self.next_report = now + (timeout / 2).min(Duration::from_secs(60));
            Verdict::Report(idle)
        } else {
            Verdict::Fine
        }
    }
}

/// The counts that explain a stall, as one line.
pub fn diagnose(queue: &Queue, fleet: &Fleet, version: u64, needed: usize) -> String {
    let d = queue.depths();
    let c = d.counters;
    let workers = fleet.addresses();
    let current = workers
        .iter()
        .filter(|w| fleet.state(w, version) == Some(crate::push::SyncState::Current))
        .count();
    let mut parts = vec![format!(
        "{} workers registered, {current} on version {version}",
        workers.len()
    )];
    let failing = fleet.failing();
    if !failing.is_empty() {
        let list: Vec<String> = failing
            .iter()
            .map(|(w, n, e)| format!("{w} ({n} failed: {e})"))
            .collect();
        parts.push(format!("pushes failing: {}", list.join("; ")));
    }
    parts.push(format!(
        "groups ready {} of {needed}, dropped as stale {}",
        queue.ready(version),
        c.groups_dropped_stale
    ));
    parts.push(format!(
        "submissions refused {}, leases outstanding {} (issued {}, expired {})",
        c.submissions_refused, d.leased, c.leases_issued, c.leases_expired
    ));
    let hint = if c.leases_issued == 0 {
        "; no worker has leased a prompt: are workers running with --learner pointing at this queue?"
    } else if c.submissions_refused > 0 && c.groups_submitted == c.submissions_refused {
        "; every submission was refused: see the workers' log for the reason"
    } else if !failing.is_empty() {
        "; workers cannot take the new weights: check each worker's --advertise address and token"
    } else if c.groups_dropped_stale > 0 {
        "; groups arrive too many versions behind (--max-version-lag)"
    } else {
        ""
    };
    format!("{}{hint}", parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_begin_at_half_the_timeout_and_the_run_stops_at_it() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut w = Watchdog::new(s(300), t0);
        assert_eq!(w.check(t0 + s(100)), Verdict::Fine);
        assert_eq!(w.check(t0 + s(150)), Verdict::Report(s(150)));
        assert_eq!(w.check(t0 + s(160)), Verdict::Fine);
        assert_eq!(w.check(t0 + s(210)), Verdict::Report(s(210)));
        assert_eq!(w.check(t0 + s(300)), Verdict::Stalled(s(300)));
        // A step starts the clock again.
        w.stepped(t0 + s(301));
        assert_eq!(w.check(t0 + s(400)), Verdict::Fine);
        // Off: never a report, never a stop.
        let mut off = Watchdog::new(Duration::ZERO, t0);
        assert_eq!(off.check(t0 + s(100_000)), Verdict::Fine);
    }
}

//! The stall watchdog: a run whose steps stop coming says why, and exits.
//!
//! The clock runs while the learner waits for scored groups, from when it is ready (and
//! again from the end of each step). When a cause is known — a worker reported what keeps
//! it from delivering, or worker calls were refused ([`crate::queue::problems`]) — one ERROR
//! line names it once the wait passes [`CAUSE_AFTER`], then one a minute; otherwise from half
//! of `--stall-timeout` on, one a minute gives the counts that explain a stall — workers and
//! their pushes, groups dropped, submissions refused, leases outstanding. Once the timeout
//! passes the run checkpoints and exits non-zero. `learner_step_idle_seconds` shows the same clock to
//! Prometheus (`deploy/prometheus/alerts.yml` fires on it).

use std::time::{Duration, Instant};

use crate::metrics::names;
use crate::push::Fleet;
use crate::queue::Queue;

/// How long a wait with a known cause goes before the cause is named.
pub const CAUSE_AFTER: Duration = Duration::from_secs(10);
/// How often a known cause is named again.
const CAUSE_EVERY: Duration = Duration::from_secs(60);

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
    /// When a known cause may be named again.
    next_cause: Instant,
}

impl Watchdog {
    /// A clock started at `now`; a zero `timeout` turns stopping (and reports) off.
    pub fn new(timeout: Duration, now: Instant) -> Self {
        let timeout = (!timeout.is_zero()).then_some(timeout);
        let mut w = Self {
            timeout,
            last_step: now,
            next_report: now,
            next_cause: now,
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
        self.next_cause = now;
        self.next_report = now + self.timeout.map_or(Duration::MAX / 4, |t| t / 2);
        metrics::gauge!(names::STEP_IDLE_SECONDS).set(0.0);
    }

    /// Where the run stands at `now`: with a known cause (`cause_known`), a report once
    /// the wait passes [`CAUSE_AFTER`] and then one a minute; otherwise reports begin at half
    /// the timeout, one a minute (or one every half timeout, if that is shorter) until the
    /// timeout.
    pub fn check(&mut self, now: Instant, cause_known: bool) -> Verdict {
        let idle = now.saturating_duration_since(self.last_step);
        metrics::gauge!(names::STEP_IDLE_SECONDS).set(idle.as_secs_f64());
        if cause_known && idle >= CAUSE_AFTER && now >= self.next_cause {
            self.next_cause = now + CAUSE_EVERY;
            self.next_report = self.next_report.max(now + CAUSE_EVERY);
            return match self.timeout {
                Some(t) if idle >= t => Verdict::Stalled(idle),
                _ => Verdict::Report(idle),
            };
        }
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

/// What explains a stall, as one line: the known causes first, then the counts.
pub fn diagnose(queue: &Queue, fleet: &Fleet, version: u64, needed: usize, now: Instant) -> String {
    let causes = queue.causes(now);
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
    let hint = if !causes.is_empty() {
        ""
    } else if c.leases_issued == 0 {
        "; no worker has leased a prompt: are workers running with --learner pointing at this queue?"
    } else if c.submissions_refused > 0 && c.groups_submitted == c.submissions_refused {
        "; every submission was refused: see the workers' log for the reason"
    } else if !failing.is_empty() {
        "; workers refuse the new weights: `pushes failing` says why"
    } else if c.groups_dropped_stale > 0 {
        "; groups arrive too many versions behind (--max-version-lag)"
    } else {
        ""
    };
    if causes.is_empty() {
        format!("{}{hint}", parts.join(", "))
    } else {
        format!("{} [{}]", causes.join("; "), parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_begin_at_half_the_timeout_and_the_run_stops_at_it() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut w = Watchdog::new(s(300), t0);
        assert_eq!(w.check(t0 + s(100), false), Verdict::Fine);
        assert_eq!(w.check(t0 + s(150), false), Verdict::Report(s(150)));
        assert_eq!(w.check(t0 + s(160), false), Verdict::Fine);
        assert_eq!(w.check(t0 + s(210), false), Verdict::Report(s(210)));
        assert_eq!(w.check(t0 + s(300), false), Verdict::Stalled(s(300)));
        // A step starts the clock again.
        w.stepped(t0 + s(301));
        assert_eq!(w.check(t0 + s(400), false), Verdict::Fine);
        // Off: never a report, never a stop.
        let mut off = Watchdog::new(Duration::ZERO, t0);
        assert_eq!(off.check(t0 + s(100_000), false), Verdict::Fine);
    }

    #[test]
    fn a_known_cause_is_named_after_ten_seconds_then_once_a_minute() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut w = Watchdog::new(s(300), t0);
        assert_eq!(w.check(t0 + s(5), true), Verdict::Fine);
        assert_eq!(w.check(t0 + s(10), true), Verdict::Report(s(10)));
        assert_eq!(w.check(t0 + s(30), true), Verdict::Fine);
        assert_eq!(w.check(t0 + s(70), true), Verdict::Report(s(70)));
        assert_eq!(w.check(t0 + s(100), true), Verdict::Fine);
        assert_eq!(w.check(t0 + s(130), true), Verdict::Report(s(130)));
        // The half-timeout count report does not follow on the heels of a cause.
        assert_eq!(w.check(t0 + s(150), false), Verdict::Fine);
        // Even with stopping off, a known cause is named.
        let mut off = Watchdog::new(Duration::ZERO, t0);
        assert_eq!(off.check(t0 + s(12), true), Verdict::Report(s(12)));
        assert_eq!(off.check(t0 + s(100_000), false), Verdict::Fine);
    }
}

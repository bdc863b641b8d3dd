//! Weight sync: the learner keeps every registered worker on its newest published weights.
//!
//! The trainer publishes a BF16 [`WeightSet`] (converted once); [`run`] pushes it to every
//! worker not known to run it. Each worker gets its own push with its own deadline, so a
//! slow or dead worker holds up nobody — neither the learner nor the other workers. A
//! failed push is retried with exponential back-off; a worker that newly advertises its
//! address, or reports in its leases a version other than the one pushed to it (it
//! restarted), is synced at once, without waiting for the next step; a worker the queue has
//! not heard from for a while is forgotten. Every change of a worker's sync state is a log
//! line, and the states show in `learner_workers{state}` and
//! `learner_workers_oldest_weight_version` (each worker's own version is its
//! `rollout_weight_version`, and in `ListWorkers`).
//!
//! A set written to the shared directory (the same-host path, [`rookworld_weights::export`]) is
//! offered to each worker by its file name first: one header, no body. A worker that
//! cannot read it (another host, no `--shared-dir`) answers FAILED_PRECONDITION; it is
//! streamed that push and every later one.
//!
//! A worker known to run the version before the newest is streamed only what changed
//! since ([`delta`]); one that cannot apply it is streamed the payload in the same push.
//! The bytes each kind of push sent are counted for the step log ([`Fleet::take_pushed`]).
//!
//! With a fan-out (`learner train --push-fanout`), streamed workers relay: the learner
//! streams each version to a few of them, and each forwards the chunks to its children
//! while it receives them ([`Fleet::plan`]), so the learner's egress per version does not
//! grow with the workers. A relay answers with how every worker below it fared; a worker
//! below a relay that failed or stalled is served again at once — below another relay,
//! or from the learner — while the relay waits out its back-off and then takes its
//! pushes alone. `ListWorkers` names each worker's parent, and each change is a log line.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rookworld_weights::relay::{self, Route};
use rookworld_weights::set::WeightSet;
use tokio::sync::{mpsc, watch};

use crate::checkpoint::CheckpointError;
use crate::queue::QueueHandle;

mod delta;
mod one;
mod outcome;
use crate::metrics::names;
use delta::Deltas;
pub use delta::{DeltaOffer, DeltaPolicy, Link};
use one::note_reachability;
pub use one::{Via, push_over, push_to, worker_answers};
pub use outcome::{Blocked, LearnerModel, PushBytes, PushOutcome};

/// Publishes `model`'s weights as `version` of run `run_id`: recorded in `run_dir` first
/// (so a crash never reuses the number), converted to BF16 once, handed to the weight sync
/// through `latest`.
pub fn publish(
    run_dir: &std::path::Path,
    model: &rookworld_lm::Gpt2,
    run_id: &str,
    version: u64,
    latest: &watch::Sender<Option<Arc<WeightSet>>>,
) -> Result<(), CheckpointError> {
    crate::checkpoint::record_published(run_dir, version)?;
    let set = WeightSet::from_model(model, run_id, version)?;
    latest.send_replace(Some(Arc::new(set)));
    Ok(())
}

/// A worker's weight sync, as the metrics and the log show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SyncState {
    /// Runs the newest published version.
    Current,
    /// Not known to run it; a push starts at the next chance.
    Stale,
    /// A push is under way.
    Pushing,
    /// The last push failed; retried after a back-off.
    Failing,
}

impl SyncState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Current => "current",
            Self::Stale => "stale",
            Self::Pushing => "pushing",
            Self::Failing => "failing",
        }
    }
}

/// What the learner knows of one worker.
#[derive(Debug, Clone)]
struct Member {
    /// Version known to be in use there (`None`: unknown, or stale).
    known: Option<u64>,
    pushing: bool,
    /// Failed pushes in a row.
    failures: u32,
    /// No push before this (back-off after a failure).
    retry_at: Option<Instant>,
    /// When a push last reached it (reports older than this are out of date).
    synced_at: Option<Instant>,
    /// When a report after that first named another version than the one pushed.
    mismatch_at: Option<Instant>,
    /// Why the last push failed (kept until one succeeds).
    last_error: Option<String>,
    /// Whether the same-host path is tried (until the worker says it cannot read it).
    shared: bool,
    /// What its pushes measured: whether a delta reaches it sooner than the payload.
    link: Link,
    /// The version whose payload it holds, streamed to it (whole, as a delta, relayed):
    /// what it can send to workers that join.
    holds: Option<u64>,
    /// Relayed pushes in a row that did not bring it the version (its relay failed, or
    /// its own push from the relay did): at two it takes its pushes alone, from the
    /// learner, which then sees the cause itself.
    missed: u32,
}

/// The workers the learner pushes to, and the version each is known to run.
#[derive(Debug, Default)]
pub struct Fleet {
    members: BTreeMap<String, Member>,
    /// Longest wait between retries of a failing worker.
    max_backoff: Duration,
    /// The newest set, the one before it (while a worker is streamed) and their delta.
    deltas: Deltas,
    /// Bytes sent since the last [`Fleet::take_pushed`].
    pushed: PushBytes,
    /// When a push sends a delta.
    delta_policy: DeltaPolicy,
    /// Workers each sender (the learner, a relay) streams to; 0: the learner streams to
    /// each worker itself.
    fanout: u32,
    /// Whether the newest set has a same-host file.
    shared_file: bool,
    /// Pushes ask each worker to answer once the version is staged, not in use.
    answer_when_staged: bool,
    /// The newest set's version.
    newest: u64,
}

impl Fleet {
    /// An empty fleet whose failing workers are retried at most `max_backoff` apart.
    pub fn new(max_backoff: Duration) -> Self {
        Self {
            members: BTreeMap::new(),
            max_backoff,
            ..Self::default()
        }
    }

    /// Sends deltas as `policy` says (by default `auto`).
    pub fn with_deltas(mut self, policy: DeltaPolicy) -> Self {
        self.delta_policy = policy;
        self
    }

    /// Relays streamed pushes through the workers, `fanout` children per sender (the
    /// learner too); 0 streams to each worker from the learner.
    pub fn with_fanout(mut self, fanout: u32) -> Self {
        self.fanout = fanout;
        self
    }

    /// Asks every worker to answer a push once the version is staged with its engine
    /// (received, checked, built; in use at its next step boundary, or after the drain),
    /// so that a push's time is the delivery's, not the engine's wait.
    pub fn answering_when_staged(mut self) -> Self {
        self.answer_when_staged = true;
        self
    }

    /// Takes `set` as the newest to push; the set it replaces is kept as the base of
    /// deltas while some worker is streamed (no shared file, or a worker that cannot read
    /// it).
    pub fn advance(&mut self, set: &Arc<WeightSet>) {
        self.shared_file = set.shared_file.is_some();
        self.newest = set.version;
        let streamed = set.shared_file.is_none() || self.members.values().any(|m| !m.shared);
        let streamed = streamed && self.delta_policy != DeltaPolicy::Never;
        self.deltas.advance(set, streamed);
    }

    /// How a push of the newest set to `address` goes: the same-host file first or not, a
    /// delta against the version it runs where one is kept, and its link as measured.
    pub fn via(&self, address: &str) -> Via {
        let m = self.members.get(address);
        Via {
            shared: m.is_some_and(|m| m.shared),
            delta: m.and_then(|m| self.deltas.offer(m.known)),
            link: m.map(|m| m.link).unwrap_or_default(),
            policy: self.delta_policy,
            route: Route {
                answer_when_staged: self.answer_when_staged,
                ..Route::default()
            },
            peer: false,
        }
    }

    /// The pushes that bring the workers `due` (from [`Fleet::due`]) the newest set: with a
    /// fan-out, the streamed workers as trees of relays ([`rookworld_weights::relay`]) —
    /// one per kind of push (a delta against one base, or the payload), the learner
    /// calling `fanout` roots of each — and alone the workers on the same-host path and
    /// those whose last push failed (the learner sees their cause itself). Workers that
    /// join (new, or restarted: no version known) are sent the payload by a peer that
    /// holds it ([`Via::peer`]) where one does, so that the learner's link carries nothing
    /// for them; that peer is busy (marked as pushing) until it has.
    pub fn plan(&mut self, mut due: Vec<String>) -> Vec<(String, Via)> {
        let mut out = Vec::new();
        // Workers whose relayed pushes failed last time go last: leaves, not relays.
        due.sort_by_key(|a| (self.members.get(a).map_or(0, |m| m.missed), a.clone()));
        let mut trees: BTreeMap<Option<u64>, Vec<String>> = BTreeMap::new();
        let mut joiners = Vec::new();
        for address in due {
            let Some(m) = self.members.get(&address) else {
                continue;
            };
            let alone = self.fanout == 0
                || (m.shared && self.shared_file)
                || m.failures > 0
                || m.missed >= 2;
            if alone {
                let via = self.via(&address);
                out.push((address, via));
            } else if m.known.is_none() {
                joiners.push(address);
            } else {
                let base = self.deltas.offer(m.known).map(|o| o.base_version());
                trees.entry(base).or_default().push(address);
            }
        }
        if !joiners.is_empty() {
            let newest = self.newest;
            let peer = self.members.iter_mut().find(|(_, m)| {
                m.known == Some(newest) && m.holds == Some(newest) && !m.pushing && m.failures == 0
            });
            match peer {
                Some((peer, m)) => {
                    m.pushing = true;
                    let via = Via {
                        peer: true,
                        route: Route {
                            relay_to: joiners,
                            fanout: self.fanout,
                            ..Route::default()
                        },
                        ..Via::default()
                    };
                    out.push((peer.clone(), via));
                }
                None => trees.entry(None).or_default().extend(joiners),
            }
        }
        for workers in trees.into_values() {
            for (root, relay_to) in relay::tree(&workers, self.fanout as usize) {
                let mut via = self.via(&root);
                via.route = Route {
                    relay_to,
                    fanout: self.fanout,
                    deadline: None,
                    answer_when_staged: self.answer_when_staged,
                };
                out.push((root, via));
            }
        }
        out
    }

    /// Bytes the pushes sent since the last call, by kind.
    pub fn take_pushed(&mut self) -> PushBytes {
        std::mem::take(&mut self.pushed)
    }

    /// Adds a worker (idempotent); it is stale until a push reaches it.
    pub fn register(&mut self, address: &str) {
        if !self.members.contains_key(address) {
            tracing::info!(worker = %address, "worker registered for weight pushes");
            self.members.insert(
                address.to_owned(),
                Member {
                    known: None,
                    pushing: false,
                    failures: 0,
                    retry_at: None,
                    synced_at: None,
                    mismatch_at: None,
                    last_error: None,
                    shared: true,
                    link: Link::default(),
                    holds: None,
                    missed: 0,
                },
            );
        }
    }

    /// Records that `address` runs `version` (e.g. it started with those weights).
    pub fn mark(&mut self, address: &str, version: u64, now: Instant) {
        self.register(address);
        let m = self.members.get_mut(address).expect("registered");
        m.known = Some(version);
        m.synced_at = Some(now);
        m.mismatch_at = None;
    }

    /// The worker's own word, from a lease the queue took at `at`: it runs `version`. A
    /// report of `newest`, the version being published, makes it current without a push.
    /// Two reports after the last push that reached it, both naming another version than
    /// the pushed one, mean it restarted (or swapped weights some other way): it is stale
    /// from then on. (One such report is not enough: a lease sent just before a push
    /// landed can arrive just after it.)
    pub fn reported(&mut self, address: &str, version: u64, at: Instant, newest: u64) {
        let Some(m) = self.members.get_mut(address) else {
            return;
        };
        if m.pushing || m.synced_at.is_some_and(|t| at <= t) {
            return;
        }
        if version == newest && m.known != Some(newest) {
            m.known = Some(newest);
            m.failures = 0;
            m.retry_at = None;
            m.mismatch_at = None;
        } else if m.known.is_some_and(|k| k != version) {
            match m.mismatch_at {
                Some(first) if at > first => {
                    tracing::warn!(worker = %address, reports = version, pushed = ?m.known, "worker runs other weights than were pushed to it (restarted?); re-syncing");
                    m.known = None;
                    m.holds = None;
                    m.mismatch_at = None;
                }
                Some(_) => {}
                None => m.mismatch_at = Some(at),
            }
        } else {
            m.mismatch_at = None;
        }
    }

    /// Stops pushing to `address` (it left).
    pub fn forget(&mut self, address: &str) {
        if self.members.remove(address).is_some() {
            tracing::info!(worker = %address, "worker forgotten: not heard from; no more pushes");
        }
    }

    /// Every worker's address.
    pub fn addresses(&self) -> Vec<String> {
        self.members.keys().cloned().collect()
    }

    /// Workers whose last push failed: address, failures in a row, the last error.
    pub fn failing(&self) -> Vec<(String, u32, String)> {
        self.members
            .iter()
            .filter(|(_, m)| m.failures > 0)
            .map(|(a, m)| {
                let error = m.last_error.clone().unwrap_or_default();
                (a.clone(), m.failures, error)
            })
            .collect()
    }

    /// Workers not known to run `version`.
    pub fn stale(&self, version: u64) -> Vec<String> {
        self.members
            .iter()
            .filter(|(_, m)| m.known != Some(version))
            .map(|(a, _)| a.clone())
            .collect()
    }

    /// Where `address` stands against `version`.
    pub fn state(&self, address: &str, version: u64) -> Option<SyncState> {
        let m = self.members.get(address)?;
        Some(if m.pushing {
            SyncState::Pushing
        } else if m.known == Some(version) {
            SyncState::Current
        } else if m.failures > 0 {
            SyncState::Failing
        } else {
            SyncState::Stale
        })
    }

    /// Workers to push `version` to now (not on it, no push under way, back-off over);
    /// they are marked as being pushed to.
    pub fn due(&mut self, version: u64, now: Instant) -> Vec<String> {
        let mut out = Vec::new();
        for (address, m) in &mut self.members {
            let waiting = m.retry_at.is_some_and(|t| now < t);
            if m.known != Some(version) && !m.pushing && !waiting {
                m.pushing = true;
                out.push(address.clone());
            }
        }
        out
    }

    /// Whether a push to `address` tries the same-host path first.
    pub fn shared(&self, address: &str) -> bool {
        self.members.get(address).is_some_and(|m| m.shared)
    }

    /// Records the outcome of a push started by [`Fleet::due`], and of every push it
    /// relayed.
    pub fn finish(&mut self, outcome: &PushOutcome, now: Instant) {
        self.finish_one(outcome, now);
        for relayed in &outcome.relayed {
            self.finish_one(relayed, now);
        }
    }

    fn finish_one(&mut self, outcome: &PushOutcome, now: Instant) {
        if outcome.path == "peer" {
            // A peer that sent joining workers the payload: free again; one that could
            // not is not asked again until a push gives it a payload.
            if let Some(m) = self.members.get_mut(&outcome.worker) {
                m.pushing = false;
                if outcome.error.is_some() {
                    m.holds = None;
                }
            }
            return;
        }
        self.pushed.add(outcome);
        let Some(m) = self.members.get_mut(&outcome.worker) else {
            return; // forgotten meanwhile
        };
        m.pushing = false;
        if outcome.parent.is_some() && outcome.error.is_some() {
            // A relayed push that did not reach it (a relay above failed), or that failed
            // there: no failure with a back-off (its relay may be the cause), so it is due
            // again at once — a leaf at the end of the next tree after a failure of its
            // own, alone after two in a row. One that lacks the delta's base is sent the
            // payload, as a worker that joins.
            if !outcome.unreached {
                m.missed += 1;
            }
            let error = outcome.error.as_deref().unwrap_or_default();
            if error.contains("delta base unusable") {
                (m.known, m.holds) = (None, None);
            }
            return;
        }
        if outcome.shared_refused {
            m.shared = false;
        }
        match outcome.error {
            None => {
                let (o, link) = (outcome, &mut m.link);
                if o.parent.is_none() {
                    // The learner's own link to it (a relayed push timed a relay's).
                    link.measured(o.path, o.bytes, o.receive_seconds, o.verify_seconds);
                }
                m.holds = matches!(o.path, "stream" | "delta").then_some(o.version);
                m.missed = 0;
                m.known = Some(outcome.version);
                m.failures = 0;
                m.retry_at = None;
                m.synced_at = Some(now);
                m.mismatch_at = None;
                m.last_error = None;
            }
            Some(ref error) => {
                m.last_error = Some(error.clone());
                m.known = None;
                m.holds = None;
                m.failures += 1;
                let backoff = Duration::from_millis(500)
                    .saturating_mul(1 << m.failures.min(16))
                    .min(self.max_backoff.max(Duration::from_millis(500)));
                m.retry_at = Some(now + backoff);
            }
        }
    }

    /// Pushes `set` to every worker due now, all at once (through relays with a fan-out),
    /// each bounded by `deadline`, and waits for them; returns one outcome per push the
    /// learner made (a relay's lists the workers below it).
    pub async fn push(
        &mut self,
        set: &WeightSet,
        token: &str,
        deadline: Duration,
    ) -> Vec<PushOutcome> {
        self.advance(&Arc::new(set.clone()));
        let tls = rookworld_service::tls::ClientTlsArgs::default();
        let due = self.due(set.version, Instant::now());
        let calls: Vec<_> = self
            .plan(due)
            .into_iter()
            .map(|(address, via)| {
                let (set, token, tls) = (set.clone(), token.to_owned(), tls.clone());
                tokio::spawn(
                    async move { push_over(address, set, token, deadline, via, &tls).await },
                )
            })
            .collect();
        let mut outcomes = Vec::with_capacity(calls.len());
        for call in calls {
            let outcome = call.await.expect("push task panicked");
            self.finish(&outcome, Instant::now());
            outcomes.push(outcome);
        }
        outcomes
    }

    /// Publishes how many workers are in each state, and each one's known version.
    fn publish_metrics(&self, version: u64) {
        let mut counts: BTreeMap<SyncState, u64> = BTreeMap::new();
        let mut oldest: Option<f64> = None;
        for (address, m) in &self.members {
            let state = self.state(address, version).expect("a member");
            *counts.entry(state).or_default() += 1;
            let known = m.known.map_or(-1.0, |v| v as f64);
            oldest = Some(oldest.map_or(known, |o| o.min(known)));
        }
        metrics::gauge!(names::WORKERS_OLDEST_WEIGHT_VERSION).set(oldest.unwrap_or(-1.0));
        for state in [
            SyncState::Current,
            SyncState::Stale,
            SyncState::Pushing,
            SyncState::Failing,
        ] {
            let n = counts.get(&state).copied().unwrap_or(0);
            metrics::gauge!(names::WORKERS, "state" => state.as_str()).set(n as f64);
        }
    }
}

/// How the sync loop works.
#[derive(Debug, Clone)]
pub struct SyncConfig {
    /// Deadline of one push to one worker.
    pub deadline: Duration,
    /// A worker the queue has not heard from for this long is forgotten.
    pub forget_after: Duration,
    /// How often the loop looks at the queue's workers.
    pub tick: Duration,
    /// TLS towards `https://` workers.
    pub tls: rookworld_service::tls::ClientTlsArgs,
    /// This learner's model (named when a worker serves another).
    pub model: LearnerModel,
}

/// How long a stopping sync waits for pushes under way (a push cut off leaves the worker
/// on its old weights, which is all a stopped learner's workers need).
pub const STOP_GRACE: Duration = Duration::from_secs(3);

/// Keeps every worker the queue knows on the newest set `latest` holds, until `stop`
/// resolves; then waits (up to the push deadline, at most [`STOP_GRACE`]) for pushes under
/// way.
pub async fn run(
    queue: QueueHandle,
    fleet: Arc<Mutex<Fleet>>,
    mut latest: watch::Receiver<Option<Arc<WeightSet>>>,
    token: String,
    cfg: SyncConfig,
    stop: impl std::future::Future<Output = ()>,
) {
    let lock_fleet = || {
        fleet
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<PushOutcome>();
    let mut in_flight = 0usize;
    let mut tick = tokio::time::interval(cfg.tick);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = tick.tick() => {}
            changed = latest.changed() => if changed.is_err() { break },
            Some(outcome) = done_rx.recv() => {
                in_flight -= 1;
                lock_fleet().finish(&outcome, Instant::now());
                note_reachability(&queue, outcome, &cfg.model).await;
            }
        }
        let Some(set) = latest.borrow().clone() else {
            continue;
        };
        let now = Instant::now();
        let workers = advertised(&queue, cfg.forget_after, now).await;
        let due = {
            let mut fleet = lock_fleet();
            observe(&workers, &mut fleet, set.version);
            fleet.advance(&set);
            let due = fleet.due(set.version, now);
            fleet.publish_metrics(set.version);
            fleet.plan(due)
        };
        for (address, via) in due {
            in_flight += 1;
            let (set, token, done) = (set.clone(), token.clone(), done_tx.clone());
            let (deadline, tls) = (cfg.deadline, cfg.tls.clone());
            tokio::spawn(async move {
                let outcome = push_over(address, (*set).clone(), token, deadline, via, &tls).await;
                let _ = done.send(outcome);
            });
        }
    }
    // Pushes under way get their deadline, within the stop's grace.
    let _ = tokio::time::timeout(cfg.deadline.min(STOP_GRACE), async {
        while in_flight > 0 {
            match done_rx.recv().await {
                Some(outcome) => {
                    in_flight -= 1;
                    lock_fleet().finish(&outcome, Instant::now());
                    note_reachability(&queue, outcome, &cfg.model).await;
                }
                None => break,
            }
        }
    })
    .await;
}

/// A worker the queue heard from: its push address and the version it reports, when.
struct Advertised {
    address: String,
    reported: Option<(u64, Instant)>,
}

/// The queue's workers with a push address, seen within `forget_after`.
async fn advertised(queue: &QueueHandle, forget_after: Duration, now: Instant) -> Vec<Advertised> {
    queue
        .run(move |q| {
            q.workers()
                .values()
                .filter(|w| {
                    !w.push_address.is_empty()
                        && w.last_seen
                            .is_some_and(|t| now.saturating_duration_since(t) < forget_after)
                })
                .map(|w| Advertised {
                    address: w.push_address.clone(),
                    reported: w.reported_version.zip(w.reported_at),
                })
                .collect()
        })
        .await
}

/// Brings `fleet` in line with the queue's `workers`: registers advertised addresses,
/// takes the versions workers report, forgets addresses no worker has used lately.
fn observe(workers: &[Advertised], fleet: &mut Fleet, newest: u64) {
    let mut live = std::collections::BTreeSet::new();
    for w in workers {
        fleet.register(&w.address);
        if let Some((version, at)) = w.reported {
            fleet.reported(&w.address, version, at, newest);
        }
        live.insert(w.address.clone());
    }
    for address in fleet.addresses() {
        if !live.contains(&address) {
            fleet.forget(&address);
        }
    }
}

#[cfg(test)]
mod tests;

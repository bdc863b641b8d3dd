//! The engine thread: owns the [`Scheduler`], takes requests and weight swaps from async
//! callers, streams each request's finished samples back, and exports metrics.
//!
//! Commands are handled between steps, so a swap always lands between two decode steps.
//! With [`SwapPolicy::Drain`] the engine stops admitting work once a swap is staged,
//! finishes the sequences in flight on the old weights, then swaps; with
//! [`SwapPolicy::Restart`] it swaps at once and restarts the sequences in flight; with
//! [`SwapPolicy::Continue`] it swaps at once and the sequences in flight go on under the
//! new weights, each token tagged with the version that sampled it.

use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rookworld_lm::Gpt2;
use tokio::sync::{mpsc, oneshot};

use super::{EngineConfig, EngineError, Event, Request, RequestId, Scheduler, SwapPolicy};
use crate::metrics;
use crate::swap_clock::{SwapClock, SwapTiming};

enum Command {
    Submit {
        request: Request,
        events: mpsc::UnboundedSender<Event>,
        reply: oneshot::Sender<Result<RequestId, EngineError>>,
    },
    Cancel(RequestId),
    Swap(Staged),
    /// Hands the staged version back for a newer one ([`Engine::reclaim`]).
    Reclaim(u64),
    /// The newer version will not come: the engine goes on as before the reclaim.
    Release(u64),
    Shutdown,
}

/// A snapshot of the engine, refreshed every step.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineStatus {
    pub weight_version: u64,
    /// The training run the weights in use belong to (empty: the weights it started with).
    pub weight_run: String,
    pub live_rows: usize,
    /// Row limit in force (below `max_seqs` after an out-of-memory error).
    pub row_limit: usize,
    pub max_seqs: usize,
    pub pending_requests: usize,
    pub pending_samples: usize,
    pub reserved_kv_tokens: usize,
    pub max_kv_tokens: usize,
    pub tokens_generated: u64,
    /// New tokens per second over the last few seconds of work.
    pub tokens_per_second: f64,
    /// A weight swap is waiting for the sequences in flight.
    pub swap_pending: bool,
    /// The version (and its run) handed to the engine and not yet in use: set the moment
    /// [`Engine::stage`] returns, cleared when it goes into use or a newer one replaces it.
    pub staged: Option<(u64, String)>,
    /// What the last weight swap cost the decode loop (`None`: none yet).
    pub last_swap: Option<SwapTiming>,
    pub device: String,
    pub dtype: String,
}

impl EngineStatus {
    /// Version `version` is no longer staged (it went into use, or was taken back).
    fn unstage(&mut self, version: u64) {
        if self.staged.as_ref().is_some_and(|(v, _)| *v == version) {
            self.staged = None;
        }
    }

    /// The newest version the engine holds and its run: the staged one, else the one in
    /// use.
    pub fn held(&self) -> (u64, &str) {
        match &self.staged {
            Some((version, run)) => (*version, run),
            None => (self.weight_version, &self.weight_run),
        }
    }
}

/// The finished samples of one request, in the order they finish. Dropping it cancels
/// whatever of the request is still queued or running.
#[derive(Debug)]
pub struct RequestStream {
    id: RequestId,
    events: mpsc::UnboundedReceiver<Event>,
    commands: std_mpsc::Sender<Command>,
}

impl RequestStream {
    /// The next event; `None` after `Done`/`Failed` (or if the engine stopped).
    pub async fn next(&mut self) -> Option<Event> {
        self.events.recv().await
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Cancel(self.id));
    }
}

/// Handle of a running engine thread; cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct Engine {
    commands: std_mpsc::Sender<Command>,
    status: Arc<Mutex<EngineStatus>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Submit { .. } => "Submit",
            Self::Cancel(_) => "Cancel",
            Self::Swap(_) => "Swap",
            Self::Reclaim(_) => "Reclaim",
            Self::Release(_) => "Release",
            Self::Shutdown => "Shutdown",
        })
    }
}

impl Engine {
    /// Starts the engine thread with `model` as weight version `version`.
    pub fn start(model: Gpt2, version: u64, cfg: EngineConfig) -> Self {
        let status = Arc::new(Mutex::new(EngineStatus {
            weight_version: version,
            weight_run: String::new(),
            live_rows: 0,
            row_limit: cfg.max_seqs,
            max_seqs: cfg.max_seqs,
            pending_requests: 0,
            pending_samples: 0,
            reserved_kv_tokens: 0,
            max_kv_tokens: cfg.max_kv_tokens,
            tokens_generated: 0,
            tokens_per_second: 0.0,
            swap_pending: false,
            staged: None,
            last_swap: None,
            device: device_name(model.device()),
            dtype: format!("{:?}", model.dtype()).to_lowercase(),
        }));
        metrics::set_weight_version(version);
        let (commands, inbox) = std_mpsc::channel();
        let scheduler = Scheduler::new(Arc::new(model), version, cfg);
        let shared = status.clone();
        let thread = std::thread::Builder::new()
            .name("rollout-engine".into())
            .spawn(move || EngineLoop::new(scheduler, cfg, inbox, shared).run())
            .expect("spawn the engine thread");
        Self {
            commands,
            status,
            thread: Mutex::new(Some(thread)),
        }
    }

    /// Names the run the starting weights belong to (a worker started with a learner's
    /// weights, such as the local run's).
    pub fn with_run(self, run: &str) -> Self {
        self.status.lock().expect("status lock").weight_run = run.to_owned();
        self
    }

    /// Queues a request; refused requests return the reason and queue nothing.
    pub async fn submit(&self, request: Request) -> Result<RequestStream, EngineError> {
        let (events_tx, events) = mpsc::unbounded_channel();
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Submit {
                request,
                events: events_tx,
                reply,
            })
            .map_err(|_| EngineError::Stopped)?;
        let id = answer.await.map_err(|_| EngineError::Stopped)??;
        Ok(RequestStream {
            id,
            events,
            commands: self.commands.clone(),
        })
    }

    /// Installs `model` as weight version `version` of run `run` between two decode steps
    /// and returns once it is in use (see the module doc for what happens to work in
    /// flight), with the model it retired — the one in use before, or an older staged
    /// one that `model` superseded — when nothing else holds that model any more.
    pub async fn swap(
        &self,
        model: Gpt2,
        version: u64,
        run: &str,
    ) -> Result<Option<Retired>, EngineError> {
        self.stage(model, version, run)?.landed().await
    }

    /// Hands `model` to the engine as weight version `version` of run `run` and returns at
    /// once: the engine swaps it in at its next step boundary (after the sequences in
    /// flight under [`SwapPolicy::Drain`]); the ticket says when. From the return on, the
    /// status's [`EngineStatus::held`] names this version, and every request submitted
    /// after it runs on it (commands are handled in order, a swap before the work after
    /// it).
    pub fn stage(&self, model: Gpt2, version: u64, run: &str) -> Result<SwapTicket, EngineError> {
        let (reply, done) = oneshot::channel();
        self.status.lock().expect("status lock").staged = Some((version, run.to_owned()));
        self.commands
            .send(Command::Swap(Staged {
                sent: Instant::now(),
                model: Arc::new(model),
                version,
                run: run.to_owned(),
                reply,
            }))
            .map_err(|_| EngineError::Stopped)?;
        Ok(SwapTicket(done))
    }

    /// Takes staged version `version` back before it goes into use, so that its memory
    /// can hold a newer version: its ticket lands with its own model as the one retired
    /// (or, when it went into use first, with the model that one retired), and the
    /// engine admits no new work — as if the version were still staged — until the
    /// returned guard is passed to [`Engine::stage_reclaimed`] or dropped.
    pub fn reclaim(&self, version: u64) -> Result<Reclaimed<'_>, EngineError> {
        self.commands
            .send(Command::Reclaim(version))
            .map_err(|_| EngineError::Stopped)?;
        Ok(Reclaimed {
            engine: self,
            version,
        })
    }

    /// [`Engine::stage`] in place of a reclaimed version.
    pub fn stage_reclaimed(
        &self,
        reclaimed: Reclaimed<'_>,
        model: Gpt2,
        version: u64,
        run: &str,
    ) -> Result<SwapTicket, EngineError> {
        let ticket = self.stage(model, version, run);
        std::mem::forget(reclaimed);
        ticket
    }

    pub fn status(&self) -> EngineStatus {
        self.status.lock().expect("status lock").clone()
    }

    /// Stops the thread; requests still running get no more events.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(thread) = self.thread.lock().expect("thread lock").take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn device_name(device: &candle_core::Device) -> String {
    match device {
        candle_core::Device::Cpu => "cpu".into(),
        candle_core::Device::Cuda(_) => "cuda".into(),
        candle_core::Device::Metal(_) => "metal".into(),
    }
}

/// Tokens per second over a window of at least this many seconds.
const RATE_WINDOW_SECONDS: f64 = 2.0;

/// Weights waiting to be swapped in, and who waits for it.
struct Staged {
    /// When [`Engine::swap`] sent them: their wait counts from here, the step the engine
    /// was running then included.
    sent: Instant,
    model: Arc<Gpt2>,
    version: u64,
    run: String,
    reply: oneshot::Sender<Option<Retired>>,
}

impl Staged {
    /// Its version will not go into use: its caller is told so, its model handed back as
    /// the one retired.
    fn hand_back(self) {
        let _ = self
            .reply
            .send(Retired::of(self.model, self.version, self.run));
    }
}

/// A model the engine no longer uses, handed back by [`Engine::swap`] (its memory can
/// hold the next version: `rookworld_weights::refill`).
#[derive(Debug)]
pub struct Retired {
    pub model: Gpt2,
    /// The weight version and run it held.
    pub version: u64,
    pub run: String,
}

impl Retired {
    /// `model` retired, if nothing else holds it.
    fn of(model: Arc<Gpt2>, version: u64, run: String) -> Option<Self> {
        Arc::try_unwrap(model).ok().map(|model| Self {
            model,
            version,
            run,
        })
    }
}

/// A staged version taken back ([`Engine::reclaim`]); dropped without a newer version
/// staged in its place, the engine goes on with the version in use.
#[derive(Debug)]
pub struct Reclaimed<'a> {
    engine: &'a Engine,
    version: u64,
}

impl Drop for Reclaimed<'_> {
    fn drop(&mut self) {
        (self.engine.status.lock().expect("status lock")).unstage(self.version);
        let _ = self.engine.commands.send(Command::Release(self.version));
    }
}

/// A staged swap ([`Engine::stage`]): resolves once its version is in use, or once a newer
/// staged version superseded it before any token used it, with the model that left.
#[derive(Debug)]
pub struct SwapTicket(oneshot::Receiver<Option<Retired>>);

impl SwapTicket {
    /// Waits for the swap to land.
    pub async fn landed(mut self) -> Result<Option<Retired>, EngineError> {
        self.wait().await
    }

    /// Waits for the swap to land, the ticket kept: a wait cut short (its future dropped)
    /// can be taken up again.
    pub async fn wait(&mut self) -> Result<Option<Retired>, EngineError> {
        (&mut self.0).await.map_err(|_| EngineError::Stopped)
    }

    /// The swap's outcome if it has landed, without waiting.
    pub fn try_landed(&mut self) -> Option<Result<Option<Retired>, EngineError>> {
        match self.0.try_recv() {
            Ok(retired) => Some(Ok(retired)),
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => Some(Err(EngineError::Stopped)),
        }
    }
}

struct EngineLoop {
    scheduler: Scheduler,
    cfg: EngineConfig,
    inbox: std_mpsc::Receiver<Command>,
    status: Arc<Mutex<EngineStatus>>,
    streams: HashMap<RequestId, mpsc::UnboundedSender<Event>>,
    staged: Option<Staged>,
    swap_clock: SwapClock,
    /// A staged version taken back for a newer one that is being built: work stays held.
    reclaimed: Option<u64>,
    tokens_generated: u64,
    window: (Instant, u64),
    tokens_per_second: f64,
}

impl EngineLoop {
    fn new(
        scheduler: Scheduler,
        cfg: EngineConfig,
        inbox: std_mpsc::Receiver<Command>,
        status: Arc<Mutex<EngineStatus>>,
    ) -> Self {
        Self {
            scheduler,
            cfg,
            inbox,
            status,
            streams: HashMap::new(),
            staged: None,
            swap_clock: SwapClock::default(),
            reclaimed: None,
            tokens_generated: 0,
            window: (Instant::now(), 0),
            tokens_per_second: 0.0,
        }
    }

    fn run(mut self) {
        loop {
            // Idle: wait for a command. Busy: take whatever arrived, then step.
            // Idle too while stalled: its replacement or release wakes the loop.
            let idle = (!self.scheduler.has_work() || self.stalled()) && self.staged.is_none();
            let first = if idle {
                match self.inbox.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                None
            };
            let arrived: Vec<Command> = first
                .into_iter()
                .chain(std::iter::from_fn(|| self.inbox.try_recv().ok()))
                .collect();
            for command in arrived {
                if !self.handle(command) {
                    return;
                }
            }
            self.maybe_swap();
            if self.scheduler.has_work() && !self.stalled() {
                let admit = self.staged.is_none() && self.reclaimed.is_none();
                let start = Instant::now();
                let (events, stats) = self.scheduler.step(admit);
                if let Some(t) = self.swap_clock.stepped(start, Instant::now(), !admit) {
                    self.swap_done(t);
                }
                self.route(events);
                self.account(stats.first_tokens + stats.decode_rows, &stats);
            } else if self.reclaimed.is_none()
                && let Some(t) = self.swap_clock.idle(Instant::now())
            {
                // (Held for a reclaimed version's replacement, the loop is not idle: the
                // swap to come still pauses from the last step on the old weights.)
                self.swap_done(t);
            }
            self.publish();
        }
    }

    /// Held for a reclaimed version's replacement with no row decoding: nothing to step.
    fn stalled(&self) -> bool {
        self.reclaimed.is_some() && self.scheduler.live_rows() == 0
    }

    /// Returns false on shutdown.
    fn handle(&mut self, command: Command) -> bool {
        match command {
            Command::Submit {
                request,
                events,
                reply,
            } => {
                let result = self.scheduler.submit(request);
                if let Ok(id) = &result {
                    self.streams.insert(*id, events);
                }
                let _ = reply.send(result);
            }
            Command::Cancel(id) => {
                self.streams.remove(&id);
                if let Err(e) = self.scheduler.cancel(id) {
                    tracing::error!(error = %e, "cancelling a request failed");
                }
            }
            Command::Swap(staged) => {
                self.reclaimed = None;
                self.swap_clock.staged(staged.sent);
                // A newer staged swap replaces an older one; its caller is told it landed
                // (its version is superseded before any token used it).
                if let Some(old) = self.staged.replace(staged) {
                    old.hand_back();
                }
            }
            Command::Reclaim(version) => {
                if self.staged.as_ref().is_some_and(|s| s.version == version) {
                    self.reclaimed = Some(version);
                    self.staged.take().expect("staged").hand_back();
                }
            }
            Command::Release(version) => {
                if self.reclaimed == Some(version) {
                    self.reclaimed = None;
                    self.swap_clock.cancel();
                }
            }
            Command::Shutdown => return false,
        }
        true
    }

    fn maybe_swap(&mut self) {
        let ready = match self.cfg.swap_policy {
            SwapPolicy::Restart | SwapPolicy::Continue => true,
            SwapPolicy::Drain => self.scheduler.live_rows() == 0,
        };
        if ready && let Some(staged) = self.staged.take() {
            let version = staged.version;
            let old = match self.cfg.swap_policy {
                SwapPolicy::Continue => self.scheduler.continue_with(staged.model, version),
                SwapPolicy::Drain | SwapPolicy::Restart => {
                    self.scheduler.set_model(staged.model, version)
                }
            };
            let (old_version, old_run) = {
                let mut status = self.status.lock().expect("status lock");
                let old_version = std::mem::replace(&mut status.weight_version, version);
                status.unstage(version);
                (
                    old_version,
                    std::mem::replace(&mut status.weight_run, staged.run),
                )
            };
            metrics::set_weight_version(version);
            self.swap_clock.swapped(version, Instant::now());
            tracing::debug!(version, "weights swapped in");
            let _ = staged.reply.send(Retired::of(old, old_version, old_run));
        }
    }

    /// A swap's cost, complete: recorded, published and logged.
    fn swap_done(&mut self, t: SwapTiming) {
        metrics::record_swap(&t);
        self.status.lock().expect("status lock").last_swap = Some(t);
        tracing::debug!(
            version = t.version,
            wait_seconds = format!("{:.4}", t.wait_seconds),
            held_steps = t.held_steps,
            pause_seconds = format!("{:.5}", t.pause_seconds),
            pause_steps = format!("{:.3}", t.pause_steps()),
            "decoding through a weight swap"
        );
    }

    fn route(&mut self, events: Vec<Event>) {
        for event in events {
            let id = match &event {
                Event::Sample(s) => {
                    metrics::record_completion(s.completion.finish_reason);
                    s.request
                }
                Event::Done(id) | Event::Failed(id, _) => *id,
            };
            let last = !matches!(event, Event::Sample(_));
            let delivered = self
                .streams
                .get(&id)
                .is_some_and(|tx| tx.send(event).is_ok());
            if last || !delivered {
                self.streams.remove(&id);
            }
            if !delivered && !last {
                // The caller went away: stop its work.
                let _ = self.scheduler.cancel(id);
            }
        }
    }

    fn account(&mut self, new_tokens: usize, stats: &super::StepStats) {
        self.tokens_generated += new_tokens as u64;
        metrics::record_step(new_tokens, stats);
        let elapsed = self.window.0.elapsed().as_secs_f64();
        if elapsed >= RATE_WINDOW_SECONDS {
            self.tokens_per_second = (self.tokens_generated - self.window.1) as f64 / elapsed;
            self.window = (Instant::now(), self.tokens_generated);
        }
    }

    fn publish(&mut self) {
        if !self.scheduler.has_work()
            && self.window.0.elapsed().as_secs_f64() >= RATE_WINDOW_SECONDS
        {
            self.tokens_per_second = 0.0;
        }
        let s = &self.scheduler;
        let mut status = self.status.lock().expect("status lock");
        status.weight_version = s.version();
        status.live_rows = s.live_rows();
        status.row_limit = s.row_limit();
        status.pending_requests = s.pending_requests();
        status.pending_samples = s.pending_samples();
        status.reserved_kv_tokens = s.reserved_kv_tokens();
        status.tokens_generated = self.tokens_generated;
        status.tokens_per_second = self.tokens_per_second;
        status.swap_pending = self.staged.is_some() || self.reclaimed.is_some();
        metrics::set_load(&status, s.model().device());
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use candle_core::{DType, Device};
    use rookworld_lm::Config;
    use rookworld_lm::model_io::init_random;
    use rookworld_lm::sampling::SamplingParams;

    use super::*;

    fn model(seed: u64) -> Gpt2 {
        init_random(&Config::tiny(), seed, DType::F32, &Device::Cpu).unwrap()
    }

    /// Polls `engine`'s status until `done` holds (within 30 s).
    async fn until(engine: &Engine, done: impl Fn(&EngineStatus) -> bool) -> EngineStatus {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let status = engine.status();
            if done(&status) {
                return status;
            }
            assert!(Instant::now() < deadline, "not within 30 s: {status:?}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// An engine of the tiny model as version 1 of run `run`, under `Drain`, four rows.
    fn draining_engine() -> Engine {
        let cfg = EngineConfig {
            max_seqs: 4,
            swap_policy: SwapPolicy::Drain,
            ..EngineConfig::default()
        };
        Engine::start(model(6), 1, cfg).with_run("run")
    }

    /// One prompt of eight tokens, four samples of `max_new_tokens` each.
    fn request(seed: u64, max_new_tokens: usize) -> Request {
        Request {
            prompts: vec![(0..8).collect()],
            n: 4,
            max_new_tokens,
            sampling: SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
            },
            seed,
            ignore_eos: true,
        }
    }

    /// Reads `stream` to its end; every sample was wholly version `version`'s. The count.
    async fn samples_of(stream: &mut RequestStream, version: u64) -> usize {
        let mut samples = 0;
        while let Some(event) = stream.next().await {
            match event {
                Event::Sample(s) => {
                    assert_eq!(s.weight_version, version);
                    assert!(s.token_versions.is_empty(), "{:?}", s.token_versions);
                    samples += 1;
                }
                Event::Done(_) => break,
                Event::Failed(_, e) => panic!("{e}"),
            }
        }
        samples
    }

    /// A version staged while a drain holds it back: `stage` returns at once with the
    /// version named as held (not yet in use), a request submitted after it runs wholly
    /// on it, and the ticket lands once the sequences in flight are done, with the model
    /// it retired.
    #[tokio::test]
    async fn a_staged_version_is_held_at_once_and_lands_after_the_drain() {
        let engine = draining_engine();
        let mut before = engine.submit(request(3, 100)).await.unwrap();
        until(&engine, |s| s.live_rows == 4).await;
        let ticket = engine.stage(model(7), 2, "run").unwrap();
        let status = engine.status();
        assert_eq!(status.held(), (2, "run"), "{status:?}");
        assert_eq!(status.weight_version, 1, "still draining: {status:?}");
        let mut after = engine.submit(request(4, 100)).await.unwrap();
        let retired = ticket
            .landed()
            .await
            .unwrap()
            .expect("the old model retired");
        assert_eq!((retired.version, retired.run.as_str()), (1, "run"));
        let status = engine.status();
        assert_eq!((status.weight_version, status.staged.clone()), (2, None));
        assert_eq!(samples_of(&mut before, 1).await, 4);
        assert_eq!(samples_of(&mut after, 2).await, 4);
    }

    /// A staged version taken back during a drain: its ticket lands with its own model,
    /// a newer version staged in its place goes into use after the same drain (the old
    /// model retired), and a reclaim released without a replacement leaves the version in
    /// use held and the engine admitting work again.
    #[tokio::test]
    async fn a_reclaimed_version_gives_its_memory_to_the_next_or_is_released() {
        let engine = draining_engine();
        let mut stream = engine.submit(request(3, 100)).await.unwrap();
        until(&engine, |s| s.live_rows == 4).await;
        let ticket = engine.stage(model(7), 2, "run").unwrap();
        let reclaimed = engine.reclaim(2).unwrap();
        let back = ticket.landed().await.unwrap().expect("the staged model");
        assert_eq!(back.version, 2);
        let ticket = engine
            .stage_reclaimed(reclaimed, back.model, 3, "run")
            .unwrap();
        assert_eq!(engine.status().held(), (3, "run"));
        let retired = ticket
            .landed()
            .await
            .unwrap()
            .expect("the old model retired");
        assert_eq!(retired.version, 1);
        assert_eq!(engine.status().weight_version, 3);
        assert_eq!(samples_of(&mut stream, 1).await, 4);
        // Released: nothing staged, and new work runs on the version in use.
        let mut stream = engine.submit(request(5, 50)).await.unwrap();
        until(&engine, |s| s.live_rows == 4).await;
        let ticket = engine.stage(retired.model, 4, "run").unwrap();
        drop(engine.reclaim(4).unwrap());
        assert_eq!(ticket.landed().await.unwrap().unwrap().version, 4);
        assert_eq!(engine.status().held(), (3, "run"));
        let mut after = engine.submit(request(6, 10)).await.unwrap();
        assert_eq!(samples_of(&mut stream, 3).await, 4);
        assert_eq!(samples_of(&mut after, 3).await, 4);
        assert!(!engine.status().swap_pending);
    }

    /// A swap staged while sequences decode, under each policy: it lands, and its cost to
    /// the decode loop is recorded — under `Drain` the steps held while the sequences in
    /// flight finished, under `Continue` none (the swap goes in at the next step).
    #[tokio::test]
    async fn a_swap_under_way_records_what_it_held_and_paused() {
        for policy in [SwapPolicy::Drain, SwapPolicy::Continue] {
            let cfg = EngineConfig {
                max_seqs: 4,
                swap_policy: policy,
                ..EngineConfig::default()
            };
            let engine = Engine::start(model(6), 1, cfg);
            let mut stream = engine.submit(request(3, 200)).await.unwrap();
            until(&engine, |s| s.live_rows == 4).await;
            engine.swap(model(7), 2, "run").await.unwrap();
            let t = until(&engine, |s| s.last_swap.is_some())
                .await
                .last_swap
                .unwrap();
            assert_eq!(t.version, 2, "{policy:?}");
            assert!(t.pause_seconds >= 0.0 && t.wait_seconds >= 0.0, "{t:?}");
            match policy {
                SwapPolicy::Drain => assert!(t.held_steps >= 1, "{t:?}"),
                _ => assert_eq!(t.held_steps, 0, "{t:?}"),
            }
            while let Some(event) = stream.next().await {
                assert!(!matches!(event, Event::Failed(..)), "{event:?}");
                if matches!(event, Event::Done(_)) {
                    break;
                }
            }
        }
    }
}

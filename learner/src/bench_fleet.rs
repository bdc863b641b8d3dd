//! `learner bench-fleet`: weight pushes to N real worker processes over shaped links —
//! the star against relays of each fan-out, the full payload against a delta — timed until
//! every worker runs the new version, with the bytes that left the learner's link.
//!
//! Each worker is `rollout-worker serve` in a network namespace of its own, and the learner
//! side (this process's pushing thread) is in one too; every link goes through a bridge
//! and is shaped with `tc` in both directions ([`lab`]). The pushes are the training
//! loop's own ([`crate::push::Fleet`]), a fleet per configuration, in rounds until every
//! worker runs the version (as the sync loop serves a worker a round missed), after one
//! untimed push (for a delta: every worker's base). The two payloads pushed in turn are a
//! fresh model's and the same after one AdamW step at `--delta-lr`, so each delta carries
//! one step's change. One JSON line on stdout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rookworld_lm::config::Config;
use rookworld_proto::rollout::v1::StatusRequest;
use rookworld_proto::rollout::v1::rollout_service_client::RolloutServiceClient;
use rookworld_weights::delta;
use rookworld_weights::set::WeightSet;
use serde::Serialize;

use crate::bench_push::deltas;
use crate::push::{DeltaPolicy, Fleet, PushOutcome};
use crate::settings::ConfigError;
use lab::{Endpoint, Lab, LabError, Shape, Shaper};

pub mod lab;

const TOKEN: &str = "bench-fleet";
/// The port every worker serves on (each has an address of its own).
const PORT: u16 = 50053;

/// What each push sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// The whole BF16 payload.
    Full,
    /// What one AdamW step changed, against the version every worker runs.
    Delta,
}

/// Options of `learner bench-fleet`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchFleetArgs {
    /// Model shape (seeded random weights): gpt2-124m or tiny.
    #[arg(long, default_value = "gpt2-124m")]
    pub preset: String,
    /// Worker processes, each behind a link of its own.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Each worker's link rate, as tc writes rates (1gbit, 100mbit).
    #[arg(long, default_value = "1gbit", value_parser = lab::parse_rate)]
    pub rate: u64,
    /// The learner's link rate (default: --rate).
    #[arg(long, value_parser = lab::parse_rate)]
    pub learner_rate: Option<u64>,
    /// Share of packets the learner's link drops in each direction (--loss is the
    /// workers' links': a push from the learner crosses one lossy link, one between
    /// workers two).
    #[arg(long, default_value_t = 0.0)]
    pub learner_loss: f64,
    /// Delay each link adds in each direction, milliseconds (needs the kernel's netem).
    #[arg(long, default_value_t = 0.0)]
    pub delay_ms: f64,
    /// Share of packets each worker's link drops in each direction (0.05: 5%).
    #[arg(long, default_value_t = 0.0)]
    pub loss: f64,
    /// Fan-outs to compare; 0 is the star (the learner streams to every worker).
    #[arg(long, value_delimiter = ',', default_value = "0,2,4")]
    pub fanouts: Vec<u32>,
    /// What the pushes send.
    #[arg(long, value_delimiter = ',', default_value = "full,delta")]
    pub kinds: Vec<Kind>,
    /// Timed pushes per configuration; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub pushes: usize,
    /// The learning rate of the AdamW step between the two payloads pushed in turn: 1e-6
    /// gives a delta about the size real training at 1e-5 sends (the book's weight-push
    /// page).
    #[arg(long, default_value_t = 1e-6)]
    pub delta_lr: f64,
    /// The `rollout-worker` executable (default: beside this one, else on PATH).
    #[arg(long)]
    pub worker_bin: Option<PathBuf>,
    /// The workers' --weight-dtype.
    #[arg(long, default_value = "auto")]
    pub worker_weight_dtype: String,
    /// Deadline of one push to one worker, seconds.
    #[arg(long, default_value_t = 120)]
    pub deadline_s: u64,
}

/// Why `learner bench-fleet` could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchFleetError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("the network: {0}")]
    Lab(#[from] LabError),
    #[error(transparent)]
    Model(#[from] rookworld_lm::Error),
    #[error(transparent)]
    Deltas(#[from] deltas::DeltaBenchError),
    #[error("{0}")]
    Delta(#[from] delta::DeltaError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A worker that did not come up, or a push that did not bring every worker the
    /// version: the cause, with the worker's log where it has one.
    #[error("{0}")]
    Fleet(String),
}

/// One timed push.
#[derive(Debug, Serialize)]
struct Push {
    /// From the learner's first call to every worker's answer that it runs the version.
    seconds: f64,
    /// Bytes the learner's link sent (frames, headers included).
    learner_sent: u64,
    /// How many workers were sent the version each way: `stream` (the payload), `delta`,
    /// `peer` (the payload from a peer, as to a worker that joins: one that lost its
    /// base in a failed push).
    paths: BTreeMap<&'static str, usize>,
    /// Pushes that failed on the way (the worker and why); each worker was served again
    /// in a later round.
    failures: Vec<String>,
    /// From the learner's first call until the last worker's last chunk arrived, and until
    /// the last worker had the version in use, by the workers' clocks (one host here).
    last_received_seconds: f64,
    last_in_use_seconds: f64,
}

/// What one worker's push did, in the median push of a configuration.
#[derive(Debug, Serialize)]
struct Hop {
    worker: String,
    /// The relay that sent it the version (`None`: the learner).
    parent: Option<String>,
    /// From its sender's first chunk to its answer, its receive phase, and (a delta) its
    /// apply and hash.
    seconds: f64,
    receive_seconds: f64,
    verify_seconds: f64,
    bytes: u64,
    /// From the learner's first call until its last chunk arrived, and until it had the
    /// version in use (its clock).
    received_after_seconds: f64,
    in_use_after_seconds: f64,
}

/// One configuration: a fan-out and a kind.
#[derive(Debug, Serialize)]
struct Run {
    fanout: u32,
    kind: Kind,
    /// What one push carries: the payload's or the delta's bytes.
    bytes: u64,
    /// Those bytes at a worker link's rate.
    line_seconds: f64,
    /// The median push; every push in order.
    seconds: f64,
    /// The median push's last receive end and last worker with the version in use (see
    /// [`Push`]).
    last_received_seconds: f64,
    last_in_use_seconds: f64,
    pushes: Vec<Push>,
    /// The median push's learner bytes over `bytes`: how many copies left its link.
    learner_sends: f64,
    hops: Vec<Hop>,
}

#[derive(Debug, Serialize)]
struct Report {
    preset: String,
    workers: usize,
    link: Shape,
    learner_link: Shape,
    shaper: Shaper,
    payload_bytes: u64,
    delta_bytes: u64,
    delta_lr: f64,
    /// Making the delta from the two payloads, once (the learner does it once per
    /// version, in the first push that sends it).
    delta_encode_seconds: f64,
    runs: Vec<Run>,
    /// The largest peak resident memory of a worker process over the whole benchmark: its
    /// model, the version it receives into beside it, and the payload it keeps to relay
    /// and to apply deltas to.
    worker_peak_rss_bytes: u64,
}

/// Runs the benchmark and prints its JSON line.
pub fn run(args: &BenchFleetArgs) -> Result<(), BenchFleetError> {
    use rookworld_service::validate::at_least;
    at_least("--workers", args.workers as u64, 1)?;
    at_least("--pushes", args.pushes as u64, 1)?;
    at_least("--deadline-s", args.deadline_s, 1)?;
    if args.workers > 4000 {
        return Err(ConfigError::Value("--workers: at most 4000".into()).into());
    }
    for (flag, loss) in [("--loss", args.loss), ("--learner-loss", args.learner_loss)] {
        if !(0.0..1.0).contains(&loss) {
            let why = format!("{flag}: a share from 0 to below 1 (0.05: 5%)");
            return Err(ConfigError::Value(why).into());
        }
    }
    if !(0.0..=10_000.0).contains(&args.delay_ms) {
        return Err(ConfigError::Value("--delay-ms: from 0 to 10000".into()).into());
    }
    if args.fanouts.is_empty() || args.kinds.is_empty() {
        return Err(ConfigError::Value("--fanouts and --kinds: at least one each".into()).into());
    }
    let cfg = Config::preset(&args.preset)?;
    Lab::check()?;
    let worker_bin = worker_bin(args.worker_bin.as_deref())?;

    // The two payloads pushed in turn, and the delta between them.
    let (a, b) = deltas::stepped(&cfg, args.delta_lr)?;
    let t = Instant::now();
    let delta_bytes = delta::encode(&a, &b)?.len() as u64;
    let delta_encode_seconds = t.elapsed().as_secs_f64();
    let sets = [
        WeightSet::from_bytes("bench-fleet", 0, a),
        WeightSet::from_bytes("bench-fleet", 0, b),
    ];

    let link = Shape {
        rate_bits: args.rate,
        delay_ms: args.delay_ms,
        loss: args.loss,
    };
    let learner_link = Shape {
        rate_bits: args.learner_rate.unwrap_or(args.rate),
        loss: args.learner_loss,
        ..link
    };
    let mut lab = Lab::new()?;
    let logs = std::env::temp_dir().join(format!("rookworld-bench-fleet-{}", std::process::id()));
    std::fs::create_dir_all(&logs)?;
    {
        let (cleanup, logs) = (lab.cleanup(), logs.clone());
        rookworld_service::serve::exit_on_signal("learner bench-fleet", move || {
            cleanup.run();
            let _ = std::fs::remove_dir_all(logs);
        })?;
    }
    let learner = lab.endpoint("l", &learner_link)?;
    let mut workers = Vec::with_capacity(args.workers);
    for i in 0..args.workers {
        let at = lab.endpoint(&format!("w{i}"), &link)?;
        let dtype = ["--weight-dtype", &args.worker_weight_dtype];
        let log = logs.join(format!("w{i}.log"));
        workers.push(Worker::spawn(
            &lab,
            at,
            &worker_bin,
            (&args.preset, &dtype),
            TOKEN,
            log,
        )?);
    }
    tracing::info!(
        workers = args.workers,
        shaper = ?lab.shaper(),
        rate_bits = args.rate,
        "bench fleet: workers started, each in a namespace behind a shaped link"
    );

    // The learner's side runs in its namespace: a thread of its own, entered before its
    // runtime starts its threads.
    let measured = std::thread::scope(|s| {
        s.spawn(|| {
            Lab::enter(&learner)?;
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            runtime.block_on(measure(args, &lab, &learner, &workers, &sets))
        })
        .join()
        .expect("the pushing thread panicked")
    });
    let worker_peak_rss_bytes = workers
        .iter()
        .filter_map(|w| Lab::peak_rss_bytes(w.pid))
        .max()
        .unwrap_or(0);
    let runs = match measured {
        Ok(runs) => runs,
        Err(e) => {
            // The workers' logs stay for the cause.
            lab.cleanup().run();
            return Err(e);
        }
    };
    lab.cleanup().run();
    let _ = std::fs::remove_dir_all(&logs);
    let report = Report {
        preset: args.preset.clone(),
        workers: args.workers,
        link,
        learner_link,
        shaper: lab.shaper(),
        payload_bytes: sets[0].bytes.len() as u64,
        delta_bytes,
        delta_lr: args.delta_lr,
        delta_encode_seconds,
        runs,
        worker_peak_rss_bytes,
    };
    println!(
        "{}",
        serde_json::to_string(&report).expect("report serialises")
    );
    Ok(())
}

/// A `rollout-worker serve` process in a lab's namespace, and where it listens.
pub struct Worker {
    pub at: Endpoint,
    pub pid: u32,
    /// Its standard output and error.
    pub log: PathBuf,
}

impl Worker {
    /// Starts `bin serve --preset PRESET` with `extra` flags at `at` (its gRPC port and
    /// its metrics on the endpoint's address), taking control calls with `token`, its
    /// output in `log`.
    pub fn spawn(
        lab: &Lab,
        at: Endpoint,
        bin: &Path,
        (preset, extra): (&str, &[&str]),
        token: &str,
        log: PathBuf,
    ) -> Result<Self, BenchFleetError> {
        let listen = format!("{}:{PORT}", at.address);
        let metrics = format!("{}:9093", at.address);
        let serve: Vec<String> = [
            "serve",
            "--preset",
            preset,
            "--listen",
            &listen,
            "--metrics",
            &metrics,
        ]
        .iter()
        .chain(extra)
        .map(|a| a.to_string())
        .collect();
        let pid = lab.spawn(&at, bin, &serve, &[("ROOKWORLD_TOKEN", token)], &log)?;
        Ok(Self { at, pid, log })
    }

    /// Its push address.
    pub fn url(&self) -> String {
        format!("http://{}:{PORT}", self.at.address)
    }

    /// Waits (up to 5 minutes) until it answers its status call; an error names a worker
    /// that exited or never answered, with the end of its log.
    pub async fn ready(&self, lab: &Lab) -> Result<(), BenchFleetError> {
        let until = Instant::now() + Duration::from_secs(300);
        loop {
            if lab.exited(self.pid) {
                return Err(BenchFleetError::Fleet(format!(
                    "the worker at {} exited at start{}",
                    self.url(),
                    tail(&self.log)
                )));
            }
            if let Ok(mut client) = RolloutServiceClient::connect(self.url()).await
                && client.status(StatusRequest {}).await.is_ok()
            {
                return Ok(());
            }
            if Instant::now() > until {
                return Err(BenchFleetError::Fleet(format!(
                    "the worker at {} did not answer within 5 minutes{}",
                    self.url(),
                    tail(&self.log)
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// `--worker-bin`, else `rollout-worker` beside this executable, else on PATH.
fn worker_bin(given: Option<&Path>) -> Result<PathBuf, BenchFleetError> {
    if let Some(path) = given {
        return if path.is_file() {
            Ok(path.to_owned())
        } else {
            Err(ConfigError::Value(format!("--worker-bin {}: no such file", path.display())).into())
        };
    }
    let beside = std::env::current_exe()?.with_file_name("rollout-worker");
    if beside.is_file() {
        return Ok(beside);
    }
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join("rollout-worker"))
                .find(|p| p.is_file())
        })
        .ok_or_else(|| {
            ConfigError::Value(
                "no rollout-worker beside learner or on PATH: name it with --worker-bin".into(),
            )
            .into()
        })
}

/// Every configuration, in order, once the workers answer.
async fn measure(
    args: &BenchFleetArgs,
    lab: &Lab,
    learner: &Endpoint,
    workers: &[Worker],
    sets: &[WeightSet; 2],
) -> Result<Vec<Run>, BenchFleetError> {
    for w in workers {
        w.ready(lab).await?;
    }
    let deadline = Duration::from_secs(args.deadline_s);
    let payload = sets[0].bytes.len() as u64;
    let mut version = 0;
    let mut runs = Vec::new();
    for &fanout in &args.fanouts {
        for &kind in &args.kinds {
            let mut fleet = Fleet::new(Duration::from_secs(1))
                .with_fanout(fanout)
                .with_deltas(match kind {
                    Kind::Full => DeltaPolicy::Never,
                    Kind::Delta => DeltaPolicy::Always,
                });
            for w in workers {
                fleet.register(&w.url());
            }
            // Untimed: for a delta, every worker's base (the version before the first timed
            // one).
            version += 1;
            push_all(&mut fleet, &sets[version % 2], version, deadline, workers).await?;
            let mut pushes = Vec::with_capacity(args.pushes);
            let mut hops = Vec::with_capacity(args.pushes);
            let mut bytes = payload;
            for _ in 0..args.pushes {
                version += 1;
                let sent = lab.sent_bytes(learner)?;
                let t = Instant::now();
                let started = std::time::SystemTime::now();
                let (outcomes, failures) =
                    push_all(&mut fleet, &sets[version % 2], version, deadline, workers).await?;
                let seconds = t.elapsed().as_secs_f64();
                let learner_sent = lab.sent_bytes(learner)? - sent;
                let sent_as = match kind {
                    Kind::Full => "stream",
                    Kind::Delta => "delta",
                };
                if let Some(b) = outcomes
                    .iter()
                    .filter(|o| o.path == sent_as)
                    .map(|o| o.bytes)
                    .max()
                {
                    bytes = b;
                }
                tracing::info!(
                    fanout,
                    kind = ?kind,
                    seconds = format!("{seconds:.3}"),
                    learner_sent,
                    "bench fleet: every worker runs version {version}"
                );
                let mut paths = BTreeMap::new();
                for o in &outcomes {
                    *paths.entry(o.path).or_default() += 1;
                }
                let after = |ns: u64| after_seconds(started, ns);
                let last = |f: fn(&PushOutcome) -> u64| {
                    outcomes.iter().map(|o| after(f(o))).fold(0.0, f64::max)
                };
                pushes.push(Push {
                    seconds,
                    learner_sent,
                    paths,
                    failures,
                    last_received_seconds: last(|o| o.received_unix_ns),
                    last_in_use_seconds: last(|o| o.in_use_unix_ns),
                });
                hops.push(
                    outcomes
                        .into_iter()
                        .map(|o| hop(o, started))
                        .collect::<Vec<_>>(),
                );
            }
            let median = median_index(&pushes);
            runs.push(Run {
                fanout,
                kind,
                bytes,
                line_seconds: bytes as f64 * 8.0 / args.rate as f64,
                seconds: pushes[median].seconds,
                last_received_seconds: pushes[median].last_received_seconds,
                last_in_use_seconds: pushes[median].last_in_use_seconds,
                learner_sends: pushes[median].learner_sent as f64 / bytes as f64,
                hops: hops.swap_remove(median),
                pushes,
            });
        }
    }
    Ok(runs)
}

/// Pushes `set` as `version` until every worker runs it, in rounds as the training loop's
/// sync loop makes them (a worker a round missed — its link stalled, its relay failed —
/// is due again in the next, or after its back-off); every worker's last outcome
/// (relayed ones included) and the failures on the way. A worker still without it at the
/// deadline fails the benchmark, with its log.
async fn push_all(
    fleet: &mut Fleet,
    set: &WeightSet,
    version: usize,
    deadline: Duration,
    workers: &[Worker],
) -> Result<(Vec<PushOutcome>, Vec<String>), BenchFleetError> {
    let set = WeightSet {
        version: version as u64,
        ..set.clone()
    };
    let until = Instant::now() + deadline;
    let mut done: Vec<PushOutcome> = Vec::with_capacity(workers.len());
    let mut failures = Vec::new();
    while done.len() < workers.len() {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let missing: Vec<&Worker> = workers
                .iter()
                .filter(|w| !done.iter().any(|o| o.worker == w.url()))
                .collect();
            let w = missing.first().expect("a worker without the version");
            return Err(BenchFleetError::Fleet(format!(
                "version {version}: {} of {} workers ran it within {deadline:?}; {} did not ({}){}",
                done.len(),
                workers.len(),
                w.url(),
                failures.last().map_or("no push reached it", String::as_str),
                tail(&w.log)
            )));
        }
        let round = fleet.push(&set, TOKEN, left).await;
        if round.is_empty() {
            // Every worker left is waiting out its back-off.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        for mut o in round {
            let below = std::mem::take(&mut o.relayed);
            for o in std::iter::once(o).chain(below) {
                match &o.error {
                    Some(e) => failures.push(format!("{}: {e}", o.worker)),
                    None => done.push(o),
                }
            }
        }
    }
    Ok((done, failures))
}

/// `; its log ends: …` with the last lines of `log`, or nothing.
fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(5).collect();
    if lines.is_empty() {
        return String::new();
    }
    let lines: Vec<&str> = lines.into_iter().rev().collect();
    format!("; its log ({}) ends: {}", log.display(), lines.join(" | "))
}

/// The index of the median push by time.
fn median_index(pushes: &[Push]) -> usize {
    let mut order: Vec<usize> = (0..pushes.len()).collect();
    order.sort_by(|&i, &j| pushes[i].seconds.total_cmp(&pushes[j].seconds));
    order[order.len() / 2]
}

/// One worker's push, its ends timed from `started`.
fn hop(o: PushOutcome, started: std::time::SystemTime) -> Hop {
    Hop {
        received_after_seconds: after_seconds(started, o.received_unix_ns),
        in_use_after_seconds: after_seconds(started, o.in_use_unix_ns),
        worker: o.worker,
        parent: o.parent,
        seconds: o.seconds,
        receive_seconds: o.receive_seconds,
        verify_seconds: o.verify_seconds,
        bytes: o.bytes,
    }
}

/// Seconds from `started` to `unix_ns` (a worker's clock; 0 when unknown or earlier).
fn after_seconds(started: std::time::SystemTime, unix_ns: u64) -> f64 {
    let at = std::time::UNIX_EPOCH + Duration::from_nanos(unix_ns);
    if unix_ns == 0 {
        return 0.0;
    }
    at.duration_since(started).map_or(0.0, |d| d.as_secs_f64())
}

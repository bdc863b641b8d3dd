//! A training cluster of real processes on loopback — a reward server, rollout workers and
//! a learner, each its own OS process running the services' command line — that a test
//! can kill (SIGKILL), stop (SIGTERM), restart and probe (gRPC, Prometheus).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rookworld_proto::queue::v1 as queue;
use rookworld_proto::queue::v1::rollout_queue_client::RolloutQueueClient;
use rookworld_proto::rollout::v1 as rollout;
use rookworld_proto::rollout::v1::rollout_service_client::RolloutServiceClient;

pub const LEARNER: &str = env!("CARGO_BIN_EXE_rw-learner");
pub const WORKER: &str = env!("CARGO_BIN_EXE_rw-rollout-worker");
pub const REWARD: &str = env!("CARGO_BIN_EXE_rw-reward-server");

/// One training cluster at a time (the fault and wiring tests): the machine has few cores.
pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Completions per prompt in every scenario.
pub const GROUP: u32 = 4;
/// Seconds a worker has to submit a leased prompt.
pub const LEASE_SECONDS: f64 = 4.0;

/// A free port on 127.0.0.1 for a service that another process binds later. It must stay
/// free until then, so it is taken below the kernel's ephemeral range (where any outgoing
/// connection on the machine, or another `bind(:0)`, could take it meanwhile), and never
/// twice in one test process.
pub fn free_addr() -> SocketAddr {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    // The ephemeral range starts at 32768 unless the machine says otherwise.
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let (low, high) = (10_000u32, ephemeral.clamp(12_000, 65_535));
    let span = high - low;
    // Test processes that run one after another start at different places.
    let start = std::process::id().wrapping_mul(2_654_435_761) % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = low + (start + n) % span;
        if let Ok(listener) = std::net::TcpListener::bind(("127.0.0.1", port as u16)) {
            return listener.local_addr().unwrap();
        }
    }
    panic!("no free port on 127.0.0.1 in {low}..{high}")
}

/// One service process; killed when dropped.
pub struct Proc {
    child: Option<Child>,
    log: PathBuf,
}

impl Proc {
    pub fn spawn(name: &str, bin: &str, args: &[String], dir: &Path) -> Self {
        Self::spawn_logging(name, bin, args, dir, "info")
    }

    /// [`Proc::spawn`] with `dir` as the working directory too (relative paths in `args`
    /// are in it).
    pub fn spawn_in(name: &str, bin: &str, args: &[String], dir: &Path) -> Self {
        Self::start(name, Command::new(bin).current_dir(dir), args, dir, "info")
    }

    /// [`Proc::spawn`] with `RUST_LOG=level`.
    pub fn spawn_logging(name: &str, bin: &str, args: &[String], dir: &Path, level: &str) -> Self {
        Self::start(name, &mut Command::new(bin), args, dir, level)
    }

    fn start(name: &str, command: &mut Command, args: &[String], dir: &Path, level: &str) -> Self {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let bin = command.get_program().to_string_lossy().into_owned();
        let child = command
            .args(args)
            .env("RUST_LOG", level)
            .env_remove("ROOKWORLD_TOKEN")
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("{bin}: {e}"));
        Self {
            child: Some(child),
            log,
        }
    }

    /// kill -9, and reap it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then waits (at most `within`) for the exit; returns whether it exited 0.
    pub fn terminate(&mut self, within: Duration) -> bool {
        let Some(mut c) = self.child.take() else {
            return false;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = c.try_wait() {
                return status.success();
            }
            if started.elapsed() > within {
                let _ = c.kill();
                let _ = c.wait();
                return false;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits (at most `within`) for it to exit by itself; its exit code, `None` while it
    /// runs (or when a signal ended it).
    pub fn exit_code(&mut self, within: Duration) -> Option<i32> {
        let started = Instant::now();
        let c = self.child.as_mut()?;
        loop {
            if let Ok(Some(status)) = c.try_wait() {
                self.child = None; // reaped: nothing left to stop
                return status.code();
            }
            if started.elapsed() > within {
                return None;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Where a worker reaches the learner and where the learner reaches it.
pub struct WorkerAddrs {
    /// The worker's own gRPC and metrics addresses.
    pub listen: SocketAddr,
    pub metrics: SocketAddr,
    /// The learner's queue as this worker calls it (direct or through a proxy).
    pub learner_url: String,
    /// Where the learner pushes weights to it (direct or through a proxy; empty: the
    /// worker's default, its listen address).
    pub advertise: String,
}

/// The cluster's shared settings and addresses.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub token_file: PathBuf,
    pub learner_addr: SocketAddr,
    pub learner_metrics: SocketAddr,
    pub reward_addr: SocketAddr,
    pub reward_metrics: SocketAddr,
    /// Certificates when every connection is mutual TLS ([`Cluster::with_tls`]).
    pub tls: Option<PathBuf>,
}

impl Cluster {
    /// A cluster in a fresh directory (kept after the test when `FAULTS_KEEP` is set).
    pub fn new() -> Self {
        let mut dir = tempfile::tempdir().unwrap();
        if std::env::var_os("FAULTS_KEEP").is_some() {
            dir.disable_cleanup(true);
            eprintln!("cluster directory: {}", dir.path().display());
        }
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, "fault-token\n").unwrap();
        Self {
            token_file,
            learner_addr: free_addr(),
            learner_metrics: free_addr(),
            reward_addr: free_addr(),
            reward_metrics: free_addr(),
            tls: None,
            dir,
        }
    }

    /// A cluster whose every gRPC connection is mutual TLS: a CA and a certificate per
    /// service (and `operator`, the tests' client) from `deploy/tls/make-certs.sh`.
    pub fn with_tls() -> Self {
        let mut c = Self::new();
        c.tls = Some(c.certs());
        c
    }

    /// The cluster's certificates ([`Cluster::with_tls`]'s), made now in `DIR/tls` for a
    /// test that gives some services TLS itself; their directory.
    pub fn certs(&self) -> PathBuf {
        let dir = self.path("tls");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/tls/make-certs.sh");
        let out = Command::new("bash")
            .arg(&script)
            .arg(&dir)
            .args(["learner", "reward-server", "worker", "operator"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "make-certs.sh: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    }

    /// `--tls-cert` and `--tls-key` of `name`'s certificate in `certs`.
    pub fn serving_tls(certs: &Path, name: &str) -> Vec<String> {
        let f = |file: String| certs.join(file).to_str().unwrap().to_owned();
        vec![
            "--tls-cert".into(),
            f(format!("{name}.crt")),
            "--tls-key".into(),
            f(format!("{name}.key")),
        ]
    }

    fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }

    /// `name`'s serving (and, with `client`, calling) TLS flags; none without TLS.
    fn tls_args(&self, name: &str, client: bool) -> Vec<String> {
        let Some(dir) = &self.tls else {
            return vec![];
        };
        let f = |file: &str| dir.join(file).to_str().unwrap().to_owned();
        let mut args = vec![
            "--tls-cert".into(),
            f(&format!("{name}.crt")),
            "--tls-key".into(),
            f(&format!("{name}.key")),
            "--tls-client-ca".into(),
            f("ca.crt"),
        ];
        if client {
            args.extend(self.client_tls_args(name));
        }
        args
    }

    /// `name`'s calling TLS flags (none without TLS).
    fn client_tls_args(&self, name: &str) -> Vec<String> {
        let Some(dir) = &self.tls else {
            return vec![];
        };
        let f = |file: &str| dir.join(file).to_str().unwrap().to_owned();
        vec![
            "--tls-ca".into(),
            f("ca.crt"),
            "--tls-client-cert".into(),
            f(&format!("{name}.crt")),
            "--tls-client-key".into(),
            f(&format!("{name}.key")),
        ]
    }

    /// The tests' own client TLS (the `operator` certificate).
    pub fn client_tls(&self) -> rookworld_service::tls::ClientTlsArgs {
        match &self.tls {
            None => Default::default(),
            Some(dir) => rookworld_service::tls::ClientTlsArgs {
                tls_ca: Some(dir.join("ca.crt")),
                tls_client_cert: Some(dir.join("operator.crt")),
                tls_client_key: Some(dir.join("operator.key")),
                ..Default::default()
            },
        }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn learner_url(&self) -> String {
        format!("{}://{}", self.scheme(), self.learner_addr)
    }

    pub fn reward_url(&self) -> String {
        format!("{}://{}", self.scheme(), self.reward_addr)
    }

    pub fn reward_server(&self) -> Proc {
        self.reward_server_with(Some(&self.token_file))
    }

    /// The reward server with its token from `token_file` (`None`: no token).
    pub fn reward_server_with(&self, token_file: Option<&Path>) -> Proc {
        let mut args: Vec<String> = [
            "serve",
            "--listen",
            &self.reward_addr.to_string(),
            "--metrics",
            &self.reward_metrics.to_string(),
        ]
        .map(String::from)
        .to_vec();
        if let Some(file) = token_file {
            args.extend(["--token-file".into(), file.to_str().unwrap().to_owned()]);
        }
        args.extend(self.tls_args("reward-server", false));
        Proc::spawn("reward", REWARD, &args, self.dir.path())
    }

    /// A worker that pulls from `addrs.learner_url` and scores at the reward server.
    pub fn worker(&self, id: &str, addrs: &WorkerAddrs) -> Proc {
        self.worker_with(id, addrs, &self.token_file)
    }

    /// [`Cluster::worker`] with its token from `token_file`.
    pub fn worker_with(&self, id: &str, addrs: &WorkerAddrs, token_file: &Path) -> Proc {
        let mut args = self.worker_base(id, addrs, token_file);
        args.extend(self.tls_args("worker", true));
        Proc::spawn(id, WORKER, &args, self.dir.path())
    }

    /// [`Cluster::worker`] with `extra` flags (a `--preset` replaces `tiny`), calling out
    /// with the cluster's client TLS, and serving it only when `serve_tls`.
    pub fn worker_args(
        &self,
        id: &str,
        addrs: &WorkerAddrs,
        extra: &[String],
        serve_tls: bool,
    ) -> Proc {
        let mut args = self.worker_base(id, addrs, &self.token_file);
        if extra.iter().any(|a| a == "--preset") {
            let at = args.iter().position(|a| a == "--preset").unwrap();
            args.drain(at..at + 2);
        }
        args.extend(extra.iter().cloned());
        args.extend(if serve_tls {
            self.tls_args("worker", true)
        } else {
            self.client_tls_args("worker")
        });
        Proc::spawn(id, WORKER, &args, self.dir.path())
    }

    /// A worker's flags, TLS aside.
    fn worker_base(&self, id: &str, addrs: &WorkerAddrs, token_file: &Path) -> Vec<String> {
        let args = [
            "serve",
            "--preset",
            "tiny",
            "--listen",
            &addrs.listen.to_string(),
            "--metrics",
            &addrs.metrics.to_string(),
            "--token-file",
            token_file.to_str().unwrap(),
            "--learner",
            &addrs.learner_url,
            "--reward",
            &self.reward_url(),
            "--worker-id",
            id,
            "--max-in-flight",
            "2",
        ]
        .map(String::from)
        .to_vec();
        let mut args = args;
        if !addrs.advertise.is_empty() {
            args.extend(["--advertise".to_owned(), addrs.advertise.clone()]);
        }
        args
    }

    /// The learner, fresh or resumed; small steps, short leases, frequent checkpoints,
    /// the step log and the rollout dump in the cluster's directory.
    pub fn learner(&self, resume: bool) -> Proc {
        self.learner_with(if resume { &["--resume"] } else { &[] })
    }

    /// The learner with `extra` flags (`--resume`, `--overwrite`).
    pub fn learner_with(&self, extra: &[&str]) -> Proc {
        self.learner_args(extra, true)
    }

    /// The learner with `extra` flags, and without `--reward` unless `reward` (it then
    /// does not check the reward server at start).
    pub fn learner_args(&self, extra: &[&str], reward: bool) -> Proc {
        let mut args: Vec<String> = [
            "train",
            "--preset",
            "tiny",
            "--run-dir",
            self.path("run").to_str().unwrap(),
            "--listen",
            &self.learner_addr.to_string(),
            "--metrics",
            &self.learner_metrics.to_string(),
            "--token-file",
            self.token_file.to_str().unwrap(),
            "--reward",
            &self.reward_url(),
            "--steps",
            "100000",
            "--sft-steps",
            "0",
            "--prompts-per-step",
            "2",
            "--micro-batch-groups",
            "2",
            "--group-size",
            &GROUP.to_string(),
            "--max-new-tokens",
            "12",
            "--lease-timeout",
            &LEASE_SECONDS.to_string(),
            "--checkpoint-every",
            "2",
            "--drain-timeout",
            "5",
            "--push-timeout",
            "5",
            "--log-jsonl",
            self.path("steps.jsonl").to_str().unwrap(),
            "--rollout-dump",
            self.path("groups.jsonl").to_str().unwrap(),
            "--no-progress",
        ]
        .map(String::from)
        .to_vec();
        if !reward {
            let at = args.iter().position(|a| a == "--reward").unwrap();
            args.drain(at..at + 2);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        args.extend(self.tls_args("learner", true));
        Proc::spawn("learner", LEARNER, &args, self.dir.path())
    }

    /// The worker's addresses when it talks to the learner directly.
    pub fn direct(&self) -> WorkerAddrs {
        let listen = free_addr();
        WorkerAddrs {
            listen,
            metrics: free_addr(),
            learner_url: self.learner_url(),
            advertise: format!("{}://{listen}", self.scheme()),
        }
    }

    async fn queue(&self) -> Option<RolloutQueueClient<tonic::transport::Channel>> {
        let channel = self
            .client_tls()
            .endpoint(&self.learner_url())
            .unwrap()
            .connect_timeout(Duration::from_secs(1))
            .timeout(Duration::from_secs(3))
            .connect()
            .await
            .ok()?;
        Some(RolloutQueueClient::new(channel))
    }

    /// The queue's depths and counters, `None` while the learner does not answer.
    pub async fn depths(&self) -> Option<queue::GetDepthsResponse> {
        let mut q = self.queue().await?;
        Some(
            q.get_depths(queue::GetDepthsRequest {})
                .await
                .ok()?
                .into_inner(),
        )
    }

    /// The learner's workers by id.
    pub async fn workers(&self) -> Vec<queue::WorkerInfo> {
        let Some(mut q) = self.queue().await else {
            return vec![];
        };
        q.list_workers(queue::ListWorkersRequest {})
            .await
            .map(|r| r.into_inner().workers)
            .unwrap_or_default()
    }

    /// Steps done, from the step log.
    pub fn steps(&self) -> u64 {
        std::fs::read_to_string(self.path("steps.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["step"].as_u64())
            .max()
            .unwrap_or(0)
    }

    /// The weight version the worker on `listen` reports, over the cluster's TLS.
    pub async fn worker_version_tls(&self, listen: SocketAddr) -> Option<u64> {
        let url = format!("{}://{listen}", self.scheme());
        let status = worker_status(&url, &self.client_tls()).await?;
        Some(status.weight_version)
    }
}

/// The weight version a worker's service reports, `None` while it does not answer.
pub async fn worker_version(listen: SocketAddr) -> Option<u64> {
    worker_weights(listen).await.map(|(_, version)| version)
}

/// The run id and weight version a worker's `Status` reports.
pub async fn worker_weights(listen: SocketAddr) -> Option<(String, u64)> {
    let status = worker_status(&format!("http://{listen}"), &Default::default()).await?;
    Some((status.weight_run_id, status.weight_version))
}

/// A worker's `Status` at `url`, `None` while it does not answer.
async fn worker_status(
    url: &str,
    tls: &rookworld_service::tls::ClientTlsArgs,
) -> Option<rollout::StatusResponse> {
    let channel = tls
        .endpoint(url)
        .ok()?
        .timeout(Duration::from_secs(3))
        .connect()
        .await
        .ok()?;
    let status = RolloutServiceClient::new(channel)
        .status(rollout::StatusRequest {})
        .await
        .ok()?;
    Some(status.into_inner())
}

/// The value of the first sample of `metric` whose line contains every one of `labels`.
pub fn metric(addr: SocketAddr, metric: &str, labels: &[&str]) -> Option<f64> {
    let text = rookworld_service::probe::scrape_metrics(addr).ok()?;
    text.lines()
        .filter(|l| l.starts_with(metric) && !l.starts_with('#'))
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

impl Cluster {
    /// Polls `check` every 200 ms until it holds; panics after `within` with the tail of
    /// every process's log.
    pub async fn wait_until<F, Fut>(&self, within: Duration, what: &str, mut check: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let started = Instant::now();
        while !check().await {
            if started.elapsed() > within {
                panic!(
                    "timed out after {within:?} waiting for {what}\n{}",
                    self.log_tails()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The last lines of every process's log.
    pub fn log_tails(&self) -> String {
        let mut out = String::new();
        let mut logs: Vec<_> = std::fs::read_dir(self.dir.path())
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        logs.sort();
        for path in logs {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            out += &format!("--- {}\n", path.display());
            for line in tail.into_iter().rev() {
                out += line;
                out.push('\n');
            }
        }
        out
    }
}

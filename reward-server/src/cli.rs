//! Command-line options and the `serve` and `score` commands.

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::service::{self, ServiceConfig};
use rookworld_chess::score::{RewardConfig, Score};
use rookworld_chess::scorer::{Item, Scorer};
use rookworld_chess::stockfish::{SearchLimit, StockfishConfig, StockfishPool};

/// Engine and weight options shared by `serve`, `score` and `bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct ScoringArgs {
    /// UCI engine (Stockfish) to grade policy answers; without it, format + legality only.
    #[arg(long, env = "REWARD_ENGINE")]
    pub engine: Option<PathBuf>,
    /// Engine processes in the pool.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "REWARD_ENGINE_PROCESSES",
        default_value_t = 1
    )]
    pub engine_processes: usize,
    /// Search depth per position (ignored when --engine-movetime-ms is given).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "REWARD_ENGINE_DEPTH",
        default_value_t = 10
    )]
    pub engine_depth: u32,
    /// Search time per position instead of a depth.
    #[arg(long, allow_negative_numbers = true, env = "REWARD_ENGINE_MOVETIME_MS")]
    pub engine_movetime_ms: Option<u64>,
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "REWARD_ENGINE_THREADS",
        default_value_t = 1
    )]
    pub engine_threads: u32,
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "REWARD_ENGINE_HASH_MB",
        default_value_t = 16
    )]
    pub engine_hash_mb: u32,
    /// Deadline of one engine query; a hung engine is replaced after it.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "REWARD_ENGINE_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub engine_timeout_ms: u64,
    /// Deadline of an engine's start (handshake and options).
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "REWARD_ENGINE_START_TIMEOUT_MS",
        default_value_t = 30_000
    )]
    pub engine_start_timeout_ms: u64,
    /// Analyses kept in the position cache.
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "REWARD_ENGINE_CACHE",
        default_value_t = 100_000
    )]
    pub engine_cache: usize,
    /// JSON file of component weights (missing keys keep their defaults).
    #[arg(long, env = "REWARD_WEIGHTS")]
    pub weights: Option<PathBuf>,
}

/// A configuration problem: one clear line, non-zero exit.
pub use rookworld_service::validate::ConfigError;

impl ScoringArgs {
    /// Reads the weights and starts the engine pool, if any.
    pub async fn scorer(&self) -> Result<Scorer, ConfigError> {
        let config = match &self.weights {
            None => RewardConfig::default(),
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| ConfigError::Unusable(format!("{}: {e}", path.display())))?;
                serde_json::from_str(&text)
                    .map_err(|e| ConfigError::Unusable(format!("{}: {e}", path.display())))?
            }
        };
        config.validate().map_err(ConfigError::Value)?;
        let engine = match &self.engine {
            None => None,
            Some(path) => {
                let mut cfg = StockfishConfig::new(path);
                cfg.processes = self.engine_processes.max(1);
                cfg.limit = match self.engine_movetime_ms {
                    Some(ms) => SearchLimit::MoveTime(Duration::from_millis(ms)),
                    None => SearchLimit::Depth(self.engine_depth),
                };
                cfg.threads = self.engine_threads;
                cfg.hash_mb = self.engine_hash_mb;
                cfg.timeout = Duration::from_millis(self.engine_timeout_ms);
                cfg.start_timeout = Duration::from_millis(self.engine_start_timeout_ms);
                cfg.cache_capacity = self.engine_cache;
                let pool = StockfishPool::start(cfg).await.map_err(|e| {
                    ConfigError::Unusable(format!("cannot start engine {}: {e}", path.display()))
                })?;
                Some(Arc::new(pool))
            }
        };
        Ok(Scorer::new(config, engine))
    }
}

/// Options of `reward-server serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    #[arg(long, env = "REWARD_LISTEN", default_value = "127.0.0.1:50052")]
    pub listen: SocketAddr,
    /// Address of the Prometheus `/metrics` endpoint.
    #[arg(long, env = "REWARD_METRICS", default_value = "127.0.0.1:9092")]
    pub metrics: SocketAddr,
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "REWARD_MAX_ITEMS_IN_FLIGHT",
        default_value_t = 65_536
    )]
    pub max_items_in_flight: usize,
    #[arg(
        long,
        allow_negative_numbers = true,
        env = "REWARD_MAX_ITEMS_PER_CALL",
        default_value_t = 16_384
    )]
    pub max_items_per_call: usize,
    #[command(flatten)]
    pub scoring: ScoringArgs,
    #[command(flatten)]
    pub token: rookworld_service::auth::TokenArgs,
    #[command(flatten)]
    pub tls: rookworld_service::tls::ServerTlsArgs,
}

impl ServeArgs {
    /// Counts in range: one line at start, not a server that refuses every call.
    fn validate(&self) -> Result<(), ConfigError> {
        use rookworld_service::validate::at_least;
        [
            at_least("--max-items-per-call", self.max_items_per_call as u64, 1),
            at_least("--max-items-in-flight", self.max_items_in_flight as u64, 1),
        ]
        .into_iter()
        .collect::<Result<(), _>>()
    }
}

/// `reward-server serve`: until Ctrl-C or SIGTERM.
pub async fn serve(args: &ServeArgs) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    args.validate()?;
    let (token, inspect_token) = (
        args.token.resolve().map_err(ConfigError::Unusable)?,
        args.token
            .resolve_inspect()
            .map_err(ConfigError::Unusable)?,
    );
    if token.is_none() {
        tracing::warn!("no --token / ROOKWORLD_TOKEN: Score calls will be refused");
    }
    let tls = args.tls.load().map_err(ConfigError::Unusable)?;
    let scorer = args.scoring.scorer().await?;
    let metrics = crate::metrics::install_exporter(args.metrics)
        .map_err(|e| ConfigError::Unusable(format!("metrics on {}: {e}", args.metrics)))?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| ConfigError::Unusable(format!("cannot listen on {}: {e}", args.listen)))?;
    tracing::info!(listen = %listener.local_addr()?, %metrics, engine = scorer.engine().is_some(), "reward server ready");
    let cfg = ServiceConfig {
        guard: rookworld_service::auth::Guard::new(token, inspect_token),
        tls,
        max_items_in_flight: args.max_items_in_flight,
        max_items_per_call: args.max_items_per_call,
        ..ServiceConfig::default()
    };
    service::run(
        scorer,
        cfg,
        listener,
        rookworld_service::serve::shutdown_signal(),
    )
    .await
}

/// Options of `reward-server score`.
#[derive(Debug, Clone, clap::Args)]
pub struct ScoreArgs {
    /// JSONL input, `-` for stdin.
    #[arg(long, default_value = "-")]
    pub input: String,
    #[command(flatten)]
    pub scoring: ScoringArgs,
}

#[derive(Deserialize)]
struct InputLine {
    task: String,
    prompt: String,
    completion: String,
}

/// Lines scored per batch.
const CHUNK: usize = 4096;
/// Longest input line: a RookWorld item is a few hundred bytes; a longer line is refused
/// without being held whole, so a batch holds at most `CHUNK` × this.
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// Reads one `\n`-terminated line into `buf`, keeping at most `max` bytes of it: `None` at
/// the end of the input, `Some(false)` when the line was longer (the rest is skipped).
fn read_line_bounded<R: BufRead>(
    input: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<Option<bool>> {
    let mut read_any = false;
    let mut fits = true;
    loop {
        let chunk = input.fill_buf()?;
        if chunk.is_empty() {
            return Ok(read_any.then_some(fits));
        }
        read_any = true;
        let (line, done) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (&chunk[..=i], true),
            None => (chunk, false),
        };
        let used = line.len();
        if fits && buf.len() + used <= max {
            buf.extend_from_slice(line);
        } else {
            fits = false;
        }
        input.consume(used);
        if done {
            return Ok(Some(fits));
        }
    }
}

/// How `reward-server score` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scored {
    /// Input lines whose results were written.
    pub lines: usize,
    /// Whether `stop` ended it before the end of the input.
    pub stopped: bool,
}

/// `reward-server score`: one JSON line out per line in, in order. A bad line gets
/// `{"error": …}` and never stops the rest; only I/O errors end the command. The input is
/// read on a thread of its own, so `stop` (Ctrl-C or SIGTERM) ends the command at once
/// even while it waits for input; the results of a batch being scored then are dropped,
/// and every line written before is whole.
pub async fn score<R: BufRead + Send + 'static, W: Write>(
    scorer: &Scorer,
    input: R,
    out: &mut W,
    stop: impl std::future::Future<Output = ()>,
) -> std::io::Result<Scored> {
    let (batches, mut next) = tokio::sync::mpsc::channel(1);
    std::thread::Builder::new()
        .name("score input".into())
        .spawn(move || read_batches(input, batches))?;
    tokio::pin!(stop);
    let mut lines = 0;
    loop {
        let parsed = tokio::select! {
            batch = next.recv() => match batch {
                None => return Ok(Scored { lines, stopped: false }),
                Some(batch) => batch?,
            },
            _ = &mut stop => return Ok(Scored { lines, stopped: true }),
        };
        let items: Vec<Item> = parsed
            .iter()
            .filter_map(|p| p.as_ref().ok().cloned())
            .collect();
        let scores = tokio::select! {
            scores = scorer.score_each(&items) => scores,
            _ = &mut stop => return Ok(Scored { lines, stopped: true }),
        };
        let mut scores = scores.into_iter();
        for p in &parsed {
            let json = match p {
                Err(e) => serde_json::json!({ "error": e }),
                Ok(_) => match scores.next().expect("one score per item") {
                    Ok(score) => score_json(&score),
                    Err(e) => serde_json::json!({ "error": e.to_string() }),
                },
            };
            writeln!(out, "{json}")?;
        }
        out.flush()?;
        lines += parsed.len();
    }
}

/// A batch of parsed input lines (each an item or why it is not one).
type Batch = Vec<Result<Item, String>>;

/// Reads `input` into batches of at most [`CHUNK`] lines and sends them until the end of
/// the input, a read error (sent, then the end) or a receiver that went away.
fn read_batches<R: BufRead>(
    mut input: R,
    batches: tokio::sync::mpsc::Sender<std::io::Result<Batch>>,
) {
    let mut line_no = 0usize;
    let mut buf = Vec::new();
    loop {
        let mut parsed: Batch = Vec::with_capacity(CHUNK);
        while parsed.len() < CHUNK {
            buf.clear();
            let fits = match read_line_bounded(&mut input, &mut buf, MAX_LINE_BYTES) {
                Ok(Some(fits)) => fits,
                Ok(None) => break,
                Err(e) => {
                    let _ = batches.blocking_send(Err(e));
                    return;
                }
            };
            line_no += 1;
            parsed.push(if fits {
                parse_line(&buf).map_err(|e| format!("line {line_no}: {e}"))
            } else {
                Err(format!(
                    "line {line_no}: longer than {MAX_LINE_BYTES} bytes"
                ))
            });
        }
        let end = parsed.len() < CHUNK;
        if (!parsed.is_empty() && batches.blocking_send(Ok(parsed)).is_err()) || end {
            return;
        }
    }
}

fn parse_line(raw: &[u8]) -> Result<Item, String> {
    let text = std::str::from_utf8(raw).map_err(|e| format!("not UTF-8: {e}"))?;
    let line: InputLine =
        serde_json::from_str(text.trim_end_matches(['\n', '\r'])).map_err(|e| e.to_string())?;
    Ok(Item {
        task: line
            .task
            .parse()
            .map_err(|e: rookworld_chess::error::RequestError| e.to_string())?,
        prompt: line.prompt,
        completion: line.completion,
    })
}

/// `{"reward", "verdict", "engine_graded", "components": {…, "reason"?}}`.
pub fn score_json(score: &Score) -> serde_json::Value {
    let mut components: serde_json::Map<String, serde_json::Value> = score
        .components
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).into()))
        .collect();
    if let Some(m) = &score.malformed {
        components.insert("reason".into(), m.detail.clone().into());
    }
    serde_json::json!({
        "reward": score.reward,
        "verdict": score.verdict.label(),
        "engine_graded": score.engine_graded,
        "components": components,
    })
}

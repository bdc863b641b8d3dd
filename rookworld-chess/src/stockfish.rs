//! A pool of UCI engines (Stockfish) giving multipv analyses, with a position cache.
//!
//! Each engine is a child process spoken to over pipes. A query that times out, or
//! whose engine dies, kills that engine, starts a fresh one in its place and retries
//! the query on it, so a crashed or hung engine never loses a request. Analyses are
//! cached by position (FEN without clocks) and search limit.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex as StdMutex;
use std::time::Duration;

use crate::metrics::names;
use shakmaty::uci::UciMove;
use shakmaty::{Chess, Move};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::{Mutex, Semaphore};

/// Stockfish where it is usually installed: `$STOCKFISH`, else `stockfish` on the PATH,
/// else Debian's `/usr/games/stockfish`; `None` when there is none.
pub fn find_stockfish() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::var_os("STOCKFISH")
        .map(PathBuf::from)
        .into_iter()
        .chain(std::env::split_paths(&path).map(|d| d.join("stockfish")))
        .chain([PathBuf::from("/usr/games/stockfish")])
        .find(|p| p.is_file())
}

/// For tests that need Stockfish: the engine, or `None` after saying SKIPPED — unless
/// `ROOKWORLD_REQUIRE_STOCKFISH` is set (CI sets it where it installed one), which makes
/// a missing engine a failure instead of a skip.
pub fn stockfish_for_tests() -> Option<PathBuf> {
    let found = find_stockfish();
    if found.is_none() {
        assert!(
            std::env::var_os("ROOKWORLD_REQUIRE_STOCKFISH").is_none(),
            "Stockfish is required (ROOKWORLD_REQUIRE_STOCKFISH is set) and none is installed"
        );
        // libtest captures the output of passing tests; the process's own stderr shows
        // the skip on a terminal and in CI logs.
        use std::io::Write;
        let msg = "SKIPPED: stockfish not installed (apt-get install -y stockfish)\n";
        match std::fs::OpenOptions::new().append(true).open("/dev/stderr") {
            Ok(mut stderr) => drop(stderr.write_all(msg.as_bytes())),
            Err(_) => eprint!("{msg}"),
        }
    }
    found
}

/// How an engine searches each position.
#[derive(Debug, Clone, PartialEq)]
pub enum SearchLimit {
    Depth(u32),
    MoveTime(Duration),
}

/// Engine pool settings.
#[derive(Debug, Clone)]
pub struct StockfishConfig {
    pub path: PathBuf,
    pub processes: usize,
    pub limit: SearchLimit,
    pub threads: u32,
    pub hash_mb: u32,
    pub multipv: u32,
    /// Deadline of one search; a hung engine is replaced after it.
    pub timeout: Duration,
    /// Deadline of an engine's start (UCI handshake and options). Kept apart from the
    /// search deadline: a loaded machine or a large network file can slow a start far
    /// more than a search.
    pub start_timeout: Duration,
    /// Attempts per query (each on a fresh engine after a failure).
    pub attempts: u32,
    /// Analyses kept in the cache.
    pub cache_capacity: usize,
}

impl StockfishConfig {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            processes: 1,
            limit: SearchLimit::Depth(10),
            threads: 1,
            hash_mb: 16,
            multipv: 5,
            timeout: Duration::from_secs(10),
            start_timeout: Duration::from_secs(30),
            attempts: 3,
            cache_capacity: 100_000,
        }
    }
}

/// One engine line: a move and its evaluation from the side to move, in pawns
/// (mate in n is ±(1000 − n/10), like the data's ±999.9).
#[derive(Debug, Clone, PartialEq)]
pub struct AnalysisLine {
    pub mv: Move,
    pub uci: String,
    pub eval_pawns: f64,
}

/// The engine's multipv lines, best first.
#[derive(Debug, Clone, PartialEq)]
pub struct Analysis {
    pub lines: Vec<AnalysisLine>,
}

/// Why an analysis failed after every attempt.
#[derive(Debug, thiserror::Error)]
pub enum StockfishError {
    #[error("engine {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("engine query timed out after {0:?}")]
    Timeout(Duration),
    #[error("engine protocol error: {0}")]
    Protocol(String),
}

struct Process {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl Process {
    async fn start(cfg: &StockfishConfig) -> Result<Self, StockfishError> {
        let io = |source| StockfishError::Io {
            path: cfg.path.display().to_string(),
            source,
        };
        let mut child = Command::new(&cfg.path)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(io)?;
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let mut p = Self {
            child,
            stdin,
            stdout,
        };
        p.send("uci").await?;
        p.wait_for("uciok").await?;
        let options = format!(
            "setoption name Threads value {}\nsetoption name Hash value {}\nsetoption name MultiPV value {}",
            cfg.threads, cfg.hash_mb, cfg.multipv
        );
        p.send(&options).await?;
        p.send("isready").await?;
        p.wait_for("readyok").await?;
        Ok(p)
    }

    async fn send(&mut self, line: &str) -> Result<(), StockfishError> {
        let write = async {
            self.stdin.write_all(line.as_bytes()).await?;
            self.stdin.write_all(b"\n").await?;
            self.stdin.flush().await
        };
        write.await.map_err(|source| StockfishError::Io {
            path: "stdin".into(),
            source,
        })
    }

    async fn next_line(&mut self) -> Result<String, StockfishError> {
        match self.stdout.next_line().await {
            Ok(Some(line)) => Ok(line),
            Ok(None) => Err(StockfishError::Protocol(
                "engine closed its output (crashed?)".into(),
            )),
            Err(source) => Err(StockfishError::Io {
                path: "stdout".into(),
                source,
            }),
        }
    }

    async fn wait_for(&mut self, token: &str) -> Result<(), StockfishError> {
        while self.next_line().await?.trim() != token {}
        Ok(())
    }

    async fn analyse(
        &mut self,
        pos: &Chess,
        fen: &str,
        limit: &SearchLimit,
    ) -> Result<Analysis, StockfishError> {
        let go = match limit {
            SearchLimit::Depth(d) => format!("go depth {d}"),
            SearchLimit::MoveTime(t) => format!("go movetime {}", t.as_millis().max(1)),
        };
        self.send(&format!("position fen {fen}\n{go}")).await?;
        let mut lines: Vec<Option<AnalysisLine>> = Vec::new();
        loop {
            let line = self.next_line().await?;
            if line.starts_with("bestmove") {
                return Ok(Analysis {
                    lines: lines.into_iter().flatten().collect(),
                });
            }
            if let Some((k, parsed)) = parse_info(pos, &line) {
                if lines.len() < k {
                    lines.resize(k, None);
                }
                lines[k - 1] = Some(parsed);
            }
        }
    }
}

/// Parses `info … multipv k … score cp x|mate n … pv m …` (bounds skipped).
fn parse_info(pos: &Chess, line: &str) -> Option<(usize, AnalysisLine)> {
    let tokens: Vec<&str> = line.split_whitespace().collect();
    if tokens.first() != Some(&"info")
        || tokens.contains(&"lowerbound")
        || tokens.contains(&"upperbound")
    {
        return None;
    }
    let after = |key: &str| {
        tokens
            .iter()
            .position(|t| *t == key)
            .and_then(|i| tokens.get(i + 1))
    };
    let k: usize = after("multipv").map_or(Some(1), |v| v.parse().ok())?;
    let score_at = tokens.iter().position(|t| *t == "score")?;
    let value: f64 = tokens.get(score_at + 2)?.parse().ok()?;
    let eval_pawns = match *tokens.get(score_at + 1)? {
        "cp" => value / 100.0,
        "mate" => value.signum() * (1000.0 - value.abs() / 10.0),
        _ => return None,
    };
    let uci = *after("pv")?;
    let mv = UciMove::from_ascii(uci.as_bytes())
        .ok()?
        .to_move(pos)
        .ok()?;
    (k >= 1).then(|| {
        (
            k,
            AnalysisLine {
                mv,
                uci: uci.to_owned(),
                eval_pawns,
            },
        )
    })
}

/// Bounded cache, oldest entries evicted first.
struct Cache {
    map: HashMap<String, Arc<Analysis>>,
    order: VecDeque<String>,
    capacity: usize,
}

impl Cache {
    fn get(&self, key: &str) -> Option<Arc<Analysis>> {
        self.map.get(key).cloned()
    }

    fn insert(&mut self, key: String, value: Arc<Analysis>) {
        if self.capacity == 0 || self.map.contains_key(&key) {
            return;
        }
        while self.map.len() >= self.capacity {
            match self.order.pop_front() {
                Some(old) => {
                    self.map.remove(&old);
                }
                None => break,
            }
        }
        self.order.push_back(key.clone());
        self.map.insert(key, value);
    }
}

/// N engine processes behind a semaphore, plus the cache.
pub struct StockfishPool {
    cfg: StockfishConfig,
    idle: Mutex<Vec<Process>>,
    slots: Semaphore,
    cache: StdMutex<Cache>,
}

impl std::fmt::Debug for StockfishPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StockfishPool")
            .field("cfg", &self.cfg)
            .finish()
    }
}

impl StockfishPool {
    /// Starts every engine; fails if the first cannot be started (bad path, not UCI).
    pub async fn start(cfg: StockfishConfig) -> Result<Self, StockfishError> {
        let mut procs = Vec::with_capacity(cfg.processes);
        for _ in 0..cfg.processes.max(1) {
            let p = tokio::time::timeout(cfg.start_timeout, Process::start(&cfg))
                .await
                .map_err(|_| StockfishError::Timeout(cfg.start_timeout))??;
            procs.push(p);
        }
        Ok(Self {
            slots: Semaphore::new(procs.len()),
            idle: Mutex::new(procs),
            cache: StdMutex::new(Cache {
                map: HashMap::new(),
                order: VecDeque::new(),
                capacity: cfg.cache_capacity,
            }),
            cfg,
        })
    }

    pub fn config(&self) -> &StockfishConfig {
        &self.cfg
    }

    /// Engine PIDs now idle (for tests that kill or stop engines).
    pub async fn idle_pids(&self) -> Vec<u32> {
        self.idle
            .lock()
            .await
            .iter()
            .filter_map(|p| p.child.id())
            .collect()
    }

    /// The multipv analysis of `pos`, from the cache or an engine.
    pub async fn analyse(&self, pos: &Chess) -> Result<Arc<Analysis>, StockfishError> {
        let fen = crate::rules::fen(pos);
        let key = format!(
            "{}|{:?}",
            fen.rsplitn(3, ' ').nth(2).unwrap_or(&fen),
            self.cfg.limit
        );
        if let Some(hit) = self.cache.lock().expect("cache lock").get(&key) {
            metrics::counter!(names::ENGINE_CACHE_HITS_TOTAL).increment(1);
            return Ok(hit);
        }
        metrics::counter!(names::ENGINE_CACHE_MISSES_TOTAL).increment(1);

        let _slot = self.slots.acquire().await.expect("semaphore never closed");
        let mut process = self.idle.lock().await.pop();
        let mut last_error = None;
        for _ in 0..self.cfg.attempts.max(1) {
            let mut p = match process.take() {
                Some(p) => p,
                None => {
                    match tokio::time::timeout(self.cfg.start_timeout, Process::start(&self.cfg))
                        .await
                    {
                        Ok(Ok(p)) => p,
                        Ok(Err(e)) => {
                            last_error = Some(e);
                            continue;
                        }
                        Err(_) => {
                            last_error = Some(StockfishError::Timeout(self.cfg.start_timeout));
                            continue;
                        }
                    }
                }
            };
            match tokio::time::timeout(self.cfg.timeout, p.analyse(pos, &fen, &self.cfg.limit))
                .await
            {
                Ok(Ok(analysis)) => {
                    self.idle.lock().await.push(p);
                    let analysis = Arc::new(analysis);
                    self.cache
                        .lock()
                        .expect("cache lock")
                        .insert(key, analysis.clone());
                    return Ok(analysis);
                }
                Ok(Err(e)) => last_error = Some(e),
                Err(_) => last_error = Some(StockfishError::Timeout(self.cfg.timeout)),
            }
            // The engine failed or hung: kill it; the next attempt starts a fresh one.
            let _ = p.child.start_kill();
            metrics::counter!(names::ENGINE_RESTARTS_TOTAL).increment(1);
            tracing::warn!(error = %last_error.as_ref().expect("set"), "engine replaced");
        }
        // Keep the pool at full strength even when every attempt failed.
        let start = tokio::time::timeout(self.cfg.start_timeout, Process::start(&self.cfg));
        if let Ok(Ok(p)) = start.await {
            self.idle.lock().await.push(p);
        }
        Err(last_error.unwrap_or_else(|| StockfishError::Protocol("no attempt made".into())))
    }
}

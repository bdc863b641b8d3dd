//! What a push did to one worker, and why none reaches a worker: the types both the fleet
//! ([`super`]) and one worker's push ([`super::one`]) speak in.

/// What happened to one worker in one push.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PushOutcome {
    pub worker: String,
    pub version: u64,
    pub seconds: f64,
    /// Bytes sent (the delta's, on the delta path; a shared push counts the bytes the
    /// worker reads); 0 when the push failed.
    pub bytes: u64,
    /// `None` when the worker now runs `version`.
    pub error: Option<String>,
    /// What blocks every push to this worker until something changes there or here.
    pub blocked: Option<Blocked>,
    /// How the payload went: "shared" (the worker read the shared file), "delta" (only
    /// what changed since the version it ran) or "stream".
    pub path: &'static str,
    /// The worker could not read the shared file: stream to it from now on.
    pub shared_refused: bool,
    /// Why the worker refused a delta, when it did (the payload was then streamed).
    pub delta_refused: Option<String>,
    /// The worker's phases of the push that reached it: receiving the bytes, and (for a
    /// delta) applying and hashing it; 0 when it failed.
    pub receive_seconds: f64,
    pub verify_seconds: f64,
    /// The worker's clock when its last chunk arrived and when the version went into use,
    /// nanoseconds since the Unix epoch (0: unknown): a push's end across workers where
    /// the clocks agree.
    pub received_unix_ns: u64,
    pub in_use_unix_ns: u64,
    /// The worker that relayed the push to this one (`None`: the learner sent it).
    pub parent: Option<String>,
    /// A relayed push its stream never reached (a relay above it failed): no failure of
    /// its own, and it is served again at once.
    pub unreached: bool,
    /// The pushes this worker relayed: every worker of its tree.
    pub relayed: Vec<PushOutcome>,
}

/// Bytes the pushes that reached workers sent, by kind, since the last count was taken
/// (the step log's `pushed`, TensorBoard's `push/*`).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PushBytes {
    /// Pushes that reached a worker.
    pub pushes: u64,
    /// Whole payloads streamed.
    pub full: u64,
    /// Deltas streamed.
    pub delta: u64,
    /// Payloads workers on this host read from the shared file.
    pub shared: u64,
    /// Payloads and deltas relays forwarded to other workers (not the learner's egress).
    #[serde(default)]
    pub relayed: u64,
}

impl PushBytes {
    /// Counts one push's outcome.
    pub fn add(&mut self, o: &PushOutcome) {
        if o.error.is_some() {
            return;
        }
        self.pushes += 1;
        match (o.parent.is_some(), o.path) {
            (true, _) => self.relayed += o.bytes,
            (false, "delta") => self.delta += o.bytes,
            (false, "shared") => self.shared += o.bytes,
            (false, _) => self.full += o.bytes,
        }
    }

    /// Mean bytes a push sent (the learner's or a relay's).
    pub fn per_push(&self) -> u64 {
        (self.full + self.delta + self.shared + self.relayed) / self.pushes.max(1)
    }
}

/// `none`, or `3 pushes, 15.6 MB each: 46.8 MB delta` (kinds that sent nothing left out).
impl std::fmt::Display for PushBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.pushes == 0 {
            return f.write_str("none");
        }
        let plural = if self.pushes == 1 { "" } else { "es" };
        write!(
            f,
            "{} push{plural}, {} each",
            self.pushes,
            bytes_text(self.per_push())
        )?;
        let kinds = [
            ("full", self.full),
            ("delta", self.delta),
            ("shared", self.shared),
            ("relayed", self.relayed),
        ];
        let mut sep = ": ";
        for (kind, bytes) in kinds.into_iter().filter(|(_, b)| *b > 0) {
            write!(f, "{sep}{} {kind}", bytes_text(bytes))?;
            sep = ", ";
        }
        Ok(())
    }
}

/// `512 B`, `15.6 MB` (decimal units).
fn bytes_text(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..1_000 => format!("{bytes} B"),
        1_000..1_000_000 => format!("{:.1} kB", b / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} MB", b / 1e6),
        _ => format!("{:.2} GB", b / 1e9),
    }
}

/// Why no push reaches or fits a worker until something changes, at the worker or here:
/// the queue answers its leases with the line [`Blocked::describe`] makes.
#[derive(Debug, Clone, PartialEq)]
pub enum Blocked {
    /// Nothing answers at the address (the connection's error).
    Unreachable(String),
    /// TLS on one side only, or a worker certificate not trusted here (the line naming
    /// it, [`rookworld_service::tls::TlsProblem`]).
    Tls(String),
    /// The worker serves another model: its shape, and where it came from if it says.
    OtherModel(String),
}

/// This learner's model, as an error about a worker of another model names it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LearnerModel {
    /// [`rookworld_lm::Config::shape`].
    pub shape: String,
    /// The flag that gives a worker the same model: `--preset tiny`, `--model DIR`.
    pub flag: String,
}

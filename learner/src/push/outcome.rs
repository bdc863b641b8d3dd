//! What a push did to one worker, and why none reaches a worker: the types both the fleet
//! ([`super`]) and one worker's push ([`super::one`]) speak in.

/// What happened to one worker in one push.
#[derive(Debug, Clone, PartialEq)]
pub struct PushOutcome {
    pub worker: String,
    pub version: u64,
    pub seconds: f64,
    pub bytes: u64,
    /// `None` when the worker now runs `version`.
    pub error: Option<String>,
    /// What blocks every push to this worker until something changes there or here.
    pub blocked: Option<Blocked>,
    /// How the payload went: "shared" (the worker read the shared file) or "stream".
    pub path: &'static str,
    /// The worker could not read the shared file: stream to it from now on.
    pub shared_refused: bool,
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

//! Weight sets on the wire: a model serialised as a bfloat16 safetensors payload,
//! cut into chunks with a header (version, size, BLAKE3 hash), and put back together with
//! every check made before anything is trusted.

use bytes::Bytes;
use rookworld_lm::{Config, Gpt2, model_io};
use rookworld_proto::rollout::v1 as pb;

/// The one payload format accepted.
pub const FORMAT: &str = "safetensors-bf16";

/// Default chunk size, chosen with `learner bench-push` (see the README): with the
/// HTTP/2 windows of `rookworld_service::serve`, chunks from 256 KiB up move the payload at
/// the same speed; smaller ones cost more frames and polls.
pub const CHUNK_BYTES: usize = 1 << 20;

/// Why a weight set was refused.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    /// The stream is not a well-formed weight set (header, order, sizes).
    #[error("{0}")]
    Malformed(String),
    /// The payload's BLAKE3 hash differs from the header's: corrupted in transit.
    #[error("checksum mismatch: header says {expected}, payload hashes to {actual}")]
    Checksum { expected: String, actual: String },
    /// The payload does not hold this worker's model (names, shapes, parse).
    #[error("payload is not a model of this worker's shape: {0}")]
    Model(#[from] rookworld_lm::Error),
    /// A same-host payload could not be read (no shared directory here, no such file):
    /// the sender streams it instead.
    #[error("shared payload unreadable: {0}")]
    Shared(String),
    /// A same-host payload file is being written over, or was replaced while it was
    /// opened: this push goes over the stream, the path stays for the next.
    #[error("shared payload busy: {0}")]
    SharedBusy(String),
    /// A delta ([`crate::delta`]) this worker cannot turn into the payload: it holds no
    /// copy of the base it is against, or the result fails the header's hash (its copy
    /// differs from the sender's). Nothing changed here; the sender streams the payload.
    #[error("delta base unusable: {0}")]
    DeltaBase(String),
    /// A delta that does not decode.
    #[error("{0}")]
    Delta(#[from] crate::delta::DeltaError),
    /// The version is not newer than the one in use, of the same run.
    #[error("version {offered} is not above the version in use ({current}) of run `{run}`")]
    Stale {
        offered: u64,
        current: u64,
        run: String,
    },
}

/// A model serialised for a push: bfloat16 safetensors bytes and their BLAKE3 hash. The bytes
/// are shared: cloning a set, or cutting it into chunks for any number of workers,
/// copies none of them.
#[derive(Debug, Clone)]
pub struct WeightSet {
    /// The training run the weights belong to; versions count within a run.
    pub run_id: String,
    pub version: u64,
    pub bytes: Bytes,
    pub blake3: [u8; 32],
    /// The payload's file in the shared directory of workers on this host, when the
    /// learner wrote one ([`shared_file_name`]).
    pub shared_file: Option<String>,
}

impl WeightSet {
    /// Serialises `model` (converted to bfloat16) as version `version` of run `run_id`.
    pub fn from_model(model: &Gpt2, run_id: &str, version: u64) -> rookworld_lm::Result<Self> {
        let bytes = model_io::to_bf16_payload(model)?;
        Ok(Self::from_bytes(run_id, version, bytes))
    }

    /// A set of payload `bytes` (safetensors, bfloat16), hashed here.
    pub fn from_bytes(run_id: &str, version: u64, bytes: Vec<u8>) -> Self {
        Self::from_shared(run_id, version, bytes.into())
    }

    /// A set of shared payload `bytes`, hashed here.
    pub fn from_shared(run_id: &str, version: u64, bytes: Bytes) -> Self {
        Self {
            run_id: run_id.to_owned(),
            version,
            blake3: hash(&bytes),
            bytes,
            shared_file: None,
        }
    }

    /// The header the first chunk carries.
    pub fn header(&self) -> pb::WeightSetHeader {
        pb::WeightSetHeader {
            version: self.version,
            total_bytes: self.bytes.len() as u64,
            blake3: self.blake3.to_vec(),
            format: FORMAT.into(),
            run_id: self.run_id.clone(),
            ..Default::default()
        }
    }

    /// The header of a push of this set as `delta`, made against version `base_version`
    /// of the same run ([`crate::delta::encode`]).
    pub fn delta_header(&self, base_version: u64, delta: &[u8]) -> pb::WeightSetHeader {
        pb::WeightSetHeader {
            delta_bytes: delta.len() as u64,
            ..self.streamed_delta_header(base_version)
        }
    }

    /// The header of a push of this set as a delta against version `base_version` that is
    /// streamed while it is made: its size is not known yet (`delta_bytes` 0), and the
    /// receiver takes its end from the delta's own blocks.
    pub fn streamed_delta_header(&self, base_version: u64) -> pb::WeightSetHeader {
        pb::WeightSetHeader {
            delta_format: crate::delta::FORMAT.into(),
            base_version,
            delta_bytes: 0,
            ..self.header()
        }
    }

    /// The one chunk of a same-host push: the header naming the shared file, no data.
    /// `None` when no shared file was written.
    pub fn shared_chunk(&self) -> Option<pb::WeightChunk> {
        let file = self.shared_file.clone()?;
        Some(pb::WeightChunk {
            header: Some(pb::WeightSetHeader {
                shared_file: file,
                ..self.header()
            }),
            offset: 0,
            data: Bytes::new(),
        })
    }

    /// The chunks of this set, header on the first: slices of the shared payload, made
    /// as they are sent.
    pub fn chunks(&self, chunk_bytes: usize) -> impl Iterator<Item = pb::WeightChunk> + use<> {
        chunks_of(self.header(), self.bytes.clone(), chunk_bytes)
    }

    /// The chunks of a push of this set as `delta` against version `base_version`.
    pub fn delta_chunks(
        &self,
        base_version: u64,
        delta: Bytes,
        chunk_bytes: usize,
    ) -> impl Iterator<Item = pb::WeightChunk> + use<> {
        chunks_of(self.delta_header(base_version, &delta), delta, chunk_bytes)
    }
}

/// `bytes` cut into chunks of `chunk_bytes`, `header` on the first (one chunk when empty).
fn chunks_of(
    header: pb::WeightSetHeader,
    bytes: Bytes,
    chunk_bytes: usize,
) -> impl Iterator<Item = pb::WeightChunk> {
    Chunker::new(header, chunk_bytes).cut(bytes)
}

/// Cuts a body that comes in pieces (a delta streamed while it is made) into chunks of at
/// most `chunk_bytes`, each at its offset in the body, the header on the first.
#[derive(Debug)]
pub struct Chunker {
    header: Option<pb::WeightSetHeader>,
    offset: usize,
    step: usize,
}

impl Chunker {
    pub fn new(header: pb::WeightSetHeader, chunk_bytes: usize) -> Self {
        Self {
            header: Some(header),
            offset: 0,
            step: chunk_bytes.max(1),
        }
    }

    /// The next `piece` of the body as chunks (one, empty, when the header has not gone
    /// and the piece is empty), made as they are taken.
    pub fn cut(&mut self, piece: Bytes) -> impl Iterator<Item = pb::WeightChunk> + use<> {
        let (step, base) = (self.step, self.offset);
        let mut header = self.header.take();
        let count = piece
            .len()
            .div_ceil(step)
            .max(usize::from(header.is_some()));
        self.offset += piece.len();
        (0..count).map(move |i| {
            let start = i * step;
            let end = (start + step).min(piece.len());
            pb::WeightChunk {
                header: header.take(),
                offset: (base + start) as u64,
                data: piece.slice(start.min(end)..end),
            }
        })
    }
}

/// What a chunk stream held, put back together.
#[derive(Debug)]
pub enum Received {
    /// The payload, its hash checked.
    Payload(WeightSet),
    /// A delta against a payload the receiver holds ([`apply_delta`] checks the result).
    Delta {
        header: pb::WeightSetHeader,
        delta: Vec<u8>,
    },
}

/// Puts a chunk stream back together, refusing anything out of order or over size; each
/// chunk of a payload is hashed as it arrives, so the checksum is ready when the last one
/// is in (a delta's result is hashed once applied).
#[derive(Debug)]
pub struct Assembler {
    max_bytes: usize,
    header: Option<pb::WeightSetHeader>,
    bytes: Vec<u8>,
    hasher: blake3::Hasher,
}

impl Assembler {
    /// Accepts payloads of at most `max_bytes`.
    pub fn new(max_bytes: usize) -> Self {
        Self::with_buffer(max_bytes, Vec::new())
    }

    /// Accepts payloads of at most `max_bytes`, received into `buffer` (emptied; the
    /// last payload's, whose memory is already there, saves faulting in a fresh one).
    pub fn with_buffer(max_bytes: usize, mut buffer: Vec<u8>) -> Self {
        buffer.clear();
        Self {
            max_bytes,
            header: None,
            bytes: buffer,
            hasher: blake3::Hasher::new(),
        }
    }

    /// Bytes received so far.
    pub fn received(&self) -> usize {
        self.bytes.len()
    }

    /// The header, once the first chunk is in.
    pub fn header(&self) -> Option<&pb::WeightSetHeader> {
        self.header.as_ref()
    }

    /// Takes the next chunk.
    pub fn push(&mut self, chunk: pb::WeightChunk) -> Result<(), WeightError> {
        let bad = |m: String| Err(WeightError::Malformed(m));
        match (&self.header, chunk.header) {
            (None, None) => return bad("the first chunk carries no header".into()),
            (Some(_), Some(_)) => return bad("a header in a chunk after the first".into()),
            (None, Some(h)) => {
                check_header(&h, self.max_bytes)?;
                if let (true, Body::Exact(n)) = (h.shared_file.is_empty(), body_bytes(&h)) {
                    self.bytes.reserve_exact(n as usize);
                }
                self.header = Some(h);
            }
            (Some(_), None) => {}
        }
        let h = self.header.as_ref().expect("set above");
        let (total, delta) = (body_bytes(h), is_delta(h));
        if chunk.offset != self.bytes.len() as u64 {
            return bad(format!(
                "chunk at offset {} but {} bytes received so far",
                chunk.offset,
                self.bytes.len()
            ));
        }
        let after = self.bytes.len() as u64 + chunk.data.len() as u64;
        match total {
            Body::Exact(n) if after > n => {
                return bad(format!("chunks exceed the announced {n} bytes"));
            }
            Body::AtMost(n) if after > n => {
                return bad(format!(
                    "a streamed delta of more than {n} bytes, the most a delta of the \
                     {}-byte payload can take",
                    h.total_bytes
                ));
            }
            _ => {}
        }
        if !delta {
            self.hasher.update(&chunk.data);
        }
        self.bytes.extend_from_slice(&chunk.data);
        Ok(())
    }

    /// The complete payload after the size and checksum checks, or the complete delta
    /// after the size check.
    pub fn finish(self) -> Result<Received, WeightError> {
        let Some(h) = self.header else {
            return Err(WeightError::Malformed("empty stream: no chunks".into()));
        };
        if let Body::Exact(n) = body_bytes(&h)
            && self.bytes.len() as u64 != n
        {
            return Err(WeightError::Malformed(format!(
                "stream ended after {} of {n} bytes",
                self.bytes.len(),
            )));
        }
        if is_delta(&h) {
            return Ok(Received::Delta {
                header: h,
                delta: self.bytes,
            });
        }
        verified(h, self.bytes, self.hasher.finalize().into()).map(Received::Payload)
    }
}

/// Whether a header announces a delta rather than the payload.
pub fn is_delta(h: &pb::WeightSetHeader) -> bool {
    !h.delta_format.is_empty()
}

/// The bytes the chunks after header `h` carry: the payload's, or the delta's as
/// announced (`Exact`), or at most a delta's [`crate::delta::bound`] for one streamed as
/// it is made (`delta_bytes` 0: its own blocks say where it ends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body {
    Exact(u64),
    AtMost(u64),
}

fn body_bytes(h: &pb::WeightSetHeader) -> Body {
    match (is_delta(h), h.delta_bytes) {
        (false, _) => Body::Exact(h.total_bytes),
        (true, 0) => Body::AtMost(crate::delta::bound(h.total_bytes as usize) as u64),
        (true, n) => Body::Exact(n),
    }
}

/// Turns `base`, the payload of version `h.base_version` of run `h.run_id`, into the one
/// header `h` announces by applying `delta`, in place, and checks the result against the
/// header's size and BLAKE3 hash. On an error the base's memory comes back with it (its
/// bytes no longer a payload when the delta was applied).
pub fn apply_delta(
    mut base: Vec<u8>,
    h: pb::WeightSetHeader,
    delta: &[u8],
) -> Result<WeightSet, (WeightError, Vec<u8>)> {
    let made = match crate::delta::payload_len(delta) {
        Ok(len) if len as u64 == h.total_bytes => len,
        Ok(len) => {
            let e = WeightError::Malformed(format!(
                "the delta makes {len} bytes, the header says {}",
                h.total_bytes
            ));
            return Err((e, base));
        }
        Err(e) => return Err((e.into(), base)),
    };
    if base.len() != made {
        let e = WeightError::DeltaBase(format!(
            "this worker's copy of version {} holds {} bytes, the delta makes {made}",
            h.base_version,
            base.len()
        ));
        return Err((e, base));
    }
    if let Err(e) = crate::delta::apply(&mut base, delta) {
        return Err((e.into(), base));
    }
    let actual = hash(&base);
    if actual[..] != h.blake3[..] {
        let e = WeightError::DeltaBase(format!(
            "the payload made from this worker's copy of version {} hashes to {}, the header \
             says {}: the copy differs from the sender's",
            h.base_version,
            hex(&actual),
            hex(&h.blake3)
        ));
        return Err((e, base));
    }
    verified(h, base, actual).map_err(|e| (e, Vec::new()))
}

/// The header's own checks: the format, a 32-byte hash, a size within `max_bytes`, and
/// for the same-host path a bare file name.
fn check_header(h: &pb::WeightSetHeader, max_bytes: usize) -> Result<(), WeightError> {
    let bad = |m: String| Err(WeightError::Malformed(m));
    if h.format != FORMAT {
        return bad(format!(
            "format `{}` is not supported (use `{FORMAT}`)",
            h.format
        ));
    }
    if h.blake3.len() != 32 {
        return bad(format!(
            "the BLAKE3 hash has {} bytes, not 32 (is the learner older than this worker?)",
            h.blake3.len()
        ));
    }
    if h.total_bytes > max_bytes as u64 {
        return bad(format!(
            "payload of {} bytes exceeds this worker's limit of {max_bytes} bytes",
            h.total_bytes
        ));
    }
    if is_delta(h) {
        if h.delta_format != crate::delta::FORMAT {
            return bad(format!(
                "delta format `{}` is not supported (use `{}`)",
                h.delta_format,
                crate::delta::FORMAT
            ));
        }
        if !h.shared_file.is_empty() {
            return bad("a delta names a shared file: a shared payload is whole".into());
        }
        if h.base_version >= h.version {
            return bad(format!(
                "a delta to version {} against version {}: its base must be older",
                h.version, h.base_version
            ));
        }
        if h.delta_bytes > max_bytes as u64 {
            return bad(format!(
                "delta of {} bytes exceeds this worker's limit of {max_bytes} bytes",
                h.delta_bytes
            ));
        }
    }
    let f = &h.shared_file;
    let bare = f.len() <= 255
        && !f.starts_with('.')
        && f.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !bare {
        return bad(format!("shared file `{f}` is not a bare file name"));
    }
    Ok(())
}

/// The set of `bytes` whose BLAKE3 hash is `actual`, if the header `h` says so.
fn verified(
    h: pb::WeightSetHeader,
    bytes: impl Into<Bytes>,
    actual: [u8; 32],
) -> Result<WeightSet, WeightError> {
    if actual[..] != h.blake3[..] {
        return Err(WeightError::Checksum {
            expected: hex(&h.blake3),
            actual: hex(&actual),
        });
    }
    Ok(WeightSet {
        run_id: h.run_id,
        version: h.version,
        bytes: bytes.into(),
        blake3: actual,
        shared_file: None,
    })
}

/// The file name a learner gives version `version` of run `run_id` in a shared
/// directory (characters other than letters, digits, `-` and `_` of the run id become `_`).
pub fn shared_file_name(run_id: &str, version: u64) -> String {
    let run: String = run_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("weights-{run}-v{version}.safetensors")
}

/// Maps the same-host payload the header `h` names in `dir` into memory, its pages
/// mapped at once (no copy: the bytes are hashed and converted where the learner wrote
/// them; [`verify_shared`] checks them). The file is share-locked for as long as the
/// bytes live: the learner writes a new version over an old file only when it gets that
/// file's exclusive lock at once, and never rewrites one under its version's name, so
/// the bytes cannot change under the worker. A file being written over, or renamed away
/// between opening and locking it, is unreadable (the learner streams that push).
pub fn read_shared(dir: &std::path::Path, h: &pb::WeightSetHeader) -> Result<Bytes, WeightError> {
    use std::os::unix::fs::MetadataExt;

    let path = dir.join(&h.shared_file);
    let unreadable = |e: std::io::Error| WeightError::Shared(format!("{}: {e}", path.display()));
    let file = std::fs::File::open(&path).map_err(unreadable)?;
    let meta = file.metadata().map_err(unreadable)?;
    if !meta.is_file() {
        return Err(WeightError::Shared(format!(
            "{} is not a file",
            path.display()
        )));
    }
    if file.try_lock_shared().is_err() {
        return Err(WeightError::SharedBusy(format!(
            "{} is being written over",
            path.display()
        )));
    }
    let named = std::fs::metadata(&path)
        .map_err(|e| WeightError::SharedBusy(format!("{}: {e}", path.display())))?;
    if (named.dev(), named.ino()) != (meta.dev(), meta.ino()) {
        return Err(WeightError::SharedBusy(format!(
            "{} was replaced while it was opened",
            path.display()
        )));
    }
    // SAFETY: the mapping is read-only and the file is not written while it is locked.
    let map = unsafe { memmap2::MmapOptions::new().populate().map(&file) }.map_err(unreadable)?;
    let bytes = Bytes::from_owner(Locked { map, _file: file });
    if bytes.len() as u64 != h.total_bytes {
        return Err(WeightError::Malformed(format!(
            "shared file {} holds {} bytes, the header says {}",
            path.display(),
            bytes.len(),
            h.total_bytes
        )));
    }
    Ok(bytes)
}

/// A mapped payload file and its open, share-locked handle (closing it drops the lock).
struct Locked {
    map: memmap2::Mmap,
    _file: std::fs::File,
}

impl AsRef<[u8]> for Locked {
    fn as_ref(&self) -> &[u8] {
        &self.map
    }
}

/// Checks a same-host payload read by [`read_shared`] against its header's BLAKE3 hash.
pub fn verify_shared(h: pb::WeightSetHeader, bytes: Bytes) -> Result<WeightSet, WeightError> {
    let actual = hash(&bytes);
    verified(h, bytes, actual)
}

impl WeightSet {
    /// Whether a worker running version `current` of run `current_run` takes this set:
    /// a newer version of the same run, or any version of another run (a new run counts
    /// its versions again).
    pub fn supersedes(&self, current_run: &str, current: u64) -> Result<(), WeightError> {
        supersedes(&self.run_id, self.version, current_run, current)
    }
}

/// The model of payload `bytes` (`cfg`'s shape, into `dtype` on `device`, packed for the
/// CPU kernel in panels of `panels` where it applies), every tensor checked: written into `spare`'s memory
/// when one is given that can take it (a retired f32 CPU model nothing else holds:
/// [`rookworld_weights::refill`]), else built afresh with the device's `kernels`.
pub fn build_model(
    bytes: &[u8],
    cfg: &Config,
    (dtype, panels): (candle_core::DType, rookworld_lm::cpu_gemm::PanelDtype),
    (device, kernels): (&candle_core::Device, &rookworld_lm::kernels::Kernels),
    spare: Option<Gpt2>,
) -> Result<Gpt2, WeightError> {
    if let Some(mut model) = spare
        && model.dtype() == dtype
        && model.panel_dtype() == panels
        && model.device().same_device(device)
        && model.config() == cfg
        && crate::refill::refill(&mut model, bytes)?
    {
        tracing::debug!("new weights written into the retired model's memory");
        return Ok(model);
    }
    let mut model = model_io::from_bytes(bytes, cfg, dtype, device)?;
    model.set_panel_dtype(panels);
    model.set_kernels(kernels.clone());
    model
        .prepare_for_inference()
        .map_err(rookworld_lm::Error::from)?;
    if model.packed_only() {
        rookworld_lm::alloc::return_freed_memory(); // the dense copies, once packed
    }
    Ok(model)
}

/// Whether version `version` of run `run` replaces version `current` of `current_run`
/// (see [`WeightSet::supersedes`]); the worker asks it of the header, before the body.
pub fn supersedes(
    run: &str,
    version: u64,
    current_run: &str,
    current: u64,
) -> Result<(), WeightError> {
    if run == current_run && version <= current {
        return Err(WeightError::Stale {
            offered: version,
            current,
            run: current_run.to_owned(),
        });
    }
    Ok(())
}

/// Pushes `set` to a worker on the same host through its shared file (one header chunk),
/// answered once in use or, with `answer_when_staged`, once staged; the worker answers
/// FAILED_PRECONDITION when it cannot read it.
pub async fn push_shared(
    client: &mut pb::rollout_service_client::RolloutServiceClient<tonic::transport::Channel>,
    set: &WeightSet,
    token: &str,
    answer_when_staged: bool,
) -> Result<pb::UpdateWeightsResponse, tonic::Status> {
    let mut chunk = set
        .shared_chunk()
        .ok_or_else(|| tonic::Status::internal("no shared file was written for this set"))?;
    if let Some(h) = chunk.header.as_mut() {
        h.answer_when_staged = answer_when_staged;
    }
    let mut request = tonic::Request::new(tokio_stream::iter([chunk]));
    rookworld_service::auth::set_token(request.metadata_mut(), token)?;
    Ok(client.update_weights(request).await?.into_inner())
}

/// Pushes `set` to a worker in `chunk_bytes` chunks with the shared `token`; the answer
/// comes once the worker uses the new weights.
pub async fn push(
    client: &mut pb::rollout_service_client::RolloutServiceClient<tonic::transport::Channel>,
    set: &WeightSet,
    token: &str,
    chunk_bytes: usize,
) -> Result<pb::UpdateWeightsResponse, tonic::Status> {
    send(client, tokio_stream::iter(set.chunks(chunk_bytes)), token).await
}

/// Sends `chunks` (header first) to a worker with the shared `token` and returns its
/// answer.
pub async fn send(
    client: &mut pb::rollout_service_client::RolloutServiceClient<tonic::transport::Channel>,
    chunks: impl tokio_stream::Stream<Item = pb::WeightChunk> + Send + 'static,
    token: &str,
) -> Result<pb::UpdateWeightsResponse, tonic::Status> {
    let mut request = tonic::Request::new(chunks);
    rookworld_service::auth::set_token(request.metadata_mut(), token)?;
    Ok(client.update_weights(request).await?.into_inner())
}

/// Pushes `set` as `delta` against version `base_version`, which the worker must hold:
/// it answers FAILED_PRECONDITION ("delta base unusable") when it does not, or when the
/// result fails the check, and keeps its weights.
pub async fn push_delta(
    client: &mut pb::rollout_service_client::RolloutServiceClient<tonic::transport::Channel>,
    (set, base_version, delta): (&WeightSet, u64, Bytes),
    token: &str,
    chunk_bytes: usize,
) -> Result<pb::UpdateWeightsResponse, tonic::Status> {
    let chunks = set.delta_chunks(base_version, delta, chunk_bytes);
    send(client, tokio_stream::iter(chunks), token).await
}

/// The BLAKE3 hash of a payload, on every core (a 249 MB payload is 57 ms on one core
/// of an H100 host: the longest phase of a same-host push to a GPU worker).
pub fn hash(bytes: &[u8]) -> [u8; 32] {
    blake3::Hasher::new().update_rayon(bytes).finalize().into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests;

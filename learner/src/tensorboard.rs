//! TensorBoard event files: a run's curves (`train/…` per step, `eval/<suite>/<metric>` per
//! evaluation) in the format `tensorboard --logdir DIR` reads, live while the run goes on.
//!
//! A file is a sequence of TFRecords — the data's length (u64, little-endian), the masked
//! CRC-32C of those 8 bytes, the data, the masked CRC-32C of the data — each holding one
//! `Event` (TensorBoard's `event.proto`): first the format's version (`brain.Event:2`), then
//! a session start at the first step the writer will write, then one event per step with a
//! `Summary` of scalars (`simple_value`). The start marker is how TensorFlow's writers say
//! "restarted here": TensorBoard's loader drops the steps from that one on that earlier files
//! of the same directory hold, so a run resumed from a checkpoint (a new file beside the
//! old ones) shows each step once.
//!
//! Files are named `events.out.tfevents.<unix seconds>.<host name>` (with a `.0001`,
//! `.0002`, … suffix when that name is taken), so names sort in the order the files were
//! made, the order TensorBoard reads them in. Every event is flushed at once. The curves are a convenience: a write that fails
//! is logged once and ends that file's writing; it never stops training.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;

/// The version of the event format, the first event of every file.
pub const FILE_VERSION: &str = "brain.Event:2";

/// An `Event` of TensorBoard's `event.proto`: the fields written here (in the proto they
/// are a `oneof`; exactly one is set).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// Set on a file's first event only: [`FILE_VERSION`].
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
    #[prost(message, optional, tag = "7")]
    pub session_log: Option<SessionLog>,
}

/// A `Summary`: the values of one event.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// A `Summary.Value` holding a scalar: its tag (`train/reward`) and value.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    #[prost(string, tag = "1")]
    pub tag: String,
    /// A member of a `oneof` in the proto: written even when 0, hence optional.
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
}

/// A `SessionLog`: here only its status, [`SessionLog::START`].
#[derive(Clone, PartialEq, prost::Message)]
pub struct SessionLog {
    #[prost(int32, tag = "1")]
    pub status: i32,
}

impl SessionLog {
    /// `SessionLog.SessionStatus.START`: a (re)start at the event's step.
    pub const START: i32 = 1;
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    !data.iter().fold(!0u32, |crc, &b| {
        CRC32C_TABLE[usize::from((crc as u8) ^ b)] ^ (crc >> 8)
    })
}

/// The CRC as TFRecords store it: rotated right by 15 bits plus a constant.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    (crc.rotate_right(15)).wrapping_add(0xa282_ead8)
}

/// The byte-at-a-time table of [`crc32c`].
const CRC32C_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// `data` as one TFRecord: length, its masked CRC, the data, its masked CRC.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// An event file could not be made: which, and why.
#[derive(Debug, thiserror::Error)]
#[error("TensorBoard event file {}: {source}", path.display())]
pub struct TensorBoardError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// One event file being written.
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    /// `None` once a write failed (the file is left as it was).
    file: Option<BufWriter<File>>,
}

impl EventWriter {
    /// Makes `dir` (and its parents) if missing and a new event file in it, which starts
    /// with the format's version and a session start at `first_step`, the first step that
    /// will be written.
    pub fn create(dir: &Path, first_step: u64) -> Result<Self, TensorBoardError> {
        let failed = |path: &Path| {
            let path = path.to_owned();
            move |source| TensorBoardError { path, source }
        };
        std::fs::create_dir_all(dir).map_err(failed(dir))?;
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let base = format!("events.out.tfevents.{secs}.{}", host_name());
        let (path, file) = create_new(dir, &base).map_err(failed(&dir.join(&base)))?;
        let mut w = Self {
            path,
            file: Some(BufWriter::new(file)),
        };
        let start = [
            Event {
                file_version: Some(FILE_VERSION.into()),
                ..event_now(0)
            },
            Event {
                session_log: Some(SessionLog {
                    status: SessionLog::START,
                }),
                ..event_now(first_step)
            },
        ];
        for e in &start {
            w.try_write(e).map_err(failed(&w.path))?;
        }
        Ok(w)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether events still go to the file (no write has failed).
    pub fn is_writing(&self) -> bool {
        self.file.is_some()
    }

    /// Appends one event with `scalars` (tag, value; f32 in the file) at `step` and
    /// flushes it. A failure is logged once and ends this file's writing.
    pub fn scalars<T: Into<String>>(
        &mut self,
        step: u64,
        scalars: impl IntoIterator<Item = (T, f64)>,
    ) {
        if self.file.is_none() {
            return;
        }
        let value = scalars
            .into_iter()
            .map(|(tag, v)| SummaryValue {
                tag: tag.into(),
                simple_value: Some(v as f32),
            })
            .collect();
        let event = Event {
            summary: Some(Summary { value }),
            ..event_now(step)
        };
        if let Err(e) = self.try_write(&event) {
            tracing::warn!(file = %self.path.display(), error = %e, "cannot write the TensorBoard event file; no more TensorBoard events this run (training goes on)");
            self.file = None;
        }
    }

    fn try_write(&mut self, event: &Event) -> std::io::Result<()> {
        let f = self.file.as_mut().ok_or(std::io::ErrorKind::BrokenPipe)?;
        f.write_all(&record(&event.encode_to_vec()))?;
        f.flush()
    }
}

/// An event at `step`, stamped now.
fn event_now(step: u64) -> Event {
    let wall_time = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    Event {
        wall_time,
        step: i64::try_from(step).unwrap_or(i64::MAX),
        ..Event::default()
    }
}

/// Creates `dir/base`, or `dir/base.1`, `.2`, … when taken (a zero-padded suffix, so the
/// names sort in the order they were made).
fn create_new(dir: &Path, base: &str) -> std::io::Result<(PathBuf, File)> {
    let mut n = 0u32;
    loop {
        let name = match n {
            0 => base.to_owned(),
            n => format!("{base}.{n:04}"),
        };
        let path = dir.join(name);
        match File::create_new(&path) {
            Ok(f) => return Ok((path, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 9999 => n += 1,
            Err(e) => return Err(e),
        }
    }
}

/// The host name from the OS, kept to characters safe in a file name (`localhost` if none).
fn host_name() -> String {
    let name: String = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_default()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The records of a file's bytes, each CRC checked (a test's reader).
    fn records(mut bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let (len, rest) = bytes.split_at(8);
            let (len_crc, rest) = rest.split_at(4);
            assert_eq!(masked_crc32c(len).to_le_bytes(), len_crc, "length CRC");
            let n = u64::from_le_bytes(len.try_into().unwrap()) as usize;
            let (data, rest) = rest.split_at(n);
            let (data_crc, rest) = rest.split_at(4);
            assert_eq!(masked_crc32c(data).to_le_bytes(), data_crc, "data CRC");
            out.push(data.to_vec());
            bytes = rest;
        }
        out
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn crc32c_matches_the_known_vectors() {
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        // RFC 3720, B.4: 32 bytes of zeros, of ones, ascending, descending.
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&ascending), 0x46DD_794E);
        let descending: Vec<u8> = (0..32).rev().collect();
        assert_eq!(crc32c(&descending), 0x113F_DB5C);
    }

    #[test]
    fn the_mask_is_tensorflows() {
        // TensorBoard's own `masked_crc32c`.
        assert_eq!(masked_crc32c(b""), 0xA282_EAD8);
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
    }

    #[test]
    fn an_event_is_framed_byte_for_byte_as_tensorboards_writer_frames_it() {
        // TensorBoard's `RecordWriter` on this event (wall time 1.5, step 3,
        // `train/reward` = 0.0): the zero is written, not left out. The other events'
        // bytes are those of TensorBoard's `event_pb2.Event` too.
        let event = Event {
            wall_time: 1.5,
            step: 3,
            summary: Some(Summary {
                value: vec![SummaryValue {
                    tag: "train/reward".into(),
                    simple_value: Some(0.0),
                }],
            }),
            ..Event::default()
        };
        let data = event.encode_to_vec();
        assert_eq!(
            data,
            hex("09000000000000f83f10032a150a130a0c747261696e2f7265776172641500000000")
        );
        assert_eq!(
            record(&data),
            hex(
                "220000000000000078113dfd09000000000000f83f10032a150a130a0c747261696e2f726577617264150000000086088f68"
            )
        );
        let version = Event {
            wall_time: 1.5,
            file_version: Some(FILE_VERSION.into()),
            ..Event::default()
        };
        assert_eq!(
            version.encode_to_vec(),
            hex("09000000000000f83f1a0d627261696e2e4576656e743a32")
        );
        let start = Event {
            wall_time: 1.5,
            step: 4,
            session_log: Some(SessionLog {
                status: SessionLog::START,
            }),
            ..Event::default()
        };
        assert_eq!(start.encode_to_vec(), hex("09000000000000f83f10043a020801"));
    }

    #[test]
    fn a_file_holds_the_version_the_start_and_one_event_per_call() {
        let dir = tempfile::tempdir().unwrap();
        let tb = dir.path().join("nested/tensorboard");
        let mut w = EventWriter::create(&tb, 4).unwrap();
        w.scalars(4, [("train/reward", -0.5), ("train/loss", 0.25)]);
        w.scalars(5, vec![("train/reward".to_string(), 0.0)]);
        assert!(w.is_writing());
        let name = w.path().file_name().unwrap().to_str().unwrap().to_owned();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        let events: Vec<Event> = records(&std::fs::read(w.path()).unwrap())
            .iter()
            .map(|d| Event::decode(d.as_slice()).unwrap())
            .collect();
        assert_eq!(events.len(), 4);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        assert_eq!(
            events[1].session_log.as_ref().unwrap().status,
            SessionLog::START
        );
        assert_eq!(events[1].step, 4);
        let values = |e: &Event| -> Vec<(String, Option<f32>)> {
            let s = e.summary.as_ref().unwrap();
            s.value
                .iter()
                .map(|v| (v.tag.clone(), v.simple_value))
                .collect()
        };
        assert_eq!(events[2].step, 4);
        assert_eq!(
            values(&events[2]),
            [
                ("train/reward".to_string(), Some(-0.5)),
                ("train/loss".to_string(), Some(0.25))
            ]
        );
        assert_eq!(events[3].step, 5);
        assert_eq!(
            values(&events[3]),
            [("train/reward".to_string(), Some(0.0))]
        );
        assert!(events.iter().all(|e| e.wall_time > 1.6e9));
    }

    #[test]
    fn a_second_file_in_the_same_second_gets_a_later_name() {
        let dir = tempfile::tempdir().unwrap();
        let base = "events.out.tfevents.1.host";
        let names: Vec<String> = (0..3)
            .map(|_| {
                let (path, _) = create_new(dir.path(), base).unwrap();
                path.file_name().unwrap().to_str().unwrap().to_owned()
            })
            .collect();
        assert_eq!(
            names,
            [
                base.to_owned(),
                format!("{base}.0001"),
                format!("{base}.0002")
            ]
        );
    }

    #[test]
    fn an_unusable_directory_is_a_typed_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"").unwrap();
        let e = EventWriter::create(&file.join("tb"), 1).unwrap_err();
        assert_eq!(e.path, file.join("tb"));
    }

    #[test]
    fn a_failed_write_ends_the_files_writing_without_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path(), 1).unwrap();
        // A file opened read-only in its place: the next write fails.
        w.file = Some(BufWriter::new(File::open(w.path()).unwrap()));
        w.scalars(1, [("train/reward", 1.0)]);
        assert!(!w.is_writing());
        w.scalars(2, [("train/reward", 1.0)]);
        assert!(!w.is_writing());
    }
}

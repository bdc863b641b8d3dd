//! The hostile-input campaign against the learner's rollout queue (`Lease`, `Submit` and
//! the inspection calls) and the rollout worker (`Generate`, `UpdateWeights`, `Status`), as
//! `reward-server/tests/integration/hostile.rs` runs it against the reward server: random bytes as
//! messages, wrong wire types, lengths past the end, huge declared sizes, invalid UTF-8,
//! oversized, deeply nested and massively repeated fields, bytes that are not gRPC at all.
//! Each goes to the real binaries, with the token (so the messages, not the guard, are
//! what is tested). Every call gets an answer that decodes or a typed error; no process
//! panics or dies; each stays healthy with bounded memory; the worker keeps its weights.

use crate::cluster;
mod raw;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use cluster::{Proc, free_addr};
use prost::Message;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use raw::{Kind, call, key, len_field, varint};
use rookworld_proto::queue::v1 as queue;
use rookworld_proto::rollout::v1 as rollout;
use tonic::Code;
use tonic::transport::Channel;

const TOKEN: &str = "hostile-token";
/// Peak resident memory either process may reach (a tiny model; the 16 MiB message limit).
const MAX_PEAK_BYTES: u64 = 1 << 30;

/// A service process under attack.
struct Target {
    name: &'static str,
    proc: Proc,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Target {
    fn spawn(name: &'static str, bin: &str, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let addr = free_addr();
        let mut argv: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        argv.extend([
            "--listen".into(),
            addr.to_string(),
            "--token".into(),
            TOKEN.into(),
        ]);
        argv.extend(["--metrics".into(), free_addr().to_string()]);
        if name == "learner" {
            argv.extend([
                "--run-dir".into(),
                dir.path().join("run").to_str().unwrap().into(),
            ]);
        }
        let proc = Proc::spawn(name, bin, &argv, dir.path());
        Self {
            name,
            proc,
            addr,
            _dir: dir,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn channel(&self) -> Channel {
        let started = Instant::now();
        loop {
            if rookworld_service::probe::check_health(
                &self.url(),
                &Default::default(),
                Duration::from_secs(2),
            )
            .await
            .is_ok()
            {
                return Channel::from_shared(self.url())
                    .unwrap()
                    .connect()
                    .await
                    .unwrap();
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "{} never served: {}",
                self.name,
                self.proc.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Resident memory now and at its peak, bytes.
    fn memory(&self) -> (u64, u64) {
        rookworld_service::probe::memory(self.proc.pid().expect("running")).unwrap()
    }

    /// Alive, serving, nothing panicked, memory bounded.
    async fn assert_healthy(&self, after: &str) {
        let health = rookworld_service::probe::check_health(
            &self.url(),
            &Default::default(),
            Duration::from_secs(10),
        )
        .await;
        let log = self.proc.log();
        assert_eq!(health, Ok(()), "{} after {after}: {log}", self.name);
        assert!(
            !log.contains("panicked"),
            "{} panicked after {after}: {log}",
            self.name
        );
        let (_, peak) = self.memory();
        assert!(
            peak < MAX_PEAK_BYTES,
            "{}: peak RSS {} MiB after {after}",
            self.name,
            peak >> 20
        );
    }
}

/// Hostile messages of every shape (what, bytes); `rng` adds random ones.
fn hostile(rng: &mut ChaCha8Rng, random: usize) -> Vec<(String, Vec<u8>)> {
    let mut cases: Vec<(String, Vec<u8>)> = vec![("empty".into(), vec![])];
    for f in 1..=9 {
        cases.push((
            format!("invalid UTF-8 in field {f}"),
            len_field(f, &[0xff, 0xfe, 0x80, b'a']),
        ));
        cases.push((
            format!("a varint where field {f} may be bytes"),
            [key(f, 0), vec![0x2a]].concat(),
        ));
        cases.push((
            format!("bytes where field {f} may be a number"),
            len_field(f, b"not a number"),
        ));
        cases.push((
            format!("a group wire type in field {f}"),
            [key(f, 3), key(f, 4)].concat(),
        ));
        cases.push((
            format!("wire type 7 in field {f}"),
            [key(f, 7), vec![1, 2, 3]].concat(),
        ));
        cases.push((
            format!("a fixed64 in field {f}"),
            [key(f, 1), vec![0xff; 8]].concat(),
        ));
        cases.push((
            format!("a length past the end in field {f}"),
            [key(f, 2), varint(1000), vec![1, 2, 3]].concat(),
        ));
        cases.push((
            format!("a declared length of 2^62 in field {f}"),
            [key(f, 2), varint(1 << 62), vec![0; 16]].concat(),
        ));
        cases.push((
            format!("a varint of 11 bytes in field {f}"),
            [key(f, 0), vec![0xff; 11]].concat(),
        ));
    }
    // Nested 200 deep (prost stops at 100) in each message field that might be one.
    for f in 1..=5 {
        let mut m = vec![];
        for _ in 0..200 {
            m = len_field(f, &m);
        }
        cases.push((format!("field {f} nested 200 deep"), m));
    }
    // Repeated: 2 M small fields, and one packed field of 4 M varints.
    cases.push((
        "2 M repeated fields".into(),
        [key(2, 0), vec![1]].concat().repeat(2 << 20),
    ));
    cases.push((
        "a packed field of 4 M varints".into(),
        len_field(4, &vec![0x7f; 4 << 20]),
    ));
    cases.push((
        "a field number of 2^29 - 1".into(),
        [key((1 << 29) - 1, 0), vec![1]].concat(),
    ));
    for i in 0..random {
        let n = rng.random_range(0..4096);
        cases.push((
            format!("random bytes #{i}"),
            (0..n).map(|_| rng.random()).collect(),
        ));
    }
    cases
}

/// Sends every case to `path`; each must be answered with a message that decodes as
/// `decode` says, or refused with a typed status. Returns how many were refused.
async fn campaign(
    target: &Target,
    channel: &Channel,
    path: &'static str,
    kind: Kind,
    cases: &[(String, Vec<u8>)],
    decode: Check,
) -> usize {
    let mut refused = 0;
    for (what, body) in cases {
        match call(channel, path, kind, vec![body.clone()], TOKEN).await {
            Ok(answers) => {
                for a in answers {
                    assert!(decode(&a), "{path} {what}: an answer that does not decode");
                }
            }
            Err(s) => {
                assert!(
                    matches!(
                        s.code(),
                        Code::InvalidArgument
                            | Code::Internal
                            | Code::OutOfRange
                            | Code::ResourceExhausted
                            | Code::FailedPrecondition
                            | Code::NotFound
                            | Code::DataLoss
                    ),
                    "{path} {what}: {s:?}\n{}",
                    target.proc.log()
                );
                assert!(
                    s.message().len() <= 4096,
                    "{path} {what}: a long status message"
                );
                refused += 1;
            }
        }
    }
    target.assert_healthy(path).await;
    refused
}

/// Oversized (past the 16 MiB limit): refused before it is decoded.
async fn oversized(channel: &Channel, path: &'static str, kind: Kind) {
    let body = len_field(1, &vec![b'x'; 17 << 20]);
    let s = call(channel, path, kind, vec![body], TOKEN)
        .await
        .unwrap_err();
    assert!(
        matches!(
            s.code(),
            Code::OutOfRange | Code::ResourceExhausted | Code::InvalidArgument
        ),
        "{path}: {s:?}"
    );
}

/// Raw bytes, HTTP/1.1 and a broken HTTP/2 preface on the gRPC port.
fn not_grpc(addr: SocketAddr, rng: &mut ChaCha8Rng) {
    for probe in [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        (0..4096).map(|_| rng.random()).collect::<Vec<u8>>(),
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x04\xff\xff\xff\xff\xff".to_vec(),
    ] {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = s.write_all(&probe);
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
}

/// Whether an answer decodes as the method's response.
type Check = fn(&[u8]) -> bool;

fn decodes<M: Message + Default>(b: &[u8]) -> bool {
    M::decode(b).is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_survives_hostile_messages_on_every_call() {
    let learner = Target::spawn(
        "learner",
        cluster::LEARNER,
        &[
            "train",
            "--preset",
            "tiny",
            "--sft-steps",
            "0",
            "--steps",
            "1000",
            "--no-progress",
        ],
    );
    let channel = learner.channel().await;
    let mut rng = ChaCha8Rng::seed_from_u64(19);
    let cases = hostile(&mut rng, 150);
    let q = "/rookworld.queue.v1.RolloutQueue/";
    let calls: [(&'static str, Check); 6] = [
        ("Lease", decodes::<queue::LeaseResponse>),
        ("Submit", decodes::<queue::SubmitResponse>),
        ("GetDepths", decodes::<queue::GetDepthsResponse>),
        ("ListWorkers", decodes::<queue::ListWorkersResponse>),
        ("GetStaleness", decodes::<queue::GetStalenessResponse>),
        ("PeekGroups", decodes::<queue::PeekGroupsResponse>),
    ];
    for (method, decode) in calls {
        let path: &'static str = Box::leak(format!("{q}{method}").into_boxed_str());
        let refused = campaign(&learner, &channel, path, Kind::Unary, &cases, decode).await;
        eprintln!(
            "{method}: {} hostile messages, {refused} refused with a typed status",
            cases.len()
        );
        oversized(&channel, path, Kind::Unary).await;
    }
    assert!(
        call(
            &channel,
            "/rookworld.queue.v1.RolloutQueue/Submit",
            Kind::Unary,
            vec![vec![]],
            TOKEN
        )
        .await
        .is_err(),
        "an empty submission is refused"
    );
    not_grpc(learner.addr, &mut rng);
    learner.assert_healthy("non-gRPC bytes").await;
    let (rss, peak) = learner.memory();
    eprintln!("learner: RSS {} MiB, peak {} MiB", rss >> 20, peak >> 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_survives_hostile_messages_and_keeps_its_weights() {
    let worker = Target::spawn("worker", cluster::WORKER, &["serve", "--preset", "tiny"]);
    let channel = worker.channel().await;
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let cases = hostile(&mut rng, 150);
    let generate: &'static str = "/rookworld.rollout.v1.RolloutService/Generate";
    let refused = campaign(
        &worker,
        &channel,
        generate,
        Kind::ServerStreaming,
        &cases,
        decodes::<rollout::GenerateResponse>,
    )
    .await;
    eprintln!(
        "Generate: {} hostile messages, {refused} refused",
        cases.len()
    );
    oversized(&channel, generate, Kind::ServerStreaming).await;
    let status: &'static str = "/rookworld.rollout.v1.RolloutService/Status";
    campaign(
        &worker,
        &channel,
        status,
        Kind::Unary,
        &cases,
        decodes::<rollout::StatusResponse>,
    )
    .await;

    // Weight pushes: every hostile message as a one-chunk stream, then hostile sequences.
    let update: &'static str = "/rookworld.rollout.v1.RolloutService/UpdateWeights";
    let refused = campaign(
        &worker,
        &channel,
        update,
        Kind::ClientStreaming,
        &cases,
        decodes::<rollout::UpdateWeightsResponse>,
    )
    .await;
    eprintln!(
        "UpdateWeights: {} hostile chunks, {refused} refused",
        cases.len()
    );
    let header = |total: u64, blake3: Vec<u8>, shared: &str| rollout::WeightChunk {
        header: Some(rollout::WeightSetHeader {
            version: 1,
            total_bytes: total,
            blake3,
            format: "bf16-safetensors".into(),
            run_id: "hostile".into(),
            shared_file: shared.into(),
            ..Default::default()
        }),
        offset: 0,
        data: Vec::new().into(),
    };
    let chunk = |offset: u64, data: Vec<u8>| rollout::WeightChunk {
        header: None,
        offset,
        data: data.into(),
    };
    let sequences: Vec<(&str, Vec<rollout::WeightChunk>)> = vec![
        (
            "a header claiming 2^64 - 1 bytes",
            vec![header(u64::MAX, vec![0; 32], "")],
        ),
        (
            "a header claiming 100 bytes, then 1 MiB",
            vec![header(100, vec![0; 32], ""), chunk(0, vec![7; 1 << 20])],
        ),
        (
            "a chunk at an offset past the end",
            vec![header(1000, vec![0; 32], ""), chunk(1 << 40, vec![1; 10])],
        ),
        (
            "chunks out of order",
            vec![
                header(20, vec![0; 32], ""),
                chunk(10, vec![1; 10]),
                chunk(0, vec![1; 10]),
            ],
        ),
        (
            "a second header",
            vec![header(10, vec![0; 32], ""), header(10, vec![0; 32], "")],
        ),
        ("no header", vec![chunk(0, vec![1; 10])]),
        (
            "a short hash",
            vec![header(10, vec![0; 3], ""), chunk(0, vec![1; 10])],
        ),
        (
            "a shared file outside the directory",
            vec![header(10, vec![0; 32], "../../etc/passwd")],
        ),
        (
            "a shared file with a slash",
            vec![header(10, vec![0; 32], "a/b")],
        ),
        (
            "the right length, random bytes",
            vec![header(64, vec![0; 32], ""), chunk(0, vec![9; 64])],
        ),
    ];
    for (what, chunks) in sequences {
        let messages = chunks.iter().map(Message::encode_to_vec).collect();
        let s = call(&channel, update, Kind::ClientStreaming, messages, TOKEN)
            .await
            .expect_err(what);
        assert!(
            matches!(
                s.code(),
                Code::InvalidArgument
                    | Code::DataLoss
                    | Code::FailedPrecondition
                    | Code::OutOfRange
            ),
            "{what}: {s:?}"
        );
    }
    worker.assert_healthy("hostile weight pushes").await;
    oversized(&channel, update, Kind::ClientStreaming).await;
    not_grpc(worker.addr, &mut rng);
    worker.assert_healthy("non-gRPC bytes").await;

    // The weights it started with still serve.
    let answer = call(&channel, status, Kind::Unary, vec![vec![]], TOKEN)
        .await
        .unwrap();
    let s = rollout::StatusResponse::decode(answer[0].as_slice()).unwrap();
    assert_eq!(s.weight_version, 0, "no hostile push landed");
    let (rss, peak) = worker.memory();
    eprintln!("worker: RSS {} MiB, peak {} MiB", rss >> 20, peak >> 20);
}

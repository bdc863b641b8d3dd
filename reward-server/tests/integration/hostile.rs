//! Hostile input against the real `reward-server` process: a million fuzzed completions,
//! then malformed requests (random bytes as messages, invalid UTF-8 in strings, wrong wire
//! types, truncated and oversized messages, bytes that are not HTTP/2 at all) and hostile
//! JSONL for `reward-server score`. Every call gets an answer or a typed error, the
//! process never panics, stays healthy, and its memory stays bounded.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use prost::Message;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use reward_server::bench::generate_items;
use rookworld_chess::scorer::Item;
use rookworld_chess::task::Task;
use rookworld_proto::reward::v1 as pb;
use rookworld_proto::reward::v1::reward_service_client::RewardServiceClient;
use rookworld_service::probe::RawCodec as Raw;
use tonic::transport::Channel;

const BIN: &str = env!("CARGO_BIN_EXE_reward-server");
const SCORE_PATH: &str = "/rookworld.reward.v1.RewardService/Score";

/// Completions fuzzed in all.
const FUZZED: usize = 1_000_000;
const BATCH: usize = 8_192;
/// Peak resident memory the server may reach.
const MAX_PEAK_BYTES: u64 = 768 << 20;

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// The server process; killed when dropped.
/// The shared token the server is started with.
const TOKEN: &str = "hostile-test-token";

struct Server {
    child: Child,
    addr: SocketAddr,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Server {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("reward.log");
        let file = std::fs::File::create(&log).unwrap();
        let addr = free_addr();
        let child = Command::new(BIN)
            .args(["serve", "--listen", &addr.to_string(), "--token", TOKEN])
            .args(["--metrics", &free_addr().to_string()])
            .env("RUST_LOG", "warn")
            .env_remove("REWARD_ENGINE")
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        Self {
            child,
            addr,
            log,
            _dir: dir,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Resident memory now and at its peak, bytes.
    fn memory(&self) -> (u64, u64) {
        rookworld_service::probe::memory(self.child.id()).unwrap()
    }

    /// Alive, serving, and nothing panicked so far.
    async fn assert_healthy(&mut self, after: &str) {
        assert!(
            self.child.try_wait().unwrap().is_none(),
            "the server died after {after}: {}",
            std::fs::read_to_string(&self.log).unwrap()
        );
        let health = rookworld_service::probe::check_health(
            &self.url(),
            &Default::default(),
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(health, Ok(()), "health after {after}");
        let log = std::fs::read_to_string(&self.log).unwrap();
        assert!(!log.contains("panicked"), "a panic after {after}: {log}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn connect(url: &str) -> Channel {
    let started = Instant::now();
    loop {
        if let Ok(c) = Channel::from_shared(url.to_owned())
            .unwrap()
            .connect()
            .await
        {
            return c;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no server at {url}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One fuzzed completion: random bytes, a mutation of the true answer, a long or odd
/// string.
fn fuzz(rng: &mut ChaCha8Rng, truth: &str) -> String {
    let random_text = |rng: &mut ChaCha8Rng, n: usize| -> String {
        (0..n)
            .map(|_| match rng.random_range(0..10) {
                0..=5 => rng.random_range(b' '..=b'~') as char,
                6 => ['+', ' ', '/', '\n', ':', '-'][rng.random_range(0..6)],
                7 => char::from_u32(rng.random_range(0..0x11_0000)).unwrap_or('\u{fffd}'),
                8 => rng.random_range(0u8..32) as char,
                _ => "KQRBNPkqrbnp12345678abcdefgh".as_bytes()[rng.random_range(0..28)] as char,
            })
            .collect()
    };
    match rng.random_range(0..10) {
        0 | 1 => {
            let n = rng.random_range(0..300);
            let bytes: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        2 => {
            let n = rng.random_range(0..200);
            random_text(rng, n)
        }
        3 => {
            // A long string (up to 32 KiB) of a repeated piece of the answer.
            let piece: String = truth.chars().take(rng.random_range(1..20)).collect();
            piece.repeat(rng.random_range(1..32_768 / piece.len().max(1)))
        }
        _ => {
            // A few edits of the true answer: delete, insert, replace, duplicate.
            let mut chars: Vec<char> = truth.chars().collect();
            for _ in 0..rng.random_range(1..6) {
                let at = rng.random_range(0..=chars.len());
                match rng.random_range(0..4) {
                    0 if at < chars.len() => {
                        chars.remove(at);
                    }
                    1 => {
                        let c = random_text(rng, 1).chars().next().unwrap();
                        chars.insert(at, c);
                    }
                    2 if at < chars.len() => {
                        chars[at] = random_text(rng, 1).chars().next().unwrap();
                    }
                    _ => {
                        let tail: Vec<char> = chars[at..].to_vec();
                        chars.extend(tail);
                    }
                }
            }
            chars.into_iter().collect()
        }
    }
}

fn to_pb(item: &Item, completion: String) -> pb::ScoreItem {
    pb::ScoreItem {
        task: match item.task {
            Task::Policy => pb::Task::Policy,
            Task::Environment => pb::Task::Environment,
        } as i32,
        prompt: item.prompt.clone(),
        completion,
    }
}

/// A Score call whose message is `body`, as is.
async fn raw_score(channel: &Channel, body: Vec<u8>) -> Result<Vec<u8>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel.clone())
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(SCORE_PATH);
    let mut request = tonic::Request::new(body);
    rookworld_service::auth::set_token(request.metadata_mut(), TOKEN)?;
    grpc.unary(request, path, Raw)
        .await
        .map(tonic::Response::into_inner)
}

/// Protobuf by hand: a field key.
fn key(field: u32, wire: u32) -> Vec<u8> {
    let mut out = Vec::new();
    prost::encoding::encode_varint(u64::from(field << 3 | wire), &mut out);
    out
}

/// A length-delimited field.
fn len_field(field: u32, bytes: &[u8]) -> Vec<u8> {
    let mut out = key(field, 2);
    prost::encoding::encode_varint(bytes.len() as u64, &mut out);
    out.extend_from_slice(bytes);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_fuzzed_completions_and_malformed_requests() {
    let mut server = Server::start();
    let channel = connect(&server.url()).await;
    let bearer = rookworld_service::auth::Bearer::new(TOKEN).unwrap();
    let mut client = RewardServiceClient::with_interceptor(channel.clone(), bearer)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let (env, policy) = generate_items(2_000, 11);
    let truths: Vec<&Item> = env.iter().chain(&policy).collect();

    // 1. Fuzzed completions on valid prompts: every call answers, one result per item.
    let mut sent = 0;
    let mut half_rss = 0;
    while sent < FUZZED {
        let items: Vec<pb::ScoreItem> = (0..BATCH.min(FUZZED - sent))
            .map(|_| {
                let truth = truths[rng.random_range(0..truths.len())];
                let completion = fuzz(&mut rng, &truth.completion);
                to_pb(truth, completion)
            })
            .collect();
        let n = items.len();
        let results = client
            .score(pb::ScoreRequest { items })
            .await
            .unwrap_or_else(|s| panic!("after {sent} items: {s:?}"))
            .into_inner()
            .results;
        assert_eq!(results.len(), n);
        assert!(results.iter().all(|r| (-1.0..=1.0).contains(&r.reward)));
        sent += n;
        if half_rss == 0 && sent >= FUZZED / 2 {
            half_rss = server.memory().0;
        }
    }
    server.assert_healthy("a million fuzzed completions").await;
    let (rss, peak) = server.memory();
    eprintln!(
        "{sent} fuzzed completions: RSS {} MiB (half-way {} MiB), peak {} MiB",
        rss >> 20,
        half_rss >> 20,
        peak >> 20
    );
    assert!(peak < MAX_PEAK_BYTES, "peak RSS {} MiB", peak >> 20);
    assert!(
        rss < half_rss + (64 << 20),
        "memory grows with the items scored: {} → {} MiB",
        half_rss >> 20,
        rss >> 20
    );

    // 2. Malformed requests: each a typed error (or, for bytes that happen to decode, an
    //    answer), never a crash.
    let valid = to_pb(truths[0], "x".into());
    // (what, message, whether it must be refused)
    let mut cases: Vec<(&str, Vec<u8>, bool)> = vec![
        ("empty message", vec![], false),
        (
            "invalid UTF-8 in the completion",
            len_field(
                1,
                &[
                    key(1, 0),
                    vec![2],
                    len_field(2, valid.prompt.as_bytes()),
                    len_field(3, &[0xff, 0xfe, 0x80]),
                ]
                .concat(),
            ),
            true,
        ),
        (
            "the task as a string",
            len_field(
                1,
                &[len_field(1, b"TASK_POLICY"), len_field(2, b"P: x")].concat(),
            ),
            true,
        ),
        ("items as a number", [key(1, 0), vec![0x2a]].concat(), true),
        (
            "a length past the end",
            [key(1, 2), vec![0xff, 0xff, 0x03], vec![1, 2, 3]].concat(),
            true,
        ),
        (
            "an unknown task",
            len_field(1, &[key(1, 0), vec![9]].concat()),
            true,
        ),
        ("a group wire type", [key(1, 3), key(1, 4)].concat(), true),
        (
            "a varint of 11 bytes",
            [key(2, 0), vec![0xff; 11]].concat(),
            true,
        ),
    ];
    for i in 0..200 {
        let n = rng.random_range(0..4096);
        let bytes: Vec<u8> = (0..n).map(|_| rng.random()).collect();
        cases.push((
            if i % 2 == 0 {
                "random bytes"
            } else {
                "random bytes (odd)"
            },
            bytes,
            false,
        ));
    }
    let mut typed = 0;
    for (what, body, refused) in cases {
        match raw_score(&channel, body).await {
            Ok(answer) => {
                assert!(!refused, "{what} was accepted");
                pb::ScoreResponse::decode(answer.as_slice())
                    .unwrap_or_else(|e| panic!("{what}: the answer does not decode: {e}"));
            }
            Err(status) => {
                assert!(
                    matches!(
                        status.code(),
                        tonic::Code::InvalidArgument | tonic::Code::Internal
                    ),
                    "{what}: {status:?}"
                );
                assert!(
                    status.message().len() <= 2048,
                    "{what}: a long status message"
                );
                typed += 1;
            }
        }
    }
    assert!(typed >= 7, "{typed} typed errors");
    server.assert_healthy("malformed messages").await;

    // Oversized: over the 16 MiB message limit, refused before it is decoded.
    let big = pb::ScoreRequest {
        items: vec![to_pb(truths[0], "x".repeat(17 << 20))],
    };
    let status = client.score(big).await.unwrap_err();
    assert!(
        matches!(
            status.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
        ),
        "{status:?}"
    );
    // A prompt that quotes a huge FEN back: the error stays short.
    let huge_fen = pb::ScoreRequest {
        items: vec![pb::ScoreItem {
            task: pb::Task::Environment as i32,
            prompt: format!("A: {}+e2e4+ +", "x".repeat(1 << 20)),
            completion: String::new(),
        }],
    };
    let status = client.score(huge_fen).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().len() <= 2048, "{}", status.message().len());

    // Not gRPC: raw bytes and HTTP/1.1 on the gRPC port.
    for probe in [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        (0..4096).map(|_| rng.random()).collect::<Vec<u8>>(),
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x04\xff\xff\xff\xff\xff".to_vec(),
    ] {
        let mut s = std::net::TcpStream::connect(server.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = s.write_all(&probe);
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    server.assert_healthy("non-gRPC bytes").await;
    let (_, peak) = server.memory();
    assert!(peak < MAX_PEAK_BYTES, "peak RSS {} MiB", peak >> 20);
}

#[test]
fn hostile_jsonl_gets_an_error_line_each_and_nothing_stops() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let (env, _) = generate_items(4, 3);
    let good =
        serde_json::json!({"task": "A", "prompt": env[0].prompt, "completion": env[0].completion})
            .to_string();
    let mut input: Vec<Vec<u8>> = vec![
        good.clone().into_bytes(),
        b"{\"task\": \"A\", \"prompt\": \"\xff\xfe\", \"completion\": \"\"}".to_vec(),
        b"{\"task\": 5, \"prompt\": [], \"completion\": null}".to_vec(),
        b"{\"task\": \"Z\", \"prompt\": \"A: x\", \"completion\": \"\"}".to_vec(),
        b"not json at all".to_vec(),
        b"{\"task\": \"A\"".to_vec(),
        vec![b'{'; 100_000],
        // Longer than any line is allowed to be: refused without being held whole.
        [
            b"{\"task\": \"A\", \"prompt\": \"".to_vec(),
            vec![b'x'; 3 << 20],
            b"\"}".to_vec(),
        ]
        .concat(),
        good.clone().into_bytes(),
    ];
    for _ in 0..200 {
        let n = rng.random_range(0..512);
        input.push(
            (0..n)
                .map(|_| rng.random::<u8>())
                .filter(|&b| b != b'\n')
                .collect(),
        );
    }
    let lines = input.len();
    let mut child = Command::new(BIN)
        .args(["score"])
        .env("RUST_LOG", "warn")
        .env_remove("REWARD_ENGINE")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        for line in input {
            stdin.write_all(&line).unwrap();
            stdin.write_all(b"\n").unwrap();
        }
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let answers: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(answers.len(), lines, "one answer per line");
    assert_eq!(answers[0]["reward"], 1.0);
    assert_eq!(
        answers[8]["reward"], 1.0,
        "good lines after bad ones still score"
    );
    for (i, a) in answers.iter().enumerate().skip(1).take(7) {
        let e = a["error"]
            .as_str()
            .unwrap_or_else(|| panic!("line {}: {a}", i + 1));
        assert!(e.starts_with(&format!("line {}:", i + 1)), "{e}");
        assert!(e.len() < 2048, "line {}: a long error", i + 1);
    }
    assert!(
        answers[7]["error"]
            .as_str()
            .unwrap()
            .contains("longer than"),
        "{}",
        answers[7]
    );
}

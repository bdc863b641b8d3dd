//! The rollout queue under a burst: 300 simulated workers (more than the 128 it tracks)
//! lease and submit large groups as fast as they can, some of them invalid, against a slow
//! learner, while someone keeps inspecting it. The queue stays within its bounds (counts,
//! the bytes those bounds imply, the worker table), answers every inspection call and
//! refuses the invalid groups.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use learner::prompts::Generator;
use learner::queue::{Queue, QueueConfig, QueueHandle};
use learner::queue_service::{self, GroupCheck, GroupSpec, QueueServer};
use rookworld_proto::queue::v1 as pb;
use rookworld_proto::queue::v1::rollout_queue_client::RolloutQueueClient;
use tonic::transport::Channel;

const TOKEN: &str = "load-token";
const WORKERS: usize = 300;
const G: u32 = 8;
const MAX_NEW_TOKENS: u32 = 32;
const BURST: Duration = Duration::from_secs(8);

fn authed<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    rookworld_service::auth::set_token(r.metadata_mut(), TOKEN).unwrap();
    r
}

/// What the workers did, together.
#[derive(Default)]
struct Tally {
    accepted: AtomicU64,
    accepted_bytes: AtomicU64,
    invalid: AtomicU64,
    too_many_workers: AtomicU64,
}

/// One simulated worker: lease, submit at once (every tenth group with an oversized text),
/// until `until`.
async fn worker(id: usize, channel: Channel, check: GroupCheck, tally: Arc<Tally>, until: Instant) {
    let mut client = RolloutQueueClient::new(channel);
    let worker_id = format!("sim-{id}");
    let mut n = 0u64;
    while Instant::now() < until {
        let lease = pb::LeaseRequest {
            worker_id: worker_id.clone(),
            max_prompts: 8,
            weight_version: 0,
            push_address: String::new(),
            weight_run_id: String::new(),
        };
        let Ok(got) = client
            .lease(authed(lease))
            .await
            .map(tonic::Response::into_inner)
        else {
            continue;
        };
        if got.backpressure == "too_many_workers" {
            tally.too_many_workers.fetch_add(1, Ordering::Relaxed);
        }
        if got.prompts.is_empty() {
            tokio::time::sleep(Duration::from_secs_f64(got.retry_after_seconds.min(0.05))).await;
            continue;
        }
        for p in got.prompts {
            n += 1;
            let text_bytes = if n.is_multiple_of(10) {
                100_000
            } else {
                12_000
            };
            let completion = pb::ScoredCompletion {
                ids: vec![7; MAX_NEW_TOKENS as usize],
                text: "x".repeat(text_bytes),
                logprobs: vec![-1.0; MAX_NEW_TOKENS as usize],
                reward: 0.5,
                components: HashMap::from([("format".to_owned(), 1.0)]),
                token_versions: vec![],
            };
            let submit = pb::SubmitRequest {
                worker_id: worker_id.clone(),
                lease_id: p.lease_id,
                prompt_id: p.prompt_id,
                prompt_ids: check.prompt_ids(&p.prompt).unwrap(),
                completions: vec![completion; G as usize],
                weight_version: 0,
                generate_seconds: 0.1,
                score_seconds: 0.1,
                run_id: String::new(),
            };
            let bytes = (G as u64) * (text_bytes as u64 + 8 * u64::from(MAX_NEW_TOKENS));
            match client.submit(authed(submit)).await {
                Ok(_) => {
                    tally.accepted.fetch_add(1, Ordering::Relaxed);
                    tally.accepted_bytes.fetch_add(bytes, Ordering::Relaxed);
                }
                Err(s) if s.code() == tonic::Code::InvalidArgument => {
                    tally.invalid.fetch_add(1, Ordering::Relaxed);
                }
                Err(s) => panic!("{worker_id}: {s:?}"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_workers_stays_within_bounds_and_inspection_keeps_answering() {
    let cfg = QueueConfig {
        max_pending: 256,
        max_scored: 16,
        max_leased: 64,
        lease_timeout: Duration::from_secs(30),
        max_version_lag: 2,
        max_workers: 128,
    };
    let queue = QueueHandle::start(Queue::new(cfg));
    let check = GroupCheck::for_model(&rookworld_lm::Config::tiny());
    let spec = GroupSpec {
        num_completions: G,
        sampling: rookworld_proto::v1::SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            max_new_tokens: MAX_NEW_TOKENS,
            seed: 0,
        },
        check: check.clone(),
    };
    let server = QueueServer::new(
        queue.clone(),
        spec,
        Some(TOKEN.into()),
        Arc::new(AtomicU64::new(0)),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(queue_service::run(server, listener, std::future::pending()));

    // Someone inspecting throughout (connected before the burst): every call answered,
    // the bounds held.
    let mut inspector = RolloutQueueClient::new(
        Channel::from_shared(url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap(),
    );

    // The learner's side: prompts kept topped up, and a slow consumer (8 groups / 50 ms).
    let until = Instant::now() + BURST;
    let learner = {
        let queue = queue.clone();
        tokio::spawn(async move {
            let mut prompts = Generator::new(3, 0.0);
            let mut longest_prompt = 0;
            while Instant::now() < until + Duration::from_secs(1) {
                let room = queue.run(|q| q.pending_room()).await;
                let batch: Vec<_> = (0..room).map(|_| prompts.next_prompt()).collect();
                for p in &batch {
                    longest_prompt = longest_prompt.max(p.prompt.len());
                }
                queue
                    .run(move |q| {
                        for p in batch {
                            q.add(p, 0);
                        }
                        q.expire(Instant::now());
                        q.take(8, 0);
                    })
                    .await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            longest_prompt
        })
    };

    let tally = Arc::new(Tally::default());
    let mut tasks = Vec::new();
    for id in 0..WORKERS {
        // A connection of its own, as a worker process has.
        let channel = Channel::from_shared(url.clone()).unwrap().connect_lazy();
        tasks.push(tokio::spawn(worker(
            id,
            channel,
            check.clone(),
            tally.clone(),
            until,
        )));
    }

    let (
        mut calls,
        mut max_scored,
        mut max_bytes,
        mut max_leased,
        mut max_pending,
        mut max_workers,
    ) = (0, 0, 0, 0, 0, 0);
    while Instant::now() < until {
        let deadline = Duration::from_secs(5);
        let d = tokio::time::timeout(deadline, inspector.get_depths(pb::GetDepthsRequest {}))
            .await
            .expect("GetDepths answered")
            .unwrap()
            .into_inner();
        let w = tokio::time::timeout(deadline, inspector.list_workers(pb::ListWorkersRequest {}))
            .await
            .expect("ListWorkers answered")
            .unwrap()
            .into_inner();
        let peek = tokio::time::timeout(
            deadline,
            inspector.peek_groups(pb::PeekGroupsRequest {
                count: 2,
                newest: true,
            }),
        )
        .await
        .expect("PeekGroups answered")
        .unwrap()
        .into_inner();
        assert!(peek.groups.len() <= 2);
        calls += 3;
        max_scored = max_scored.max(d.scored);
        max_bytes = max_bytes.max(d.scored_bytes);
        max_leased = max_leased.max(d.leased);
        max_pending = max_pending.max(d.pending);
        max_workers = max_workers.max(w.workers.len());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    let longest_prompt = learner.await.unwrap();

    let bound_groups = (cfg.max_scored + cfg.max_leased) as u64;
    let bound_bytes =
        bound_groups * check.max_group_bytes(G, MAX_NEW_TOKENS, longest_prompt) as u64;
    let accepted_bytes = tally.accepted_bytes.load(Ordering::Relaxed);
    eprintln!(
        "{} groups accepted ({} MiB), {} invalid refused, {} leases refused for the worker bound; \
         {calls} inspection calls; at most {max_scored} groups / {} MiB waiting (bound {bound_groups} / {} MiB), \
         {max_leased} leased, {max_pending} pending, {max_workers} workers",
        tally.accepted.load(Ordering::Relaxed),
        accepted_bytes >> 20,
        tally.invalid.load(Ordering::Relaxed),
        tally.too_many_workers.load(Ordering::Relaxed),
        max_bytes >> 20,
        bound_bytes >> 20,
    );
    assert!(calls >= 30, "{calls} inspection calls");
    assert!(max_scored <= bound_groups, "{max_scored} groups waiting");
    assert!(max_bytes <= bound_bytes, "{max_bytes} bytes waiting");
    assert!(max_leased <= cfg.max_leased as u64 && max_pending <= cfg.max_pending as u64);
    // 300 workers, a table of 128: full and no fuller (past it, the longest-silent worker
    // without leases makes room; a worker is refused only when all 128 hold leases).
    assert_eq!(
        max_workers, cfg.max_workers,
        "{max_workers} workers tracked"
    );
    assert!(
        tally.invalid.load(Ordering::Relaxed) > 0,
        "invalid groups were refused"
    );
    assert!(
        accepted_bytes > 2 * max_bytes,
        "the burst was bigger than what waited at once"
    );
}

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::prompts::{TaskKind, TaskPrompt};

fn prompt(i: u64) -> TaskPrompt {
    TaskPrompt {
        kind: TaskKind::Environment,
        prompt: format!("A: prompt {i}+"),
        completion: None,
    }
}

fn group(id: PromptId, version: u64) -> ScoredGroup {
    ScoredGroup {
        prompt_id: id,
        prompt: String::new(),
        prompt_ids: vec![],
        completions: vec![],
        worker: String::new(),
        run_id: String::new(),
        weight_version: version,
        seed: 0,
        generate_seconds: 0.0,
        score_seconds: 0.0,
        lease_seconds: 0.0,
    }
}

fn cfg() -> QueueConfig {
    QueueConfig {
        max_pending: 8,
        max_scored: 3,
        max_leased: 4,
        lease_timeout: Duration::from_secs(10),
        max_version_lag: 1,
        max_workers: 3,
    }
}

#[test]
fn an_expired_lease_is_reissued_and_the_late_submission_refused() {
    let t0 = Instant::now();
    let mut q = Queue::new(cfg());
    let id = q.add(prompt(0), 5).unwrap();
    let a = q.lease("a", 1, t0).unwrap();
    assert_eq!((a.len(), a[0].prompt.id, a[0].prompt.attempts), (1, id, 1));
    assert_eq!(q.lease("b", 1, t0), Err(Backpressure::Empty));
    // Worker a is silent past its deadline: b gets the prompt.
    let b = q.lease("b", 1, t0 + Duration::from_secs(11)).unwrap();
    assert_eq!((b[0].prompt.id, b[0].prompt.attempts), (id, 2));
    let late = q.submit("a", a[0].lease, group(id, 0), t0 + Duration::from_secs(12));
    assert_eq!(late, Err(SubmitError::UnknownLease(a[0].lease)));
    q.submit("b", b[0].lease, group(id, 0), t0 + Duration::from_secs(12))
        .unwrap();
    // Twice is refused too.
    assert!(
        q.submit("b", b[0].lease, group(id, 0), t0 + Duration::from_secs(12))
            .is_err()
    );
    let taken = q.take(10, 0);
    assert_eq!(taken.len(), 1);
    assert_eq!(taken[0].worker, "b");
    let c = q.depths().counters;
    assert_eq!(
        (c.leases_expired, c.submissions_refused, c.groups_consumed),
        (1, 2, 1)
    );
    assert_eq!(q.workers()["a"].expired, 1);
}

#[test]
fn backpressure_bounds_and_stale_groups() {
    let t0 = Instant::now();
    let mut q = Queue::new(cfg());
    for i in 0..8 {
        assert!(q.add(prompt(i), i).is_some());
    }
    assert!(q.add(prompt(99), 0).is_none(), "pending is bounded");
    let grants = q.lease("w", 10, t0).unwrap();
    assert_eq!(grants.len(), 4, "leases are bounded");
    assert!(matches!(
        q.lease("w", 1, t0),
        Err(Backpressure::TooManyLeases { .. })
    ));
    for (k, g) in grants.iter().take(3).enumerate() {
        q.submit("w", g.lease, group(g.prompt.id, k as u64), t0)
            .unwrap();
    }
    assert!(matches!(
        q.lease("v", 1, t0),
        Err(Backpressure::LearnerBehind { .. })
    ));
    // Learner at version 2: the version-0 group is two behind (bound 1) and dropped.
    let taken = q.take(10, 2);
    assert_eq!(
        taken.iter().map(|g| g.weight_version).collect::<Vec<_>>(),
        vec![1, 2]
    );
    assert_eq!(q.depths().counters.groups_dropped_stale, 1);
    assert_eq!(&q.staleness()[..2], &[1, 1]);
    // A worker that goes away returns its leases.
    assert_eq!(q.release_worker("w"), 1);
    assert_eq!(q.depths().leased, 0);
}

#[test]
fn under_random_faults_every_prompt_ends_once() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let t0 = Instant::now();
    let mut q = Queue::new(QueueConfig {
        max_pending: 16,
        max_scored: 8,
        max_leased: 12,
        lease_timeout: Duration::from_secs(5),
        max_version_lag: 2,
        max_workers: 8,
    });
    let mut held: Vec<(String, Grant)> = Vec::new();
    let mut ended: BTreeMap<PromptId, u32> = BTreeMap::new();
    let mut version = 0u64;
    let mut added = 0u64;
    for tick in 0..5000u64 {
        let now = t0 + Duration::from_millis(tick * 100);
        match rng.random_range(0..10) {
            0 | 1 => {
                while q.pending_room() > 0 && added < 2000 {
                    q.add(prompt(added), added);
                    added += 1;
                }
            }
            2..=4 => {
                let w = format!("w{}", rng.random_range(0..4));
                if let Ok(gs) = q.lease(&w, rng.random_range(1..4), now) {
                    held.extend(gs.into_iter().map(|g| (w.clone(), g)));
                }
            }
            5 | 6 if !held.is_empty() => {
                let (w, g) = held.swap_remove(rng.random_range(0..held.len()));
                // Some workers die silently (never submit); the rest submit, maybe late.
                if rng.random_bool(0.85) {
                    let v = version.saturating_sub(rng.random_range(0..4));
                    let _ = q.submit(&w, g.lease, group(g.prompt.id, v), now);
                }
            }
            7 => {
                for g in q.take(rng.random_range(1..5), version) {
                    *ended.entry(g.prompt_id).or_default() += 1;
                }
                version += rng.random_range(0..2);
            }
            8 => {
                q.release_worker(&format!("w{}", rng.random_range(0..4)));
            }
            _ => {}
        }
    }
    // Drain: everything still leased expires, and is leased, submitted and taken.
    let mut now = t0 + Duration::from_secs(10_000);
    loop {
        now += Duration::from_secs(10);
        for g in q.take(100, version) {
            *ended.entry(g.prompt_id).or_default() += 1;
        }
        let d = q.depths();
        if d.pending + d.leased + d.scored == 0 {
            break;
        }
        if let Ok(gs) = q.lease("drain", 100, now) {
            for g in gs {
                q.submit("drain", g.lease, group(g.prompt.id, version), now)
                    .unwrap();
            }
        }
    }
    let c = q.depths().counters;
    assert!(
        ended.values().all(|&n| n == 1),
        "a prompt was consumed twice"
    );
    assert_eq!(c.prompts_added, added);
    assert_eq!(c.groups_consumed + c.groups_dropped_stale, added, "{c:?}");
    assert_eq!(c.groups_consumed, ended.len() as u64);
    assert!(
        c.leases_expired > 0 && c.groups_dropped_stale > 0 && c.submissions_refused > 0,
        "{c:?}"
    );
}

/// Leases and submits one prompt per version given (each by worker "w").
fn submit_versions(q: &mut Queue, versions: &[u64], now: Instant) -> Vec<PromptId> {
    let mut ids = Vec::new();
    for &v in versions {
        let id = q.add(prompt(v), v).unwrap();
        let g = q.lease("w", 1, now).unwrap();
        q.submit("w", g[0].lease, group(id, v), now).unwrap();
        ids.push(id);
    }
    ids
}

#[test]
fn unusable_groups_never_hold_the_buffer_shut() {
    // The buffer (3) fills with groups the learner at version 5 will not take: leases stop
    // for backpressure, so without a purge nothing would ever move again.
    let t0 = Instant::now();
    let mut q = Queue::new(cfg());
    submit_versions(&mut q, &[1, 2, 3], t0);
    q.add(prompt(9), 9).unwrap();
    assert!(matches!(
        q.lease("w", 1, t0),
        Err(Backpressure::LearnerBehind { .. })
    ));
    assert_eq!(q.ready(5), 0);
    assert!(q.depths().scored_bytes > 0);
    assert_eq!(q.purge(5), 3);
    assert_eq!(q.depths().scored_bytes, 0);
    assert_eq!(q.depths().counters.groups_dropped_stale, 3);
    assert_eq!(q.lease("w", 1, t0).unwrap().len(), 1);
}

#[test]
fn retired_and_unpublished_versions_are_dropped() {
    let t0 = Instant::now();
    let mut q = Queue::new(QueueConfig {
        max_scored: 8,
        max_version_lag: 5,
        ..cfg()
    });
    // Versions 3..=4 came from a crashed run's weights; 9 is ahead of the learner (8).
    q.retire(3, 4);
    let ids = submit_versions(&mut q, &[2, 3, 4, 5, 9, 8], t0);
    assert_eq!(q.ready(8), 2);
    let taken: Vec<u64> = q.take(10, 8).iter().map(|g| g.weight_version).collect();
    assert_eq!(taken, [5, 8], "version 2 is 6 behind (bound 5)");
    let c = q.depths().counters;
    assert_eq!((c.groups_consumed, c.groups_dropped_stale), (2, 4));
    assert_eq!(
        q.depths().scored_bytes,
        0,
        "nothing held once all are taken or dropped"
    );
    assert_eq!(c.prompts_added, ids.len() as u64);
}

/// An update that reached the worker mid-completion: the group is kept while its newest
/// token is within the limit, and the ids sampled by versions past it (or retired) are
/// marked as the completion's stale prefix; a group whose every id is past it is dropped.
#[test]
fn tokens_past_the_staleness_limit_are_marked_and_the_group_kept_while_one_is_within() {
    let t0 = Instant::now();
    let mut q = Queue::new(QueueConfig {
        max_scored: 8,
        max_version_lag: 1,
        ..cfg()
    });
    let completion = |versions: &[u64]| ScoredCompletion {
        ids: vec![1; versions.len()],
        text: String::new(),
        logprobs: vec![-1.0; versions.len()],
        reward: 0.0,
        components: BTreeMap::new(),
        token_versions: versions.to_vec(),
        stale_prefix: 0,
    };
    let submit = |q: &mut Queue, completions: Vec<ScoredCompletion>| {
        let id = q.add(prompt(0), 0).unwrap();
        let lease = q.lease("w", 1, t0).unwrap()[0].lease;
        let oldest = completions
            .iter()
            .flat_map(|c| c.token_versions.iter().copied())
            .min()
            .unwrap();
        let group = ScoredGroup {
            completions,
            ..group(id, oldest)
        };
        q.submit("w", lease, group, t0).unwrap();
    };
    // A learner at version 4 with a lag of 1 trains on versions 3 and 4.
    submit(
        &mut q,
        vec![completion(&[2, 2, 3, 4]), completion(&[3, 3, 3])],
    );
    submit(&mut q, vec![completion(&[1, 2]), completion(&[2, 2])]);
    submit(&mut q, vec![completion(&[2, 3, 4, 4])]);
    q.retire(3, 3);
    let taken = q.take(10, 4);
    let prefixes: Vec<Vec<usize>> = taken
        .iter()
        .map(|g| g.completions.iter().map(|c| c.stale_prefix).collect())
        .collect();
    // The retired version 3 is stale too.
    assert_eq!(prefixes, [vec![3, 3], vec![2]]);
    let c = q.depths().counters;
    assert_eq!((c.groups_consumed, c.groups_dropped_stale), (2, 1));
    // Each kept group counts at the lag of the oldest version it is trained on.
    assert_eq!(&q.staleness()[..2], &[2, 0]);
}

#[test]
fn counters_and_retired_versions_continue_after_a_restore() {
    let t0 = Instant::now();
    let mut q = Queue::new(cfg());
    q.retire(4, 6);
    submit_versions(&mut q, &[1, 1], t0);
    assert_eq!(q.take(1, 1).len(), 1);
    q.add(prompt(7), 7).unwrap();
    q.lease("w", 1, t0).unwrap();
    let snapshot = q.snapshot();
    // The snapshot survives JSON (the checkpoint's form).
    let json = serde_json::to_string(&snapshot).unwrap();
    let snapshot: QueueSnapshot = serde_json::from_str(&json).unwrap();

    let mut r = Queue::new(cfg());
    r.restore(snapshot.clone());
    let c = r.depths().counters;
    assert_eq!(c, q.depths().counters);
    // prompts added = consumed + dropped + unfinished, across the restore.
    assert_eq!(
        c.prompts_added,
        c.groups_consumed + c.groups_dropped_stale + r.unfinished().len() as u64
    );
    assert_eq!(r.depths().pending, 2, "the scored and the leased prompt");
    assert_eq!(r.snapshot().retired, vec![(4, 6)]);
    // A checkpoint from before the counters were kept counts its prompts as added.
    let mut old = Queue::new(cfg());
    old.restore(QueueSnapshot {
        counters: None,
        retired: vec![],
        ..snapshot
    });
    assert_eq!(old.depths().counters.prompts_added, 2);
}

#[test]
fn the_worker_table_is_bounded() {
    let t0 = Instant::now();
    let mut q = Queue::new(cfg()); // 3 workers at most
    for i in 0..8 {
        q.add(prompt(i), i).unwrap();
    }
    for (k, w) in ["a", "b", "c"].iter().enumerate() {
        q.lease(w, 1, t0 + Duration::from_secs(k as u64)).unwrap();
    }
    // Every worker holds a lease: a fourth is refused, nobody is forgotten.
    assert_eq!(
        q.lease("d", 1, t0),
        Err(Backpressure::TooManyWorkers { bound: 3 })
    );
    assert_eq!(q.workers().len(), 3);
    // Once a worker has no leases, the longest-silent such one makes room.
    q.release_worker("a");
    q.release_worker("b");
    q.lease("d", 1, t0 + Duration::from_secs(5)).unwrap();
    let names: Vec<&str> = q.workers().keys().map(String::as_str).collect();
    assert_eq!(names, ["b", "c", "d"]);
    // Refused submissions of unknown workers leave no trace in the table.
    let _ = q.submit("stranger", 999, group(0, 0), t0);
    assert_eq!(q.workers().len(), 3);
    // What a worker reports in its lease is kept.
    q.describe_worker("d", "http://d:1", ("", 7), t0);
    assert_eq!(q.workers()["d"].reported_version, Some(7));
    assert_eq!(q.workers()["d"].push_address, "http://d:1");
}

#[test]
fn dynamic_sampling_consumes_groups_without_signal_and_keeps_the_others() {
    let t0 = Instant::now();
    let mut q = Queue::new(cfg());
    let rewarded = |id, rewards: &[f32]| ScoredGroup {
        completions: rewards
            .iter()
            .map(|&reward| ScoredCompletion {
                ids: vec![1],
                text: String::new(),
                logprobs: vec![-1.0],
                reward,
                components: BTreeMap::new(),
                token_versions: vec![],
                stale_prefix: 0,
            })
            .collect(),
        ..group(id, 0)
    };
    let mut ids = Vec::new();
    for rewards in [&[0.5f32, 0.5][..], &[1.0, -1.0], &[-1.0, -1.0]] {
        let id = q.add(prompt(ids.len() as u64), 0).unwrap();
        let lease = q.lease("a", 1, t0).unwrap()[0].lease;
        q.submit("a", lease, rewarded(id, rewards), t0).unwrap();
        ids.push(id);
    }
    let bytes = q.depths().scored_bytes;
    let skipped = q.take_without_signal();
    assert_eq!(
        skipped.iter().map(|g| g.prompt_id).collect::<Vec<_>>(),
        [ids[0], ids[2]]
    );
    assert!(!skipped[0].has_signal() && !skipped[1].has_signal());
    let d = q.depths();
    assert_eq!((d.scored, d.counters.groups_consumed), (1, 2));
    assert!(d.scored_bytes < bytes);
    let kept = q.take(3, 0);
    assert_eq!(kept.len(), 1);
    assert!(kept[0].has_signal() && kept[0].prompt_id == ids[1]);
    assert_eq!(q.depths().scored_bytes, 0);
}

#[test]
fn a_second_worker_under_a_held_id_is_refused_until_the_holder_is_silent() {
    let t0 = Instant::now();
    let s = Duration::from_secs;
    let mut q = Queue::new(cfg()); // lease timeout 10 s
    q.add(prompt(0), 0).unwrap();
    // The worker at A leases under `w`: it holds the id.
    q.lease("w", 1, t0).unwrap();
    q.describe_worker("w", "http://a:1", ("", 0), t0);
    assert_eq!(q.claim("w", "http://a:1", t0 + s(1)), Ok(()));
    // Another address under the same id is refused, naming both addresses.
    let e = q.claim("w", "http://b:1", t0 + s(3)).unwrap_err();
    assert_eq!(
        (e.holder.as_str(), e.claimant.as_str()),
        ("http://a:1", "http://b:1")
    );
    assert_eq!(e.silent, s(3));
    let text = e.to_string();
    assert!(
        text.contains("--worker-id") && text.contains("`w`"),
        "{text}"
    );
    // A group under the id counts as the holder heard from.
    q.seen("w", t0 + s(9));
    assert!(q.claim("w", "http://b:1", t0 + s(18)).is_err());
    // Silent for the lease timeout: the id is free (the holder restarted elsewhere).
    assert_eq!(q.claim("w", "http://b:1", t0 + s(19)), Ok(()));
    // Workers without a push address are not told apart; unknown ids are free.
    assert_eq!(q.claim("w", "", t0 + s(10)), Ok(()));
    assert_eq!(q.claim("other", "http://b:1", t0), Ok(()));
}

use super::*;

fn outcome(worker: &str, version: u64, error: Option<&str>) -> PushOutcome {
    PushOutcome {
        worker: worker.into(),
        version,
        seconds: 0.1,
        bytes: 0,
        error: error.map(String::from),
        blocked: None,
        path: "stream",
        shared_refused: false,
        delta_refused: None,
        ..Default::default()
    }
}

#[test]
fn a_worker_is_pushed_once_backs_off_and_is_resynced_after_a_restart() {
    let t0 = Instant::now();
    let mut fleet = Fleet::new(Duration::from_secs(8));
    fleet.register("w");
    assert_eq!(fleet.state("w", 3), Some(SyncState::Stale));
    assert_eq!(fleet.due(3, t0), ["w"]);
    // Under way: not due again, and reports do not change it.
    assert_eq!(fleet.state("w", 3), Some(SyncState::Pushing));
    assert!(fleet.due(3, t0).is_empty());
    fleet.finish(&outcome("w", 3, Some("connect: refused")), t0);
    assert_eq!(fleet.state("w", 3), Some(SyncState::Failing));
    // Back-off: 1 s after the first failure, then doubling to the bound.
    assert!(fleet.due(3, t0 + Duration::from_millis(900)).is_empty());
    assert_eq!(fleet.due(3, t0 + Duration::from_millis(1000)), ["w"]);
    fleet.finish(&outcome("w", 3, Some("again")), t0);
    assert!(fleet.due(3, t0 + Duration::from_millis(1999)).is_empty());
    assert_eq!(fleet.due(3, t0 + Duration::from_secs(2)), ["w"]);
    let t1 = t0 + Duration::from_secs(3);
    fleet.finish(&outcome("w", 3, None), t1);
    assert_eq!(fleet.state("w", 3), Some(SyncState::Current));

    // A report from before the push changes nothing; nor does one stale report after
    // it (sent before the swap, arrived after) that the next one contradicts.
    fleet.reported("w", 2, t1 - Duration::from_millis(1), 3);
    fleet.reported("w", 2, t1 + Duration::from_millis(10), 3);
    fleet.reported("w", 3, t1 + Duration::from_millis(20), 3);
    assert_eq!(fleet.state("w", 3), Some(SyncState::Current));
    // Two reports naming version 0: the worker restarted; stale again, pushed at once.
    let t2 = t1 + Duration::from_secs(1);
    fleet.reported("w", 0, t2, 3);
    fleet.reported("w", 0, t2, 3); // the same lease, seen twice
    assert_eq!(fleet.state("w", 3), Some(SyncState::Current));
    fleet.reported("w", 0, t2 + Duration::from_millis(300), 3);
    assert_eq!(fleet.state("w", 3), Some(SyncState::Stale));
    assert_eq!(fleet.due(3, t2), ["w"]);
}

#[test]
fn a_worker_that_reports_the_newest_version_needs_no_push() {
    let t0 = Instant::now();
    let mut fleet = Fleet::new(Duration::from_secs(8));
    fleet.register("local");
    fleet.reported("local", 5, t0, 5);
    assert_eq!(fleet.state("local", 5), Some(SyncState::Current));
    assert!(fleet.due(5, t0).is_empty());
    // Forgotten: no state, never due.
    fleet.forget("local");
    assert_eq!(fleet.state("local", 6), None);
    assert!(fleet.due(6, t0).is_empty());
}

/// A fleet made to take staged answers asks for them in every push it plans — alone,
/// and as the roots of relay trees (whose header the relays pass on) — and one made
/// without does not.
#[test]
fn a_fleet_answering_when_staged_asks_it_of_every_push_it_plans() {
    let t0 = Instant::now();
    for (staged, fanout) in [(true, 0), (true, 2), (false, 2)] {
        let mut fleet = Fleet::new(Duration::from_secs(8)).with_fanout(fanout);
        if staged {
            fleet = fleet.answering_when_staged();
        }
        for w in ["a", "b", "c", "d", "e"] {
            fleet.mark(w, 1, t0);
        }
        fleet.advance(&Arc::new(WeightSet::from_bytes("r", 2, vec![1; 64])));
        let due = fleet.due(2, t0);
        assert_eq!(due.len(), 5);
        let planned = fleet.plan(due);
        assert!(!planned.is_empty());
        for (worker, via) in planned {
            assert_eq!(via.route.answer_when_staged, staged, "{worker} {fanout}");
        }
    }
}

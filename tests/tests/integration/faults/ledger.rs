//! The books of a run after its learner stopped cleanly: every prompt it ever issued is
//! in exactly one of three places — consumed once (the rollout dump, rolled back to the
//! checkpoint on a resume), dropped and counted, or kept unfinished in the final
//! checkpoint — and every consumed group was scored in full.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::cluster::{Cluster, GROUP};

/// What the books say.
#[derive(Debug)]
pub struct Ledger {
    pub issued: u64,
    pub consumed: u64,
    pub dropped: u64,
    pub unfinished: u64,
    pub steps: u64,
}

/// Reads the final checkpoint and the dump, checks every rule, returns the totals.
pub fn check(cluster: &Cluster) -> Ledger {
    let checkpoints = cluster.path("run/checkpoints");
    let latest = std::fs::read_to_string(checkpoints.join("latest")).expect("a final checkpoint");
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(checkpoints.join(latest.trim()).join("trainer_state.json"))
            .unwrap(),
    )
    .unwrap();
    let q = &state["queue"];
    let counters = &q["counters"];
    let count = |name: &str| counters[name].as_u64().unwrap_or_else(|| panic!("{name}"));
    let unfinished: BTreeSet<u64> = q["unfinished"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_u64().unwrap())
        .collect();

    let dump = std::fs::read_to_string(cluster.path("groups.jsonl")).unwrap_or_default();
    let mut consumed = BTreeSet::new();
    let steps = state["step"].as_u64().unwrap();
    for line in dump.lines() {
        let g: Value = serde_json::from_str(line).expect("every dump line is whole");
        let id = g["prompt_id"].as_u64().unwrap();
        assert!(consumed.insert(id), "prompt {id} consumed twice");
        assert!(
            g["step"].as_u64().unwrap() <= steps,
            "a dump line after the checkpoint"
        );
        let completions = g["completions"].as_array().unwrap();
        assert_eq!(
            completions.len(),
            GROUP as usize,
            "prompt {id}: a partial group"
        );
        for c in completions {
            let reward = c["reward"].as_f64().unwrap();
            assert!(
                (-1.0..=1.0).contains(&reward),
                "prompt {id}: reward {reward}"
            );
            assert!(
                c["components"].as_object().is_some_and(|m| !m.is_empty()),
                "prompt {id}: a completion the reward server never scored"
            );
        }
    }
    assert!(
        consumed.is_disjoint(&unfinished),
        "a consumed prompt is also kept as unfinished"
    );
    let ledger = Ledger {
        issued: q["next_prompt_id"].as_u64().unwrap(),
        consumed: consumed.len() as u64,
        dropped: count("groups_dropped_stale"),
        unfinished: unfinished.len() as u64,
        steps,
    };
    assert_eq!(ledger.consumed, count("groups_consumed"), "{ledger:?}");
    assert_eq!(ledger.issued, count("prompts_added"), "{ledger:?}");
    assert_eq!(
        ledger.issued,
        ledger.consumed + ledger.dropped + ledger.unfinished,
        "every prompt consumed, dropped or kept: {ledger:?}"
    );
    // Ids are issued without gaps: each is in exactly one of the three places.
    assert!(
        unfinished
            .iter()
            .chain(&consumed)
            .all(|&id| id < ledger.issued)
    );
    ledger
}

//! `learner train --eval-every`: the held-out suites run beside a real `--local` run on
//! the published weights, their results reach the step log, Prometheus and the final
//! checkpoint, and they take no prompt from the rollout queue.

use std::path::Path;

use clap::Parser;
use learner::checkpoint::TrainerState;
use learner::train::{self, TrainArgs};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: TrainArgs,
}

fn args(run: &Path, extra: &[&str]) -> TrainArgs {
    let mut argv = vec![
        "train",
        "--local",
        "--run-dir",
        run.to_str().unwrap(),
        "--no-progress",
        "--sft-steps",
        "0",
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "16",
    ];
    argv.extend_from_slice(extra);
    Cli::parse_from(argv).args
}

async fn listener() -> tokio::net::TcpListener {
    tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evaluations_run_beside_training_and_land_in_log_metrics_and_checkpoint() {
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    learner::metrics::install_exporter(metrics).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("steps.jsonl");
    let summary = train::run(
        args(
            dir.path(),
            &[
                "--metrics",
                "off",
                "--steps",
                "4",
                "--eval-every",
                "2",
                "--eval-limit",
                "3",
                "--eval-suites",
                "checkmate-in-one,environment",
                "--log-jsonl",
                log.to_str().unwrap(),
            ],
        ),
        listener().await,
        std::future::pending(),
    )
    .await
    .unwrap();
    assert_eq!(summary.steps.len(), 4);

    // The start's weights first, the final weights last (one in between may have been
    // replaced by a newer request while another ran); each evaluated both suites.
    let steps: Vec<u64> = summary.evals.iter().map(|e| e.step).collect();
    assert_eq!(steps.first(), Some(&0), "{steps:?}");
    assert_eq!(steps.last(), Some(&4), "{steps:?}");
    assert!(steps.windows(2).all(|w| w[0] < w[1]), "{steps:?}");
    for e in &summary.evals {
        // Version 1 is the start's weights; each step adds one.
        assert_eq!(e.version, e.step + 1);
        let suites: Vec<(&str, usize)> = e.suites.iter().map(|s| (s.suite, s.items)).collect();
        assert_eq!(suites, [("checkmate-in-one", 3), ("environment", 3)]);
        assert!(
            e.suites
                .iter()
                .all(|s| s.metrics.values().all(|v| (0.0..=1.0).contains(v)))
        );
    }

    // The log: 4 step lines and one line per evaluation with every eval/<suite>/<metric>.
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let evals: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l.get("eval/seconds").is_some())
        .collect();
    assert_eq!(lines.len() - evals.len(), 4);
    assert_eq!(evals.len(), summary.evals.len());
    let last = evals.last().unwrap();
    assert_eq!(last["step"], 4);
    for key in [
        "eval/checkmate-in-one/mate",
        "eval/checkmate-in-one/legal_best",
        "eval/checkmate-in-one/well_formed",
        "eval/checkmate-in-one/mean_reward",
        "eval/environment/exact_fen",
        "eval/environment/placement",
        "eval/environment/flags",
    ] {
        assert!(last[key].is_number(), "{key} missing in {last}");
    }

    // The final checkpoint carries its own weights' evaluation.
    let checkpoint = summary.checkpoint.unwrap();
    let state: TrainerState =
        serde_json::from_slice(&std::fs::read(checkpoint.join("trainer_state.json")).unwrap())
            .unwrap();
    let eval = state.eval.expect("the final checkpoint's evaluation");
    assert_eq!(eval["step"], 4);
    assert_eq!(eval["suites"][0]["suite"], "checkmate-in-one");
    assert_eq!(eval["suites"][1]["items"], 3);

    // No prompt went to the evaluation: every issued prompt was trained on, dropped as
    // stale or is kept for the next run.
    let queue = state.queue.unwrap();
    let dropped = summary.steps.last().unwrap().dropped_stale_total;
    assert_eq!(
        queue.next_prompt_id,
        4 * 2 + dropped + queue.unfinished.len() as u64
    );

    // Prometheus: learner_eval{suite,metric} and the evaluated step.
    let text =
        tokio::task::spawn_blocking(move || rookworld_service::probe::scrape_metrics(metrics))
            .await
            .unwrap()
            .unwrap();
    let mate = text
        .lines()
        .find(|l| {
            l.starts_with("learner_eval{")
                && l.contains("suite=\"checkmate-in-one\"")
                && l.contains("metric=\"mate\"")
        })
        .unwrap_or_else(|| panic!("learner_eval missing:\n{text}"));
    let value: f64 = mate.rsplit(' ').next().unwrap().parse().unwrap();
    assert!((0.0..=1.0).contains(&value));
    let step = text
        .lines()
        .find_map(|l| l.strip_prefix("learner_eval_step "))
        .unwrap_or_else(|| panic!("learner_eval_step missing:\n{text}"));
    assert_eq!(step.parse::<f64>().unwrap(), 4.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_suite_or_a_bad_data_file_stops_the_run_before_it_starts() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let err = train::run(
        args(
            &run,
            &[
                "--metrics",
                "off",
                "--eval-every",
                "5",
                "--eval-suites",
                "chess960",
            ],
        ),
        listener().await,
        std::future::pending(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("--eval-suites") && err.contains("unknown suite `chess960`"),
        "{err}"
    );
    assert!(!err.contains('\n'), "{err}");
    assert!(!run.join("checkpoints").exists());

    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::write(data.join("opening_dataset_eval.json"), "[{\"prompt\": 1}]").unwrap();
    let err = train::run(
        args(
            &run,
            &[
                "--metrics",
                "off",
                "--eval-every",
                "5",
                "--eval-suites",
                "environment",
                "--eval-data-dir",
                data.to_str().unwrap(),
            ],
        ),
        listener().await,
        std::future::pending(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("opening_dataset_eval.json"), "{err}");
}

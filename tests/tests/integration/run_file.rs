//! Run files (`--config FILE`) as the binaries read them: the known keys, the precedence
//! (defaults < file < environment < flags), scoped tables, and one line naming the key for
//! an unknown key (with the closest known one), a wrong type or a value out of range.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

const LEARNER: &str = env!("CARGO_BIN_EXE_rw-learner");
const WORKER: &str = env!("CARGO_BIN_EXE_rw-rollout-worker");
const REWARD: &str = env!("CARGO_BIN_EXE_rw-reward-server");

/// Every long option of every command of `cmd`, with underscores.
fn keys(cmd: &clap::Command, out: &mut BTreeSet<String>) {
    for arg in cmd.get_arguments() {
        if let Some(long) = arg.get_long() {
            out.insert(long.replace('-', "_"));
        }
    }
    for sub in cmd.get_subcommands() {
        keys(sub, out);
    }
}

#[test]
fn the_known_keys_are_every_option_of_the_three_binaries() {
    let mut all = BTreeSet::new();
    keys(&learner::app::command(), &mut all);
    keys(&rollout_worker::app::command(), &mut all);
    keys(&reward_server::app::command(), &mut all);
    for own in ["help", "version"] {
        all.remove(own);
    }
    let generated: String = all.iter().map(|k| format!("{k}\n")).collect();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../rookworld-service/src/run_file/known_keys.txt");
    if std::env::var_os("ROOKWORLD_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    assert!(
        rookworld_service::run_file::KNOWN_KEYS == generated,
        "{} is stale (an option was added or removed): write it again with \
         `ROOKWORLD_BLESS=1 cargo test -p rookworld-tests --test integration run_file::`",
        path.display()
    );
}

/// Every occurrence of the long option `key` in `cmd`'s commands: (command path, default
/// values, environment variable, help).
fn occurrences(cmd: &clap::Command, path: &str, key: &str, out: &mut Vec<[String; 4]>) {
    for arg in cmd.get_arguments() {
        if arg.get_long() == Some(key) {
            let defaults: Vec<String> = arg
                .get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect();
            out.push([
                path.to_owned(),
                defaults.join(","),
                arg.get_env()
                    .map(|e| e.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                arg.get_help().map(|h| h.to_string()).unwrap_or_default(),
            ]);
        }
    }
    for sub in cmd.get_subcommands() {
        occurrences(sub, &format!("{path} {}", sub.get_name()), key, out);
    }
}

#[test]
fn a_shared_setting_has_one_default_and_one_rule_wherever_it_is_taken() {
    // The sampling, objective and batch settings, each declared once (SamplingArgs,
    // ObjectiveArgs, BatchArgs) and taken by several commands, and the model's (`--preset`
    // is left out: `train` defaults to tiny, the benchmarks to the gpt2-124m shape).
    let shared = [
        "temperature",
        "top-k",
        "top-p",
        "max-new-tokens",
        "beta",
        "clip-eps",
        "clip-eps-high",
        "advantage-norm",
        "aggregation",
        "policy-loss",
        "gspo-eps",
        "gspo-eps-high",
        "off-policy-correction",
        "is-cap",
        "mask-truncated",
        "prompts-per-step",
        "group-size",
        "micro-batch-groups",
        "model",
        "init-seed",
        "device",
        "precision",
        "weight-dtype",
        "matmul-precision",
    ];
    for key in shared {
        let mut seen = Vec::new();
        occurrences(&learner::app::command(), "learner", key, &mut seen);
        occurrences(
            &rollout_worker::app::command(),
            "rollout-worker",
            key,
            &mut seen,
        );
        // `learner eval` measures the greedy policy: its temperature default is 0, the one
        // documented exception.
        seen.retain(|o| !(key == "temperature" && o[0] == "learner eval"));
        assert!(
            seen.len() >= 2,
            "--{key} is taken by one command only: {seen:?}"
        );
        for o in &seen[1..] {
            assert_eq!(
                (&o[1], &o[2]),
                (&seen[0][1], &seen[0][2]),
                "--{key}: {} and {} differ in default or environment",
                seen[0][0],
                o[0]
            );
        }
    }
    // The exception is what it says.
    let mut eval = Vec::new();
    occurrences(
        &learner::app::command(),
        "learner",
        "temperature",
        &mut eval,
    );
    let eval = eval.iter().find(|o| o[0] == "learner eval").unwrap();
    assert_eq!(eval[1], "0");
}

/// Runs `bin args` with extra environment; (exit code, stdout, stderr).
fn run(bin: &str, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut c = Command::new(bin);
    c.args(args);
    for var in [
        "ROOKWORLD_CONFIG",
        "LEARNER_LR",
        "LEARNER_STEPS",
        "ROOKWORLD_TOKEN",
    ] {
        c.env_remove(var);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

/// `learner config show` of a run file with extra flags and environment, as a TOML table.
fn shown(file: &str, flags: &[&str], env: &[(&str, &str)]) -> toml::Table {
    let mut args = vec!["config", "show", "--config", file];
    args.extend_from_slice(flags);
    let (code, out, err) = run(LEARNER, &args, env);
    assert_eq!(code, 0, "{err}");
    out.parse().unwrap()
}

const RUN: &str = r#"
preset = "tiny"
[grpo]
group_size = 4
lr = 0.0005
[sampling]
temperature = 0.9
top_k = 20
[learner.train]
steps = 7
[learner.eval]
eval_limit = 3
[rollout-worker]
max_in_flight = 3
[reward-server]
max_items_per_call = 64
"#;

#[test]
fn defaults_lie_under_the_file_the_environment_over_it_and_flags_over_both() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "run.toml", RUN);
    let t = shown(&file, &["--steps", "9"], &[("LEARNER_LR", "0.25")]);
    // From the file (grouping tables and the binary's command table), the env, a flag.
    assert_eq!(t["group_size"].as_integer(), Some(4));
    assert_eq!(t["temperature"].as_float(), Some(0.9));
    assert_eq!(t["top_k"].as_integer(), Some(20));
    assert_eq!(
        t["lr"].as_float(),
        Some(0.25),
        "the environment beats the file"
    );
    assert_eq!(t["steps"].as_integer(), Some(9), "a flag beats the file");
    // A default nobody set; another command's and other binaries' keys left alone.
    assert_eq!(t["beta"].as_float(), Some(0.01));
    assert_eq!(t["eval_limit"].as_integer(), Some(64));
    assert!(!t.contains_key("max_in_flight"));
    // Without the flag and the variable, the file's values.
    let t = shown(&file, &[], &[]);
    assert_eq!(t["lr"].as_float(), Some(0.0005));
    assert_eq!(t["steps"].as_integer(), Some(7));
    // No secret is ever shown.
    let t = shown(&file, &["--token", "hunter2"], &[]);
    assert!(!t.contains_key("token"));
    // The file is named by the variable too.
    let (code, out, err) = run(LEARNER, &["config", "show"], &[("ROOKWORLD_CONFIG", &file)]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("steps = 7"), "{out}");
}

#[test]
fn a_bad_key_or_value_is_one_line_naming_the_key_and_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, &[&str], &str, &str)> = vec![
        (
            LEARNER,
            &["config", "show"],
            "group_sze = 4\n",
            "unknown key `group_sze`; did you mean `group_size`?",
        ),
        (
            LEARNER,
            &["config", "show"],
            "[learner]\nclip-eps = 0.1\n",
            "unknown key `clip-eps`; did you mean `clip_eps`?",
        ),
        (
            LEARNER,
            &["config", "show"],
            "[learner.trian]\nsteps = 3\n",
            "table `[learner.trian]` names no learner command; did you mean `[learner.train]`?",
        ),
        (
            WORKER,
            &["serve", "--preset", "tiny"],
            "[rollout_worker]\nmax_in_flight = 3\n",
            "table `[rollout_worker]` names no binary; did you mean `[rollout-worker]`?",
        ),
        (
            LEARNER,
            &["config", "show"],
            "top_p = \"x\"\n",
            "top_p = \"x\": expected a number, found a string",
        ),
        (
            LEARNER,
            &["config", "show"],
            "max_new_tokens = \"96\"\n",
            "max_new_tokens = \"96\": expected an integer, found a string",
        ),
        (
            LEARNER,
            &["config", "show"],
            "group_size = [8]\n",
            "group_size = [8]: expected one value, an integer, found a list",
        ),
        (
            LEARNER,
            &["config", "show"],
            "seed = true\n",
            "seed = true: expected an integer, found a boolean",
        ),
        (
            LEARNER,
            &["config", "show"],
            "policy_loss = \"ppo\"\n",
            "policy_loss = \"ppo\": invalid value 'ppo'; valid values: clip, gspo, gspo-token, cispo",
        ),
        (
            LEARNER,
            &["config", "show"],
            "run_dir = 7\n",
            "run_dir = 7: expected a string, found an integer (quote it: \"7\")",
        ),
        (
            LEARNER,
            &["config", "show"],
            "[learner.train]\nlocal = true\nreward = \"http://reward:50052\"\n",
            "`local` and `reward` exclude each other: set one",
        ),
        (
            WORKER,
            &["serve", "--preset", "tiny"],
            "worker_id = \"w1\"\n",
            "--worker-id is an option of the worker loop, which runs with --learner and --reward; without them this worker only serves Generate (`worker_id` in",
        ),
        (
            LEARNER,
            &["config", "show"],
            "aggregation = \"tokens\"\n",
            "aggregation = \"tokens\": invalid value 'tokens'",
        ),
        (
            LEARNER,
            &["config", "show"],
            "group_size = 1\n",
            "--group-size must be ≥ 2 (got 1) (`group_size` in",
        ),
        (
            LEARNER,
            &["config", "show"],
            "mask_truncated = \"yes\"\n",
            "mask_truncated = \"yes\": expected true or false",
        ),
        (
            LEARNER,
            &["config", "show"],
            "token = \"s3cret\"\n",
            "`token` cannot be set in a run file (a secret: use token_file",
        ),
        (
            LEARNER,
            &["config", "show"],
            "lr = 0.1\n[grpo]\nlr = 0.2\n",
            "`lr` is set twice",
        ),
        (
            LEARNER,
            &["config", "show"],
            "steps = [\n",
            "not valid TOML",
        ),
        (
            WORKER,
            &["serve", "--preset", "tiny"],
            "max_in_flite = 2\n",
            "did you mean `max_in_flight`?",
        ),
        (
            REWARD,
            &["serve"],
            "[reward-server]\nlisten = \"127.0.0.1:0\"\nmax_items = 3\n",
            "unknown key `max_items`",
        ),
    ];
    for (i, (bin, args, text, want)) in cases.into_iter().enumerate() {
        let file = write(dir.path(), &format!("bad{i}.toml"), text);
        let mut argv = args.to_vec();
        argv.extend(["--config", &file]);
        let (code, _, err) = run(bin, &argv, &[]);
        assert_eq!(code, 1, "{text}: exit {code}\n{err}");
        assert!(err.contains(want), "{text}: wanted {want:?}, got\n{err}");
        assert_eq!(err.trim().lines().count(), 1, "{text}: one line\n{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // A missing file.
    let (code, _, err) = run(
        LEARNER,
        &["config", "show", "--config", "/nonexistent/run.toml"],
        &[],
    );
    assert_eq!(code, 1);
    assert!(err.contains("--config /nonexistent/run.toml"), "{err}");
}

#[test]
fn a_run_records_its_resolved_settings_and_a_resume_names_what_changed() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let file = write(
        dir.path(),
        "run.toml",
        &format!(
            "preset = \"tiny\"\ninit_seed = 3\n[grpo]\nsteps = 2\nprompts_per_step = 2\ngroup_size = 2\nsft_steps = 0\n\
             [sampling]\nmax_new_tokens = 8\n[learner.train]\nlocal = true\nno_progress = true\nrun_dir = {:?}\n",
            run_dir.to_str().unwrap()
        ),
    );
    // Two local runs at once would collide on fixed ports: --local takes free ones.
    let (code, out, err) = run(LEARNER, &["train", "--config", &file], &[]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        !err.contains("127.0.0.1:50051"),
        "--local took the fixed queue port\n{err}"
    );
    assert!(
        err.contains("Prometheus metrics at http://127.0.0.1:"),
        "{err}"
    );
    // RUN/config.toml: every setting (defaults too), with where the run came from.
    let text = std::fs::read_to_string(run_dir.join("config.toml")).unwrap();
    let t: toml::Table = text.parse().unwrap();
    assert_eq!(t["steps"].as_integer(), Some(2));
    assert_eq!(t["beta"].as_float(), Some(0.01), "a default is recorded");
    let record = t["record"].as_table().unwrap();
    assert_eq!(record["model"].as_str(), Some("preset tiny (seed 3)"));
    assert!(record["device"].as_str().unwrap().starts_with("cpu"));
    assert!(record.contains_key("commit") && record.contains_key("version"));
    // Each checkpoint keeps the same record.
    let kept = run_dir.join("checkpoints/step-00000002/config.toml");
    assert_eq!(std::fs::read_to_string(kept).unwrap(), text);

    // `config show --run-dir` prints that run's record; other options are refused.
    let (code, out, err) = run(
        LEARNER,
        &["config", "show", "--run-dir", run_dir.to_str().unwrap()],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, text);
    let (code, _, err) = run(
        LEARNER,
        &[
            "config",
            "show",
            "--run-dir",
            run_dir.to_str().unwrap(),
            "--lr",
            "0.1",
        ],
        &[],
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--lr would not change them"), "{err}");

    // The record runs again; a resumed run names what changed, and a finished one says so.
    let record_path = run_dir.join("config.toml");
    let record_path = record_path.to_str().unwrap();
    let (code, out, err) = run(
        LEARNER,
        &[
            "train",
            "--config",
            record_path,
            "--resume",
            "--push-timeout",
            "30",
        ],
        &[],
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(err.contains("push_timeout: 60.0 → 30.0"), "{err}");
    assert!(
        out.contains("all 2 steps of") && out.contains("--resume --steps 4"),
        "{out}"
    );
    // A setting that defines the maths is refused, named with old and new values.
    let (code, _, err) = run(
        LEARNER,
        &["train", "--config", record_path, "--resume", "--lr", "0.5"],
        &[],
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("lr: 0.001 → 0.5"), "{err}");
}

/// A flag beats the file for every option, one model source over another too; in the
/// file, a more specific table's source beats a general one.
#[test]
fn a_flag_beats_the_file_even_for_another_option_that_excludes_it() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("some-checkpoint");
    let model = model.to_str().unwrap();
    let file = write(dir.path(), "preset.toml", "preset = \"gpt2-124m\"\n");
    let t = shown(&file, &["--model", model], &[]);
    assert_eq!(t["model"].as_str(), Some(model));
    assert!(
        !t.contains_key("preset"),
        "the preset's default is no setting beside --model: {t:?}"
    );
    let file = write(
        dir.path(),
        "both.toml",
        &format!("preset = \"gpt2-124m\"\n[learner.train]\nmodel = {model:?}\n"),
    );
    let t = shown(&file, &[], &[]);
    assert_eq!(t["model"].as_str(), Some(model));
    // A flag that excludes a file's mode: the flag's mode runs.
    let file = write(dir.path(), "local.toml", "[learner.train]\nlocal = true\n");
    let t = shown(&file, &["--reward", "http://reward:50052"], &[]);
    assert_eq!(t["local"].as_bool(), Some(false));
    assert_eq!(t["reward_wait"].as_float(), Some(30.0));
    let t = shown(&file, &[], &[]);
    assert!(!t.contains_key("reward_wait"), "{t:?}");
    assert_eq!(t["rollout_weight_dtype"].as_str(), Some("auto"));
}

/// Options the chosen mode ignores, and options that exclude each other, are refused
/// with one line and exit 1, on the command line as in a file.
#[test]
fn an_option_the_mode_ignores_is_refused_with_one_line() {
    let cases: [(&str, &[&str], &str); 6] = [
        (
            LEARNER,
            &["train", "--local", "--reward", "http://reward:50052"],
            "cannot be used with",
        ),
        (
            LEARNER,
            &["train", "--resume", "--overwrite"],
            "cannot be used with",
        ),
        (
            LEARNER,
            &["train", "--rollout-weight-dtype", "bf16"],
            "--rollout-weight-dtype is the weight dtype of --local's worker",
        ),
        (
            LEARNER,
            &["train", "--reward-wait", "5"],
            "--reward-wait is how long to wait for --reward",
        ),
        (
            WORKER,
            &["serve", "--preset", "tiny", "--max-in-flight", "2"],
            "--max-in-flight is an option of the worker loop",
        ),
        (
            LEARNER,
            &["train", "--stps", "3"],
            "unexpected argument '--stps' found; tip: a similar argument exists: '--steps'",
        ),
    ];
    for (bin, args, want) in cases {
        let (code, out, err) = run(bin, args, &[]);
        assert_eq!(code, 1, "{args:?}: exit {code}\n{err}");
        assert!(err.contains(want), "{args:?}: wanted {want:?}\n{err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line\n{err}");
        assert!(out.is_empty(), "{out}");
    }
}

#[test]
fn the_deploy_run_file_is_read_by_every_service() {
    use std::ffi::OsString;
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/run.toml");
    let path = path.to_str().unwrap();
    let cases = [
        (
            learner::app::command(),
            ["learner", "train"],
            vec!["--steps=1000", "--sft-steps=250"],
        ),
        (
            rollout_worker::app::command(),
            ["rollout-worker", "serve"],
            vec![],
        ),
        (
            reward_server::app::command(),
            ["reward-server", "serve"],
            vec!["--engine-processes=2", "--engine-depth=10"],
        ),
    ];
    for (cmd, start, wanted) in cases {
        let argv: Vec<OsString> = start
            .iter()
            .chain(&["--config", path])
            .map(OsString::from)
            .collect();
        let out = rookworld_service::run_file::with_run_file(&cmd, &argv, &[])
            .unwrap_or_else(|e| panic!("{}: {e}", start[0]));
        let added: Vec<String> = out[argv.len()..]
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        for w in &wanted {
            assert!(added.contains(&w.to_string()), "{}: {added:?}", start[0]);
        }
        if wanted.is_empty() {
            assert!(added.is_empty(), "{}: {added:?}", start[0]);
        }
    }
}

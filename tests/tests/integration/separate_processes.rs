//! The guide `docs/guides/separate-processes.md`, run as written: the commands of its `sh`
//! blocks, section by section (plaintext, then mutual TLS) in one directory, as a reader
//! would. `target/release/BINARY` is the launcher of `tests/src/bin` that runs the same
//! command line, every `127.0.0.1:PORT` of a section a free port of the test's, and
//! `deploy/` the repository's; `cargo build` is left out (the launchers are built). The
//! services start in the page's order, every health check must pass, and the learner must
//! finish its steps and exit 0; then the section's services are stopped.

use crate::cluster;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use cluster::{Proc, SERIAL};

const PAGE: &str = "docs/guides/separate-processes.md";

/// One command of the page: its section (`## ` heading), line and text (continuation
/// lines joined).
#[derive(Debug)]
struct Step {
    section: String,
    line: usize,
    text: String,
}

/// Every command of the page's `sh` blocks, a trailing `\` joining the next line.
fn steps(page: &str) -> Vec<Step> {
    let mut out = Vec::new();
    let (mut section, mut in_sh) = (String::new(), false);
    let mut current: Option<Step> = None;
    for (i, line) in page.lines().enumerate() {
        if line.starts_with("```") {
            in_sh = line.trim() == "```sh";
            continue;
        }
        if !in_sh {
            if let Some(h) = line.strip_prefix("## ") {
                section = h.trim().to_owned();
            }
            continue;
        }
        let text = line.trim();
        match current.as_mut() {
            Some(step) => {
                step.text.push(' ');
                step.text.push_str(text.trim_end_matches('\\').trim());
            }
            None if !text.is_empty() => {
                current = Some(Step {
                    section: section.clone(),
                    line: i + 1,
                    text: text.trim_end_matches('\\').trim().to_owned(),
                });
            }
            None => {}
        }
        if !text.ends_with('\\')
            && let Some(step) = current.take()
        {
            out.push(step);
        }
    }
    out
}

/// `text` with every `127.0.0.1:PORT` mapped to a free port (the same one each time).
fn with_ports(text: &str, ports: &mut BTreeMap<String, String>) -> String {
    const HOST: &str = "127.0.0.1:";
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(HOST) {
        let after = &rest[at + HOST.len()..];
        let digits = after.chars().take_while(char::is_ascii_digit).count();
        let port = &after[..digits];
        let free = ports
            .entry(port.to_owned())
            .or_insert_with(|| cluster::free_addr().port().to_string());
        out.push_str(&rest[..at + HOST.len()]);
        out.push_str(free);
        rest = &after[digits..];
    }
    out.push_str(rest);
    out
}

/// The launcher of `target/release/NAME`.
fn launcher(name: &str) -> &'static str {
    match name {
        "learner" => cluster::LEARNER,
        "reward-server" => cluster::REWARD,
        "rollout-worker" => cluster::WORKER,
        other => panic!("{PAGE}: no launcher for target/release/{other}"),
    }
}

/// Runs `args` of `bin` until it exits 0 (a health check of a service still starting);
/// after `within`, its last output.
fn until_ok(bin: &str, args: &[String], dir: &Path, within: Duration) -> Result<(), String> {
    let started = Instant::now();
    loop {
        let out = std::process::Command::new(bin)
            .args(args)
            .current_dir(dir)
            .output()
            .unwrap();
        if out.status.success() {
            return Ok(());
        }
        if started.elapsed() > within {
            return Err(format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// One section's commands in `dir`: setup commands run to their end, services started,
/// health checks passed; then the learner must exit 0. Returns the services' logs.
fn run_section(section: &str, steps: &[&Step], dir: &Path) -> Vec<(String, String)> {
    let mut ports = BTreeMap::new();
    let deploy = rookworld_tests::repo_root().join("deploy");
    let mut services: Vec<(String, Proc)> = Vec::new();
    for step in steps {
        let text = with_ports(&step.text, &mut ports);
        let at = format!("{PAGE}:{} ({section})", step.line);
        if text.starts_with("cargo build") {
            continue;
        }
        if let Some(rest) = text.strip_prefix("target/release/") {
            let words: Vec<String> = rest.split_whitespace().map(String::from).collect();
            let (bin, args) = (launcher(&words[0]), &words[1..]);
            match args.first().map(String::as_str) {
                Some("serve" | "train") => {
                    let tag = section.split_whitespace().last().unwrap_or("");
                    let name = format!("{}-{}", words[0], tag.to_lowercase());
                    services.push((words[0].clone(), Proc::spawn_in(&name, bin, args, dir)));
                }
                Some("health") => {
                    if let Err(e) = until_ok(bin, args, dir, Duration::from_secs(120)) {
                        let logs: Vec<String> = services.iter().map(|(_, p)| p.log()).collect();
                        panic!("{at}: {e}\n{}", logs.join("\n"));
                    }
                }
                other => panic!("{at}: what does `{other:?}` do?"),
            }
            continue;
        }
        let text = text.replace("deploy/", &format!("{}/", deploy.display()));
        let out = std::process::Command::new("bash")
            .args(["-c", &text])
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{at}: `{text}`: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let names: Vec<&str> = services.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["reward-server", "learner", "rollout-worker"],
        "{PAGE} ({section}): the services, in their order"
    );
    let (_, learner) = &mut services[1];
    let code = learner.exit_code(Duration::from_secs(300));
    // The worker says that the learner's run ended (or the learner stopped), at once.
    let (_, worker) = &services[2];
    let told = Instant::now();
    while !worker.log().contains("its run ended") && told.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let logs: Vec<(String, String)> = services.iter().map(|(n, p)| (n.clone(), p.log())).collect();
    assert_eq!(
        code,
        Some(0),
        "{PAGE} ({section}): the learner did not finish\n{logs:#?}"
    );
    for (_, service) in &mut services {
        service.terminate(Duration::from_secs(10));
    }
    assert!(
        logs[2]
            .1
            .contains("unreachable (it stopped, or its run ended)"),
        "{PAGE} ({section}): the worker does not say the learner went away\n{}",
        logs[2].1
    );
    logs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_separate_processes_guide_runs_as_written() {
    let _serial = SERIAL.lock().await;
    let page = std::fs::read_to_string(rookworld_tests::repo_root().join(PAGE)).unwrap();
    let steps = steps(&page);
    let dir = tempfile::tempdir().unwrap();
    for (section, tls) in [("Plaintext", false), ("Over mutual TLS", true)] {
        let ours: Vec<&Step> = steps
            .iter()
            .filter(|s| s.section == section || s.section.is_empty())
            .collect();
        assert!(
            ours.iter().any(|s| s.section == section),
            "{PAGE}: no commands under `## {section}`"
        );
        let logs = tokio::task::block_in_place(|| run_section(section, &ours, dir.path()));
        let (_, learner) = &logs[1];
        assert!(
            learner.contains("worker registered for weight pushes"),
            "{learner}"
        );
        if tls {
            for (name, log) in &logs {
                assert!(
                    log.contains("mutual=true"),
                    "{name} serves no mutual TLS\n{log}"
                );
            }
        }
    }
}

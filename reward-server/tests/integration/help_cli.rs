//! The binary starts and answers `--help`.

#[test]
fn help_answers() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_reward-server"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("Usage"));
}

//! The book's layout page (`docs/architecture/layout.md`) against the workspace: its table
//! names every member of the root `Cargo.toml` and no crate that is not one, so a crate
//! added, moved or removed without the page fails here.

use std::collections::BTreeSet;
use std::path::Path;

const PAGE: &str = "docs/architecture/layout.md";

/// The workspace's members, as the root `Cargo.toml` lists them (paths such as `proto`).
fn members(root: &Path) -> BTreeSet<String> {
    let manifest: toml::Table = std::fs::read_to_string(root.join("Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    manifest["workspace"]["members"]
        .as_array()
        .expect("[workspace] members is a list")
        .iter()
        .map(|m| m.as_str().unwrap().trim_end_matches('/').to_owned())
        .collect()
}

/// A crate's package name, from its `Cargo.toml`.
fn package_name(dir: &Path) -> String {
    let manifest: toml::Table = std::fs::read_to_string(dir.join("Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    manifest["package"]["name"].as_str().unwrap().to_owned()
}

/// The paths in the first column of the page's tables (`| \`learner/\` | … |`), without the
/// trailing `/`.
fn table_paths(page: &str) -> Vec<String> {
    page.lines()
        .filter_map(|line| {
            let cell = line.strip_prefix('|')?.split('|').next()?.trim();
            let path = cell.strip_prefix('`')?.strip_suffix('`')?;
            Some(path.trim_end_matches('/').to_owned())
        })
        .collect()
}

/// Every code span of the page that is a bare crate-like name starting with `rookworld-`
/// (`rookworld-train`, `rookworld-lm/`), without the trailing `/`.
fn rookworld_names(page: &str) -> BTreeSet<String> {
    page.split('`')
        .skip(1)
        .step_by(2)
        .map(|span| span.trim_end_matches('/'))
        .filter(|span| {
            span.starts_with("rookworld-")
                && span
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn table_paths_are_the_first_cells_that_are_code() {
    let page = "| path | what |\n| --- | --- |\n| `proto/` | the `x/` protocol |\n\
                | `tests` | more |\ntext `learner/` in prose\n";
    assert_eq!(table_paths(page), ["proto", "tests"]);
    assert_eq!(
        rookworld_names("`rookworld-lm/`, `rookworld-lm/src/x.rs`, `rookworld_lm::f`, `x`"),
        BTreeSet::from(["rookworld-lm".to_owned()])
    );
}

#[test]
fn the_layout_page_names_every_workspace_member_and_no_other_crate() {
    let root = rookworld_tests::repo_root();
    let members = members(&root);
    // The manifest is read: a parse that found nothing would pass vacuously.
    assert!(
        members.len() >= 10 && members.contains("learner"),
        "members read from Cargo.toml: {members:?}"
    );
    let page = std::fs::read_to_string(root.join(PAGE)).unwrap();
    let rows = table_paths(&page);

    let listed: BTreeSet<&str> = rows.iter().map(String::as_str).collect();
    let missing: Vec<&String> = members
        .iter()
        .filter(|m| !listed.contains(m.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "{PAGE} has no row for the workspace members {missing:?}: add one each"
    );

    // A row that is not a member is a folder of the repository that is no crate.
    let mut wrong = Vec::new();
    for row in rows.iter().filter(|r| !members.contains(r.as_str())) {
        let dir = root.join(row);
        if !dir.is_dir() {
            wrong.push(format!("`{row}/`: no such folder"));
        } else if dir.join("Cargo.toml").exists() {
            wrong.push(format!("`{row}/`: a crate that is not a workspace member"));
        }
    }
    // Crates named in the prose: each a member, by folder or by package name.
    let known: BTreeSet<String> = members
        .iter()
        .flat_map(|m| [m.clone(), package_name(&root.join(m))])
        .collect();
    for name in rookworld_names(&page) {
        if !known.contains(&name) {
            wrong.push(format!("`{name}`: not a workspace member"));
        }
    }
    assert!(wrong.is_empty(), "{PAGE}:\n{}", wrong.join("\n"));
}

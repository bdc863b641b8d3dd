//! The README's table of metrics against the names the services' sources export.

use std::collections::BTreeSet;

use crate::{deploy, read};

/// The metric names of the README's Metrics table (first column).
fn readme_table() -> BTreeSet<String> {
    let readme = read(&deploy().join("../README.md"));
    let section = readme
        .split("\n## Metrics\n")
        .nth(1)
        .expect("a Metrics section in the README");
    let section = section.split("\n## ").next().unwrap();
    section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_readme_lists_every_metric_the_services_export_and_no_other() {
    let table = readme_table();
    let exported = crate::grafana::exported_metrics();
    let missing: Vec<_> = exported.difference(&table).collect();
    let extra: Vec<_> = table.difference(&exported).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "README Metrics table: missing {missing:?}; not exported {extra:?}"
    );
    for name in &table {
        let counter = name.ends_with("_total");
        let row = read(&deploy().join("../README.md"))
            .lines()
            .find(|l| l.starts_with(&format!("| `{name}` |")))
            .unwrap()
            .to_owned();
        assert_eq!(
            counter,
            row.contains("| counter |"),
            "{name}: `_total` exactly on counters: {row}"
        );
    }
}

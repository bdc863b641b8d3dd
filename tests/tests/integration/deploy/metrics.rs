//! The book's table of metrics (`docs/operations/metrics.md`) against the names the
//! services' sources export.

use std::collections::BTreeSet;

use super::{deploy, read};

fn page() -> String {
    read(&deploy().join("../docs/operations/metrics.md"))
}

/// The metric names of the book's Metrics table (first column).
fn readme_table() -> BTreeSet<String> {
    page()
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_book_lists_every_metric_the_services_export_and_no_other() {
    let table = readme_table();
    let exported = super::grafana::exported_metrics();
    let missing: Vec<_> = exported.difference(&table).collect();
    let extra: Vec<_> = table.difference(&exported).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "docs/operations/metrics.md: missing {missing:?}; not exported {extra:?}"
    );
    for name in &table {
        let counter = name.ends_with("_total");
        let row = page()
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

//! The book's reference pages are generated from the code — the command lines from clap,
//! the metrics from the services' describe calls, the gRPC API from the `.proto` comments —
//! and fail here when stale; every relative link of the README and the book resolves, to a
//! file and, where it names one, a heading of that file.
//!
//! After a change of a flag, a metric or a `.proto` comment, write the pages again with
//! `ROOKWORLD_BLESS=1 cargo test -p rookworld-tests --test integration docs::`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use prost::Message as _;

fn root() -> PathBuf {
    rookworld_tests::repo_root()
}

/// Compares `text` with the page at `rel` (writes it under `ROOKWORLD_BLESS=1`).
fn check_page(rel: &str, text: &str) {
    let path = root().join(rel);
    if std::env::var_os("ROOKWORLD_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
        return;
    }
    let old = std::fs::read_to_string(&path).unwrap_or_default();
    if old != text {
        let line = old
            .lines()
            .zip(text.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(old.lines().count().min(text.lines().count()));
        panic!(
            "{rel} is stale (first difference at line {}): write it again with \
             `ROOKWORLD_BLESS=1 cargo test -p rookworld-tests --test integration docs::`",
            line + 1
        );
    }
}

/// A table cell: one line, pipes escaped, and angle brackets outside code spans too
/// (`<FEN>` is no HTML tag).
fn cell(text: &str) -> String {
    let line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    line.split('`')
        .enumerate()
        .map(|(i, part)| {
            let part = part.replace('|', "\\|");
            if i % 2 == 0 {
                part.replace('<', "&lt;").replace('>', "&gt;")
            } else {
                part
            }
        })
        .collect::<Vec<_>>()
        .join("`")
}

// ---- the command lines ----

fn options_table(cmd: &clap::Command, out: &mut String) {
    let args: Vec<&clap::Arg> = cmd
        .get_arguments()
        .filter(|a| !a.is_hide_set() && !["help", "version"].contains(&a.get_id().as_str()))
        .collect();
    if args.is_empty() {
        return;
    }
    out.push_str("| option | default | environment | what |\n| --- | --- | --- | --- |\n");
    for arg in args {
        let name = match (arg.get_long(), arg.get_short()) {
            (Some(long), Some(short)) => format!("`-{short}`, `--{long}`"),
            (Some(long), None) => format!("`--{long}`"),
            (None, Some(short)) => format!("`-{short}`"),
            (None, None) => format!("`{}`", arg.get_id().as_str().to_uppercase()),
        };
        let defaults: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect();
        let default = if defaults.is_empty() {
            String::new()
        } else {
            format!("`{}`", defaults.join(","))
        };
        let env = arg
            .get_env()
            .map(|e| format!("`{}`", e.to_string_lossy()))
            .unwrap_or_default();
        let mut what = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        let values: Vec<String> = arg
            .get_possible_values()
            .iter()
            .filter(|v| !v.is_hide_set())
            .map(|v| v.get_name().to_owned())
            .collect();
        if !values.is_empty() && arg.get_num_args().is_none_or(|n| n.max_values() != 0) {
            write!(what, " (one of: {})", values.join(", ")).unwrap();
        }
        writeln!(out, "| {name} | {default} | {env} | {} |", cell(&what)).unwrap();
    }
    out.push('\n');
}

fn command_section(cmd: &clap::Command, path: &str, out: &mut String) {
    let depth = path.split(' ').count().min(4);
    writeln!(out, "{} `{path}`\n", "#".repeat(depth + 1)).unwrap();
    if let Some(about) = cmd.get_long_about().or(cmd.get_about()) {
        writeln!(out, "{about}\n").unwrap();
    }
    options_table(cmd, out);
    for sub in cmd.get_subcommands() {
        if sub.get_name() != "help" {
            command_section(sub, &format!("{path} {}", sub.get_name()), out);
        }
    }
}

fn cli_page() -> String {
    let mut out = String::from(
        "<!-- Generated from the code by tests/tests/integration/docs.rs: do not edit. -->\n\n\
         # Command line\n\n\
         Every option can also be given in a run file (`--config FILE`, the long name with \
         underscores) or, where a variable is named, in the environment. Precedence: \
         defaults < run file < environment < flags.\n\n",
    );
    for (name, cmd) in [
        ("learner", learner::app::command()),
        ("rollout-worker", rollout_worker::app::command()),
        ("reward-server", reward_server::app::command()),
    ] {
        command_section(&cmd, name, &mut out);
    }
    out
}

#[test]
fn the_command_line_reference_is_current() {
    check_page("docs/reference/cli.md", &cli_page());
}

// ---- the metrics ----

/// What a describe call says of a metric: its type, unit and help.
type Described = BTreeMap<String, (&'static str, Option<Unit>, String)>;

/// Records what the describe calls say; every metric handle is a no-op.
#[derive(Default)]
struct Descriptions(Mutex<Described>);

impl Descriptions {
    fn add(&self, kind: &'static str, key: KeyName, unit: Option<Unit>, help: SharedString) {
        self.0
            .lock()
            .unwrap()
            .insert(key.as_str().to_owned(), (kind, unit, help.to_string()));
    }
}

impl Recorder for Descriptions {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, help: SharedString) {
        self.add("counter", key, unit, help);
    }
    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, help: SharedString) {
        self.add("gauge", key, unit, help);
    }
    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, help: SharedString) {
        self.add("histogram", key, unit, help);
    }
    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        Counter::noop()
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

fn described(describe: fn()) -> Described {
    let recorder = Arc::new(Descriptions::default());
    metrics::with_local_recorder(recorder.as_ref(), describe);
    recorder.0.lock().unwrap().clone()
}

fn metrics_page() -> String {
    let mut out = String::from(
        "<!-- Generated from the code by tests/tests/integration/docs.rs: do not edit. -->\n\n\
         # Metrics\n\n\
         Every service serves Prometheus text on its `--metrics` address (`/metrics`). \
         The names, types and descriptions below are the services' own describe calls; \
         labels are named in the descriptions as `label`.\n\n",
    );
    for (service, describe) in [
        ("learner", learner::metrics::describe as fn()),
        ("rollout-worker", rollout_worker::metrics::describe),
        ("reward-server", reward_server::metrics::describe),
    ] {
        writeln!(out, "## {service}\n").unwrap();
        out.push_str("| metric | type | unit | what |\n| --- | --- | --- | --- |\n");
        for (name, (kind, unit, help)) in described(describe) {
            let unit = unit.map(|u| u.as_str().to_owned()).unwrap_or_default();
            writeln!(out, "| `{name}` | {kind} | {unit} | {} |", cell(&help)).unwrap();
        }
        out.push('\n');
    }
    out
}

#[test]
fn the_metrics_reference_is_current() {
    check_page("docs/reference/metrics.md", &metrics_page());
}

#[test]
fn every_exported_metric_is_described() {
    let mut all = BTreeMap::new();
    for describe in [
        learner::metrics::describe as fn(),
        rollout_worker::metrics::describe,
        reward_server::metrics::describe,
    ] {
        all.extend(described(describe));
    }
    for name in rookworld_tests::metric_names_in_sources() {
        let (kind, _, _) = all
            .get(&name)
            .unwrap_or_else(|| panic!("{name} is recorded but never described"));
        assert_eq!(
            name.ends_with("_total"),
            *kind == "counter",
            "{name}: `_total` exactly on counters"
        );
    }
}

/// Each metric name is written once, as a constant of the crate that records it; describe
/// calls and recording sites use the constant, so a renamed metric cannot leave a stale
/// twin behind.
#[test]
fn every_metric_name_is_one_constant() {
    let literals = rookworld_tests::metric_literals();
    assert!(
        literals.len() > 50,
        "the scan found the names: {literals:?}"
    );
    let mut seen = BTreeMap::new();
    for l in &literals {
        assert!(
            l.constant,
            "{} is written as a literal in {}: use its constant",
            l.name,
            l.file.display()
        );
        if let Some(first) = seen.insert(l.name.clone(), l.file.clone()) {
            panic!(
                "{} is defined twice: {} and {}",
                l.name,
                first.display(),
                l.file.display()
            );
        }
    }
}

// ---- the gRPC API ----

/// The comment attached to the element at `path` of `file`.
fn comment(file: &prost_types::FileDescriptorProto, path: &[i32]) -> String {
    file.source_code_info
        .as_ref()
        .and_then(|info| info.location.iter().find(|l| l.path == path))
        .and_then(|l| l.leading_comments.as_deref())
        // `///` comments arrive with one slash left on each line.
        .map(|c| {
            c.lines()
                .map(|l| l.strip_prefix('/').unwrap_or(l).trim())
                .collect::<Vec<_>>()
                .join("\n")
                .trim()
                .to_owned()
        })
        .unwrap_or_default()
}

fn short_type(name: &str) -> String {
    name.rsplit('.').next().unwrap_or(name).to_owned()
}

fn field_type(f: &prost_types::FieldDescriptorProto) -> String {
    use prost_types::field_descriptor_proto::{Label, Type};
    let base = match f.r#type() {
        Type::Message | Type::Enum => short_type(f.type_name()),
        Type::Double => "double".into(),
        Type::Float => "float".into(),
        Type::Int64 => "int64".into(),
        Type::Uint64 => "uint64".into(),
        Type::Int32 => "int32".into(),
        Type::Uint32 => "uint32".into(),
        Type::Bool => "bool".into(),
        Type::String => "string".into(),
        Type::Bytes => "bytes".into(),
        other => format!("{other:?}").to_lowercase(),
    };
    if f.label() == Label::Repeated {
        format!("repeated {base}")
    } else {
        base
    }
}

fn message_section(
    file: &prost_types::FileDescriptorProto,
    msg: &prost_types::DescriptorProto,
    prefix: &str,
    path: Vec<i32>,
    out: &mut String,
) {
    let name = format!("{prefix}{}", msg.name());
    writeln!(out, "#### `{name}`\n").unwrap();
    let about = comment(file, &path);
    if !about.is_empty() {
        writeln!(out, "{about}\n").unwrap();
    }
    if !msg.field.is_empty() {
        out.push_str("| field | type | what |\n| --- | --- | --- |\n");
        for (i, f) in msg.field.iter().enumerate() {
            let mut p = path.clone();
            p.extend([2, i as i32]);
            writeln!(
                out,
                "| `{}` | `{}` | {} |",
                f.name(),
                field_type(f),
                cell(&comment(file, &p))
            )
            .unwrap();
        }
        out.push('\n');
    }
    for (i, nested) in msg.nested_type.iter().enumerate() {
        if nested.options.as_ref().is_some_and(|o| o.map_entry()) {
            continue;
        }
        let mut p = path.clone();
        p.extend([3, i as i32]);
        message_section(file, nested, &format!("{name}."), p, out);
    }
    for (i, e) in msg.enum_type.iter().enumerate() {
        let mut p = path.clone();
        p.extend([4, i as i32]);
        enum_section(file, e, &format!("{name}."), p, out);
    }
}

fn enum_section(
    file: &prost_types::FileDescriptorProto,
    e: &prost_types::EnumDescriptorProto,
    prefix: &str,
    path: Vec<i32>,
    out: &mut String,
) {
    writeln!(out, "#### `{prefix}{}` (enum)\n", e.name()).unwrap();
    let about = comment(file, &path);
    if !about.is_empty() {
        writeln!(out, "{about}\n").unwrap();
    }
    out.push_str("| value | number | what |\n| --- | --- | --- |\n");
    for (i, v) in e.value.iter().enumerate() {
        let mut p = path.clone();
        p.extend([2, i as i32]);
        writeln!(
            out,
            "| `{}` | {} | {} |",
            v.name(),
            v.number(),
            cell(&comment(file, &p))
        )
        .unwrap();
    }
    out.push('\n');
}

fn grpc_page() -> String {
    let set = prost_types::FileDescriptorSet::decode(rookworld_proto::FILE_DESCRIPTOR_SET)
        .expect("the descriptor set decodes");
    let mut out = String::from(
        "<!-- Generated from the .proto comments by tests/tests/integration/docs.rs: do not edit. -->\n\n\
         # gRPC API\n\n\
         Every call needs the shared token (`authorization: Bearer TOKEN`) unless it says \
         otherwise; every server also answers gRPC health checks and, for grpcurl, server \
         reflection.\n\n",
    );
    let mut files: Vec<_> = set
        .file
        .iter()
        .filter(|f| f.package().starts_with("rookworld."))
        .collect();
    files.sort_by_key(|f| f.name().to_owned());
    for file in files {
        writeln!(out, "## `{}` (`proto/{}`)\n", file.package(), file.name()).unwrap();
        for (i, service) in file.service.iter().enumerate() {
            writeln!(out, "### service `{}`\n", service.name()).unwrap();
            let about = comment(file, &[6, i as i32]);
            if !about.is_empty() {
                writeln!(out, "{about}\n").unwrap();
            }
            out.push_str("| call | request | response | what |\n| --- | --- | --- | --- |\n");
            for (j, m) in service.method.iter().enumerate() {
                let stream = |yes: bool| if yes { "stream " } else { "" };
                writeln!(
                    out,
                    "| `{}` | `{}{}` | `{}{}` | {} |",
                    m.name(),
                    stream(m.client_streaming()),
                    short_type(m.input_type()),
                    stream(m.server_streaming()),
                    short_type(m.output_type()),
                    cell(&comment(file, &[6, i as i32, 2, j as i32]))
                )
                .unwrap();
            }
            out.push('\n');
        }
        if !file.message_type.is_empty() || !file.enum_type.is_empty() {
            out.push_str("### Messages\n\n");
        }
        for (i, msg) in file.message_type.iter().enumerate() {
            message_section(file, msg, "", vec![4, i as i32], &mut out);
        }
        for (i, e) in file.enum_type.iter().enumerate() {
            enum_section(file, e, "", vec![5, i as i32], &mut out);
        }
    }
    out
}

#[test]
fn the_grpc_reference_is_current() {
    check_page("docs/reference/grpc.md", &grpc_page());
}

// ---- links ----

/// The lines of a page outside fenced code blocks (```` ``` ```` or `~~~`), numbered from 1.
fn unfenced(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut fence: Option<&str> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| trimmed.starts_with(m));
        match (fence, marker) {
            (None, Some(m)) => fence = Some(m),
            (Some(f), Some(m)) if f == m => fence = None,
            (None, None) => out.push((i + 1, line)),
            _ => {}
        }
    }
    out
}

/// `line` with its inline code spans blanked: they hold no links.
fn without_code_spans(line: &str) -> String {
    line.split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 0)
        .map(|(_, s)| s)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The destination at the start of `rest` (just after `](`): `<…>` or up to the `)` that
/// closes the link (nested pairs allowed), a title after a space left off.
fn destination(rest: &str) -> Option<(&str, usize)> {
    if let Some(inner) = rest.strip_prefix('<') {
        let end = inner.find('>')?;
        return Some((&inner[..end], end + 2));
    }
    let mut depth = 0usize;
    for (i, c) in rest.char_indices() {
        match c {
            '(' => depth += 1,
            ')' if depth == 0 => {
                let target = rest[..i].trim();
                let target = target.split_once(' ').map_or(target, |(t, _)| t);
                return Some((target, i));
            }
            ')' => depth -= 1,
            _ => {}
        }
    }
    None
}

/// One link of a page: its line and its target.
#[derive(Debug, PartialEq)]
struct Link {
    line: usize,
    target: String,
}

/// A page's links outside code — inline `[text](target)` in prose, lists, tables and
/// headings, and reference definitions `[label]: target`.
fn links(text: &str) -> Vec<Link> {
    let mut out = Vec::new();
    for (line, raw) in unfenced(text) {
        let prose = without_code_spans(raw);
        let definition = prose.trim_start().strip_prefix('[').and_then(|r| {
            let (label, rest) = r.split_once("]:")?;
            (!label.is_empty() && !label.contains(']'))
                .then(|| rest.split_whitespace().next())
                .flatten()
        });
        if let Some(target) = definition {
            let target = target.trim_start_matches('<').trim_end_matches('>');
            out.push(Link {
                line,
                target: target.to_owned(),
            });
            continue;
        }
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some((target, end)) = destination(after) else {
                break;
            };
            out.push(Link {
                line,
                target: target.to_owned(),
            });
            rest = &after[end..];
        }
    }
    out
}

/// The id GitHub and mdBook give a heading of this text: the text as rendered (a code
/// span's text, a link's text, no tags or entities), lowercased, each space a `-`, and
/// every other character that is not a letter, a digit, `-` or `_` dropped.
fn heading_id(heading: &str) -> String {
    let mut rendered = String::new();
    let mut rest = heading;
    while let Some(c) = rest.chars().next() {
        let skip = match c {
            // A link's target is not shown: `[text](target)` reads `text`.
            ']' if rest[1..].starts_with('(') => {
                destination(&rest[2..]).map_or(1, |(_, end)| end + 3)
            }
            '<' => rest.find('>').map_or(1, |end| end + 1),
            '&' => rest
                .find(';')
                .filter(|&end| {
                    end > 1
                        && rest[1..end]
                            .chars()
                            .all(|c| c.is_alphanumeric() || c == '#')
                })
                .map_or(1, |end| end + 1),
            _ => {
                rendered.push(c);
                c.len_utf8()
            }
        };
        rest = &rest[skip..];
    }
    rendered
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            c if c.is_whitespace() => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The text of an ATX heading (`## Text`, closing `#`s left off).
fn atx_heading(line: &str) -> Option<&str> {
    let hashes = line.len() - line.trim_start_matches('#').len();
    if !(1..=6).contains(&hashes) {
        return None;
    }
    let rest = &line[hashes..];
    if !(rest.is_empty() || rest.starts_with(' ') || rest.starts_with('\t')) {
        return None;
    }
    let rest = rest.trim();
    let closed = rest.trim_end_matches('#');
    Some(if closed.is_empty() || closed.ends_with(' ') {
        closed.trim_end()
    } else {
        rest
    })
}

/// Whether `line` underlines the paragraph line before it into a heading (`===`, `---`).
fn setext_underline(line: &str, previous: &str) -> bool {
    let line = line.trim_end();
    let paragraph = !previous.trim().is_empty()
        && atx_heading(previous).is_none()
        && !previous.trim_start().starts_with(['|', '-', '*', '+', '>'])
        && !previous.starts_with("    ");
    paragraph
        && !line.is_empty()
        && !line.starts_with("    ")
        && (line.trim_start().chars().all(|c| c == '=')
            || line.trim_start().chars().all(|c| c == '-'))
}

/// The anchors of a page's headings, as GitHub and mdBook make them: a heading's id, and
/// for the second, third, … heading of the same id `id-1`, `id-2`, ….
fn anchors(text: &str) -> Vec<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = Vec::new();
    let mut previous: Option<(usize, &str)> = None;
    for (number, line) in unfenced(text) {
        let heading = match previous {
            Some((n, p)) if n + 1 == number && setext_underline(line, p) => Some(p.trim()),
            _ => atx_heading(line),
        };
        if let Some(heading) = heading {
            let id = heading_id(heading);
            let count = seen.entry(id.clone()).or_insert(0);
            out.push(if *count == 0 {
                id
            } else {
                format!("{id}-{count}")
            });
            *count += 1;
            previous = None;
        } else {
            previous = Some((number, line));
        }
    }
    out
}

#[test]
fn headings_get_the_anchors_github_and_mdbook_give_them() {
    let page = "# A page\n\
                \n\
                ## `learner train` (`learner/src/train/`)\n\
                \n\
                ## Against PyTorch's configurations\n\
                \n\
                ```sh\n\
                # a comment, not a heading\n\
                ```\n\
                \n\
                ## Messages\n\
                ### Messages\n\
                ## Messages ##\n\
                \n\
                An underlined heading\n\
                ---\n\
                \n\
                ## See [the guide](guide.md#x) &amp; more\n\
                #hashtag, not a heading\n";
    assert_eq!(
        anchors(page),
        [
            "a-page",
            "learner-train-learnersrctrain",
            "against-pytorchs-configurations",
            "messages",
            "messages-1",
            "messages-2",
            "an-underlined-heading",
            "see-the-guide--more",
        ]
    );
}

#[test]
fn links_are_found_in_prose_and_tables_but_not_in_code() {
    let page = "See [a](b.md#c) and `[x](y.md)`, [d](<e f.md> \"title\").\n\
                | [g](h(i).md) | [j](#k) |\n\
                ```md\n\
                [no](code.md)\n\
                ```\n\
                [label]: ref.md#anchor\n";
    let targets: Vec<(usize, String)> = links(page)
        .into_iter()
        .map(|l| (l.line, l.target))
        .collect();
    assert_eq!(
        targets,
        [
            (1, "b.md#c".to_owned()),
            (1, "e f.md".to_owned()),
            (2, "h(i).md".to_owned()),
            (2, "#k".to_owned()),
            (6, "ref.md#anchor".to_owned()),
        ]
    );
}

/// Every relative link of the README and the book — in prose, lists and tables alike —
/// names a file that exists and, where it names a heading (`page.md#anchor`, `#anchor`),
/// a heading of that page.
#[test]
fn every_relative_link_of_the_readme_and_the_book_resolves() {
    let mut broken = Vec::new();
    let (mut checked, mut anchored) = (0, 0);
    for page in rookworld_tests::book_pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let shown = page
            .strip_prefix(root())
            .unwrap_or(&page)
            .display()
            .to_string();
        for Link { line, target: link } in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") || link.is_empty() {
                continue;
            }
            checked += 1;
            let (file, anchor) = match link.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (link.as_str(), None),
            };
            let target = if file.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(file)
            };
            if !target.exists() {
                broken.push(format!("{shown}:{line}: {link} (no such file)"));
                continue;
            }
            if let Some(anchor) = anchor
                && target.extension().is_some_and(|e| e == "md")
            {
                anchored += 1;
                let text = std::fs::read_to_string(&target).unwrap();
                if !anchors(&text).iter().any(|a| a == anchor) {
                    broken.push(format!("{shown}:{line}: {link} (no such heading)"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    // The scan sees the pages' links: a parser that found none would pass vacuously.
    assert!(
        checked > 100 && anchored > 5,
        "only {checked} relative links, {anchored} with an anchor"
    );
}

#[test]
fn the_book_lists_every_page_and_only_pages_that_exist() {
    let summary = std::fs::read_to_string(root().join("docs/SUMMARY.md")).unwrap();
    let listed: Vec<String> = links(&summary).into_iter().map(|l| l.target).collect();
    for page in rookworld_tests::book_pages() {
        let Ok(rel) = page.strip_prefix(root().join("docs")) else {
            continue;
        };
        let rel = rel.display().to_string();
        if rel != "SUMMARY.md" {
            assert!(
                listed.contains(&rel),
                "docs/{rel} is not in docs/SUMMARY.md"
            );
        }
    }
}

// ---- what a resume may change ----

/// `page` with the text between `<!-- begin NAME -->` and `<!-- end NAME -->` replaced.
fn with_section(page: &str, name: &str, body: &str) -> String {
    let (begin, end) = (
        format!("<!-- begin {name} -->\n"),
        format!("<!-- end {name} -->"),
    );
    let start = page
        .find(&begin)
        .unwrap_or_else(|| panic!("no `{begin}` marker"))
        + begin.len();
    let stop = page[start..]
        .find(&end)
        .unwrap_or_else(|| panic!("no `{end}` marker"))
        + start;
    format!("{}{body}{}", &page[..start], &page[stop..])
}

fn resume_rules_text() -> String {
    let list = |keys: &[String]| {
        keys.iter()
            .map(|k| format!("`{k}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut out = String::from(
        "| command | a change is refused | may change | not part of the run (taken as given; the weights come from the checkpoint) |\n| --- | --- | --- | --- |\n",
    );
    for (name, rules) in [
        ("`learner train`", learner::train::resume_rules()),
        ("`learner sft`", learner::sft::resume_rules()),
    ] {
        writeln!(
            out,
            "| {name} | {} | {} | {} |",
            list(&rules.refused),
            list(&rules.may_change),
            list(&rules.free)
        )
        .unwrap();
    }
    out
}

/// The run-directories page lists what a resume refuses and takes from
/// `learner::run_dir::ResumeRules`, the lists the resume check uses.
#[test]
fn the_resume_rules_on_the_run_directories_page_are_the_codes() {
    let rel = "docs/guides/run-directories.md";
    let page = std::fs::read_to_string(root().join(rel)).unwrap();
    check_page(
        rel,
        &with_section(&page, "resume-rules", &resume_rules_text()),
    );
}

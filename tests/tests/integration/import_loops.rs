//! No import loops inside a crate: a crate reads from its top module down, so no two of its
//! files name each other's items, directly or round a longer ring.
//!
//! Each member's `src/**/*.rs` is read by a small hand parser (no compile): the module tree
//! from each crate root (`lib.rs`, `main.rs`, `bin/*.rs`) through `mod name;`, and in each
//! file the paths of its `use` declarations and the paths in its code that start with
//! `crate::`, `super::`, `self::` or a child module's name. A path names the module of its
//! longest prefix that is a module of the crate (a file's inline modules are that file), and
//! an edge A → B means file A names something in B's module. A child naming its parent's
//! items is an edge up, the parent naming the child's an edge down: both at once are a loop.
//! Not edges: `mod b;` itself, a module re-exporting (`pub use`) an item of a module below
//! it (the facade through which a crate is read top down), comments, docs and strings,
//! `#[cfg(test)]` items (the `mod tests` blocks), and the files `tests.rs` and
//! `*_tests.rs`. Every set of files that reach each other through edges (a strongly
//! connected component of more than one file) is a loop, reported with the first line of
//! each edge inside it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A token and its line.
type Tok = (String, usize);
/// A path written in a module: the module (absolute, without `crate`), the path, its line,
/// and whether a `pub use` (or `pub(crate) use`) re-exports it.
type Written = (Vec<String>, Vec<String>, usize, bool);
/// The edges between files, each with the line of the first path that makes it.
type Edges = BTreeMap<(PathBuf, PathBuf), usize>;

/// The tokens of a Rust file: identifiers, `::`, single punctuation, string literals (their
/// text after a `"`); comments (block comments not nested), characters and lifetimes dropped.
fn tokens(src: &str) -> Vec<Tok> {
    let (mut i, mut line, mut out) = (0, 1, Vec::new());
    let word_end = |s: &str| s.find(|c: char| !c.is_alphanumeric() && c != '_');
    while i < src.len() {
        let (rest, start) = (&src[i..], i);
        let raw = rest.strip_prefix("br").or(rest.strip_prefix('r'));
        let raw = raw.unwrap_or("~");
        let hashes = raw.len() - raw.trim_start_matches('#').len();
        let c = rest.chars().next().unwrap();
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("/*") {
            i += rest.find("*/").unwrap() + 2;
        } else if raw[hashes..].starts_with('"') {
            let open = rest.len() - raw.len() + hashes + 1;
            let close = format!("\"{}", "#".repeat(hashes));
            let len = rest[open..].find(&close).unwrap();
            out.push((format!("\"{}", &rest[open..open + len]), line));
            i += open + len + 1 + hashes;
        } else if c == '"' {
            let mut k = 1;
            while rest.as_bytes()[k] != b'"' {
                k += if rest.as_bytes()[k] == b'\\' { 2 } else { 1 };
            }
            out.push((rest[..k].to_owned(), line));
            i += k + 1;
        } else if c == '\'' {
            let next = rest[1..].chars().next().unwrap();
            i += match next {
                '\\' => 4 + rest[3..].find('\'').unwrap(),
                _ if rest[1 + next.len_utf8()..].starts_with('\'') => 2 + next.len_utf8(),
                _ => 1 + word_end(&rest[1..]).unwrap(), // a lifetime or a label
            };
        } else if c.is_alphanumeric() || c == '_' {
            i += word_end(rest).unwrap_or(rest.len());
            out.push((rest[..i - start].to_owned(), line));
        } else {
            i += c.len_utf8() + usize::from(rest.starts_with("::"));
            if !c.is_whitespace() {
                out.push((rest[..i - start].to_owned(), line));
            }
        }
        line += src[start..i].matches('\n').count();
    }
    out
}

/// Where the item at `j` ends: past its `;` or its first block (`{…}`, or `[…]` when it is
/// an attribute's).
fn item_end(t: &[Tok], mut j: usize) -> usize {
    let (mut nest, attribute) = (0, t[j].0 == "[");
    while j < t.len() {
        j += 1;
        match t[j - 1].0.as_str() {
            "(" | "[" | "{" => nest += 1,
            "}" | "]" if nest == 1 && (attribute || t[j - 1].0 == "}") => return j,
            ")" | "]" | "}" => nest -= 1,
            ";" if nest == 0 => return j,
            _ => {}
        }
    }
    j
}

/// The paths of the use tree at `j` (`a::{b, c::d as e, f::*}`), each after `path`.
fn use_tree(t: &[Tok], j: &mut usize, mut path: Vec<String>, out: &mut Vec<Vec<String>>) {
    loop {
        *j += 1;
        match t[*j - 1].0.as_str() {
            "::" => {}
            "*" => return out.push(path),
            "{" => {
                while t[*j].0 != "}" {
                    use_tree(t, j, path.clone(), out);
                    *j += usize::from(t[*j].0 == ",");
                }
                return *j += 1;
            }
            name => {
                if name != "self" {
                    path.push(name.to_owned());
                }
                *j += if t[*j].0 == "as" { 2 } else { 0 };
                if t[*j].0 != "::" {
                    return out.push(path);
                }
            }
        }
    }
}

/// A crate as read so far: the files left to read (module, file, whether its child files
/// sit beside it as `lib.rs`'s and `mod.rs`'s do), each module's file, the paths written.
#[derive(Default)]
struct Crate {
    todo: Vec<(Vec<String>, PathBuf, bool)>,
    modules: BTreeMap<Vec<String>, PathBuf>,
    paths: Vec<(PathBuf, Written)>,
}

impl Crate {
    /// The edges of the crate whose root file is `root`.
    fn edges(root: &Path) -> Edges {
        let mut c = Crate::default();
        c.todo.push((Vec::new(), root.to_owned(), true));
        while let Some((module, file, mod_rs)) = c.todo.pop() {
            let name = file.file_name().unwrap().to_str().unwrap();
            if name != "tests.rs" && !name.ends_with("_tests.rs") {
                c.modules.insert(module.clone(), file.clone());
                c.parse(&file, &module, mod_rs);
            }
        }
        let mut edges = Edges::new();
        for (from, (scope, path, line, reexport)) in &c.paths {
            let Some(module) = c.named(scope, path) else {
                continue;
            };
            let below = module.len() > scope.len() && module.starts_with(scope);
            let to = &c.modules[&module];
            if to != from && !(*reexport && below) {
                edges.entry((from.clone(), to.clone())).or_insert(*line);
            }
        }
        edges
    }

    /// The module a path written in `scope` names: the longest prefix of its absolute form
    /// that is a module; `None` outside the crate (`std::…`, `Self::…`).
    fn named(&self, scope: &[String], path: &[String]) -> Option<Vec<String>> {
        let ups = path.iter().take_while(|s| *s == "super").count();
        let (base, rest) = match path[0].as_str() {
            "crate" => (&[][..], &path[1..]),
            "self" => (scope, &path[1..]),
            "super" => (&scope[..scope.len().checked_sub(ups)?], &path[ups..]),
            _ => (scope, path),
        };
        let is_module = |k: &usize| self.modules.contains_key(&[base, &rest[..*k]].concat());
        let k = (0..=rest.len()).rev().find(is_module)?;
        // A bare path names a child module or nothing of the crate.
        (k > 0 || rest.len() < path.len()).then(|| [base, &rest[..k]].concat())
    }

    /// Reads the file of `module`: its child files, inline modules and paths.
    fn parse(&mut self, file: &Path, module: &[String], mod_rs: bool) {
        let t = tokens(&std::fs::read_to_string(file).unwrap());
        let at = |k: usize| t.get(k).map_or("", |x| x.0.as_str());
        let (mut j, mut depth, mut path_attr) = (0, 0, None);
        // The inline modules open here: each name and the depth of its body.
        let mut inline: Vec<(String, usize)> = Vec::new();
        let (dir, stem) = (file.parent().unwrap(), file.with_extension(""));
        let base = if mod_rs { dir } else { &stem };
        while j < t.len() {
            let names = inline.iter().map(|m| m.0.clone());
            let scope: Vec<String> = module.iter().cloned().chain(names).collect();
            let before = if j > 0 { at(j - 1) } else { "" };
            match at(j) {
                "#" => {
                    let end = item_end(&t, j + 1 + usize::from(at(j + 1) == "!"));
                    let attr: Vec<&str> = t[j..end].iter().map(|x| x.0.as_str()).collect();
                    let test = attr[2] == "cfg" && attr.contains(&"test") && !attr.contains(&"not");
                    if attr[2] == "path" {
                        path_attr = Some(attr[4][1..].to_owned());
                    }
                    j = if test { item_end(&t, end) } else { end };
                    continue;
                }
                "{" => depth += 1,
                "}" => {
                    if inline.last().is_some_and(|m| m.1 == depth) {
                        inline.pop();
                    }
                    depth -= 1;
                }
                "mod" if at(j + 2) == ";" => {
                    let name = at(j + 1).to_owned();
                    let at_dir = inline.iter().fold(base.to_owned(), |d, m| d.join(&m.0));
                    let (flat, nested) = (at_dir.join(name.clone() + ".rs"), at_dir.join(&name));
                    let (path, mod_rs) = match path_attr.take() {
                        Some(p) => (dir.join(p), false),
                        None if flat.exists() => (flat, false),
                        None => (nested.join("mod.rs"), true),
                    };
                    self.todo.push(([scope, vec![name]].concat(), path, mod_rs));
                }
                "mod" if at(j + 2) == "{" => {
                    inline.push((at(j + 1).to_owned(), depth + 1));
                    let inner = [scope, vec![at(j + 1).to_owned()]].concat();
                    self.modules.insert(inner, file.to_owned());
                    (depth, j) = (depth + 1, j + 3);
                    continue;
                }
                "use" => {
                    let vis = if before == ")" { at(j - 4) } else { before };
                    let (line, mut leaves) = (t[j].1, Vec::new());
                    j += 1;
                    use_tree(&t, &mut j, Vec::new(), &mut leaves);
                    for path in leaves {
                        let written = (scope.clone(), path, line, vis == "pub");
                        self.paths.push((file.to_owned(), written));
                    }
                    continue;
                }
                // A path in code (`crate::…`, `super::…`, `child::…`), not `pub(in …)`.
                name if at(j + 1) == "::"
                    && name.starts_with(|c: char| c.is_alphabetic() || c == '_')
                    && !["::", ".", "$"].contains(&before)
                    && !(before == "in" && at(j - 2) == "(") =>
                {
                    let (mut path, line) = (vec![name.to_owned()], t[j].1);
                    while at(j + 1) == "::" && at(j + 2).starts_with(char::is_alphanumeric) {
                        path.push(at(j + 2).to_owned());
                        j += 2;
                    }
                    let written = (scope, path, line, false);
                    self.paths.push((file.to_owned(), written));
                }
                _ => {}
            }
            j += 1;
        }
    }
}

/// The loops: each set of more than one file that reach each other through `edges`.
fn loops(edges: &Edges) -> Vec<BTreeSet<&Path>> {
    let reach = |from: &Path| {
        let (mut seen, mut todo) = (BTreeSet::from([from.to_owned()]), vec![from.to_owned()]);
        while let Some(a) = todo.pop() {
            for (_, b) in edges.keys().filter(|(x, _)| *x == a) {
                if seen.insert(b.clone()) {
                    todo.push(b.clone());
                }
            }
        }
        seen
    };
    let nodes: BTreeSet<&Path> = edges.keys().map(|(a, _)| &**a).collect();
    let reached: BTreeMap<_, _> = nodes.into_iter().map(|a| (a, reach(a))).collect();
    let mut found: Vec<BTreeSet<&Path>> = Vec::new();
    for (a, ahead) in &reached {
        let mut ring = BTreeSet::new();
        for (b, back) in &reached {
            if ahead.contains(*b) && back.contains(*a) {
                ring.insert(*b);
            }
        }
        if ring.len() > 1 && !found.contains(&ring) {
            found.push(ring);
        }
    }
    found
}

/// Each crate's loops, (crate, its files under `src/`), with one line per edge inside; and
/// the number of edges read.
fn workspace_loops(root: &Path) -> (BTreeMap<(String, String), Vec<String>>, usize) {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let manifest: toml::Table = manifest.parse().unwrap();
    let (mut found, mut count) = (BTreeMap::new(), 0);
    for member in manifest["workspace"]["members"].as_array().unwrap() {
        let member = member.as_str().unwrap();
        let src = root.join(member).join("src");
        // Each root a crate of its own: the library, the binary, `bin/*.rs`.
        let bins = std::fs::read_dir(src.join("bin")).into_iter().flatten();
        let roots = [src.join("lib.rs"), src.join("main.rs")].into_iter();
        let roots = roots.chain(bins.map(|e| e.unwrap().path()));
        let edges: Edges = roots
            .filter(|r| r.exists())
            .flat_map(|r| Crate::edges(&r))
            .collect();
        count += edges.len();
        let name = |p: &Path| p.strip_prefix(&src).unwrap().display().to_string();
        for ring in loops(&edges) {
            let mut lines = Vec::new();
            for ((a, b), l) in &edges {
                if ring.contains(&**a) && ring.contains(&**b) {
                    lines.push(format!("{member}/src/{}:{l} -> {}", name(a), name(b)));
                }
            }
            let files: Vec<String> = ring.into_iter().map(name).collect();
            found.insert((member.to_owned(), files.join(" ")), lines);
        }
    }
    (found, count)
}

#[test]
fn a_parent_and_child_naming_each_other_are_a_loop_and_re_exports_down_tests_comments_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("a")).unwrap();
    let fixture = r##"
lib.rs: mod a; mod c; pub use a::{self, b::Y}; pub fn top() {}
a.rs: mod b; /// [`crate::c::Z`]
a.rs: pub struct X; fn f() { super::top(); b::f() }
a/b.rs: pub struct Y(crate::a::X); #[cfg(test)] mod tests { use crate::c::Z; }
c.rs: pub use crate::a::X; fn f(_: &'static str) { ("crate::c", '"', r#"a::""#, b'x') }"##;
    for line in fixture.lines().skip(1) {
        let (name, text) = line.split_once(": ").unwrap();
        let old = std::fs::read_to_string(src.join(name)).unwrap_or_default();
        std::fs::write(src.join(name), old + text + "\n").unwrap();
    }
    let edges = Crate::edges(&src.join("lib.rs"));
    let name = |p: &Path| p.strip_prefix(&src).unwrap().display().to_string();
    let lines: Vec<_> = edges
        .iter()
        .map(|((a, b), l)| format!("{}:{l} {}", name(a), name(b)))
        .collect();
    let want = "a/b.rs:1 a.rs, a.rs:2 a/b.rs, a.rs:2 lib.rs, c.rs:1 a.rs";
    assert_eq!(lines.join(", "), want);
    let found: Vec<Vec<_>> = loops(&edges)
        .into_iter()
        .map(|r| r.into_iter().map(name).collect())
        .collect();
    assert_eq!(found, [["a/b.rs", "a.rs"]]);
}

#[test]
fn no_crate_has_an_import_loop() {
    let (found, edges) = workspace_loops(&rookworld_tests::repo_root());
    // The parse read the crates' imports: a few hundred edges, not none.
    assert!(edges > 300, "{edges} edges read");
    let wrong: Vec<String> = found
        .iter()
        .map(|((krate, files), lines)| {
            format!(
                "{krate}: a loop of {files}, its edges:\n  {}",
                lines.join("\n  ")
            )
        })
        .collect();
    println!("{} loops, {edges} edges", found.len());
    assert!(
        wrong.is_empty(),
        "import loops inside crates:\n{}",
        wrong.join("\n")
    );
}

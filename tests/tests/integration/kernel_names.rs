//! One name, one kernel: no two `extern "C" __global__` kernels of the repository's
//! `*/kernels/*.cu` share a name, so a kernel's name in a launch, a kernel profile or the
//! book means one signature. The names come from a plain scan of the sources: comments
//! dropped, `__launch_bounds__(…)` skipped, and a kernel defined in a function-like macro
//! named once per invocation of the macro, its parameters replaced and `##` pasted.

use std::collections::BTreeMap;
use std::path::Path;

#[test]
fn no_two_cuda_kernels_share_a_name() {
    let root = rookworld_tests::repo_root();
    let sources = kernel_sources(&root);
    assert!(
        sources.len() >= 2,
        "kernel sources found under {}: {:?}",
        root.display(),
        sources.iter().map(|s| &s.0).collect::<Vec<_>>()
    );
    let names = kernels_by_name(&sources);
    let clashes = clashes(&names);
    assert!(
        clashes.is_empty(),
        "kernels defined more than once:\n{}",
        clashes.join("\n")
    );
    // The scan finds plain kernels and macro-made ones in both crates' files, so the check
    // above covers them.
    for (name, file) in [
        ("layer_norm_fwd", "rookworld-lm/kernels/train_ops.cu"),
        (
            "grouped_attention_bf16",
            "rookworld-lm/kernels/grouped_attention.cu",
        ),
        ("pass_layer_norm_fwd", "rookworld-train/kernels/pass.cu"),
        ("attention_tile_dkv_d64", "rookworld-train/kernels/pass.cu"),
    ] {
        assert_eq!(
            names.get(name).map(Vec::as_slice),
            Some([file.to_string()].as_slice()),
            "kernel `{name}`"
        );
    }
}

#[test]
fn the_scan_names_macro_made_kernels_and_reports_a_clash_by_its_files() {
    let a = r#"
// extern "C" __global__ void commented_out(float *x) {}
#define PAIR(SUFFIX, T)                                                   \
    extern "C" __global__ void __launch_bounds__(8 * 32)                  \
        scale_##SUFFIX(T *x) {}                                           \
    extern "C" __global__ void NAME(T *x) {}
PAIR(f32, float)
PAIR(bf16, __nv_bfloat16)
extern "C" __global__ void __launch_bounds__(ROWS * (WARP))
    plain(float *x, int n) {}
__global__ void not_exported(float *x) {}
"#;
    assert_eq!(
        kernel_names(a),
        ["plain", "scale_f32", "NAME", "scale_bf16", "NAME"]
    );
    let b = "extern \"C\" __global__ void scale_bf16(float *x) {}\n";
    let names = kernels_by_name(&[("a.cu".into(), a.into()), ("b.cu".into(), b.into())]);
    assert_eq!(
        clashes(&names),
        ["`NAME` in a.cu and a.cu", "`scale_bf16` in a.cu and b.cu"]
    );
}

/// Every `*/kernels/*.cu` under `root` (a directory's `kernels/`, one level down), by its
/// path relative to `root`, with its source; sorted.
fn kernel_sources(root: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for dir in std::fs::read_dir(root).expect("the repository root lists") {
        let kernels = dir.unwrap().path().join("kernels");
        let Ok(files) = std::fs::read_dir(&kernels) else {
            continue;
        };
        for file in files {
            let path = file.unwrap().path();
            if path.extension().is_some_and(|e| e == "cu") {
                let rel = path.strip_prefix(root).unwrap();
                let rel = rel.to_string_lossy().replace('\\', "/");
                out.push((rel, std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// Each kernel name with the files that define it, once per definition.
fn kernels_by_name(sources: &[(String, String)]) -> BTreeMap<String, Vec<String>> {
    let mut names: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (file, src) in sources {
        for name in kernel_names(src) {
            names.entry(name).or_default().push(file.clone());
        }
    }
    names
}

/// One line per name defined more than once: the name and the files of its first two
/// definitions.
fn clashes(names: &BTreeMap<String, Vec<String>>) -> Vec<String> {
    names
        .iter()
        .filter(|(_, files)| files.len() > 1)
        .map(|(name, files)| format!("`{name}` in {} and {}", files[0], files[1]))
        .collect()
}

/// The names of the `extern "C" __global__` kernels of one CUDA source: those outside
/// macros in order, then those of each invocation of a function-like macro that defines
/// kernels, in order of invocation.
fn kernel_names(src: &str) -> Vec<String> {
    let src = without_comments(&src.replace("\\\r\n", " ").replace("\\\n", " "));
    // Function-like macros: name → (parameters, the kernel names in the body as pieces).
    let mut macros: BTreeMap<String, (Vec<String>, Vec<Vec<String>>)> = BTreeMap::new();
    let mut outside = String::new();
    for line in src.lines() {
        let t = tokens(line);
        let is_define = t.len() >= 2 && t[0] == "#" && t[1] == "define";
        if is_define && t.len() >= 4 && t[3] == "(" && line.contains(&format!("{}(", t[2])) {
            let close = t
                .iter()
                .position(|x| x == ")")
                .expect("a macro's parameters close");
            let params = t[4..close].iter().filter(|x| *x != ",").cloned().collect();
            let kernels = kernels_in(&t[close + 1..]);
            if !kernels.is_empty() {
                macros.insert(t[2].clone(), (params, kernels));
            }
        } else if !line.trim_start().starts_with('#') {
            outside.push_str(line);
            outside.push('\n');
        }
    }
    let t = tokens(&outside);
    let mut names: Vec<String> = kernels_in(&t).iter().map(|p| p.concat()).collect();
    let mut i = 0;
    while i < t.len() {
        let Some((params, kernels)) = macros.get(&t[i]) else {
            i += 1;
            continue;
        };
        assert_eq!(
            t.get(i + 1).map(String::as_str),
            Some("("),
            "{} invoked",
            t[i]
        );
        let close = i + 1 + group_len(&t[i + 1..]);
        let args: Vec<&str> = t[i + 2..close - 1]
            .split(|x| x == ",")
            .map(|arg| arg.first().map_or("", String::as_str))
            .collect();
        for pieces in kernels {
            let name = pieces
                .iter()
                .map(|p| match params.iter().position(|x| x == p) {
                    Some(k) => args[k],
                    None => p.as_str(),
                });
            names.push(name.collect());
        }
        i = close;
    }
    names
}

/// The kernel names among `t` (the tokens after `extern "C" __global__ void`, less a
/// `__launch_bounds__(…)`), each as its pieces around `##`.
fn kernels_in(t: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for (i, w) in t.windows(3).enumerate() {
        if w[0] != "extern" || w[1] != "\"C\"" || w[2] != "__global__" {
            continue;
        }
        let mut j = i + 3;
        if t.get(j).is_some_and(|x| x == "void") {
            j += 1;
        }
        if t.get(j).is_some_and(|x| x == "__launch_bounds__") {
            j += 1 + group_len(&t[j + 1..]);
        }
        let mut pieces = Vec::new();
        while let Some(x) = t.get(j).filter(|x| *x != "(") {
            if x != "##" {
                pieces.push(x.clone());
            }
            j += 1;
        }
        out.push(pieces);
    }
    out
}

/// The length of the parenthesised group that `t` starts with, parentheses included.
fn group_len(t: &[String]) -> usize {
    let mut depth = 0;
    for (i, x) in t.iter().enumerate() {
        match x.as_str() {
            "(" => depth += 1,
            ")" => depth -= 1,
            _ => {}
        }
        if depth == 0 {
            return i + 1;
        }
    }
    panic!("unbalanced parentheses: {}", t.join(" "))
}

/// Words (letters, digits, `_`), string literals, `##`, and single other characters.
fn tokens(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_whitespace() {
            continue;
        }
        let mut token = c.to_string();
        let word = |c: &char| c.is_ascii_alphanumeric() || *c == '_';
        if word(&c) {
            while let Some(c) = chars.next_if(word) {
                token.push(c);
            }
        } else if c == '"' {
            for c in chars.by_ref() {
                token.push(c);
                if c == '"' {
                    break;
                }
            }
        } else if c == '#' && chars.next_if_eq(&'#').is_some() {
            token.push('#');
        }
        out.push(token);
    }
    out
}

/// `src` without its `//` and `/* */` comments (the kernels' sources quote no `//` or
/// `/*` in strings).
fn without_comments(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    loop {
        let line = rest.find("//");
        let block = rest.find("/*");
        match (line, block) {
            (Some(l), b) if b.is_none_or(|b| l < b) => {
                out.push_str(&rest[..l]);
                rest = &rest[l..];
                rest = &rest[rest.find('\n').unwrap_or(rest.len())..];
            }
            (_, Some(b)) => {
                out.push_str(&rest[..b]);
                out.push(' ');
                rest = &rest[b + 2..];
                rest = &rest[rest.find("*/").map_or(rest.len(), |e| e + 2)..];
            }
            _ => {
                out.push_str(rest);
                return out;
            }
        }
    }
}

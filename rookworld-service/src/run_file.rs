//! Run files: `--config FILE` (TOML) on every command of the three binaries.
//!
//! A key is a long flag with underscores (`group_size = 8` for `--group-size 8`). Tables
//! group keys freely (`[grpo]`, `[sampling]`, …: the flat form works as well); a table named
//! after a binary (`[learner]`, `[rollout-worker]`, `[reward-server]`) applies to that binary
//! only, and within it a table named after one of its commands (`[learner.eval]`) to that
//! command only; the more specific table wins; `[record]` is never read. So one file can
//! describe a whole deployment: each command takes the keys it knows and leaves the others'
//! to them.
//!
//! Precedence: built-in defaults < file < environment < flags. Clap does the layering: a
//! file value becomes a command-line argument only when neither the command line nor the
//! environment set that option (nor one it conflicts with). A key no command of the three
//! binaries knows, a value of the wrong type, or a key set twice in one table is one line
//! naming the key (with the closest known key for a typo), before any work.
//!
//! [`resolved`] is the other direction: every option's value after parsing, defaults
//! included, as a TOML table (what `learner config show` prints and a run records).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Command};

/// The binaries a run file can scope tables to.
pub const BINARIES: [&str; 3] = ["learner", "rollout-worker", "reward-server"];

/// A table run files keep but never read: where a recorded run came from
/// (`RUN/config.toml`'s version, commit, model and device).
pub const RECORD_TABLE: &str = "record";

/// The variable that names a run file when `--config` is not given.
pub const CONFIG_ENV: &str = "ROOKWORLD_CONFIG";

/// Options no run file sets: secrets (a token belongs in `token_file`), the file itself,
/// clap's own.
const NOT_IN_FILES: [&str; 5] = ["config", "token", "inspect_token", "help", "version"];

/// `--config FILE`, flattened into every binary's top-level options.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RunFileArgs {
    /// Run file (TOML): keys are the long options with underscores (`group_size = 8`),
    /// tables may group them; flags and the environment override it.
    #[arg(long, global = true, env = CONFIG_ENV, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// A run file that cannot be used: one line naming the file and the key.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RunFileError(pub String);

/// Which options the run file set, for naming the key in a later range error.
#[derive(Debug, Default)]
struct FromFile {
    file: PathBuf,
    /// (`--flag`, key)
    flags: Vec<(String, String)>,
}

static FROM_FILE: OnceLock<FromFile> = OnceLock::new();

/// Parses the process's command line for `cmd` with its run file (if any) layered under
/// the flags and the environment. Clap's own errors (and `--help`) exit as clap does; a run
/// file problem is one `error: …` line and exit 1.
///
/// `stand_ins` lets a command read another's tables: `("config show", "train")` gives
/// `learner config show` the keys of `[learner.train]`.
pub fn parse(cmd: Command, stand_ins: &[(&str, &str)]) -> ArgMatches {
    let argv: Vec<OsString> = std::env::args_os().collect();
    match parse_from(cmd.clone(), &argv, stand_ins) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

/// [`parse`] on a given command line (`argv[0]` is the program). Clap errors exit, but a
/// negative number for a count is one line with the rule, as every range check says it.
pub fn parse_from(
    cmd: Command,
    argv: &[OsString],
    stand_ins: &[(&str, &str)],
) -> Result<ArgMatches, RunFileError> {
    let cmd = negatives_reach_checks(cmd);
    let argv = with_run_file(&cmd, argv, stand_ins)?;
    cmd.try_get_matches_from(argv).map_err(|e| {
        use clap::error::ErrorKind;
        match e.kind() {
            // Help and version are output, not errors; a binary without its command prints
            // its help (exit 2), as clap does.
            ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => e.exit(),
            _ => RunFileError(annotate(
                &negative_count(&e).unwrap_or_else(|| one_line(&e)),
            )),
        }
    })
}

/// Clap's usage error as one line: its message, then its tips and valid values
/// (`unexpected argument '--stps' found; tip: a similar argument exists: '--steps'`).
fn one_line(e: &clap::Error) -> String {
    let text = e.to_string();
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let mut out = lines
        .next()
        .unwrap_or_default()
        .trim_start_matches("error: ")
        .to_owned();
    for line in lines {
        if line.starts_with("Usage:") || line.starts_with("For more information") {
            break;
        }
        let line = line.trim_start_matches('[').trim_end_matches(']');
        out.push_str(if out.ends_with(':') { " " } else { "; " });
        out.push_str(line);
    }
    out
}

/// Every option that takes a value takes a negative number as its value (not as an
/// unknown flag), so that the option's own rule refuses it by name.
fn negatives_reach_checks(cmd: Command) -> Command {
    cmd.mut_args(|a| {
        if a.get_num_args().is_none_or(|n| n.takes_values())
            && !matches!(
                a.get_action(),
                ArgAction::SetTrue
                    | ArgAction::SetFalse
                    | ArgAction::Count
                    | ArgAction::Help
                    | ArgAction::Version
                    | ArgAction::HelpShort
                    | ArgAction::HelpLong
            )
            && a.get_long().is_some()
        {
            a.allow_negative_numbers(true)
        } else {
            a
        }
    })
    .mut_subcommands(negatives_reach_checks)
}

/// `--steps must not be negative (got -5)` for clap's error on a negative number given to
/// an option that counts (an unsigned integer).
fn negative_count(e: &clap::Error) -> Option<String> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if !matches!(
        e.kind(),
        ErrorKind::ValueValidation | ErrorKind::InvalidValue
    ) {
        return None;
    }
    let text = |k| match e.get(k) {
        Some(ContextValue::String(s)) => Some(s.clone()),
        _ => None,
    };
    let value = text(ContextKind::InvalidValue)?;
    let arg = text(ContextKind::InvalidArg)?;
    let flag = arg.split_whitespace().next()?.to_owned();
    let negative = value.starts_with('-') && value[1..].parse::<u128>().is_ok();
    let unsigned = e.to_string().contains("invalid digit");
    (negative && unsigned).then(|| format!("{flag} must not be negative (got {value})"))
}

/// The command line with the run file's values appended where neither a flag nor the
/// environment sets them; unchanged without a run file.
pub fn with_run_file(
    cmd: &Command,
    argv: &[OsString],
    stand_ins: &[(&str, &str)],
) -> Result<Vec<OsString>, RunFileError> {
    // A lenient first pass: which command runs, which run file, what is already set.
    let lenient = cmd
        .clone()
        .ignore_errors(true)
        .try_get_matches_from(argv.iter())
        .ok();
    let Some(lenient) = lenient else {
        return Ok(argv.to_vec());
    };
    let path = config_path(&lenient);
    let Some(path) = path else {
        return Ok(argv.to_vec());
    };
    let text = std::fs::read_to_string(&path)
        .map_err(|e| RunFileError(format!("--config {}: {e}", path.display())))?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        RunFileError(format!(
            "{}: not valid TOML: {}",
            path.display(),
            e.to_string().lines().next().unwrap_or_default()
        ))
    })?;

    // The command chain: binary, command, subcommand…
    let binary = cmd.get_name().to_owned();
    let mut chain = vec![(cmd.clone(), lenient.clone())];
    loop {
        let (c, m) = chain.last().expect("not empty");
        let Some((name, sub)) = m.subcommand() else {
            break;
        };
        let Some(sc) = c.find_subcommand(name).cloned() else {
            break;
        };
        chain.push((sc, sub.clone()));
    }
    let mut names: Vec<String> = chain
        .iter()
        .skip(1)
        .map(|(c, _)| c.get_name().to_owned())
        .collect();
    if let Some((_, to)) = stand_ins.iter().find(|(from, _)| *from == names.join(" ")) {
        names = to.split(' ').map(str::to_owned).collect();
    }
    let mut every = Vec::new();
    command_names(cmd, &mut every);
    check_table_names(&table, &binary, &every, &path)?;
    let flat = flatten(&table, &binary, &names, &every, &path)?;

    // Every key some command of the three binaries takes.
    let known = known_keys();
    // Each key with the option it sets, in the deepest command that takes it.
    let mut entries = Vec::new();
    for (key, (value, specificity)) in &flat {
        let target = chain
            .iter()
            .enumerate()
            .rev()
            .find_map(|(i, (c, m))| find_arg(c, key).map(|a| (i, c, m, a)));
        let Some((level, command, matches, arg)) = target else {
            if known.contains(&key.as_str()) {
                // Another command's or binary's: left to it.
                continue;
            }
            return Err(unknown_key(&path, key, &known));
        };
        let id = arg.get_id().as_str();
        if NOT_IN_FILES.contains(&id) {
            return Err(RunFileError(format!(
                "{}: `{key}` cannot be set in a run file{}",
                path.display(),
                if id.ends_with("token") {
                    " (a secret: use token_file, or the environment)"
                } else {
                    ""
                }
            )));
        }
        // A flag or the environment beats the file: for this option, and for every option
        // that excludes it (`--model` on the command line over the file's `preset`).
        let others = excluded_by(command, arg);
        if explicitly_set(matches, id) || others.iter().any(|c| explicitly_set(matches, c)) {
            continue;
        }
        entries.push(Entry {
            key,
            value,
            specificity: *specificity,
            level,
            arg,
            others,
        });
    }
    // Two keys of the file that exclude each other: the more specific table's wins; in
    // tables of the same scope, they contradict each other.
    let mut dropped = Vec::new();
    for a in &entries {
        for b in &entries {
            if a.others.contains(&b.arg.get_id().as_str()) && a.specificity <= b.specificity {
                if a.specificity == b.specificity {
                    return Err(RunFileError(format!(
                        "{}: `{}` and `{}` exclude each other: set one",
                        path.display(),
                        a.key.min(b.key),
                        a.key.max(b.key)
                    )));
                }
                dropped.push(a.key.as_str());
            }
        }
    }

    let mut front = Vec::new();
    let mut back = Vec::new();
    let mut from_file = FromFile {
        file: path.clone(),
        flags: Vec::new(),
    };
    let last = chain.len() - 1;
    for e in entries
        .iter()
        .filter(|e| !dropped.contains(&e.key.as_str()))
    {
        let (key, value, arg) = (e.key, e.value, e.arg);
        let flag = format!("--{}", arg.get_long().expect("found by its long name"));
        let args = file_args(&path, key, value, arg, &flag)?;
        from_file.flags.push((flag, key.clone()));
        // The binary's own options go before the command's name, the rest at the end (an
        // intermediate command such as `learner config` has only global options).
        if e.level == 0 && last > 0 {
            front.extend(args);
        } else {
            back.extend(args);
        }
    }
    let _ = FROM_FILE.set(from_file);
    let mut out = Vec::with_capacity(argv.len() + front.len() + back.len());
    out.extend(argv.first().cloned());
    out.extend(front);
    // Before a `--`, if the command line has one.
    let rest = &argv[1.min(argv.len())..];
    match rest.iter().position(|a| a == "--") {
        Some(dash) => {
            out.extend(rest[..dash].iter().cloned());
            out.extend(back);
            out.extend(rest[dash..].iter().cloned());
        }
        None => {
            out.extend(rest.iter().cloned());
            out.extend(back);
        }
    }
    Ok(out)
}

/// A run file's key and the option it sets.
struct Entry<'a> {
    key: &'a String,
    value: &'a toml::Value,
    /// How specific its table is (0: general, 1: the binary's, 2…: its commands').
    specificity: usize,
    /// The command in the chain that takes it (0: the binary).
    level: usize,
    arg: &'a clap::Arg,
    /// The options it excludes or that exclude it.
    others: Vec<&'a str>,
}

/// The ids of the options of `command` that `arg` conflicts with or that conflict with
/// it (clap's `conflicts_with` is declared on one side only), and its mates in a group
/// that takes one of its options.
fn excluded_by<'a>(command: &'a Command, arg: &clap::Arg) -> Vec<&'a str> {
    let id = arg.get_id();
    let mut out: Vec<&str> = command
        .get_arg_conflicts_with(arg)
        .iter()
        .map(|a| a.get_id().as_str())
        .collect();
    for other in command.get_arguments() {
        if other.get_id() != id
            && command
                .get_arg_conflicts_with(other)
                .iter()
                .any(|c| c.get_id() == id)
        {
            out.push(other.get_id().as_str());
        }
    }
    for group in command.get_groups() {
        // (`is_multiple` takes `&mut self`.)
        if !group.clone().is_multiple() && group.get_args().any(|a| a == id) {
            out.extend(group.get_args().filter(|a| *a != id).map(|a| a.as_str()));
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The command-line arguments of `key = value` for the option `arg` (`flag`), after
/// checking the value's type against the option's and the value with the option's own
/// parser: one line naming the key, the expected type and the value found otherwise.
fn file_args(
    path: &Path,
    key: &str,
    value: &toml::Value,
    arg: &clap::Arg,
    flag: &str,
) -> Result<Vec<OsString>, RunFileError> {
    let wrong = |why: String| RunFileError(format!("{}: {key} = {value}: {why}", path.display()));
    let kind = Kind::of(arg);
    if kind == Kind::Bool && matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse) {
        return match value {
            toml::Value::Boolean(true) => Ok(vec![OsString::from(flag)]),
            toml::Value::Boolean(false) => Ok(vec![]),
            other => Err(wrong(format!(
                "expected {}, found {}",
                kind.name(),
                found(other)
            ))),
        };
    }
    let items: Vec<&toml::Value> = match value {
        toml::Value::Array(items) if takes_many(arg) => items.iter().collect(),
        toml::Value::Array(_) => {
            return Err(wrong(format!(
                "expected one value, {}, found a list",
                kind.name()
            )));
        }
        toml::Value::Table(_) => {
            return Err(wrong(format!("expected {}, found a table", kind.name())));
        }
        one => vec![one],
    };
    // The option's own parser on each value, alone (clap's message, the key named).
    let check = Command::new("run-file").no_binary_name(true).arg(
        clap::Arg::new("value")
            .long("value")
            .action(ArgAction::Set)
            .allow_negative_numbers(true)
            .value_parser(arg.get_value_parser().clone()),
    );
    let mut args = Vec::new();
    for item in items {
        if !kind.accepts(item) {
            let quote = match item {
                toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::Boolean(_) => {
                    format!(" (quote it: \"{item}\")")
                }
                _ => String::new(),
            };
            return Err(wrong(format!(
                "expected {}, found {}{}",
                kind.name(),
                found(item),
                if kind == Kind::Text {
                    quote
                } else {
                    String::new()
                }
            )));
        }
        let v = values_of(item)
            .ok_or_else(|| wrong(format!("expected {}, found {}", kind.name(), found(item))))?;
        let v = v.into_iter().next().unwrap_or_default();
        check
            .clone()
            .try_get_matches_from([OsString::from(format!("--value={v}"))])
            .map_err(|e| {
                let why = match negative_count(&e) {
                    Some(_) => "must not be negative".to_owned(),
                    None => clap_reason(&e),
                };
                let valid: Vec<String> = arg
                    .get_possible_values()
                    .iter()
                    .filter(|p| !p.is_hide_set())
                    .map(|p| p.get_name().to_owned())
                    .collect();
                if valid.is_empty() {
                    wrong(why)
                } else {
                    wrong(format!("{why}; valid values: {}", valid.join(", ")))
                }
            })?;
        args.push(OsString::from(format!("{flag}={v}")));
    }
    Ok(args)
}

/// Whether `arg` takes several values (a list in a run file).
fn takes_many(arg: &clap::Arg) -> bool {
    matches!(arg.get_action(), ArgAction::Append)
        || arg.get_num_args().is_some_and(|n| n.max_values() > 1)
}

/// The type a run file's value must have for an option: its parser's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Bool,
    Integer,
    /// An integer or a float.
    Number,
    /// A string: text, a path, an address, a name among valid values.
    Text,
}

impl Kind {
    fn of(arg: &clap::Arg) -> Kind {
        use std::any::TypeId;
        if matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse) {
            return Kind::Bool;
        }
        let t = arg.get_value_parser().type_id();
        let integers = [
            TypeId::of::<u8>(),
            TypeId::of::<u16>(),
            TypeId::of::<u32>(),
            TypeId::of::<u64>(),
            TypeId::of::<usize>(),
            TypeId::of::<i8>(),
            TypeId::of::<i16>(),
            TypeId::of::<i32>(),
            TypeId::of::<i64>(),
            TypeId::of::<isize>(),
        ];
        if integers.into_iter().any(|i| t == i) {
            Kind::Integer
        } else if t == TypeId::of::<f64>() || t == TypeId::of::<f32>() {
            Kind::Number
        } else if t == TypeId::of::<bool>() {
            Kind::Bool
        } else {
            Kind::Text
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Bool => "true or false",
            Kind::Integer => "an integer",
            Kind::Number => "a number",
            Kind::Text => "a string",
        }
    }

    fn accepts(self, v: &toml::Value) -> bool {
        matches!(
            (self, v),
            (Kind::Bool, toml::Value::Boolean(_))
                | (Kind::Integer, toml::Value::Integer(_))
                | (
                    Kind::Number,
                    toml::Value::Integer(_) | toml::Value::Float(_)
                )
                | (Kind::Text, toml::Value::String(_))
        )
    }

    /// A resolved value as this kind's TOML value (a string where it does not parse).
    fn typed(self, s: &str) -> toml::Value {
        let parsed = match self {
            Kind::Bool => s.parse().ok().map(toml::Value::Boolean),
            Kind::Integer => s.parse().ok().map(toml::Value::Integer),
            Kind::Number => s
                .parse::<f64>()
                .ok()
                .filter(|f| f.is_finite())
                .map(toml::Value::Float),
            Kind::Text => None,
        };
        parsed.unwrap_or_else(|| toml::Value::String(s.to_owned()))
    }
}

/// What a value is, for an error: "a string", "an integer", …
fn found(v: &toml::Value) -> &'static str {
    match v {
        toml::Value::String(_) => "a string",
        toml::Value::Integer(_) => "an integer",
        toml::Value::Float(_) => "a float",
        toml::Value::Boolean(_) => "a boolean",
        toml::Value::Datetime(_) => "a date",
        toml::Value::Array(_) => "a list",
        toml::Value::Table(_) => "a table",
    }
}

/// The names of every command under `cmd`, at any depth.
fn command_names(cmd: &Command, out: &mut Vec<String>) {
    for sub in cmd.get_subcommands() {
        out.push(sub.get_name().to_owned());
        command_names(sub, out);
    }
}

/// The run file given with `--config` or [`CONFIG_ENV`], at any level of the command.
fn config_path(m: &ArgMatches) -> Option<PathBuf> {
    let mut level = Some(m);
    let mut found = None;
    while let Some(m) = level {
        if let Ok(Some(p)) = m.try_get_one::<PathBuf>("config") {
            found = Some(p.clone());
        }
        level = m.subcommand().map(|(_, s)| s);
    }
    found
}

/// Whether the command line or the environment set `id`.
fn explicitly_set(m: &ArgMatches, id: &str) -> bool {
    matches!(
        m.try_contains_id(id).ok().and_then(|_| m.value_source(id)),
        Some(ValueSource::CommandLine | ValueSource::EnvVariable)
    )
}

/// The option whose long name is `key` with hyphens.
fn find_arg<'a>(c: &'a Command, key: &str) -> Option<&'a clap::Arg> {
    let long = key.replace('_', "-");
    c.get_arguments()
        .find(|a| a.get_long() == Some(long.as_str()) && !key.contains('-'))
}

/// A value's command-line strings; `None` for tables and nested lists.
fn values_of(v: &toml::Value) -> Option<Vec<String>> {
    let one = |v: &toml::Value| match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    };
    match v {
        toml::Value::Array(a) => a.iter().map(one).collect(),
        v => one(v).map(|s| vec![s]),
    }
}

/// The flat keys that apply to `binary` running `commands` (outermost first): general
/// tables and top-level keys first, then the binary's table, then its commands' tables,
/// each more specific one overriding.
/// Tables named after one of `every` command of the binary belong to that command.
fn flatten(
    table: &toml::Table,
    binary: &str,
    commands: &[String],
    every: &[String],
    path: &Path,
) -> Result<BTreeMap<String, (toml::Value, usize)>, RunFileError> {
    let mut out = BTreeMap::new();
    let mut unscoped = BINARIES.to_vec();
    unscoped.push(RECORD_TABLE);
    general(table, &mut out, path, &unscoped, 0)?;
    if let Some(toml::Value::Table(own)) = table.get(binary) {
        let mut scope = own;
        let names: Vec<&str> = every.iter().map(String::as_str).collect();
        general(scope, &mut out, path, &names, 1)?;
        for (depth, name) in commands.iter().enumerate() {
            match scope.get(name.as_str()) {
                Some(toml::Value::Table(t)) => {
                    general(t, &mut out, path, &names, depth + 2)?;
                    scope = t;
                }
                _ => break,
            }
        }
    }
    Ok(out)
}

/// The keys of `t` and of its tables but those named in `scoped` (recursively), into `out`
/// at `specificity`; a key found twice at one level of specificity is an error.
fn general(
    t: &toml::Table,
    out: &mut BTreeMap<String, (toml::Value, usize)>,
    path: &Path,
    scoped: &[&str],
    specificity: usize,
) -> Result<(), RunFileError> {
    let mut here = BTreeMap::new();
    collect(t, &mut here, path, scoped)?;
    out.extend(here.into_iter().map(|(k, v)| (k, (v, specificity))));
    Ok(())
}

fn collect(
    t: &toml::Table,
    here: &mut BTreeMap<String, toml::Value>,
    path: &Path,
    scoped: &[&str],
) -> Result<(), RunFileError> {
    for (k, v) in t {
        match v {
            toml::Value::Table(inner) => {
                if scoped.contains(&k.as_str()) || BINARIES.contains(&k.as_str()) {
                    continue;
                }
                collect(inner, here, path, &[])?;
            }
            v => {
                if here.insert(k.clone(), v.clone()).is_some() {
                    return Err(RunFileError(format!(
                        "{}: `{k}` is set twice (in two tables of the same scope)",
                        path.display()
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Refuses a table that was surely meant to name a binary or a command and does not: one
/// a letter away from a binary's name or, at the top or inside this binary's table, from
/// one of its commands (`[lerner]`, `[learner.trian]`, `[bench_push]`), or a command's own
/// name outside its binary's table (`[train]`, which would apply to every command). Any
/// other table only groups keys. Each binary checks its own tables; another binary's are
/// left to it.
fn check_table_names(
    table: &toml::Table,
    binary: &str,
    every: &[String],
    path: &Path,
) -> Result<(), RunFileError> {
    let commands: Vec<&str> = every.iter().map(String::as_str).collect();
    let misnamed = |table: &str, meant: &str, why: &str| {
        RunFileError(format!(
            "{}: table `[{table}]` {why}; did you mean `[{meant}]`? (a table named after a \
             binary or a command applies to it only; any other name groups keys for every \
             command)",
            path.display()
        ))
    };
    for (name, value) in table {
        let toml::Value::Table(inner) = value else {
            continue;
        };
        if name == binary {
            check_command_tables(inner, binary, &commands, &misnamed)?;
            continue;
        }
        if BINARIES.contains(&name.as_str()) || name == RECORD_TABLE {
            continue;
        }
        if let Some(meant) = near(name, &BINARIES) {
            return Err(misnamed(name, meant, "names no binary"));
        }
        if commands.contains(&name.as_str()) {
            return Err(misnamed(
                name,
                &format!("{binary}.{name}"),
                &format!("is a {binary} command outside `[{binary}]`"),
            ));
        }
        if let Some(meant) = near(name, &commands) {
            return Err(misnamed(
                name,
                &format!("{binary}.{meant}"),
                &format!("names no {binary} command"),
            ));
        }
    }
    Ok(())
}

/// [`check_table_names`] inside the table `at` of this binary (`[learner]`,
/// `[learner.train]`, …), at any depth.
fn check_command_tables(
    t: &toml::Table,
    at: &str,
    commands: &[&str],
    misnamed: &impl Fn(&str, &str, &str) -> RunFileError,
) -> Result<(), RunFileError> {
    for (name, value) in t {
        let toml::Value::Table(inner) = value else {
            continue;
        };
        if !commands.contains(&name.as_str())
            && let Some(meant) = near(name, commands)
        {
            let root = at.split('.').next().unwrap_or(at);
            return Err(misnamed(
                &format!("{at}.{name}"),
                &format!("{at}.{meant}"),
                &format!("names no {root} command"),
            ));
        }
        check_command_tables(inner, &format!("{at}.{name}"), commands, misnamed)?;
    }
    Ok(())
}

/// The name of `names` that `name` surely misspells: the same with `-` for `_` or in
/// another case, or (four letters or more) one edit away — a letter left out, added,
/// changed, or two swapped.
fn near<'a>(name: &str, names: &[&'a str]) -> Option<&'a str> {
    let normal = name.replace('_', "-").to_lowercase();
    names.iter().copied().find(|&n| {
        n != name
            && (normal == n
                || normal.chars().count() >= 4 && strsim::damerau_levenshtein(&normal, n) <= 1)
    })
}

/// "unknown key" with the closest known key, if one is close.
fn unknown_key(path: &Path, key: &str, known: &[&str]) -> RunFileError {
    let normal = key.replace('-', "_").to_lowercase();
    let best = known
        .iter()
        .map(|k| (strsim::jaro_winkler(&normal, k), *k))
        .max_by(|a, b| a.0.total_cmp(&b.0));
    let hint = match best {
        Some((score, k)) if score >= 0.8 => format!("; did you mean `{k}`?"),
        _ => String::new(),
    };
    RunFileError(format!(
        "{}: unknown key `{key}`{hint} (keys are long options with underscores)",
        path.display()
    ))
}

/// The reason in a clap value error, without clap's framing.
fn clap_reason(e: &clap::Error) -> String {
    let text = e.to_string();
    let first = text.lines().next().unwrap_or_default();
    let reason = first.trim_start_matches("error: ");
    // "invalid value 'x' for '--value <value>': why" → "why";
    // "invalid value 'x' for '--value <value>'" → "invalid value 'x'".
    match reason.split_once(" for '--value <value>'") {
        Some((_, why)) if why.starts_with(": ") => why[2..].to_owned(),
        Some((what, _)) => what.to_owned(),
        None => reason.to_owned(),
    }
}

/// Whether the run file (not the command line or the environment) gave `flag`
/// (`--run-dir`) in this process's [`parse`].
pub fn set_by_file(flag: &str) -> bool {
    FROM_FILE
        .get()
        .is_some_and(|f| f.flags.iter().any(|(f, _)| f == flag))
}

/// `msg`, with the key and file named when it is about an option the run file set (a
/// range check after parsing names the flag: `--group-size must be ≥ 2`).
pub fn annotate(msg: &str) -> String {
    let Some(from) = FROM_FILE.get() else {
        return msg.to_owned();
    };
    for (flag, key) in &from.flags {
        if let Some(at) = msg.find(flag.as_str()) {
            let next = msg[at + flag.len()..].chars().next();
            if next.is_none_or(|c| !(c.is_alphanumeric() || c == '-')) {
                return format!("{msg} (`{key}` in {})", from.file.display());
            }
        }
    }
    msg.to_owned()
}

/// Every option of the matched command (the deepest subcommand of `m` in `cmd`) with its
/// value after parsing, defaults included, as TOML: the record of a run. Options without a
/// value and those no run file sets (secrets) are left out.
pub fn resolved(cmd: &Command, m: &ArgMatches) -> toml::Table {
    let (mut c, mut m) = (cmd.clone(), m);
    while let Some((name, sub)) = m.subcommand() {
        match c.find_subcommand(name) {
            Some(sc) => {
                c = sc.clone();
                m = sub;
            }
            None => break,
        }
    }
    let mut out = toml::Table::new();
    for arg in c.get_arguments() {
        let id = arg.get_id().as_str();
        let Some(long) = arg.get_long() else { continue };
        if NOT_IN_FILES.contains(&id) || arg.is_hide_set() {
            continue;
        }
        let key = long.replace('-', "_");
        let Ok(Some(raw)) = m.try_get_raw(id) else {
            continue;
        };
        // A default that a given option excludes (`preset` beside `--model`) is not a
        // setting of this run: left out, so that the record runs again as it is (a flag
        // that is off excludes nothing).
        let given =
            |id: &str| !matches!(m.value_source(id), None | Some(ValueSource::DefaultValue));
        let off = Kind::of(arg) == Kind::Bool && raw.clone().all(|v| v == "false");
        if !off && !given(id) && excluded_by(&c, arg).iter().any(|other| given(other)) {
            continue;
        }
        let values: Vec<String> = raw.map(|v| v.to_string_lossy().into_owned()).collect();
        let kind = Kind::of(arg);
        let typed = |s: &str| kind.typed(s);
        let takes_many = takes_many(arg);
        let value = if takes_many {
            toml::Value::Array(values.iter().map(|v| typed(v)).collect())
        } else {
            match values.first() {
                Some(v) => typed(v),
                None => continue,
            }
        };
        out.insert(key, value);
    }
    out
}

/// Every key some command of the three binaries takes (long options with underscores):
/// a key none takes is a typo, one another binary takes is left to it. The list is
/// generated from the binaries' own argument definitions (`run_file/known_keys.txt`,
/// written by `ROOKWORLD_BLESS=1 cargo test -p rookworld-tests --test integration
/// run_file::`, which fails while it is stale): a new option is never listed by hand.
pub fn known_keys() -> Vec<&'static str> {
    KNOWN_KEYS.lines().filter(|k| !k.is_empty()).collect()
}

/// The generated list of [`known_keys`], one a line.
pub const KNOWN_KEYS: &str = include_str!("run_file/known_keys.txt");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_misspelt_binary_or_command_table_is_named_with_the_one_meant() {
        let names = ["train", "bench-push", "eval", "sft"];
        assert_eq!(near("trian", &names), Some("train"));
        assert_eq!(near("tran", &names), Some("train"));
        assert_eq!(near("bench_push", &names), Some("bench-push"));
        assert_eq!(near("Train", &names), Some("train"));
        assert_eq!(near("train", &names), None, "the name itself");
        // Group names stay groups: too short to judge, or more than an edit away.
        for group in ["set", "grpo", "sampling", "trainer", "services", "warm_up"] {
            assert_eq!(near(group, &names), None, "{group}");
        }
        assert_eq!(near("lerner", &BINARIES), Some("learner"));
        assert_eq!(near("rollout_worker", &BINARIES), Some("rollout-worker"));

        let every: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let check = |text: &str| {
            let table: toml::Table = text.parse().unwrap();
            check_table_names(&table, "learner", &every, Path::new("run.toml"))
                .map_err(|e| e.to_string())
        };
        check("[grpo]\nlr = 1\n[learner.train.sampling]\ntop_k = 2\n[rollout-worker]\n").unwrap();
        check("[learner.eval]\n[reward-server.scor]\n").unwrap(); // another binary's: its own
        let err = check("[learner.trian]\nsteps = 3\n").unwrap_err();
        assert_eq!(
            err,
            "run.toml: table `[learner.trian]` names no learner command; did you mean \
             `[learner.train]`? (a table named after a binary or a command applies to it only; \
             any other name groups keys for every command)"
        );
        let err = check("[learner.sft.evall]\n").unwrap_err();
        assert!(err.contains("did you mean `[learner.sft.eval]`?"), "{err}");
        let err = check("[lerner]\nsteps = 3\n").unwrap_err();
        assert!(
            err.contains("table `[lerner]` names no binary; did you mean `[learner]`?"),
            "{err}"
        );
        let err = check("[train]\nsteps = 3\n").unwrap_err();
        assert!(
            err.contains("table `[train]` is a learner command outside `[learner]`; did you mean `[learner.train]`?"),
            "{err}"
        );
        let err = check("[bench_push]\n").unwrap_err();
        assert!(
            err.contains("did you mean `[learner.bench-push]`?"),
            "{err}"
        );
    }

    #[test]
    fn a_negative_number_for_a_count_is_refused_by_its_rule() {
        let cmd = Command::new("b").subcommand(
            Command::new("serve").arg(
                clap::Arg::new("n")
                    .long("n")
                    .action(ArgAction::Set)
                    .value_parser(clap::value_parser!(usize)),
            ),
        );
        let argv: Vec<OsString> = ["b", "serve", "--n", "-2"].map(OsString::from).to_vec();
        let e = parse_from(cmd, &argv, &[]).unwrap_err();
        assert_eq!(e.to_string(), "--n must not be negative (got -2)");
    }
}

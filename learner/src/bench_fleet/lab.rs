//! A network of Linux namespaces on one host, for measuring and breaking weight pushes
//! between real processes: a hub namespace whose bridge joins one link per endpoint (the
//! learner, each worker), every endpoint a namespace of its own, and every link shaped in
//! both directions with `tc` — `netem` (rate, delay, loss) where the kernel has it, else
//! `tbf` for the rate and an nftables ingress rule for the loss (no delay without netem:
//! asking for one is refused, naming why).
//!
//! ```text
//!   [lab-l: eth0 10.77.0.1] ──p0──┐
//!   [lab-w0: eth0 10.77.0.2] ─p1──┤ br0 (lab-hub)
//!   [lab-w1: eth0 10.77.0.3] ─p2──┘
//! ```
//!
//! Addresses exist only inside the namespaces. Names carry this process's id and its
//! count of labs, so no two labs meet; a lab whose process died (SIGKILL) is removed by
//! the next one. Dropping the lab (or [`Cleanup`], from a signal handler) kills what it started and
//! deletes its namespaces.

use std::fs::File;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

/// Every lab's namespaces start with this, then the owning process's id.
const PREFIX: &str = "rwlab";

/// Why a lab could not be made or used: the command that failed and what it said.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error(
        "network namespaces need root (this process runs as uid {0}); run as root, or in a container with CAP_NET_ADMIN and CAP_SYS_ADMIN"
    )]
    NotRoot(u32),
    #[error("`{0}` is not installed (iproute2 gives ip and tc, nftables gives nft)")]
    Missing(&'static str),
    #[error("`{command}` failed: {said}")]
    Command { command: String, said: String },
    #[error(
        "this kernel has no netem qdisc (sch_netem): links are shaped in rate (tbf) and loss (nftables) only, so a delay cannot be set; leave it at 0"
    )]
    NoDelay,
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

/// How one link is shaped, the same in both directions.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Shape {
    /// Bits a second.
    pub rate_bits: u64,
    /// One-way delay added in each direction, milliseconds.
    pub delay_ms: f64,
    /// Share of packets dropped in each direction (0.05: 5%).
    pub loss: f64,
}

/// A rate as `tc` writes one: `1gbit`, `100mbit`, `500kbit`, `2.5gbit`, `8000bit`.
pub fn parse_rate(text: &str) -> Result<u64, String> {
    let t = text.trim().to_ascii_lowercase();
    let (number, unit) = [("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)]
        .into_iter()
        .find_map(|(suffix, unit)| t.strip_suffix(suffix).map(|n| (n.to_owned(), unit)))
        .ok_or_else(|| format!("{text:?}: a rate ends in gbit, mbit, kbit or bit"))?;
    let n: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{text:?}: {number:?} is not a number"))?;
    let bits = n * unit;
    if !(8000.0..=1e12).contains(&bits) {
        return Err(format!("{text:?}: a rate from 8kbit to 1000gbit"));
    }
    Ok(bits as u64)
}

/// What shapes the links.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Shaper {
    /// `tc qdisc … netem rate R delay D loss L` on each end.
    Netem,
    /// `tc qdisc … tbf rate R` on each end, loss as an nftables ingress rule.
    TbfNftables,
}

/// One namespace with one link to the hub.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// The namespace's name (`ip netns exec NAME …`).
    pub netns: String,
    /// Its end of the link (`eth0`) and the hub's (`pN`).
    pub device: &'static str,
    pub hub_port: String,
    pub address: Ipv4Addr,
}

/// What the lab started and made: what cleaning up removes.
#[derive(Debug, Default)]
struct Owned {
    children: Vec<Child>,
    namespaces: Vec<String>,
}

impl Owned {
    fn clean(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.children.clear();
        // The hub last: deleting an endpoint's namespace deletes its veth pair.
        for ns in self.namespaces.drain(..).rev() {
            let _ = Command::new("ip")
                .args(["netns", "del", &ns])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// Removes everything the lab started and made; callable from a signal handler's thread.
#[derive(Debug, Clone)]
pub struct Cleanup(Arc<Mutex<Owned>>);

impl Cleanup {
    pub fn run(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clean();
    }
}

/// A hub and the endpoints linked to it.
#[derive(Debug)]
pub struct Lab {
    name: String,
    hub: String,
    shaper: Shaper,
    endpoints: usize,
    owned: Arc<Mutex<Owned>>,
}

impl Lab {
    /// Whether this process can make a lab: root, with `ip` and `tc`.
    pub fn check() -> Result<(), LabError> {
        let uid = nix::unistd::geteuid().as_raw();
        if uid != 0 {
            return Err(LabError::NotRoot(uid));
        }
        for tool in ["ip", "tc"] {
            if !on_path(tool) {
                return Err(LabError::Missing(tool));
            }
        }
        Ok(())
    }

    /// A new lab (its hub namespace and bridge), after removing labs whose process died.
    pub fn new() -> Result<Lab, LabError> {
        Self::check()?;
        remove_orphans();
        // Process id, then this process's count of labs (tests make several at once).
        static LABS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = LABS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("{PREFIX}{}x{n}", std::process::id());
        let hub = format!("{name}-hub");
        let mut lab = Lab {
            name,
            hub: hub.clone(),
            shaper: Shaper::Netem,
            endpoints: 0,
            owned: Arc::new(Mutex::new(Owned::default())),
        };
        run("ip", &["netns", "add", &hub])?;
        lab.own_namespace(hub.clone());
        run("ip", &["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        run("ip", &["-n", &hub, "link", "set", "br0", "up"])?;
        // netem where the kernel has it: tried on the bridge, then taken off.
        let netem = run(
            "tc",
            &["-n", &hub, "qdisc", "add", "dev", "br0", "root", "netem"],
        )
        .is_ok();
        lab.shaper = if netem {
            run("tc", &["-n", &hub, "qdisc", "del", "dev", "br0", "root"])?;
            Shaper::Netem
        } else {
            Shaper::TbfNftables
        };
        Ok(lab)
    }

    /// What shapes this lab's links.
    pub fn shaper(&self) -> Shaper {
        self.shaper
    }

    /// Cleans up from elsewhere (a signal handler).
    pub fn cleanup(&self) -> Cleanup {
        Cleanup(self.owned.clone())
    }

    fn own_namespace(&self, ns: String) {
        self.owned.lock().expect("lab lock").namespaces.push(ns);
    }

    /// A namespace `<lab>-<name>` linked to the hub through a link shaped as `shape`.
    pub fn endpoint(&mut self, name: &str, shape: &Shape) -> Result<Endpoint, LabError> {
        if shape.delay_ms > 0.0 && self.shaper != Shaper::Netem {
            return Err(LabError::NoDelay);
        }
        let n = self.endpoints;
        self.endpoints += 1;
        let netns = format!("{}-{name}", self.name);
        let hub_port = format!("p{n}");
        let host = n + 1;
        let address = Ipv4Addr::new(10, 77, (host / 250) as u8, (host % 250 + 1) as u8);
        run("ip", &["netns", "add", &netns])?;
        self.own_namespace(netns.clone());
        let hub = self.hub.as_str();
        run(
            "ip",
            &[
                "-n", hub, "link", "add", &hub_port, "type", "veth", "peer", "name", "eth0",
                "netns", &netns,
            ],
        )?;
        run(
            "ip",
            &["-n", hub, "link", "set", &hub_port, "master", "br0"],
        )?;
        run("ip", &["-n", hub, "link", "set", &hub_port, "up"])?;
        let cidr = format!("{address}/16");
        run("ip", &["-n", &netns, "addr", "add", &cidr, "dev", "eth0"])?;
        run("ip", &["-n", &netns, "link", "set", "eth0", "up"])?;
        run("ip", &["-n", &netns, "link", "set", "lo", "up"])?;
        for (ns, dev) in [(netns.as_str(), "eth0"), (hub, hub_port.as_str())] {
            self.shape(ns, dev, shape)?;
        }
        Ok(Endpoint {
            netns,
            device: "eth0",
            hub_port,
            address,
        })
    }

    /// Shapes what leaves `dev` in `ns` (and, without netem, drops what enters it).
    fn shape(&self, ns: &str, dev: &str, s: &Shape) -> Result<(), LabError> {
        let rate = format!("{}bit", s.rate_bits);
        match self.shaper {
            Shaper::Netem => {
                let delay = format!("{}ms", s.delay_ms);
                let loss = format!("{}%", s.loss * 100.0);
                // A queue of 100 ms at the link's rate, in 1,500-byte packets.
                let limit = (s.rate_bits / 8 / 10 / 1500).max(1000).to_string();
                run(
                    "tc",
                    &[
                        "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "rate", &rate,
                        "delay", &delay, "loss", &loss, "limit", &limit,
                    ],
                )
            }
            Shaper::TbfNftables => {
                // A burst of 1 ms at the rate (at least 64 KiB: one segment of a veth's
                // offloaded sends) and a queue of 20 ms.
                let burst = (s.rate_bits / 8 / 1000).max(64 << 10).to_string();
                run(
                    "tc",
                    &[
                        "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", &rate,
                        "burst", &burst, "latency", "20ms",
                    ],
                )?;
                if s.loss > 0.0 {
                    drop_share(ns, dev, s.loss)?;
                }
                Ok(())
            }
        }
    }

    /// Starts `program args…` inside `at`'s namespace, its output appended to `log`;
    /// returns its process id. The lab kills it when cleaned up.
    pub fn spawn(
        &self,
        at: &Endpoint,
        program: &Path,
        args: &[String],
        envs: &[(&str, &str)],
        log: &Path,
    ) -> Result<u32, LabError> {
        let io = |e| LabError::Io {
            what: format!("{}", log.display()),
            source: e,
        };
        let out = File::create(log).map_err(io)?;
        let err = out.try_clone().map_err(io)?;
        let child = Command::new("ip")
            .args(["netns", "exec", &at.netns])
            .arg(program)
            .args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| LabError::Io {
                what: format!("starting {} in {}", program.display(), at.netns),
                source: e,
            })?;
        let pid = child.id();
        self.owned.lock().expect("lab lock").children.push(child);
        Ok(pid)
    }

    /// Kills a process [`Lab::spawn`] started (SIGKILL: no goodbye) and reaps it.
    pub fn kill(&self, pid: u32) {
        let mut owned = self.owned.lock().expect("lab lock");
        if let Some(i) = owned.children.iter().position(|c| c.id() == pid) {
            let mut child = owned.children.swap_remove(i);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether a process [`Lab::spawn`] started has exited.
    pub fn exited(&self, pid: u32) -> bool {
        let mut owned = self.owned.lock().expect("lab lock");
        owned
            .children
            .iter_mut()
            .find(|c| c.id() == pid)
            .is_none_or(|c| !matches!(c.try_wait(), Ok(None)))
    }

    /// The peak resident memory of a process [`Lab::spawn`] started (`VmHWM`), if it runs.
    pub fn peak_rss_bytes(pid: u32) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    /// Bytes `at` has sent on its link since it was made (Ethernet frames, every header).
    pub fn sent_bytes(&self, at: &Endpoint) -> Result<u64, LabError> {
        let command = format!("ip -n {} -j -s link show dev {}", at.netns, at.device);
        let out = output(
            "ip",
            &[
                "-n", &at.netns, "-j", "-s", "link", "show", "dev", at.device,
            ],
        )?;
        let json: serde_json::Value =
            serde_json::from_slice(&out).map_err(|e| LabError::Command {
                command: command.clone(),
                said: format!("not the JSON expected: {e}"),
            })?;
        json[0]["stats64"]["tx"]["bytes"]
            .as_u64()
            .ok_or(LabError::Command {
                command,
                said: "no stats64.tx.bytes".into(),
            })
    }

    /// Moves the calling thread into `at`'s namespace: sockets it (and the threads it
    /// starts from now on, such as a runtime's) opens are `at`'s.
    pub fn enter(at: &Endpoint) -> Result<(), LabError> {
        let path = PathBuf::from("/run/netns").join(&at.netns);
        let io = |e| LabError::Io {
            what: format!("entering {}", path.display()),
            source: e,
        };
        let file = File::open(&path).map_err(io)?;
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| io(std::io::Error::from(e)))
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.cleanup().run();
    }
}

/// Drops `loss` of the packets entering `dev` in `ns` (an nftables netdev ingress rule).
fn drop_share(ns: &str, dev: &str, loss: f64) -> Result<(), LabError> {
    if !on_path("nft") {
        return Err(LabError::Missing("nft"));
    }
    let per_million = (loss * 1e6).round() as u64;
    let rules = format!(
        "table netdev lab {{\n chain loss {{\n  type filter hook ingress device \"{dev}\" priority 0; policy accept;\n  numgen random mod 1000000 < {per_million} drop\n }}\n}}\n"
    );
    feed(
        "ip",
        &["netns", "exec", ns, "nft", "-f", "-"],
        rules.as_bytes(),
    )
    .map(drop)
}

/// Deletes the namespaces of labs whose process no longer runs.
fn remove_orphans() {
    let Ok(out) = output("ip", &["netns", "list"]) else {
        return;
    };
    for line in String::from_utf8_lossy(&out).lines() {
        let ns = line.split_whitespace().next().unwrap_or("");
        let Some(pid) = ns
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split(['x', '-']).next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            tracing::info!(
                netns = ns,
                pid,
                "removing a lab namespace whose process is gone"
            );
            let _ = run("ip", &["netns", "del", ns]);
        }
    }
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(tool).is_file()))
}

/// Runs `program args…`; its standard output, or an error naming the command and the
/// first line it wrote to stderr.
fn output(program: &str, args: &[&str]) -> Result<Vec<u8>, LabError> {
    feed(program, args, &[])
}

/// Runs `program` with `args`, `input` on its standard input; its standard output, or the
/// command and the first line it said when it failed.
fn feed(program: &str, args: &[&str], input: &[u8]) -> Result<Vec<u8>, LabError> {
    use std::io::Write;
    let command = format!("{program} {}", args.join(" "));
    let io = |source| LabError::Io {
        what: command.clone(),
        source,
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io)?;
    let written = child.stdin.take().expect("piped stdin").write_all(input);
    let out = child.wait_with_output().map_err(io)?;
    if !out.status.success() || written.is_err() {
        return Err(LabError::Command {
            command,
            said: first_line(&out.stderr),
        });
    }
    Ok(out.stdout)
}

fn run(program: &str, args: &[&str]) -> Result<(), LabError> {
    output(program, args).map(drop)
}

fn first_line(text: &[u8]) -> String {
    let text = String::from_utf8_lossy(text);
    let line = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    if line.is_empty() {
        "no message".into()
    } else {
        line.trim().to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::parse_rate;

    #[test]
    fn rates_are_read_as_tc_writes_them() {
        assert_eq!(parse_rate("1gbit"), Ok(1_000_000_000));
        assert_eq!(parse_rate("2.5Gbit"), Ok(2_500_000_000));
        assert_eq!(parse_rate("100mbit"), Ok(100_000_000));
        assert_eq!(parse_rate("500kbit"), Ok(500_000));
        for bad in ["1gb", "fast", "0mbit", "-1gbit", "gbit"] {
            assert!(parse_rate(bad).is_err(), "{bad}");
        }
    }
}

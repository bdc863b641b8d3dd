//! A TCP proxy on loopback that plays the network between two services: it passes bytes,
//! holds them (a partition: nothing moves either way, connections stay open, as when
//! packets are dropped, and everything flows again when it heals), cuts connections once
//! they have carried some bytes from the client (transfers interrupted halfway), or from
//! then on drops the client's bytes (a transfer stuck halfway until a side goes away).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Pass,
    /// Nothing moves; connections stay open.
    Partition,
    /// Every connection is cut once its client has sent this many bytes.
    CutAfter(u64),
    /// Every new connection passes this many of its client's bytes and drops the rest
    /// (read, never delivered) until one side closes it.
    HoldAfter(u64),
}

/// What a connection does once its client has sent a number of bytes.
#[derive(Debug, Clone, Copy)]
enum Limit {
    Cut(u64),
    Hold(u64),
}

/// A running proxy; it stops when dropped.
pub struct Proxy {
    pub addr: SocketAddr,
    mode: watch::Sender<Mode>,
    cuts: Arc<AtomicU64>,
    holds: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// A proxy on 127.0.0.1 to `target`, passing traffic.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (mode, modes) = watch::channel(Mode::Pass);
        let cuts = Arc::new(AtomicU64::new(0));
        let holds = Arc::new(AtomicU64::new(0));
        let counts = Counts {
            cuts: cuts.clone(),
            holds: holds.clone(),
        };
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let limit = match *modes.borrow() {
                    Mode::CutAfter(n) => Some(Limit::Cut(n)),
                    Mode::HoldAfter(n) => Some(Limit::Hold(n)),
                    _ => None,
                };
                let (modes, counts) = (modes.clone(), counts.clone());
                tokio::spawn(async move {
                    // A partitioned network answers no new connection either.
                    wait_open(&modes).await;
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    relay(client, server, modes, limit, counts).await;
                });
            }
        });
        Self {
            addr,
            mode,
            cuts,
            holds,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// Connections cut so far.
    pub fn cuts(&self) -> u64 {
        self.cuts.load(Ordering::SeqCst)
    }

    /// Connections that reached their [`Mode::HoldAfter`] limit so far.
    pub fn holds(&self) -> u64 {
        self.holds.load(Ordering::SeqCst)
    }
}

/// The proxy's tallies, shared with its connections.
#[derive(Clone)]
struct Counts {
    cuts: Arc<AtomicU64>,
    holds: Arc<AtomicU64>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies both ways until either side closes; holds while partitioned; cuts after, or
/// drops what follows, the `limit`'s client bytes.
async fn relay(
    client: TcpStream,
    server: TcpStream,
    modes: watch::Receiver<Mode>,
    limit: Option<Limit>,
    counts: Counts,
) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let sent = Arc::new(AtomicU64::new(0));
    let upstream = {
        let (modes, sent) = (modes.clone(), sent.clone());
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                wait_open(&modes).await;
                let n = match client_read.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                let before = sent.fetch_add(n as u64, Ordering::SeqCst);
                let total = before + n as u64;
                let mut pass = n;
                match limit {
                    Some(Limit::Cut(limit)) if total >= limit => {
                        // Counted before the sockets close, so a caller that sees its call
                        // fail also sees the cut.
                        counts.cuts.fetch_add(1, Ordering::SeqCst);
                        return; // cut: both directions end, the sockets close
                    }
                    Some(Limit::Hold(limit)) if total >= limit => {
                        if before < limit {
                            counts.holds.fetch_add(1, Ordering::SeqCst);
                        }
                        pass = usize::try_from(limit.saturating_sub(before)).unwrap_or(n);
                    }
                    _ => {}
                }
                wait_open(&modes).await;
                if server_write.write_all(&buf[..pass]).await.is_err() {
                    return;
                }
            }
        }
    };
    let downstream = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            wait_open(&modes).await;
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            wait_open(&modes).await;
            if client_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        () = upstream => {}
        () = downstream => {}
    }
}

/// Returns once the proxy is not partitioned.
async fn wait_open(modes: &watch::Receiver<Mode>) {
    let mut modes = modes.clone();
    let _ = modes.wait_for(|m| *m != Mode::Partition).await;
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use candle_core::{DType, Device};
    use rollout_worker::{ServiceConfig, Worker, WorkerConfig};
    use rookworld_lm::Config;
    use rookworld_lm::model_io::init_random;
    use rookworld_weights::set::WeightSet;

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pushes_pass_through_and_are_cut_when_asked() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = listener.local_addr().unwrap();
        let model = init_random(&Config::tiny(), 1, DType::F32, &Device::Cpu).unwrap();
        let config = WorkerConfig {
            service: ServiceConfig {
                guard: rookworld_service::auth::Guard::shared("t"),
                ..ServiceConfig::default()
            },
            ..WorkerConfig::new(model)
        };
        let _worker = Worker::start(config, listener, std::future::pending())
            .await
            .unwrap();
        let proxy = Proxy::start(target).await;
        let model = init_random(&Config::tiny(), 2, DType::F32, &Device::Cpu).unwrap();
        let push = |v: u64| {
            let set = WeightSet::from_model(&model, "proxy-test", v).unwrap();
            learner::push::push_to(proxy.url(), set, "t".into(), Duration::from_secs(5), true)
        };
        for v in 1..=3 {
            let o = push(v).await;
            assert_eq!(o.error, None, "push {v}: {o:?}");
        }
        proxy.set(Mode::CutAfter(1 << 20));
        let o = push(4).await;
        assert!(o.error.is_some(), "{o:?}");
        assert_eq!(proxy.cuts(), 1);
        proxy.set(Mode::Pass);
        assert_eq!(push(4).await.error, None);
        // Held: the push gets 1 MiB through, then nothing until its deadline ends it.
        proxy.set(Mode::HoldAfter(1 << 20));
        let set = WeightSet::from_model(&model, "proxy-test", 5).unwrap();
        let o = learner::push::push_to(proxy.url(), set, "t".into(), Duration::from_secs(1), true)
            .await;
        assert!(o.error.is_some(), "{o:?}");
        assert_eq!((proxy.holds(), proxy.cuts()), (1, 1));
        proxy.set(Mode::Pass);
        assert_eq!(push(5).await.error, None);
    }
}

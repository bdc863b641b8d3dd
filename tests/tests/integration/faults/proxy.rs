//! A TCP proxy on loopback that plays the network between two services: it passes bytes,
//! holds them (a partition: nothing moves either way, connections stay open, as when
//! packets are dropped, and everything flows again when it heals), or cuts connections
//! once they have carried some bytes from the client (transfers interrupted halfway).

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
}

/// A running proxy; it stops when dropped.
pub struct Proxy {
    pub addr: SocketAddr,
    mode: watch::Sender<Mode>,
    cuts: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// A proxy on 127.0.0.1 to `target`, passing traffic.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (mode, modes) = watch::channel(Mode::Pass);
        let cuts = Arc::new(AtomicU64::new(0));
        let cut_count = cuts.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let cut_after = match *modes.borrow() {
                    Mode::CutAfter(n) => Some(n),
                    _ => None,
                };
                let (modes, cuts) = (modes.clone(), cut_count.clone());
                tokio::spawn(async move {
                    // A partitioned network answers no new connection either.
                    wait_open(&modes).await;
                    let Ok(server) = TcpStream::connect(target).await else {
                        return;
                    };
                    relay(client, server, modes, cut_after, cuts).await;
                });
            }
        });
        Self {
            addr,
            mode,
            cuts,
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
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies both ways until either side closes; holds while partitioned; cuts after
/// `cut_after` client bytes.
async fn relay(
    client: TcpStream,
    server: TcpStream,
    modes: watch::Receiver<Mode>,
    cut_after: Option<u64>,
    cuts: Arc<AtomicU64>,
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
                let total = sent.fetch_add(n as u64, Ordering::SeqCst) + n as u64;
                if cut_after.is_some_and(|limit| total >= limit) {
                    // Counted before the sockets close, so a caller that sees its call
                    // fail also sees the cut.
                    cuts.fetch_add(1, Ordering::SeqCst);
                    return; // cut: both directions end, the sockets close
                }
                wait_open(&modes).await;
                if server_write.write_all(&buf[..n]).await.is_err() {
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
    }
}

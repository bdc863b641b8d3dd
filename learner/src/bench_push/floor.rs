//! The floor a weight push is measured against: moving the same bytes by one `memcpy` and
//! by one raw loopback TCP transfer.

use std::time::Instant;

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Seconds and GB/s of each way of moving the payload.
#[derive(Debug, Serialize)]
pub(super) struct Floor {
    memcpy_seconds: f64,
    memcpy_gb_per_second: f64,
    tcp_seconds: f64,
    tcp_gb_per_second: f64,
}

/// The floor for moving `bytes`: one `memcpy` into memory already touched, and one raw
/// loopback TCP transfer (TCP_NODELAY, 1 MiB reads) into a reused buffer.
pub(super) async fn floor(bytes: &[u8]) -> std::io::Result<Floor> {
    let mut dst = vec![1u8; bytes.len()];
    let t = Instant::now();
    dst.copy_from_slice(bytes);
    let memcpy_seconds = t.elapsed().as_secs_f64();
    std::hint::black_box(&dst);
    drop(dst);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let reader = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        let mut buf = vec![0u8; 1 << 20];
        let mut n = 0usize;
        loop {
            match s.read(&mut buf).await? {
                0 => return Ok::<usize, std::io::Error>(n),
                k => n += k,
            }
        }
    });
    let t = Instant::now();
    let mut w = tokio::net::TcpStream::connect(addr).await?;
    w.set_nodelay(true)?;
    w.write_all(bytes).await?;
    w.shutdown().await?;
    let got = reader.await.map_err(std::io::Error::other)??;
    let tcp_seconds = t.elapsed().as_secs_f64();
    if got != bytes.len() {
        return Err(std::io::Error::other(format!(
            "the floor's reader got {got} of {} bytes",
            bytes.len()
        )));
    }
    let gbps = |s: f64| bytes.len() as f64 / s / 1e9;
    Ok(Floor {
        memcpy_seconds,
        memcpy_gb_per_second: gbps(memcpy_seconds),
        tcp_seconds,
        tcp_gb_per_second: gbps(tcp_seconds),
    })
}

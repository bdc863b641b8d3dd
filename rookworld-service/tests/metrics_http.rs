//! The metrics endpoint every service serves is read-only and cannot be held: GET/HEAD on
//! `/metrics` and `/health` only (405 for any other method, 404 elsewhere, bodies never
//! read), an idle connection is closed, and connections past the bound are refused.
//! (Own test binary: the recorder is process-global.)

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusBuilder;
use rookworld_service::metrics_http::{self, MAX_CONNECTIONS};

/// Sends `request` on a new connection and returns the whole answer.
fn http(addr: SocketAddr, request: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

fn status_line(answer: &str) -> &str {
    answer.lines().next().unwrap_or("")
}

/// Whether the server closed `s` (end of stream, or a reset) within `within`.
fn closed(s: &mut TcpStream, within: Duration) -> bool {
    use std::io::ErrorKind::{TimedOut, WouldBlock};
    s.set_read_timeout(Some(within)).unwrap();
    match s.read(&mut [0u8; 64]) {
        Ok(n) => n == 0,
        Err(e) => !matches!(e.kind(), WouldBlock | TimedOut),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_port_is_read_only_and_bounded() {
    let addr =
        metrics_http::install(PrometheusBuilder::new(), "127.0.0.1:0".parse().unwrap()).unwrap();
    metrics::counter!("probe_total").increment(3);

    tokio::task::spawn_blocking(move || {
        let get = http(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert!(status_line(&get).contains(" 200 "), "{get}");
        assert!(get.contains("probe_total 3"), "{get}");
        let head = http(addr, "HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert!(status_line(&head).contains(" 200 "), "{head}");
        assert!(!head.contains("probe_total"), "HEAD has no body: {head}");
        let health = http(addr, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert!(health.ends_with("OK\n"), "{health}");

        // Writes: refused, and nothing changes.
        for method in ["POST", "PUT", "DELETE", "PATCH"] {
            for path in ["/metrics", "/health"] {
                let body = "probe_total 999\n";
                let answer = http(
                    addr,
                    &format!(
                        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    ),
                );
                assert!(status_line(&answer).contains(" 405 "), "{method} {path}: {answer}");
                assert!(answer.contains("allow: GET, HEAD"), "{answer}");
            }
        }
        for path in ["/", "/metrics/../admin", "/api/v1/write", "/debug/pprof"] {
            let answer = http(addr, &format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
            assert!(status_line(&answer).contains(" 404 "), "{path}: {answer}");
        }
        let again = http(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert!(again.contains("probe_total 3") && !again.contains("999"), "{again}");

        // A client that connects and sends nothing is closed after the head timeout.
        let mut idle = TcpStream::connect(addr).unwrap();
        assert!(
            closed(&mut idle, metrics_http::HEAD_TIMEOUT + Duration::from_secs(10)),
            "an idle connection stayed open"
        );

        // Past the bound, connections are closed at once; once the idle ones are gone,
        // scrapes work again.
        let mut held: Vec<TcpStream> = (0..MAX_CONNECTIONS)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let mut extra = TcpStream::connect(addr).unwrap();
        assert!(
            closed(&mut extra, Duration::from_secs(2)),
            "a connection past the bound was kept"
        );
        for s in &mut held {
            assert!(closed(s, metrics_http::HEAD_TIMEOUT + Duration::from_secs(10)));
        }
        let after = http(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert!(after.contains("probe_total 3"), "{after}");
    })
    .await
    .unwrap();
}

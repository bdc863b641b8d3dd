//! Client-side probes of a running RookWorld service: what reflection lists, and a
//! scrape of its Prometheus endpoint. Used by the tests and by tools that check a
//! deployment.

use std::io::{Read, Write};
use std::net::SocketAddr;

use tokio_stream::StreamExt;
use tonic::transport::Channel;

/// Asks one reflection version for its service list.
macro_rules! list_with {
    ($version:ident, $channel:expr) => {{
        use tonic_reflection::pb::$version::ServerReflectionRequest;
        use tonic_reflection::pb::$version::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::$version::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::$version::server_reflection_response::MessageResponse;
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut client = ServerReflectionClient::new($channel);
        let mut stream = client
            .server_reflection_info(tokio_stream::iter([request]))
            .await?
            .into_inner();
        match stream
            .next()
            .await
            .transpose()?
            .and_then(|r| r.message_response)
        {
            Some(MessageResponse::ListServicesResponse(list)) => {
                Ok(list.service.into_iter().map(|s| s.name).collect())
            }
            other => Err(tonic::Status::internal(format!(
                "unexpected reflection answer {other:?}"
            ))),
        }
    }};
}

/// The services that server reflection lists, through the v1 or the v1alpha protocol.
pub async fn list_services(channel: Channel, v1alpha: bool) -> Result<Vec<String>, tonic::Status> {
    if v1alpha {
        list_with!(v1alpha, channel)
    } else {
        list_with!(v1, channel)
    }
}

/// The body of `GET /metrics` on `addr` (blocking); an error unless the answer is 200.
pub fn scrape_metrics(addr: SocketAddr) -> std::io::Result<String> {
    let mut stream = std::net::TcpStream::connect(addr)?;
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    if !response.starts_with("HTTP/1.1 200") {
        let status = response.lines().next().unwrap_or("no answer").to_owned();
        return Err(std::io::Error::other(format!(
            "GET /metrics on {addr}: {status}"
        )));
    }
    Ok(response)
}

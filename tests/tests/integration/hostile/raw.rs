//! gRPC calls whose messages are raw bytes, and protobuf pieces written by hand: what a
//! hostile client sends, past every check of a generated client.

use rookworld_service::probe::RawCodec as Raw;
use tokio_stream::StreamExt;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;

fn grpc(channel: &Channel) -> tonic::client::Grpc<Channel> {
    tonic::client::Grpc::new(channel.clone())
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20)
}

fn request<T>(body: T, token: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(body);
    rookworld_service::auth::set_token(r.metadata_mut(), token).unwrap();
    r
}

/// The kind of call a method is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Unary,
    ServerStreaming,
    ClientStreaming,
}

/// One call of `path` with `messages` (one unless client-streaming), carrying `token`:
/// the answers (a server stream is read for at most a few messages, then dropped).
pub async fn call(
    channel: &Channel,
    path: &'static str,
    kind: Kind,
    messages: Vec<Vec<u8>>,
    token: &str,
) -> Result<Vec<Vec<u8>>, tonic::Status> {
    let mut g = grpc(channel);
    g.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let path = PathAndQuery::from_static(path);
    match kind {
        Kind::Unary => {
            let body = messages.into_iter().next().unwrap_or_default();
            let answer = g.unary(request(body, token), path, Raw).await?;
            Ok(vec![answer.into_inner()])
        }
        Kind::ServerStreaming => {
            let body = messages.into_iter().next().unwrap_or_default();
            let mut stream = g
                .server_streaming(request(body, token), path, Raw)
                .await?
                .into_inner();
            let mut out = vec![];
            while out.len() < 4 {
                match tokio::time::timeout(std::time::Duration::from_secs(20), stream.next()).await
                {
                    Ok(Some(item)) => out.push(item?),
                    Ok(None) | Err(_) => break,
                }
            }
            Ok(out)
        }
        Kind::ClientStreaming => {
            let stream = tokio_stream::iter(messages);
            let answer = g
                .client_streaming(request(stream, token), path, Raw)
                .await?;
            Ok(vec![answer.into_inner()])
        }
    }
}

/// A field key.
pub fn key(field: u32, wire: u32) -> Vec<u8> {
    varint(u64::from(field << 3 | wire))
}

pub fn varint(v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    prost::encoding::encode_varint(v, &mut out);
    out
}

/// A length-delimited field.
pub fn len_field(field: u32, bytes: &[u8]) -> Vec<u8> {
    [key(field, 2), varint(bytes.len() as u64), bytes.to_vec()].concat()
}

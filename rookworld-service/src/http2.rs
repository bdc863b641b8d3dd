//! The HTTP/2 settings every server and client here shares (flow-control windows, frame
//! size), and a client endpoint with them: [`crate::serve`] serves with these settings,
//! [`crate::tls`] builds its clients' endpoints from [`endpoint`].

/// HTTP/2 flow-control window of one stream, on servers and clients: room for several
/// chunks of a weight push in flight (with the 64 KiB default a 249 MB push waits on
/// window updates; `learner bench-push` measures the transfer, see the README).
pub const STREAM_WINDOW_BYTES: u32 = 8 << 20;
/// HTTP/2 flow-control window of one connection (several streams at once).
pub const CONNECTION_WINDOW_BYTES: u32 = 16 << 20;
/// Largest HTTP/2 frame a peer may send (the default is 16 KiB): a weight push's
/// megabyte chunks cross in a few frames instead of 64 each.
pub const MAX_FRAME_BYTES: u32 = 1 << 20;

/// A client endpoint for `url` with the windows of [`STREAM_WINDOW_BYTES`] and
/// [`CONNECTION_WINDOW_BYTES`], frames up to [`MAX_FRAME_BYTES`] and TCP_NODELAY, as every
/// server here has.
pub fn endpoint(url: &str) -> Result<tonic::transport::Endpoint, tonic::transport::Error> {
    Ok(tonic::transport::Endpoint::from_shared(url.to_owned())?
        .initial_stream_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
        .max_frame_size(MAX_FRAME_BYTES)
        .tcp_nodelay(true))
}

//! gRPC statuses whose message is bounded: an error that quotes a request (a bad FEN, a
//! prompt) stays one readable line and fits the `grpc-message` header it travels in,
//! whatever the client sent.

/// Longest status message, in bytes (longer ones are cut at a character boundary).
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// `message`, cut to [`MAX_MESSAGE_BYTES`] with a mark of how much went.
pub fn bounded(message: String) -> String {
    if message.len() <= MAX_MESSAGE_BYTES {
        return message;
    }
    let mut end = MAX_MESSAGE_BYTES;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes more)", &message[..end], message.len() - end)
}

/// A status with `code` and the bounded `message`.
pub fn status(code: tonic::Code, message: String) -> tonic::Status {
    tonic::Status::new(code, bounded(message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_messages_are_cut_at_a_character_boundary() {
        assert_eq!(bounded("short".into()), "short");
        let long = "é".repeat(1000); // 2000 bytes
        let cut = bounded(long);
        assert!(cut.len() < MAX_MESSAGE_BYTES + 40, "{}", cut.len());
        assert!(cut.ends_with("… (976 bytes more)"), "{cut}");
    }
}

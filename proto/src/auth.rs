//! The shared token that guards control and worker calls: `authorization: Bearer <token>`
//! in the request metadata, checked in constant time.

use tonic::Status;
use tonic::metadata::MetadataMap;

/// Why a call was not authorized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// The server has no token configured, so it accepts no guarded call.
    #[error("no token is configured here, so guarded calls are refused")]
    NotConfigured,
    #[error("missing `authorization: Bearer <token>`")]
    Missing,
    #[error("wrong token")]
    Wrong,
}

impl From<TokenError> for Status {
    /// A missing token is UNAUTHENTICATED; a wrong one (or none configured) PERMISSION_DENIED.
    fn from(e: TokenError) -> Self {
        match e {
            TokenError::Missing => Status::unauthenticated(e.to_string()),
            TokenError::NotConfigured | TokenError::Wrong => {
                Status::permission_denied(e.to_string())
            }
        }
    }
}

/// Checks that `metadata` carries `Bearer <configured>`.
pub fn check_token(metadata: &MetadataMap, configured: Option<&str>) -> Result<(), TokenError> {
    let configured = configured.ok_or(TokenError::NotConfigured)?;
    let given = metadata
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or(TokenError::Missing)?;
    let same = given.len() == configured.len()
        && given
            .bytes()
            .zip(configured.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0;
    if same { Ok(()) } else { Err(TokenError::Wrong) }
}

/// Adds `authorization: Bearer <token>` to outgoing metadata; an error when the token
/// cannot be sent in a header.
pub fn set_token(metadata: &mut MetadataMap, token: &str) -> Result<(), Status> {
    let value = format!("Bearer {token}")
        .parse()
        .map_err(|_| Status::invalid_argument("the token is not valid in a header"))?;
    metadata.insert("authorization", value);
    Ok(())
}

/// The shared-token options every service takes (flattened into its command line).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TokenArgs {
    /// Shared token of worker and control calls.
    #[arg(
        long,
        env = "ROOKWORLD_TOKEN",
        hide_env_values = true,
        conflicts_with = "token_file"
    )]
    pub token: Option<String>,
    /// File holding the shared token (e.g. a Docker or Kubernetes secret).
    #[arg(long, env = "ROOKWORLD_TOKEN_FILE")]
    pub token_file: Option<std::path::PathBuf>,
}

impl TokenArgs {
    /// The configured token, if any (see [`resolve_token`]).
    pub fn resolve(&self) -> Result<Option<String>, String> {
        resolve_token(self.token.as_deref(), self.token_file.as_deref())
    }
}

/// The configured token from `--token` or `--token-file` (surrounding whitespace trimmed);
/// `None` when neither is given. An empty token or an unreadable file is an error, as one
/// line naming the option.
pub fn resolve_token(
    token: Option<&str>,
    file: Option<&std::path::Path>,
) -> Result<Option<String>, String> {
    match (token, file) {
        (Some(t), _) if t.trim().is_empty() => Err("--token is empty".into()),
        (Some(t), _) => Ok(Some(t.trim().to_owned())),
        (None, Some(path)) => {
            let t = std::fs::read_to_string(path)
                .map_err(|e| format!("--token-file {}: {e}", path.display()))?;
            match t.trim() {
                "" => Err(format!("--token-file {} is empty", path.display())),
                t => Ok(Some(t.to_owned())),
            }
        }
        (None, None) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked() {
        let mut m = MetadataMap::new();
        assert_eq!(check_token(&m, Some("t")), Err(TokenError::Missing));
        assert_eq!(check_token(&m, None), Err(TokenError::NotConfigured));
        set_token(&mut m, "t").unwrap();
        assert_eq!(check_token(&m, Some("t")), Ok(()));
        assert_eq!(check_token(&m, Some("u")), Err(TokenError::Wrong));
        assert_eq!(check_token(&m, Some("tt")), Err(TokenError::Wrong));
        assert!(set_token(&mut m, "bad\nvalue").is_err());
    }
}

//! The shared token that guards every call that spends compute or changes state
//! (`Generate`, `UpdateWeights`, `Lease`, `Submit`, `Score`): `authorization: Bearer
//! <token>` in the request metadata, checked in constant time. Inspection calls (`Status`,
//! `Info`, the queue's depths, workers, staleness and peeks) are open unless an inspection
//! token is set ([`Guard`]). A token is never logged.

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

/// What a server asks of its callers: the shared token for work and control calls (none
/// configured refuses them all); for inspection calls nothing, unless an inspection token is
/// configured, then it or the shared token.
#[derive(Clone, Default)]
pub struct Guard {
    token: Option<String>,
    inspect: Option<String>,
}

impl std::fmt::Debug for Guard {
    /// Says which tokens are set, never what they are.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("inspect", &self.inspect.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl Guard {
    pub fn new(token: Option<String>, inspect: Option<String>) -> Self {
        Self { token, inspect }
    }

    /// A guard of the shared `token` alone (inspection open).
    pub fn shared(token: impl Into<String>) -> Self {
        Self::new(Some(token.into()), None)
    }

    /// The shared token, if any.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// A call that spends compute or changes state.
    pub fn work(&self, metadata: &MetadataMap) -> Result<(), TokenError> {
        check_token(metadata, self.token.as_deref())
    }

    /// A read-only inspection call.
    pub fn inspect(&self, metadata: &MetadataMap) -> Result<(), TokenError> {
        let Some(inspect) = self.inspect.as_deref() else {
            return Ok(());
        };
        match check_token(metadata, Some(inspect)) {
            Err(TokenError::Wrong) if self.work(metadata).is_ok() => Ok(()),
            other => other,
        }
    }
}

/// A client interceptor that adds `authorization: Bearer <token>` to every call
/// (`XClient::with_interceptor(channel, Bearer::new(token)?)`).
#[derive(Clone)]
pub struct Bearer(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl Bearer {
    /// An error when the token cannot be sent in a header.
    pub fn new(token: &str) -> Result<Self, Status> {
        format!("Bearer {token}")
            .parse()
            .map(Self)
            .map_err(|_| Status::invalid_argument("the token is not valid in a header"))
    }
}

impl std::fmt::Debug for Bearer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Bearer(<token>)")
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        request
            .metadata_mut()
            .insert("authorization", self.0.clone());
        Ok(request)
    }
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
#[derive(Clone, Default, clap::Args)]
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
    /// Token that inspection calls (status, depths, workers, peeks) must carry; without it
    /// they are open to anyone who reaches the port. The shared token is accepted too.
    #[arg(
        long,
        env = "ROOKWORLD_INSPECT_TOKEN",
        hide_env_values = true,
        conflicts_with = "inspect_token_file"
    )]
    pub inspect_token: Option<String>,
    /// File holding the inspection token.
    #[arg(long, env = "ROOKWORLD_INSPECT_TOKEN_FILE")]
    pub inspect_token_file: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for TokenArgs {
    /// The files, and whether tokens are set, never the tokens.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = |t: &Option<String>| t.as_ref().map(|_| "<set>");
        f.debug_struct("TokenArgs")
            .field("token", &set(&self.token))
            .field("token_file", &self.token_file)
            .field("inspect_token", &set(&self.inspect_token))
            .field("inspect_token_file", &self.inspect_token_file)
            .finish()
    }
}

impl TokenArgs {
    /// The configured token, if any (see [`resolve_token`]).
    pub fn resolve(&self) -> Result<Option<String>, String> {
        resolve_token(self.token.as_deref(), self.token_file.as_deref())
    }

    /// The configured inspection token, if any.
    pub fn resolve_inspect(&self) -> Result<Option<String>, String> {
        resolve_token(
            self.inspect_token.as_deref(),
            self.inspect_token_file.as_deref(),
        )
        .map_err(|e| e.replace("--token", "--inspect-token"))
    }

    /// The guard of a server: both tokens resolved.
    pub fn guard(&self) -> Result<Guard, String> {
        Ok(Guard::new(self.resolve()?, self.resolve_inspect()?))
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

    #[test]
    fn inspection_is_open_unless_an_inspection_token_is_set() {
        let (none, with) = (MetadataMap::new(), {
            let mut m = MetadataMap::new();
            set_token(&mut m, "work").unwrap();
            m
        });
        let inspect = {
            let mut m = MetadataMap::new();
            set_token(&mut m, "look").unwrap();
            m
        };
        let open = Guard::new(Some("work".into()), None);
        assert_eq!(open.inspect(&none), Ok(()));
        assert_eq!(open.work(&none), Err(TokenError::Missing));
        assert_eq!(open.work(&with), Ok(()));
        let closed = Guard::new(Some("work".into()), Some("look".into()));
        assert_eq!(closed.inspect(&none), Err(TokenError::Missing));
        assert_eq!(closed.inspect(&inspect), Ok(()));
        assert_eq!(closed.inspect(&with), Ok(()));
        assert_eq!(closed.work(&inspect), Err(TokenError::Wrong));
        assert!(!format!("{closed:?}").contains("work") && !format!("{closed:?}").contains("look"));
        let args = TokenArgs {
            token: Some("work".into()),
            inspect_token: Some("look".into()),
            ..TokenArgs::default()
        };
        let shown = format!("{args:?}");
        assert!(
            !shown.contains("work") && !shown.contains("look"),
            "{shown}"
        );
    }
}

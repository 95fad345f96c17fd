//! Who made a call, as far as tasks are concerned: the credential it came with. A task is
//! read and cancelled only with the credential that created it; the store keeps a digest of the
//! credential, never the credential.

use std::sync::Arc;

use rmcp::RoleServer;
use rmcp::service::RequestContext;
use sha2::{Digest as _, Sha256};

/// The owner key of a caller (put on each authenticated HTTP request by the gateway's auth
/// layer; a stdio client is the one process that started the gateway).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller(Arc<str>);

impl Caller {
    /// A caller that presented `token` (`None`: an endpoint served open, `auth: none`).
    pub fn with_token(token: Option<&str>) -> Self {
        match token {
            Some(token) => {
                let digest = Sha256::digest(token.as_bytes());
                let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
                Self(format!("token:{hex}").into())
            }
            None => Self("open".into()),
        }
    }

    /// The client on the other end of stdio.
    pub fn stdio() -> Self {
        Self("stdio".into())
    }

    /// The caller of a request: the credential the HTTP layer found, or stdio's.
    pub fn of(context: &RequestContext<RoleServer>) -> Self {
        match context.extensions.get::<http::request::Parts>() {
            Some(parts) => parts
                .extensions
                .get::<Caller>()
                .cloned()
                .unwrap_or_else(|| Self::with_token(None)),
            None => Self::stdio(),
        }
    }

    pub fn owner(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_credential_is_its_own_owner_and_never_kept_as_given() {
        let a = Caller::with_token(Some("aaaaaaaaaaaaaaaaaaaa"));
        let b = Caller::with_token(Some("bbbbbbbbbbbbbbbbbbbb"));
        assert_ne!(a, b);
        assert_eq!(a, Caller::with_token(Some("aaaaaaaaaaaaaaaaaaaa")));
        assert!(!a.owner().contains("aaaa"), "{}", a.owner());
        assert_ne!(Caller::with_token(None), Caller::stdio());
    }
}

//! A model source's text read into its parts, every form the original Nomad accepts: a path or
//! `file:`, `git+https://`/`git+ssh://`/`git+file://` with `@ref`, `hf://org/name@revision`,
//! `oras://registry[:port]/repository[:tag][@sha256:…]`, each with `#subdir`.

use std::path::{Path, PathBuf};

use crate::SourceError;

/// A parsed model source.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    Local(PathBuf),
    Git {
        /// What `git clone` takes (the URL without `git+`, `@ref` and `#subdir`).
        url: String,
        reference: Option<String>,
        subdir: Option<String>,
    },
    HuggingFace {
        repo: String,
        revision: Option<String>,
        subdir: Option<String>,
    },
    Oras {
        artifact: Artifact,
        subdir: Option<String>,
    },
}

/// An OCI artifact's address: the registry (host and port), the repository in it, and a tag
/// or a digest (or both: the digest is what is pulled, the tag is kept for messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Artifact {
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    pub digest: Option<String>,
}

impl Artifact {
    /// The tag pulled when the source names neither a tag nor a digest (as oras does).
    pub const DEFAULT_TAG: &'static str = "latest";

    /// `registry/repository` without tag or digest.
    pub fn repository_ref(&self) -> String {
        format!("{}/{}", self.registry, self.repository)
    }

    /// The tag a pull resolves when no digest pins it.
    pub fn tag_or_default(&self) -> &str {
        self.tag.as_deref().unwrap_or(Self::DEFAULT_TAG)
    }

    /// The same artifact pinned to `digest` (the tag dropped, as a pinned source reads).
    pub fn pinned(&self, digest: &str) -> Artifact {
        Artifact {
            tag: None,
            digest: Some(digest.to_owned()),
            ..self.clone()
        }
    }

    /// Whether the registry is on this host, where plain HTTP is the norm (as `oras
    /// --plain-http` and the registry's own default listener).
    pub fn is_loopback(&self) -> bool {
        let host = match self.registry.rsplit_once(':') {
            Some((host, port)) if port.chars().all(|c| c.is_ascii_digit()) => host,
            _ => self.registry.as_str(),
        };
        host == "localhost" || host.starts_with("127.") || host == "[::1]"
    }
}

impl std::fmt::Display for Artifact {
    /// `oras://registry/repository[:tag][@digest]`, as a source names it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "oras://{}", self.repository_ref())?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

/// Splits `#subdir` off, refusing one that climbs out of the repository.
fn split_subdir<'a>(text: &'a str, source: &str) -> Result<(&'a str, Option<String>), SourceError> {
    match text.split_once('#') {
        None => Ok((text, None)),
        Some((rest, sub)) => {
            let sub = sub.strip_prefix("subdirectory=").unwrap_or(sub);
            let sub = sub.trim_matches('/');
            if sub.is_empty() {
                return Ok((rest, None));
            }
            if Path::new(sub)
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
            {
                return Err(invalid(
                    source,
                    format!("subdirectory {sub:?} must stay inside the repository"),
                ));
            }
            Ok((rest, Some(sub.to_owned())))
        }
    }
}

fn invalid(spec: &str, reason: impl Into<String>) -> SourceError {
    SourceError::Invalid {
        spec: spec.to_owned(),
        reason: reason.into(),
    }
}

/// `sha256:<64 hex>` or `sha512:<128 hex>` (a bare 64-hex digest is read as sha256), in lower
/// case as registries name blobs.
pub fn digest(text: &str) -> Option<String> {
    let (algorithm, hex) = match text.split_once(':') {
        Some((algorithm, hex)) => (algorithm.to_ascii_lowercase(), hex),
        None => ("sha256".to_owned(), text),
    };
    let length = match algorithm.as_str() {
        "sha256" => 64,
        "sha512" => 128,
        _ => return None,
    };
    (hex.len() == length && hex.chars().all(|c| c.is_ascii_hexdigit()))
        .then(|| format!("{algorithm}:{}", hex.to_ascii_lowercase()))
}

/// A repository path as the OCI distribution spec allows it: lower-case components of
/// letters and digits joined by `.`, `_`, `__` or `-`, separated by `/`.
fn repository_ok(repository: &str) -> bool {
    repository.split('/').all(|part| {
        !part.is_empty()
            && part.chars().all(|c| {
                c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-')
            })
            && part.starts_with(|c: char| c.is_ascii_alphanumeric())
            && part.ends_with(|c: char| c.is_ascii_alphanumeric())
    })
}

/// A tag as the OCI distribution spec allows it.
fn tag_ok(tag: &str) -> bool {
    tag.len() <= 128
        && tag.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
        && tag
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

fn oras(text: &str, rest: &str) -> Result<Source, SourceError> {
    let (rest, subdir) = split_subdir(rest, text)?;
    let (reference, digest) = match rest.rsplit_once('@') {
        Some((reference, pin)) => {
            let Some(digest) = digest(pin) else {
                return Err(invalid(
                    text,
                    format!(
                        "{pin:?} is not a digest: pin with @sha256:<64 hex digits> (or \
                         @sha512:<128>), or name a tag with :tag"
                    ),
                ));
            };
            (reference, Some(digest))
        }
        None => (rest, None),
    };
    let Some((registry, path)) = reference.split_once('/') else {
        return Err(invalid(
            text,
            "oras:// takes registry/repository[:tag][@sha256:…] \
             (e.g. oras://registry.example.org/models/embed:v1)",
        ));
    };
    // A `:` after the last `/` starts the tag; one before it is the registry's port.
    let (repository, tag) = match path.rsplit_once(':') {
        Some((repository, tag)) => (repository, Some(tag.to_owned())),
        None => (path, None),
    };
    if registry.is_empty() || registry.contains(['@', ' ']) {
        return Err(invalid(text, "oras:// needs a registry host (host[:port])"));
    }
    if !repository_ok(repository) {
        return Err(invalid(
            text,
            format!(
                "repository {repository:?} is not an OCI repository name (lower-case letters, \
                 digits and . _ - in /-separated parts)"
            ),
        ));
    }
    if let Some(tag) = tag.as_deref().filter(|t| !tag_ok(t)) {
        return Err(invalid(
            text,
            format!("tag {tag:?} is not an OCI tag (letters, digits, . _ -; at most 128)"),
        ));
    }
    Ok(Source::Oras {
        artifact: Artifact {
            registry: registry.to_owned(),
            repository: repository.to_owned(),
            tag,
            digest,
        },
        subdir,
    })
}

fn hugging_face(text: &str, rest: &str) -> Result<Source, SourceError> {
    let (rest, subdir) = split_subdir(rest, text)?;
    let (repo, revision) = match rest.split_once('@') {
        Some((repo, rev)) => (repo, Some(rev.to_owned())),
        None => (rest, None),
    };
    let repo = repo.trim_matches('/');
    let parts: Vec<&str> = repo.split('/').collect();
    if parts.len() != 2 || parts.iter().any(|p| p.is_empty() || *p == "..") {
        return Err(invalid(
            text,
            "hf:// takes org/name (e.g. hf://sentence-transformers/all-MiniLM-L6-v2)",
        ));
    }
    if revision
        .as_deref()
        .is_some_and(|r| r.is_empty() || r.contains(".."))
    {
        return Err(invalid(
            text,
            "the revision after @ is empty or climbs (..)",
        ));
    }
    Ok(Source::HuggingFace {
        repo: repo.to_owned(),
        revision,
        subdir,
    })
}

fn git(text: &str, rest: &str) -> Result<Source, SourceError> {
    let (rest, subdir) = split_subdir(rest, text)?;
    let Some((scheme, after)) = rest.split_once("://") else {
        return Err(invalid(
            text,
            "git+ takes a URL (git+file:///path, git+https://host/repo or git+ssh://user@host/repo)",
        ));
    };
    if !matches!(scheme, "file" | "https" | "http" | "ssh") {
        return Err(SourceError::Scheme {
            spec: text.to_owned(),
            scheme: format!("git+{scheme}"),
        });
    }
    // `@ref` follows the path; an `@` before the path's first `/` is a user name.
    let path_start = if scheme == "file" {
        0
    } else {
        after.find('/').unwrap_or(after.len())
    };
    let (url_rest, reference) = match after[path_start..].find('@') {
        Some(at) => (
            &after[..path_start + at],
            Some(after[path_start + at + 1..].to_owned()),
        ),
        None => (after, None),
    };
    if url_rest[path_start.min(url_rest.len())..]
        .trim_matches('/')
        .is_empty()
    {
        return Err(invalid(text, "the git URL has no repository path"));
    }
    Ok(Source::Git {
        url: format!("{scheme}://{url_rest}"),
        reference: reference.filter(|r| !r.is_empty()),
        subdir,
    })
}

/// `user@host:path` (git's scp-like form), as the original reads it: a git+ssh URL.
fn scp_like(text: &str) -> Option<String> {
    let (user_host, path) = text.split_once(':')?;
    let (user, host) = user_host.split_once('@')?;
    let word = |s: &str| !s.is_empty() && !s.contains(['/', ' ']);
    (word(user) && word(host) && !path.starts_with("//") && !path.is_empty())
        .then(|| format!("git+ssh://{user}@{host}/{path}"))
}

impl Source {
    pub fn parse(text: &str) -> Result<Self, SourceError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(invalid("", "empty"));
        }
        if let Some(path) = text.strip_prefix("file://") {
            return Ok(Source::Local(PathBuf::from(path)));
        }
        if let Some(path) = text.strip_prefix("file:") {
            return Ok(Source::Local(PathBuf::from(path)));
        }
        if let Some(rest) = text.strip_prefix("oras://") {
            return oras(text, rest);
        }
        if let Some(rest) = text.strip_prefix("hf://") {
            return hugging_face(text, rest);
        }
        if let Some(rest) = text.strip_prefix("git+") {
            return git(text, rest);
        }
        if let Some((scheme, _)) = text.split_once("://") {
            return Err(SourceError::Scheme {
                spec: text.to_owned(),
                scheme: scheme.to_owned(),
            });
        }
        if let Some(url) = scp_like(text) {
            return git(text, &url["git+".len()..]);
        }
        Ok(Source::Local(PathBuf::from(text)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn artifact(
        registry: &str,
        repository: &str,
        tag: Option<&str>,
        digest: Option<&str>,
    ) -> Artifact {
        Artifact {
            registry: registry.into(),
            repository: repository.into(),
            tag: tag.map(Into::into),
            digest: digest.map(Into::into),
        }
    }

    #[test]
    fn sources_parse_into_their_parts() {
        let hex = "ab".repeat(32);
        let pinned = format!("sha256:{hex}");
        let cases = [
            ("/models/a", Source::Local("/models/a".into())),
            ("file:///models/a", Source::Local("/models/a".into())),
            ("file:models/demo", Source::Local("models/demo".into())),
            (
                "git+file:///srv/repo.git@v1.2#models/tiny",
                Source::Git {
                    url: "file:///srv/repo.git".into(),
                    reference: Some("v1.2".into()),
                    subdir: Some("models/tiny".into()),
                },
            ),
            (
                "git+https://git@example.org/org/repo.git",
                Source::Git {
                    url: "https://git@example.org/org/repo.git".into(),
                    reference: None,
                    subdir: None,
                },
            ),
            (
                "git+ssh://git@example.com:2222/org/repo.git@feature/refactor",
                Source::Git {
                    url: "ssh://git@example.com:2222/org/repo.git".into(),
                    reference: Some("feature/refactor".into()),
                    subdir: None,
                },
            ),
            (
                "git@example.com:org/repo.git@main#weights",
                Source::Git {
                    url: "ssh://git@example.com/org/repo.git".into(),
                    reference: Some("main".into()),
                    subdir: Some("weights".into()),
                },
            ),
            (
                "hf://org/name@v2#onnx",
                Source::HuggingFace {
                    repo: "org/name".into(),
                    revision: Some("v2".into()),
                    subdir: Some("onnx".into()),
                },
            ),
            (
                "oras://registry.example.com/org/model:v1#weights",
                Source::Oras {
                    artifact: artifact("registry.example.com", "org/model", Some("v1"), None),
                    subdir: Some("weights".into()),
                },
            ),
            (
                "oras://registry.example.com:5000/models/model:v1",
                Source::Oras {
                    artifact: artifact(
                        "registry.example.com:5000",
                        "models/model",
                        Some("v1"),
                        None,
                    ),
                    subdir: None,
                },
            ),
            (
                "oras://localhost:5000/scifm",
                Source::Oras {
                    artifact: artifact("localhost:5000", "scifm", None, None),
                    subdir: None,
                },
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(Source::parse(text).unwrap(), expected, "{text}");
        }
        // Digests: prefixed, bare (read as sha256), upper case, with a tag kept beside them, in
        // nested repositories.
        for (text, tag) in [
            (
                format!("oras://localhost:5000/a/b/c@{pinned}#sub/dir"),
                None,
            ),
            (
                format!("oras://localhost:5000/a/b/c@{}#sub/dir", hex.to_uppercase()),
                None,
            ),
            (
                format!("oras://localhost:5000/a/b/c:v1@{pinned}#sub/dir"),
                Some("v1"),
            ),
        ] {
            assert_eq!(
                Source::parse(&text).unwrap(),
                Source::Oras {
                    artifact: artifact("localhost:5000", "a/b/c", tag, Some(&pinned)),
                    subdir: Some("sub/dir".into()),
                },
                "{text}"
            );
        }
        let a = artifact("localhost:5000", "a/b", Some("v1"), Some(&pinned));
        assert_eq!(
            a.to_string(),
            format!("oras://localhost:5000/a/b:v1@{pinned}")
        );
        assert_eq!(
            Source::parse(&a.to_string()).unwrap(),
            Source::Oras {
                artifact: a.clone(),
                subdir: None
            }
        );
        assert!(a.is_loopback());
        assert!(artifact("127.0.0.1:5000", "a", None, None).is_loopback());
        assert!(!artifact("registry.example.com:5000", "a", None, None).is_loopback());
    }

    #[test]
    fn bad_sources_are_refused_by_name() {
        let cases = [
            ("", "empty"),
            ("s3://bucket/model", "unsupported scheme `s3`"),
            ("git+ftp://host/repo", "unsupported scheme `git+ftp`"),
            ("hf://just-a-name", "hf:// takes org/name"),
            (
                "git+file:///repo#../../etc",
                "must stay inside the repository",
            ),
            ("git+https://", "no repository path"),
            ("git+https://example.org", "no repository path"),
            (
                "oras://registry.example.com",
                "oras:// takes registry/repository",
            ),
            (
                "oras://registry.example.com/",
                "is not an OCI repository name",
            ),
            (
                "oras://registry.example.com/Org/Model:v1",
                "is not an OCI repository name",
            ),
            (
                "oras://registry.example.com/org/model@sha256:deadbeef",
                "is not a digest",
            ),
            (
                "oras://registry.example.com/org/model@v1",
                "is not a digest",
            ),
            (
                &format!(
                    "oras://registry.example.com/org/model@md5:{}",
                    "a".repeat(32)
                ),
                "is not a digest",
            ),
            (
                "oras://registry.example.com/org/model:v1 beta",
                "is not an OCI tag",
            ),
            (
                "oras://registry.example.com/org/model:v1#../x",
                "must stay inside",
            ),
        ];
        for (text, expected) in cases {
            let message = Source::parse(text).unwrap_err().to_string();
            assert!(message.contains(expected), "{text}: {message}");
        }
    }

    #[test]
    fn digests_are_read_as_registries_name_them() {
        let hex = "d".repeat(64);
        assert_eq!(digest(&hex), Some(format!("sha256:{hex}")));
        assert_eq!(
            digest(&format!("SHA256:{}", hex.to_uppercase())),
            Some(format!("sha256:{hex}"))
        );
        assert_eq!(
            digest(&format!("sha512:{}", "e".repeat(128)))
                .unwrap()
                .len(),
            135
        );
        for bad in [
            "main",
            &"a".repeat(63),
            &"g".repeat(64),
            &format!("sha1:{}", "a".repeat(40)),
        ] {
            assert_eq!(digest(bad), None, "{bad}");
        }
    }
}

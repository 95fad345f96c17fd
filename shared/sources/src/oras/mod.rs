//! `oras://` sources: OCI artifacts pulled through the ORAS project's client, each layer checked
//! against the manifest's digest, stored in the cache by the manifest's digest and reused from
//! there without a registry (a tag resolved once is remembered, so a start with the registry
//! down serves what it pulled before). `nomad export --to oras` pushes the same shape back.

mod auth;
mod layers;

use std::path::{Path, PathBuf};
use std::time::Duration;

use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

use nomad_config::registries::Registries;

use crate::SourceError;
use crate::parse::Artifact;

pub use auth::credentials;

/// How long one request to a registry may take to connect and to answer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const READ_TIMEOUT: Duration = Duration::from_secs(120);

/// Why a registry refused or failed a pull or a push, each with what to do about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegistryFailure {
    Unreachable,
    NotFound,
    Denied,
    Digest,
    Artifact,
    Other,
}

impl RegistryFailure {
    pub fn advice(self) -> &'static str {
        match self {
            RegistryFailure::Unreachable => {
                "check the registry's address and that it is up; a source pulled before is served \
                 from the cache without it (pin it with @sha256:… or pull it once while the \
                 registry is reachable)"
            }
            RegistryFailure::NotFound => {
                "check the repository, tag or digest (`oras repo tags` lists the tags; \
                 `nomad export --to oras --pin` writes a config whose digests exist)"
            }
            RegistryFailure::Denied => {
                "log in (`oras login` or `docker login` write ~/.docker/config.json; \
                 NOMAD_AUTH_FILE or DOCKER_CONFIG name another file) or set \
                 NOMAD_REGISTRY_USERNAME and NOMAD_REGISTRY_PASSWORD"
            }
            RegistryFailure::Digest => {
                "the registry's content does not match its digest: push the artifact again"
            }
            RegistryFailure::Artifact => {
                "push the model's files with `oras push` or `nomad export --to oras`, each \
                 file (or directory) a layer with its title"
            }
            RegistryFailure::Other => "see the registry's answer above",
        }
    }
}

fn registry_error(spec: &str, failure: RegistryFailure, detail: impl Into<String>) -> SourceError {
    SourceError::Registry {
        spec: spec.to_owned(),
        failure,
        detail: detail.into(),
    }
}

/// Reads the client's error as one of the failures a user can act on.
fn classify(error: &OciDistributionError) -> RegistryFailure {
    match error {
        OciDistributionError::AuthenticationFailure(_)
        | OciDistributionError::UnauthorizedError { .. } => RegistryFailure::Denied,
        OciDistributionError::ImageManifestNotFoundError(_) => RegistryFailure::NotFound,
        OciDistributionError::DigestError(_) => RegistryFailure::Digest,
        OciDistributionError::RegistryError { envelope, .. } => {
            let codes = envelope.errors.iter().map(|e| &e.code);
            for code in codes {
                match code {
                    OciErrorCode::ManifestUnknown
                    | OciErrorCode::NameUnknown
                    | OciErrorCode::NotFound
                    | OciErrorCode::BlobUnknown => return RegistryFailure::NotFound,
                    OciErrorCode::Unauthorized | OciErrorCode::Denied => {
                        return RegistryFailure::Denied;
                    }
                    OciErrorCode::DigestInvalid => return RegistryFailure::Digest,
                    _ => {}
                }
            }
            RegistryFailure::Other
        }
        OciDistributionError::ServerError { code: 404, .. } => RegistryFailure::NotFound,
        OciDistributionError::ServerError {
            code: 401 | 403, ..
        } => RegistryFailure::Denied,
        // Refused, unresolvable or silent: the registry cannot be reached.
        OciDistributionError::RequestError(e) if e.is_connect() || e.is_timeout() => {
            RegistryFailure::Unreachable
        }
        _ => RegistryFailure::Other,
    }
}

/// The error chain as one line (reqwest's top message alone hides the cause).
fn chain(error: &OciDistributionError) -> String {
    use std::error::Error as _;
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        let line = inner.to_string();
        if !text.contains(&line) {
            text.push_str(": ");
            text.push_str(&line);
        }
        source = inner.source();
    }
    text
}

fn failed(spec: &str, error: &OciDistributionError) -> SourceError {
    registry_error(spec, classify(error), chain(error))
}

/// A client for `artifact`'s registry: plain HTTP on this host (as a local registry listens),
/// else HTTPS, unless NOMAD_REGISTRY_PLAIN_HTTP names the registry (comma-separated host:port).
/// The process's TLS provider is installed by then (`nomad_rpc::install_crypto_provider`).
fn client(artifact: &Artifact) -> Client {
    let plain = std::env::var("NOMAD_REGISTRY_PLAIN_HTTP").unwrap_or_default();
    let plain = artifact.is_loopback()
        || plain
            .split(',')
            .any(|r| r.trim() == artifact.registry && !r.trim().is_empty());
    Client::new(ClientConfig {
        protocol: if plain {
            ClientProtocol::Http
        } else {
            ClientProtocol::Https
        },
        connect_timeout: Some(CONNECT_TIMEOUT),
        read_timeout: Some(READ_TIMEOUT),
        ..ClientConfig::default()
    })
}

fn reference(artifact: &Artifact) -> Reference {
    match &artifact.digest {
        Some(digest) => Reference::with_digest(
            artifact.registry.clone(),
            artifact.repository.clone(),
            digest.clone(),
        ),
        None => Reference::with_tag(
            artifact.registry.clone(),
            artifact.repository.clone(),
            artifact.tag_or_default().to_owned(),
        ),
    }
}

/// Where the cache keeps artifacts: one directory per manifest digest, and the tags resolved.
fn store(cache: &Path) -> PathBuf {
    cache.join("oras")
}

fn digest_dir(cache: &Path, digest: &str) -> PathBuf {
    store(cache).join(digest.replace(':', "-"))
}

/// The file that remembers which digest `artifact`'s tag named when it was last resolved.
fn tag_file(cache: &Path, artifact: &Artifact) -> PathBuf {
    use sha2::{Digest as _, Sha256};
    let key = format!(
        "{}:{}",
        artifact.repository_ref(),
        artifact.tag_or_default()
    );
    let digest = Sha256::digest(key.as_bytes());
    let name: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
    store(cache).join("tags").join(name)
}

/// The digest `artifact`'s tag names: asked of the registry, else (the registry unreachable)
/// the one it named when last pulled here.
async fn resolve_tag(
    spec: &str,
    artifact: &Artifact,
    client: &Client,
    auth: &RegistryAuth,
    cache: &Path,
) -> Result<String, SourceError> {
    let remembered = tag_file(cache, artifact);
    match client
        .fetch_manifest_digest(&reference(artifact), auth)
        .await
    {
        Ok(digest) => Ok(digest),
        Err(e) if classify(&e) == RegistryFailure::Unreachable => {
            let known = std::fs::read_to_string(&remembered).ok().and_then(|text| {
                let digest = text.lines().next()?.trim().to_owned();
                digest_dir(cache, &digest).is_dir().then_some(digest)
            });
            match known {
                Some(digest) => {
                    tracing::warn!(%spec, %digest, error = %chain(&e), "the registry is unreachable: serving the digest its tag named when it was pulled here");
                    Ok(digest)
                }
                None => Err(failed(spec, &e)),
            }
        }
        Err(e) => Err(failed(spec, &e)),
    }
}

/// The file listing the repositories a stored digest was pulled from or found in: the content
/// is shared by digest, but a pin names a repository too, and one that does not hold the digest
/// is refused as the registry would refuse it.
fn repositories_file(cache: &Path, digest: &str) -> PathBuf {
    store(cache).join(format!("{}.repositories", digest.replace(':', "-")))
}

fn seen_in(cache: &Path, digest: &str, repository: &str) -> bool {
    std::fs::read_to_string(repositories_file(cache, digest))
        .is_ok_and(|text| text.lines().any(|l| l == repository))
}

fn record_seen(cache: &Path, digest: &str, repository: &str) {
    use std::io::Write as _;
    if seen_in(cache, digest, repository) {
        return;
    }
    let file = repositories_file(cache, digest);
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&file)
        .and_then(|mut f| writeln!(f, "{repository}"));
    if let Err(e) = written {
        tracing::warn!(file = %file.display(), error = %e, "cannot note the artifact's repository");
    }
}

/// The local directory holding `artifact` (pulled into `cache` unless it is there already),
/// and the manifest digest it is.
pub async fn pull(
    spec: &str,
    artifact: &Artifact,
    cache: &Path,
    registries: &Registries,
) -> Result<(PathBuf, String), SourceError> {
    let repository = artifact.repository_ref();
    if let Some(digest) = &artifact.digest {
        let dir = digest_dir(cache, digest);
        if dir.is_dir() && seen_in(cache, digest, &repository) {
            return Ok((dir, digest.clone()));
        }
    }
    let client = client(artifact);
    let auth = credentials(&artifact.registry, &repository, registries)
        .map_err(|reason| registry_error(spec, RegistryFailure::Denied, reason))?;
    let digest = match &artifact.digest {
        Some(digest) => digest.clone(),
        None => resolve_tag(spec, artifact, &client, &auth, cache).await?,
    };
    let dir = digest_dir(cache, &digest);
    let pinned = reference(&artifact.pinned(&digest));
    if !dir.is_dir() {
        let (manifest, got) = client
            .pull_image_manifest(&pinned, &auth)
            .await
            .map_err(|e| failed(spec, &e))?;
        if got != digest {
            return Err(registry_error(
                spec,
                RegistryFailure::Digest,
                format!("asked for manifest {digest}, the registry answered {got}"),
            ));
        }
        tracing::info!(%spec, %digest, layers = manifest.layers.len(), into = %dir.display(), "pulling the model artifact");
        layers::pull_into(spec, &client, &pinned, &manifest, &dir).await?;
    } else if !seen_in(cache, &digest, &repository) {
        // The content is here from another repository: this one must hold it too.
        client
            .fetch_manifest_digest(&pinned, &auth)
            .await
            .map_err(|e| failed(spec, &e))?;
    }
    record_seen(cache, &digest, &repository);
    if artifact.digest.is_none() {
        remember_tag(cache, artifact, &digest);
    }
    Ok((dir, digest))
}

/// Notes which digest the tag named, for a later start without the registry (best effort: a
/// cache that cannot be written only loses that).
fn remember_tag(cache: &Path, artifact: &Artifact, digest: &str) {
    let file = tag_file(cache, artifact);
    let staging = file.with_extension(format!("{}.tmp", std::process::id()));
    let written = file
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::write(&staging, format!("{digest}\n{artifact}\n")))
        .and_then(|()| std::fs::rename(&staging, &file));
    if let Err(e) = written {
        tracing::warn!(file = %file.display(), error = %e, "cannot remember the tag's digest");
    }
}

/// The layers of a model's files (a directory's, or one file's), in the shape oras clients push.
pub struct Packed {
    layers: Vec<ImageLayer>,
}

impl Packed {
    /// Packs `path`: each top-level file of a directory a layer, each directory a gzipped tar
    /// layer, titled as the oras clients title them (so `oras pull` unpacks what Nomad pushed,
    /// and Nomad what oras pushed); a file alone, one layer.
    pub fn new(path: &Path) -> std::io::Result<Packed> {
        Ok(Packed {
            layers: layers::pack(path)?,
        })
    }

    /// A digest of the layers' digests and titles: the same files give the same fingerprint.
    pub fn fingerprint(&self) -> String {
        use sha2::{Digest as _, Sha256};
        let mut hash = Sha256::new();
        for layer in &self.layers {
            hash.update(layer.sha256_digest().as_bytes());
            if let Some(title) = layer
                .annotations
                .as_ref()
                .and_then(|a| a.get(layers::TITLE))
            {
                hash.update(title.as_bytes());
            }
        }
        hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Pushes `packed` as one artifact to `artifact` (a tag) and returns its manifest's digest.
pub async fn push(
    spec: &str,
    artifact: &Artifact,
    packed: Packed,
    registries: &Registries,
) -> Result<String, SourceError> {
    let client = client(artifact);
    let auth = credentials(&artifact.registry, &artifact.repository_ref(), registries)
        .map_err(|reason| registry_error(spec, RegistryFailure::Denied, reason))?;
    let config = Config::new(b"{}".to_vec(), layers::CONFIG_MEDIA_TYPE.to_owned(), None);
    let target = reference(artifact);
    client
        .push(&target, &packed.layers, config, &auth, None)
        .await
        .map_err(|e| failed(spec, &e))?;
    client
        .fetch_manifest_digest(&target, &auth)
        .await
        .map_err(|e| failed(spec, &e))
}

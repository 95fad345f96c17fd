//! A registry's credentials, from where users already keep them: the variables the config's
//! `registries:` names for it, else NOMAD_REGISTRY_USERNAME and NOMAD_REGISTRY_PASSWORD, else the
//! `auths` of a Docker-style auth file (NOMAD_AUTH_FILE, else `$DOCKER_CONFIG/config.json`, else
//! `~/.docker/config.json`, as `oras login` and `docker login` write it), else none. Never a
//! secret from the config, which travels.

use std::collections::BTreeMap;
use std::path::PathBuf;

use base64::Engine as _;
use nomad_config::registries::Registries;
use oci_client::secrets::RegistryAuth;
use serde::Deserialize;

#[derive(Deserialize, Default)]
struct AuthFile {
    #[serde(default)]
    auths: BTreeMap<String, AuthEntry>,
}

#[derive(Deserialize, Default)]
struct AuthEntry {
    auth: Option<String>,
    username: Option<String>,
    password: Option<String>,
}

/// The auth file to read: the one NOMAD_AUTH_FILE names (it must exist), else Docker's.
fn auth_file() -> Result<Option<PathBuf>, String> {
    if let Some(file) = std::env::var_os("NOMAD_AUTH_FILE").filter(|f| !f.is_empty()) {
        let file = PathBuf::from(file);
        return if file.is_file() {
            Ok(Some(file))
        } else {
            Err(format!(
                "NOMAD_AUTH_FILE names {}, which is not a file",
                file.display()
            ))
        };
    }
    let file = match std::env::var_os("DOCKER_CONFIG").filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir).join("config.json"),
        None => match std::env::var_os("HOME") {
            Some(home) => PathBuf::from(home).join(".docker/config.json"),
            None => return Ok(None),
        },
    };
    Ok(file.is_file().then_some(file))
}

/// The key an auth file's entry is for, without scheme and API suffix (`https://host/v1/`).
fn entry_key(key: &str) -> &str {
    let key = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let key = key
        .strip_suffix("/v1/")
        .or_else(|| key.strip_suffix("/v2/"))
        .unwrap_or(key);
    key.trim_end_matches('/')
}

/// The entry for `repository_ref` (`registry/repository`): the longest key that is the
/// registry or a prefix of the repository at a `/`.
fn entry_for<'a>(
    file: &'a AuthFile,
    registry: &str,
    repository_ref: &str,
) -> Option<&'a AuthEntry> {
    file.auths
        .iter()
        .filter(|(key, _)| {
            let key = entry_key(key);
            key == registry
                || (repository_ref.starts_with(key)
                    && repository_ref[key.len()..].starts_with('/')
                    && key.starts_with(registry)
                    && key[registry.len()..].starts_with('/'))
                || key == repository_ref
        })
        .max_by_key(|(key, _)| entry_key(key).len())
        .map(|(_, entry)| entry)
}

fn basic(entry: &AuthEntry, registry: &str) -> Result<Option<RegistryAuth>, String> {
    if let (Some(user), Some(password)) = (&entry.username, &entry.password) {
        return Ok(Some(RegistryAuth::Basic(user.clone(), password.clone())));
    }
    let Some(encoded) = entry.auth.as_deref().filter(|a| !a.is_empty()) else {
        return Ok(None);
    };
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .ok_or_else(|| {
            format!("the auth file's entry for {registry} is not base64 of user:password")
        })?;
    let (user, password) = decoded.split_once(':').ok_or_else(|| {
        format!("the auth file's entry for {registry} is not base64 of user:password")
    })?;
    Ok(Some(RegistryAuth::Basic(
        user.to_owned(),
        password.to_owned(),
    )))
}

/// The credentials for `registry` (and `repository_ref` in it); a variable the config names but
/// the environment lacks, or an unreadable auth file, is an error naming it; no credentials at all
/// is an anonymous pull.
pub fn credentials(
    registry: &str,
    repository_ref: &str,
    registries: &Registries,
) -> Result<RegistryAuth, String> {
    if let Some(login) = registries.get(registry) {
        let read = |name: &str| {
            std::env::var(name).map_err(|_| {
                format!(
                    "the config's registries.{registry} names the variable {name}, which is not \
                     set in this process's environment"
                )
            })
        };
        return Ok(RegistryAuth::Basic(
            read(&login.username_env)?,
            read(&login.password_env)?,
        ));
    }
    if let (Ok(user), Ok(password)) = (
        std::env::var("NOMAD_REGISTRY_USERNAME"),
        std::env::var("NOMAD_REGISTRY_PASSWORD"),
    ) {
        return Ok(RegistryAuth::Basic(user, password));
    }
    let Some(path) = auth_file()? else {
        return Ok(RegistryAuth::Anonymous);
    };
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let file: AuthFile = serde_json::from_str(&text)
        .map_err(|e| format!("{}: not a Docker auth file: {e}", path.display()))?;
    match entry_for(&file, registry, repository_ref) {
        Some(entry) => Ok(basic(entry, registry)
            .map_err(|e| format!("{}: {e}", path.display()))?
            .unwrap_or(RegistryAuth::Anonymous)),
        None => Ok(RegistryAuth::Anonymous),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_matching_entry_of_an_auth_file_is_used() {
        let file: AuthFile = serde_json::from_str(
            r#"{"auths": {
                "https://registry.example.org/v1/": {"auth": "aG9zdDpwdw=="},
                "registry.example.org/team": {"username": "team", "password": "t"},
                "registry.example.org/teammate": {"username": "mate", "password": "m"},
                "other.example.org": {"auth": "b3RoZXI6bw=="}
            }}"#,
        )
        .unwrap();
        let user = |registry: &str, repository: &str| {
            let entry = entry_for(&file, registry, &format!("{registry}/{repository}"))?;
            match basic(entry, registry).unwrap()? {
                RegistryAuth::Basic(user, _) => Some(user),
                _ => None,
            }
        };
        assert_eq!(
            user("registry.example.org", "team/embed").as_deref(),
            Some("team")
        );
        assert_eq!(
            user("registry.example.org", "teammate/x").as_deref(),
            Some("mate")
        );
        assert_eq!(
            user("registry.example.org", "teams/x").as_deref(),
            Some("host")
        );
        assert_eq!(user("other.example.org", "a").as_deref(), Some("other"));
        assert_eq!(user("unknown.example.org", "a"), None);
        let bad = AuthEntry {
            auth: Some("not base64!".into()),
            ..AuthEntry::default()
        };
        assert!(
            basic(&bad, "r")
                .unwrap_err()
                .contains("not base64 of user:password")
        );
    }
}

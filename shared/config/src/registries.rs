//! `registries:`: which environment variables hold a registry's login, by registry
//! (`host[:port]`). The config names the variables, never the secrets, so it can travel (`nomad
//! export`, a run's kept copy) without them.
//!
//! ```yaml
//! registries:
//!   registry.example.org:
//!     username_env: SCIFM_REGISTRY_USER
//!     password_env: SCIFM_REGISTRY_TOKEN
//! ```

use std::collections::BTreeMap;

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RegistryLogin {
    /// The variable holding the user name.
    pub username_env: String,
    /// The variable holding the password or token.
    pub password_env: String,
}

/// The logins by registry.
pub type Registries = BTreeMap<String, RegistryLogin>;

/// Checks the section: a registry is `host[:port]`, a variable name letters, digits and `_`.
pub fn check(registries: &Registries) -> Result<(), String> {
    let variable = |name: &str| {
        !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    for (registry, login) in registries {
        if registry.is_empty() || registry.contains(['/', ' ', '@']) {
            return Err(format!(
                "registries: {registry:?} is not a registry host (host or host:port, e.g. \
                 registry.example.org:5000)"
            ));
        }
        for (key, name) in [
            ("username_env", &login.username_env),
            ("password_env", &login.password_env),
        ] {
            if !variable(name) {
                return Err(format!(
                    "registries.{registry}.{key}: {name:?} is not an environment variable's name \
                     (the config names the variable that holds the secret, never the secret)"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logins_name_variables_of_registries() {
        let login = |u: &str, p: &str| RegistryLogin {
            username_env: u.into(),
            password_env: p.into(),
        };
        let ok = Registries::from([("registry.example.org:5000".into(), login("USER", "TOKEN_2"))]);
        assert_eq!(check(&ok), Ok(()));
        for (registry, user, password, expected) in [
            ("https://r", "U", "P", "is not a registry host"),
            (
                "r",
                "U",
                "hunter2!",
                "is not an environment variable's name",
            ),
            ("r", "", "P", "registries.r.username_env"),
        ] {
            let bad = Registries::from([(registry.to_owned(), login(user, password))]);
            let error = check(&bad).unwrap_err();
            assert!(error.contains(expected), "{error}");
        }
    }
}

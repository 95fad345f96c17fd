//! The registries' logins a model spec carries (the config's `registries:`: variable names),
//! as the sources crate reads them.

use nomad_proto::v1::ModelSpec;

/// The config's `registries:` as the spec carries them.
pub fn registries(spec: &ModelSpec) -> nomad_config::registries::Registries {
    spec.registries
        .iter()
        .map(|(registry, login)| {
            (
                registry.clone(),
                nomad_config::registries::RegistryLogin {
                    username_env: login.username_env.clone(),
                    password_env: login.password_env.clone(),
                },
            )
        })
        .collect()
}

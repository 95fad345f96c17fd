//! The one config loader every Nomad service uses.
//!
//! A service reads one YAML or TOML file (`--config`), then takes the sections it owns
//! (`telemetry`, `tools`, `tool_manager`, ...) as typed structs. Environment overrides are
//! resolved by the owner of each section against an [`Env`], so precedence rules are plain
//! functions that tests drive with a map instead of the process environment.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Format, Serialized, Toml, Yaml};
use serde::de::DeserializeOwned;

mod explain;
mod interpolate;
pub mod registries;
pub mod requirements;
pub use explain::{explain, suggest};
/// A config value before it is typed: what a section of several shapes is read as first.
pub use figment::value::Value;
pub use interpolate::expand;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: not found")]
    NotFound { path: PathBuf },
    #[error("config file {path}: unsupported extension (use .yaml, .yml or .toml)")]
    UnsupportedFormat { path: PathBuf },
    #[error("config file {path}: not valid {format}: {source}")]
    Syntax {
        path: PathBuf,
        format: &'static str,
        #[source]
        source: Box<figment::Error>,
    },
    #[error(
        "config file {path}: {location}: ${{{variable}}} is not set and has no default (write ${{{variable}:default}} to give one)"
    )]
    UnsetVariable {
        path: PathBuf,
        location: String,
        variable: String,
    },
    #[error(
        "config file {path}: unknown top-level key `{key}`{hint}; the sections are: {sections}",
        sections = SECTIONS.join(", ")
    )]
    UnknownSection {
        path: PathBuf,
        key: String,
        hint: String,
    },
    #[error("config section `{section}`: {source}")]
    Section {
        section: String,
        #[source]
        source: Box<figment::Error>,
    },
    #[error("{variable}={value:?} is not a boolean (use 1/true/yes/on or 0/false/no/off)")]
    InvalidBool { variable: String, value: String },
    #[error("{variable}={value:?}: {reason}")]
    Invalid {
        variable: String,
        value: String,
        reason: String,
    },
}

/// The default models' directories (under the models directory, `models/` unless
/// `NOMAD_MODELS_DIR` says otherwise), as `scripts/fetch-models` unpacks them.
pub const DEFAULT_MODELS: [&str; 2] = ["all-minilm-l6-v2", "smollm2-135m-instruct"];

/// Every top-level section a Nomad config may have (each read by the service that owns it);
/// `search_tool` is the original Nomad's and is accepted so its configs load (Nomad's gateway
/// always offers search).
pub const SECTIONS: &[&str] = &[
    "auth",
    "fmod_models",
    "gateway",
    "head",
    "model_host",
    "registries",
    "sandbox",
    "search_tool",
    "servers",
    "sim",
    "supervise",
    "telemetry",
    "tls",
    "tool_manager",
    "tools",
];

/// A parsed config file (or an empty one when no file was given).
#[derive(Debug, Clone, Default)]
pub struct ConfigFile {
    figment: Figment,
    path: Option<PathBuf>,
}

impl ConfigFile {
    /// Reads `path` as YAML (`.yaml`, `.yml`) or TOML (`.toml`), with `${VAR}` and
    /// `${VAR:DEFAULT}` in its strings replaced from the environment (as the original Nomad's
    /// config does); `None` gives an empty config.
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_with(path, &ProcessEnv)
    }

    /// As [`ConfigFile::load`], with the variables from `env`.
    pub fn load_with(path: Option<&Path>, env: &(impl Env + ?Sized)) -> Result<Self, ConfigError> {
        let Some(path) = path else {
            return Ok(Self::default());
        };
        if !path.is_file() {
            return Err(ConfigError::NotFound {
                path: path.to_owned(),
            });
        }
        let (figment, format) = match path.extension().and_then(|e| e.to_str()) {
            Some("yaml" | "yml") => (Figment::from(Yaml::file_exact(path)), "YAML"),
            Some("toml") => (Figment::from(Toml::file_exact(path)), "TOML"),
            _ => {
                return Err(ConfigError::UnsupportedFormat {
                    path: path.to_owned(),
                });
            }
        };
        // Parsed whole here, so that a syntax error is the file's, not the first section's.
        let tree: figment::value::Dict = figment.extract().map_err(|e| ConfigError::Syntax {
            path: path.to_owned(),
            format,
            source: Box::new(e),
        })?;
        if let Some(key) = tree.keys().find(|k| !SECTIONS.contains(&k.as_str())) {
            return Err(ConfigError::UnknownSection {
                path: path.to_owned(),
                key: key.clone(),
                hint: suggest(key, SECTIONS)
                    .map(|s| format!(" (did you mean `{s}`?)"))
                    .unwrap_or_default(),
            });
        }
        let tree =
            expand(tree, env).map_err(|(location, variable)| ConfigError::UnsetVariable {
                path: path.to_owned(),
                location,
                variable,
            })?;
        Ok(Self {
            figment: Figment::from(Serialized::defaults(tree)),
            path: Some(path.to_owned()),
        })
    }

    /// Parses YAML text directly (tests, embedded defaults).
    pub fn from_yaml_str(text: &str) -> Self {
        Self {
            figment: Figment::from(Yaml::string(text)),
            path: None,
        }
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The section named `key`, or its `Default` when the file does not have it.
    pub fn section<T: DeserializeOwned + Default>(&self, key: &str) -> Result<T, ConfigError> {
        let section_error = |e: figment::Error| ConfigError::Section {
            section: key.to_owned(),
            source: Box::new(e),
        };
        if !self.figment.contains(key) {
            // Surface syntax errors in the file even when the section is absent.
            self.figment
                .extract::<figment::value::Dict>()
                .map_err(section_error)?;
            return Ok(T::default());
        }
        self.figment.extract_inner(key).map_err(section_error)
    }
}

/// Where environment variables come from: the process, or a map in tests.
pub trait Env {
    fn var(&self, name: &str) -> Option<String>;

    /// The variable's value, or `None` when it is unset or blank.
    fn non_empty(&self, name: &str) -> Option<String> {
        self.var(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    }

    /// A strict boolean: `None` when unset, an error naming the variable when malformed.
    fn bool(&self, name: &str) -> Result<Option<bool>, ConfigError> {
        self.non_empty(name)
            .map(|value| parse_bool(name, &value))
            .transpose()
    }
}

/// The real process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

/// An environment with defaults under it: a variable `user` sets always wins.
pub struct Layered<'a> {
    pub user: &'a dyn Env,
    pub defaults: &'a [(String, String)],
}

impl Env for Layered<'_> {
    fn var(&self, name: &str) -> Option<String> {
        self.user.var(name).or_else(|| {
            self.defaults
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        })
    }
}

impl Env for HashMap<String, String> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }
}

impl Env for [(&str, &str)] {
    fn var(&self, name: &str) -> Option<String> {
        self.iter()
            .rev()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| (*v).to_owned())
    }
}

/// Longest duration any setting may give: a year. Beyond it a value is a typo, and
/// `Instant + Duration` would overflow long before `Duration` itself does.
pub const MAX_SECONDS: f64 = 365.0 * 86_400.0;

/// A number of seconds from a config field or flag (`name` is in the error): finite, greater than
/// 0 and at most [`MAX_SECONDS`].
pub fn seconds(name: &str, value: f64) -> Result<std::time::Duration, String> {
    if value > 0.0 {
        seconds_or_zero(name, value)
    } else {
        Err(format!(
            "{name} must be a number of seconds greater than 0; got {value}"
        ))
    }
}

/// As [`seconds`], but 0 is allowed (a delay that may be none).
pub fn seconds_or_zero(name: &str, value: f64) -> Result<std::time::Duration, String> {
    if (0.0..=MAX_SECONDS).contains(&value) {
        Ok(std::time::Duration::from_secs_f64(value))
    } else {
        Err(format!(
            "{name} must be a number of seconds from 0 to {MAX_SECONDS} (a year); got {value}"
        ))
    }
}

/// Accepts 1/true/yes/on and 0/false/no/off, case-insensitively; `variable` names the source
/// in the error.
pub fn parse_bool(variable: &str, value: &str) -> Result<bool, ConfigError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(ConfigError::InvalidBool {
            variable: variable.to_owned(),
            value: value.to_owned(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    /// A directory of this test process's own, named for the test.
    fn scratch(test: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("nomad-config-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[derive(Debug, Default, Deserialize, PartialEq)]
    struct Section {
        a: Option<u32>,
        b: Option<String>,
    }

    #[test]
    fn parse_bool_accepts_the_documented_spellings_only() {
        for v in ["1", "true", "YES", " on "] {
            assert!(parse_bool("X", v).unwrap(), "{v}");
        }
        for v in ["0", "False", "no", "OFF"] {
            assert!(!parse_bool("X", v).unwrap(), "{v}");
        }
        let err = parse_bool("NOMAD_OTEL_ENABLED", "maybe").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("NOMAD_OTEL_ENABLED") && msg.contains("maybe"),
            "{msg}"
        );
    }

    #[test]
    fn missing_section_is_default_and_present_section_is_typed() {
        let file = ConfigFile::from_yaml_str("other:\n  x: 1\nsec:\n  a: 3\n");
        assert_eq!(
            file.section::<Section>("absent").unwrap(),
            Section::default()
        );
        assert_eq!(
            file.section::<Section>("sec").unwrap(),
            Section {
                a: Some(3),
                b: None
            }
        );
    }

    #[test]
    fn wrong_type_names_the_section_and_field() {
        let file = ConfigFile::from_yaml_str("sec:\n  a: lots\n");
        let msg = file.section::<Section>("sec").unwrap_err().to_string();
        assert!(msg.contains("sec") && msg.contains('a'), "{msg}");
    }

    #[test]
    fn missing_file_and_unknown_extension_are_clear_errors() {
        let msg = ConfigFile::load(Some(Path::new("/nonexistent/nomad.yaml")))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("/nonexistent/nomad.yaml") && msg.contains("not found"));
        let dir = scratch("test");
        let ini = dir.join("nomad.ini");
        std::fs::write(&ini, "x=1").unwrap();
        let msg = ConfigFile::load(Some(&ini)).unwrap_err().to_string();
        assert!(msg.contains("unsupported extension"), "{msg}");
    }

    #[test]
    fn toml_and_yaml_files_load_the_same_section() {
        let dir = scratch("fmt");
        let y = dir.join("c.yaml");
        let t = dir.join("c.toml");
        std::fs::write(&y, "head:\n  a: 7\n  b: hi\n").unwrap();
        std::fs::write(&t, "[head]\na = 7\nb = \"hi\"\n").unwrap();
        let from_yaml: Section = ConfigFile::load(Some(&y)).unwrap().section("head").unwrap();
        let from_toml: Section = ConfigFile::load(Some(&t)).unwrap().section("head").unwrap();
        assert_eq!(from_yaml, from_toml);
        assert_eq!(from_yaml.b.as_deref(), Some("hi"));
    }

    #[test]
    fn variables_expand_at_load_and_a_syntax_error_is_the_files() {
        let dir = scratch("vars");
        let y = dir.join("c.yaml");
        std::fs::write(&y, "head:\n  a: 7\n  b: ${WHO:nobody}-${HOME}\n").unwrap();
        let env: &[(&str, &str)] = &[("HOME", "/h")];
        let sec: Section = ConfigFile::load_with(Some(&y), env)
            .unwrap()
            .section("head")
            .unwrap();
        assert_eq!(sec.b.as_deref(), Some("nobody-/h"));
        let unset = ConfigFile::load_with(Some(&y), &[] as &[(&str, &str)])
            .unwrap_err()
            .to_string();
        assert!(
            unset.contains("head.b") && unset.contains("${HOME} is not set"),
            "{unset}"
        );
        std::fs::write(&y, "tls:\n  a: [1\nsec:\n  a: 2\n").unwrap();
        let syntax = ConfigFile::load(Some(&y)).unwrap_err().to_string();
        assert!(
            syntax.contains("not valid YAML") && syntax.contains("line"),
            "{syntax}"
        );
    }

    #[test]
    fn an_unknown_top_level_key_is_refused_with_the_nearest_section() {
        let dir = scratch("keys");
        let y = dir.join("c.yaml");
        std::fs::write(&y, "tool:\n  - name: x\n").unwrap();
        let message = ConfigFile::load(Some(&y)).unwrap_err().to_string();
        assert!(
            message.contains("unknown top-level key `tool` (did you mean `tools`?)"),
            "{message}"
        );
        std::fs::write(&y, "fmod_models: []\nsearch_tool:\n  expose: true\n").unwrap();
        ConfigFile::load(Some(&y)).unwrap();
    }

    #[test]
    fn seconds_refuse_what_no_timer_can_mean() {
        assert_eq!(
            seconds("x", 1.5).unwrap(),
            std::time::Duration::from_millis(1500)
        );
        assert_eq!(
            seconds_or_zero("x", 0.0).unwrap(),
            std::time::Duration::ZERO
        );
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e300] {
            let error = seconds("sandbox.timeout_seconds", bad).unwrap_err();
            assert!(error.contains("sandbox.timeout_seconds"), "{bad}: {error}");
        }
        for bad in [-0.5, f64::NAN, MAX_SECONDS * 2.0] {
            assert!(seconds_or_zero("x", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn env_bool_names_the_variable() {
        let env: &[(&str, &str)] = &[("FLAG", "maybe"), ("ON", "yes")];
        assert_eq!(env.bool("ON").unwrap(), Some(true));
        assert_eq!(env.bool("UNSET").unwrap(), None);
        assert!(env.bool("FLAG").unwrap_err().to_string().contains("FLAG"));
    }
}

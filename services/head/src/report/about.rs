//! What a run ran on, for the report's last section: each service's version (from its spans'
//! resource) and the run's config file, with the values of secret-looking keys hidden, since a
//! report is a file people pass around.

use std::collections::BTreeMap;
use std::path::Path;

use crate::traces::Span;

/// The most of a config file the report shows.
const CONFIG_LIMIT: usize = 64 << 10;

/// Words that mark a key whose value the report hides.
const SECRET_WORDS: [&str; 8] = [
    "token",
    "secret",
    "password",
    "passwd",
    "authorization",
    "api_key",
    "apikey",
    "credential",
];

pub struct About {
    /// `service.name` -> `service.version`.
    pub versions: BTreeMap<String, String>,
    pub config: Option<ConfigFile>,
    /// Each server of the fleet, with how often it was started again and its last exit
    /// (`servers.json`; none for a run that was not a `nomad up` fleet).
    pub servers: Vec<ServerLife>,
}

pub struct ServerLife {
    pub name: String,
    pub restarts: u64,
    pub last_exit: Option<String>,
}

/// The fleet's servers as the supervisor last wrote them.
fn servers(dir: &Path) -> Vec<ServerLife> {
    let text =
        std::fs::read_to_string(dir.join(crate::supervisor::SERVERS_FILE)).unwrap_or_default();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    json["servers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| {
            Some(ServerLife {
                name: s["name"].as_str()?.to_owned(),
                restarts: s["restarts"].as_u64().unwrap_or(0),
                last_exit: s["last_exit"].as_str().map(str::to_owned),
            })
        })
        .collect()
}

pub struct ConfigFile {
    pub name: String,
    pub text: String,
}

/// The run directory's copy of its config (`config.<ext>` for `nomad up --config`, else the
/// `nomad.yaml` `nomad up` wrote) and the versions its spans name.
pub fn about(dir: &Path, spans: &[Span]) -> About {
    let mut versions = BTreeMap::new();
    for span in spans {
        if let Some(version) = span.resource.get("service.version") {
            versions
                .entry(span.service_name.clone())
                .or_insert_with(|| version.clone());
        }
    }
    let copy = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("config."))
        .min();
    let config = copy
        .or_else(|| {
            dir.join("nomad.yaml")
                .is_file()
                .then(|| "nomad.yaml".into())
        })
        .and_then(|name| {
            let bytes = std::fs::read(dir.join(&name)).ok()?;
            let mut text =
                String::from_utf8_lossy(&bytes[..bytes.len().min(CONFIG_LIMIT)]).into_owned();
            if bytes.len() > CONFIG_LIMIT {
                text.push_str(&format!(
                    "\n[... cut at {CONFIG_LIMIT} of {} bytes]",
                    bytes.len()
                ));
            }
            Some(ConfigFile {
                name,
                text: hide_secrets(&text),
            })
        });
    About {
        versions,
        config,
        servers: servers(dir),
    }
}

/// Each line with a secret word in its key keeps the key and loses the value, unless the value
/// is only a `${VARIABLE}` reference (which names, not holds, the secret).
pub fn hide_secrets(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        out.push_str(&hide_in_line(line));
        out.push('\n');
    }
    out
}

fn hide_in_line(line: &str) -> String {
    let lower = line.to_ascii_lowercase();
    let Some(word) = SECRET_WORDS.iter().filter_map(|w| lower.find(w)).min() else {
        return line.to_owned();
    };
    let Some(separator) = lower[word..].find([':', '=']).map(|i| word + i) else {
        return line.to_owned();
    };
    let value = line[separator + 1..].trim();
    let reference = value.starts_with("${") && value.ends_with('}') && !value[2..].contains('$');
    if value.is_empty() || reference {
        return line.to_owned();
    }
    format!("{} <hidden>", &line[..=separator])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_values_are_hidden_and_references_kept() {
        let config = "\
tools:
  - kind: embed
    source: models/all-minilm-l6-v2
servers:
  search:
    url: https://example.com/mcp
    headers:
      Authorization: Bearer sk-live-123
    api_key: ${SEARCH_KEY}
gateway:
  token_file: /run/secrets/nomad
telemetry: {otlp_headers: {authorization: Bearer%20abc}}
PASSWORD=hunter2
";
        let shown = hide_secrets(config);
        for secret in ["sk-live-123", "/run/secrets/nomad", "abc", "hunter2"] {
            assert!(!shown.contains(secret), "{secret} shown:\n{shown}");
        }
        assert!(shown.contains("      Authorization: <hidden>"), "{shown}");
        assert!(shown.contains("    api_key: ${SEARCH_KEY}"), "{shown}");
        assert!(
            shown.contains("telemetry: {otlp_headers: {authorization: <hidden>"),
            "{shown}"
        );
        assert!(
            shown.contains("    source: models/all-minilm-l6-v2"),
            "{shown}"
        );
        assert!(
            shown.contains("    url: https://example.com/mcp"),
            "{shown}"
        );
        assert_eq!(shown.lines().count(), config.lines().count());
    }
}

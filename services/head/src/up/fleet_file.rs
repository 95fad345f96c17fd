//! `fleet.json`: `nomad up` writes it, and the commands that join a running fleet (`nomad run`,
//! `nomad top`) read it.

use std::path::{Path, PathBuf};

use anyhow::Context as _;

#[derive(Debug, serde::Deserialize)]
pub struct FleetFile {
    pub run_id: String,
    pub run_dir: Option<PathBuf>,
    pub scheduler: String,
    pub gateway: String,
    pub token: Option<String>,
    /// The fleet's telemetry variables, for a client to export where the fleet does.
    #[serde(default)]
    pub telemetry_env: std::collections::BTreeMap<String, String>,
}

/// Writes `fleet` as the run's `fleet.json`, and returns its path. Written whole, then renamed:
/// whoever waits for the file never reads half of it. It holds the fleet's token: readable by
/// this user only, from its first byte. A partial file an earlier start left behind is removed (a
/// link is removed, not followed).
pub fn write(run_dir: &Path, fleet: &serde_json::Value) -> anyhow::Result<PathBuf> {
    let path = run_dir.join("fleet.json");
    let partial = run_dir.join("fleet.json.partial");
    let _ = std::fs::remove_file(&partial);
    super::write_private(&partial, format!("{fleet:#}\n").as_bytes())
        .and_then(|()| std::fs::rename(&partial, &path))
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

impl FleetFile {
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the fleet file {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not a fleet.json of nomad up", path.display()))
    }

    /// Reads `path` and checks that the fleet still answers: its file outlives it, and a
    /// stopped fleet should be named as such, not met as a connection error on every call.
    pub async fn read_running(path: &Path) -> anyhow::Result<Self> {
        let fleet = Self::read(path)?;
        match gateway_answers(&fleet.gateway).await {
            Ok(()) => Ok(fleet),
            Err(Unanswered::Refused(e)) => anyhow::bail!(
                "fleet {} is not running: its gateway {} refuses connections ({e}); start it \
                 again with `nomad up` (its fleet.json: {})",
                fleet.run_id,
                fleet.gateway,
                path.display()
            ),
            Err(Unanswered::Silent) => anyhow::bail!(
                "fleet {} is not answering: its gateway {} did not accept a connection within \
                 3 s (its fleet.json: {})",
                fleet.run_id,
                fleet.gateway,
                path.display()
            ),
        }
    }
}

/// Why a gateway did not answer a connection.
#[derive(Debug)]
pub enum Unanswered {
    Refused(std::io::Error),
    /// No connection within 3 s.
    Silent,
}

/// Whether a gateway's address accepts a TCP connection within 3 s: a client checks once before
/// its first call, so a stopped fleet or a wrong address is named once, not met on every call.
pub async fn gateway_answers(address: &str) -> Result<(), Unanswered> {
    let host = address
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/');
    match tokio::time::timeout(
        std::time::Duration::from_secs(3),
        tokio::net::TcpStream::connect(host),
    )
    .await
    {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(Unanswered::Refused(e)),
        Err(_) => Err(Unanswered::Silent),
    }
}

//! What `nomad up` (and `nomad serve`) checks before it starts and says once the fleet is
//! ready: the config's tools as the scheduler reads them, then where everything is and how a
//! client gets in.

use std::path::Path;

use anyhow::Context as _;

use super::fleet::{Addresses, GatewayFront};

/// The ready fleet, as it is announced.
pub struct Ready<'a> {
    /// `nomad up` or `nomad serve`.
    pub who: &'a str,
    pub run_id: &'a str,
    pub runs_dir: &'a Path,
    pub run_dir: &'a Path,
    pub fleet_path: &'a Path,
    pub addresses: &'a Addresses,
    pub front: &'a GatewayFront,
    pub token: Option<&'a str>,
    pub servers: &'a [(String, u32)],
}

/// Prints, on stderr, that the fleet is ready and where each part of it is.
pub fn announce(r: &Ready<'_>) {
    let (who, run_id, addresses) = (r.who, r.run_id, r.addresses);
    eprintln!("{who}: run {run_id} is ready");
    let others: Vec<String> = crate::fleets::running(r.runs_dir)
        .into_iter()
        .filter(|id| id != run_id)
        .collect();
    if !others.is_empty() {
        eprintln!(
            "  note: also running under {}: {} (`nomad ps` lists them, `nomad down RUN_ID` stops one)",
            r.runs_dir.display(),
            others.join(", ")
        );
    }
    eprintln!("  run directory   {}", r.run_dir.display());
    eprintln!(
        "  fleet.json      {} (addresses and the token)",
        r.fleet_path.display()
    );
    eprintln!("  scheduler       {}", addresses.scheduler);
    eprintln!("  gateway (gRPC)  {}", addresses.gateway);
    match r.front {
        GatewayFront::Code => {
            eprintln!("  gateway (MCP)   {}", addresses.mcp_url);
            if let Some(tools) = &addresses.tools_url {
                eprintln!("  tools (MCP)     {tools}");
            }
        }
        GatewayFront::ToolsHttp { .. } => eprintln!("  MCP (the tools) {}", addresses.mcp_url),
        GatewayFront::ToolsStdio => {
            eprintln!("  MCP (the tools) on this process's stdin and stdout")
        }
    }
    // Over stdio the client is the process that started this one: no token is asked.
    if !matches!(r.front, GatewayFront::ToolsStdio) {
        eprintln!("  {}", token_line(r.token, r.fleet_path));
    }
    if let Some(openai) = &addresses.openai_url {
        eprintln!("  OpenAI API      {openai}");
    }
    for (name, pid) in r.servers {
        eprintln!(
            "  {name:<15} pid {pid}, log {}",
            r.run_dir.join(format!("{name}.log")).display()
        );
    }
}

/// `nomad-scheduler --check` on the config: its tools load as the scheduler will load them.
pub fn check_tools(bin_dir: &Path, config: &Path) -> anyhow::Result<()> {
    let scheduler = bin_dir.join("nomad-scheduler");
    let checked = std::process::Command::new(&scheduler)
        .arg("--check")
        .arg("--config")
        .arg(config)
        .stdin(std::process::Stdio::null())
        .output()
        .with_context(|| format!("running {} --check", scheduler.display()))?;
    if checked.status.success() {
        return Ok(());
    }
    let said = String::from_utf8_lossy(&checked.stderr);
    anyhow::bail!("{}: {}", config.display(), said.trim_end())
}

/// How an HTTP client gets in: the token itself where only this user can read the terminal,
/// else where it is kept.
fn token_line(token: Option<&str>, fleet_path: &Path) -> String {
    match token {
        None => "token           none: the fleet is open (auth: none)".to_owned(),
        Some(token) if private_terminal() => format!(
            "token           {token} (send `Authorization: Bearer <token>`; also in {})",
            fleet_path.display()
        ),
        Some(_) => format!(
            "token           in {} as \"token\" (send `Authorization: Bearer <token>`)",
            fleet_path.display()
        ),
    }
}

/// Whether standard error is a terminal that this user owns and no one else can read (a log
/// file or a shared terminal never gets the token).
fn private_terminal() -> bool {
    use std::os::unix::fs::MetadataExt as _;
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return false;
    }
    std::fs::metadata("/proc/self/fd/2").is_ok_and(|m| {
        // SAFETY: getuid has no preconditions and cannot fail.
        m.uid() == unsafe { libc::getuid() } && m.mode() & 0o044 == 0
    })
}

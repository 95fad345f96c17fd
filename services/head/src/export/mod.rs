//! `nomad export CONFIG OUTPUT`: the original Nomad's command. Every model a config names is
//! copied into OUTPUT/models (`--to disk`) or pushed to a registry as an OCI artifact (`--to
//! oras`), and OUTPUT/nomad.yml is written naming each where it went (by digest with `--pin`),
//! beside each model's card and a README that reports what was exported. A node without Hub or
//! git access starts from that config alone.

mod bundle;
mod report;

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use nomad_sources::Artifact;

use crate::config_sources::{SOURCE_KEYS, set_value};
use crate::up::ready;

/// Where the models go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// Copied into OUTPUT/models; the config names them by relative path.
    #[value(alias = "dir")]
    Disk,
    /// Pushed to --oras-registry as OCI artifacts; the config names them oras://.
    Oras,
}

#[derive(clap::Args)]
pub struct ExportArgs {
    /// The config whose models are exported (YAML, as the original's nomad.yml).
    pub config: PathBuf,
    /// Directory written: nomad.yml (the config naming where each model went), cards/ (each
    /// model's card), README.md (the report) and, with --to disk, models/.
    pub output: PathBuf,
    /// `disk` copies every model into OUTPUT/models; `oras` pushes each to --oras-registry.
    #[arg(long, value_enum, default_value = "disk")]
    pub to: Target,
    /// With --to oras: the repository every model is pushed to, each as a tag of its own
    /// (e.g. registry.example.org/scifm; credentials as for pulling: docs/models.md).
    #[arg(long, alias = "registry", value_name = "REGISTRY/REPOSITORY")]
    pub oras_registry: Option<String>,
    /// Name each pushed model by its digest in the written config (the default).
    #[arg(long, overrides_with = "no_pin")]
    pub pin: bool,
    /// Name each pushed model by its tag instead (what the tag names at each start).
    #[arg(long, overrides_with = "pin")]
    pub no_pin: bool,
    /// Where sources are pulled and cloned to (as the device worker's --cache-dir).
    #[arg(long, env = "NOMAD_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Directory of the service binaries (the config is checked with nomad-scheduler --check).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
}

/// One model as exported.
pub struct Exported {
    /// The tool's name (or the entry's place when it names none).
    pub tool: String,
    pub section: &'static str,
    pub original: String,
    /// The source as found (a tag or branch replaced by what it named).
    pub pinned: String,
    pub written: String,
    pub digest: Option<String>,
    pub files: usize,
    pub bytes: u64,
    pub requirements: Vec<String>,
    pub card: String,
}

pub async fn export(args: ExportArgs) -> anyhow::Result<bool> {
    let config =
        std::path::absolute(&args.config).with_context(|| format!("{}", args.config.display()))?;
    if !matches!(
        config.extension().and_then(|e| e.to_str()),
        Some("yml" | "yaml")
    ) {
        anyhow::bail!(
            "{}: nomad export reads a YAML config (nomad.yml)",
            config.display()
        );
    }
    let registry = match (args.to, args.oras_registry.as_deref()) {
        (Target::Oras, None) => {
            anyhow::bail!("--to oras needs --oras-registry REGISTRY/REPOSITORY")
        }
        (Target::Oras, Some(r)) => Some(repository(r)?),
        (Target::Disk, Some(_)) => anyhow::bail!("--oras-registry is for --to oras"),
        (Target::Disk, None) => None,
    };
    let bin_dir = crate::up::bin_dir(args.bin_dir.as_deref())?;
    // The tools must read as the scheduler will read the written config.
    ready::check_tools(&bin_dir, &config)?;
    let out = std::path::absolute(&args.output)?;
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let written_config = out.join("nomad.yml");
    if written_config.canonicalize().ok() == config.canonicalize().ok() {
        anyhow::bail!(
            "{}: OUTPUT must be another directory than the config's own",
            out.display()
        );
    }
    let cache = args
        .cache_dir
        .unwrap_or_else(nomad_sources::default_cache_dir);
    let pin = !args.no_pin;
    let base_dir = config.parent().unwrap_or(Path::new("/")).to_owned();
    let mut document: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(&config).with_context(|| config.display().to_string())?,
    )
    .with_context(|| format!("{}: not valid YAML", config.display()))?;
    // Sources and files as the config means them: `${VAR}` expanded.
    let expanded = nomad_config::ConfigFile::load(Some(&config))?;
    let registries: nomad_config::registries::Registries = expanded.section("registries")?;
    nomad_config::registries::check(&registries).map_err(anyhow::Error::msg)?;
    let mut exported = Vec::new();
    let mut bundle = bundle::Bundle::new(&out, &registries);
    for (section, key, name_key) in SOURCE_KEYS {
        let entries: Vec<serde_json::Value> = expanded.section(section).unwrap_or_default();
        for (index, entry) in entries.iter().enumerate() {
            let Some(source) = entry.get(key).and_then(|s| s.as_str()) else {
                continue;
            };
            // Named as the scheduler names it when the entry does not: by the class (the last
            // part of `model_class`), else by the entry's place.
            let class = entry.get("model_class").and_then(|c| c.as_str());
            let tool = match (entry.get(name_key).and_then(|n| n.as_str()), class) {
                (Some(name), _) => name.to_owned(),
                (None, Some(class)) => class.rsplit('.').next().unwrap_or(class).to_owned(),
                (None, None) => format!("{section}[{index}]"),
            };
            eprintln!("nomad export: {tool}: reading {source}");
            let resolved =
                nomad_sources::resolve(source, &base_dir.to_string_lossy(), &cache, &registries)
                    .await
                    .with_context(|| format!("{section}[{index}] ({tool})"))?;
            let path = resolved.path;
            let (written, digest) = match &registry {
                None => (bundle.copy(&tool, &path)?, None),
                Some(repository) => {
                    let (written, digest) = bundle.push(&tool, &path, repository, pin).await?;
                    (written, Some(digest))
                }
            };
            let (files, bytes) = bundle::size(&path);
            eprintln!(
                "nomad export: {tool}: {files} files, {} -> {written}",
                report::human_bytes(bytes)
            );
            set_value(&mut document, section, index, key, written.as_str().into())?;
            let requirements = requirements(entry, &base_dir)
                .with_context(|| format!("{section}[{index}] ({tool}): env"))?;
            if !requirements.is_empty() {
                // The environment travels inside the config, as the list the file held.
                let list = serde_yaml::to_value(&requirements)?;
                set_value(&mut document, section, index, "env", list)?;
            }
            let card = report::card(&tool, &path, source, &written, digest.as_deref());
            exported.push(Exported {
                tool,
                section,
                original: source.to_owned(),
                pinned: resolved.pinned,
                written,
                digest,
                files,
                bytes,
                requirements,
                card,
            });
        }
    }
    if exported.is_empty() {
        anyhow::bail!(
            "{}: names no model to export (fmod_models' name_or_path, tools' source)",
            config.display()
        );
    }
    let modules = bundle::copy_modules(&base_dir, &out)?;
    let header = format!(
        "# Written by `nomad export` from {} ({}).\n",
        config.display(),
        match (args.to, pin) {
            (Target::Disk, _) => "models copied into models/".to_owned(),
            (Target::Oras, true) => "models pushed as OCI artifacts, named by digest".to_owned(),
            (Target::Oras, false) => "models pushed as OCI artifacts, named by tag".to_owned(),
        }
    );
    std::fs::write(&written_config, header + &serde_yaml::to_string(&document)?)?;
    report::write(&out, &config, &exported, &modules)?;
    eprintln!(
        "nomad export: wrote {} ({} models), cards/ and README.md; start it with `nomad up {}`",
        written_config.display(),
        exported.len(),
        written_config.display()
    );
    Ok(true)
}

/// `--oras-registry` read as `registry/repository` (an `oras://` prefix allowed).
fn repository(text: &str) -> anyhow::Result<Artifact> {
    let text = text.trim().trim_start_matches("oras://").trim_matches('/');
    match nomad_sources::Source::parse(&format!("oras://{text}")) {
        Ok(nomad_sources::Source::Oras {
            artifact,
            subdir: None,
        }) if artifact.tag.is_none() && artifact.digest.is_none() => Ok(artifact),
        Ok(_) => anyhow::bail!(
            "--oras-registry {text:?}: name a repository without tag, digest or #subdir \
             (each model is pushed as a tag of its own)"
        ),
        Err(e) => anyhow::bail!("--oras-registry {text:?}: {e}"),
    }
}

/// An entry's `env` when it is a requirements file, read as the scheduler reads it.
fn requirements(entry: &serde_json::Value, base_dir: &Path) -> anyhow::Result<Vec<String>> {
    match entry.get("env").and_then(|e| e.as_str()) {
        Some(file) if nomad_config::requirements::is_file(file) => {
            nomad_config::requirements::read(file, &base_dir.to_string_lossy())
                .map_err(anyhow::Error::msg)
        }
        _ => Ok(Vec::new()),
    }
}

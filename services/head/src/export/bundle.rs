//! Where each model goes: copied into OUTPUT/models, or pushed as an artifact; a source two
//! entries share goes once.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use nomad_config::registries::Registries;
use nomad_sources::Artifact;
use nomad_sources::oras::{self, Packed};

pub struct Bundle<'a> {
    out: &'a Path,
    /// The config's `registries:` (the variables holding each registry's login).
    registries: &'a Registries,
    /// Names taken in OUTPUT/models and as tags.
    names: HashSet<String>,
    /// What a model's files became, by their local path.
    done: HashMap<PathBuf, (String, Option<String>)>,
}

/// A name safe as a directory and as an OCI tag: letters, digits, `.`, `_`, `-`.
fn safe_name(tool: &str) -> String {
    let name: String = tool
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    let name = name.trim_matches(['-', '.']).to_owned();
    if name.is_empty() {
        "model".to_owned()
    } else {
        name.chars().take(64).collect()
    }
}

impl<'a> Bundle<'a> {
    pub fn new(out: &'a Path, registries: &'a Registries) -> Self {
        Bundle {
            out,
            registries,
            names: HashSet::new(),
            done: HashMap::new(),
        }
    }

    fn unique(&mut self, tool: &str) -> String {
        let base = safe_name(tool);
        let mut name = base.clone();
        let mut n = 2;
        while !self.names.insert(name.clone()) {
            name = format!("{base}-{n}");
            n += 1;
        }
        name
    }

    /// Copies the model at `path` into OUTPUT/models/<name> and returns how the written config
    /// names it (relative to OUTPUT).
    pub fn copy(&mut self, tool: &str, path: &Path) -> anyhow::Result<String> {
        if let Some((written, _)) = self.done.get(path) {
            return Ok(written.clone());
        }
        let name = self.unique(tool);
        let into = self.out.join("models").join(&name);
        if into.exists() {
            std::fs::remove_dir_all(&into)
                .with_context(|| format!("replacing {}", into.display()))?;
        }
        std::fs::create_dir_all(&into)?;
        let written = if path.is_file() {
            let file = path.file_name().context("a model file without a name")?;
            std::fs::copy(path, into.join(file))
                .with_context(|| format!("copying {}", path.display()))?;
            format!("models/{name}/{}", file.to_string_lossy())
        } else {
            copy_tree(path, &into)?;
            format!("models/{name}")
        };
        self.done.insert(path.to_owned(), (written.clone(), None));
        Ok(written)
    }

    /// Pushes the model at `path` to `repository` as the tag `<name>-<fingerprint>` and returns
    /// how the written config names it (by digest with `pin`) and the manifest's digest.
    pub async fn push(
        &mut self,
        tool: &str,
        path: &Path,
        repository: &Artifact,
        pin: bool,
    ) -> anyhow::Result<(String, String)> {
        if let Some((written, Some(digest))) = self.done.get(path) {
            return Ok((written.clone(), digest.clone()));
        }
        let packed = Packed::new(path).with_context(|| format!("packing {}", path.display()))?;
        let name = self.unique(tool);
        let tag = format!("{name}-{}", &packed.fingerprint()[..12]);
        let target = Artifact {
            tag: Some(tag),
            ..repository.clone()
        };
        eprintln!("nomad export: {tool}: pushing to {target}");
        let digest = oras::push(&target.to_string(), &target, packed, self.registries).await?;
        let artifact = if pin { target.pinned(&digest) } else { target };
        // A single file is the artifact's one layer: the source names it inside.
        let written = match path.is_file().then(|| path.file_name()).flatten() {
            Some(file) => format!("{artifact}#{}", file.to_string_lossy()),
            None => artifact.to_string(),
        };
        self.done
            .insert(path.to_owned(), (written.clone(), Some(digest.clone())));
        Ok((written, digest))
    }
}

/// Copies `from` into `to` (files read through links, as a Hugging Face snapshot is made of
/// them).
fn copy_tree(from: &Path, to: &Path) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(from).with_context(|| from.display().to_string())? {
        let entry = entry?;
        let source = entry.path();
        let target = to.join(entry.file_name());
        let metadata = std::fs::metadata(&source)?;
        if metadata.is_dir() {
            std::fs::create_dir_all(&target)?;
            copy_tree(&source, &target)?;
        } else if metadata.is_file() {
            std::fs::copy(&source, &target)
                .with_context(|| format!("copying {}", source.display()))?;
        }
    }
    Ok(())
}

/// The files under `path` and their bytes.
pub fn size(path: &Path) -> (usize, u64) {
    let Ok(metadata) = std::fs::metadata(path) else {
        return (0, 0);
    };
    if metadata.is_file() {
        return (1, metadata.len());
    }
    let mut total = (0, 0);
    for entry in std::fs::read_dir(path).into_iter().flatten().flatten() {
        let (files, bytes) = size(&entry.path());
        total = (total.0 + files, total.1 + bytes);
    }
    total
}

/// The config's Python modules beside it (`*.py` files and packages), which a model's class may
/// live in, copied beside the written config: its directory is first on the model host's import
/// path, as the original's was.
pub fn copy_modules(base_dir: &Path, out: &Path) -> anyhow::Result<Vec<String>> {
    let mut copied = Vec::new();
    for entry in std::fs::read_dir(base_dir)?.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_module = path.is_file() && name.ends_with(".py");
        let is_package = path.is_dir() && path.join("__init__.py").is_file();
        if !(is_module || is_package) || path == out {
            continue;
        }
        let target = out.join(&name);
        if is_module {
            std::fs::copy(&path, &target)?;
        } else {
            std::fs::create_dir_all(&target)?;
            copy_tree(&path, &target)?;
        }
        copied.push(name);
    }
    copied.sort();
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_safe_as_directories_and_tags_and_never_taken_twice() {
        assert_eq!(safe_name("org---model"), "org---model");
        assert_eq!(safe_name("my model/v1"), "my-model-v1");
        assert_eq!(safe_name("../.."), "model");
        let out = std::env::temp_dir();
        let registries = Registries::new();
        let mut bundle = Bundle::new(&out, &registries);
        assert_eq!(bundle.unique("embed"), "embed");
        assert_eq!(bundle.unique("embed"), "embed-2");
        assert_eq!(bundle.unique("embed"), "embed-3");
    }
}

//! An artifact's layers as files: each layer named by its `org.opencontainers.image.title`
//! annotation, a gzipped tar layer unpacked into a directory. Pulled into a directory of its own
//! and renamed into place whole, so an interrupted pull leaves nothing a later start would read.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use oci_client::client::ImageLayer;
use oci_client::manifest::{OciDescriptor, OciImageManifest};
use oci_client::{Client, Reference};

use super::{RegistryFailure, failed, registry_error};
use crate::SourceError;

/// The annotation naming a layer's file (or directory), as every oras client writes it.
pub const TITLE: &str = "org.opencontainers.image.title";
/// The annotation the oras CLI puts on a directory's layer.
const UNPACK: &str = "io.deis.oras.content.unpack";
/// A file's layer and a directory's, as oras pushes them.
const FILE_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar";
const DIRECTORY_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// The artifact's (empty) config, as oras-py writes it.
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.unknown.config.v1+json";

/// A layer's title as a path inside the artifact, refused if it could land outside it.
fn title_path(layer: &OciDescriptor) -> Result<PathBuf, String> {
    let title = layer
        .annotations
        .as_ref()
        .and_then(|a| a.get(TITLE))
        .ok_or_else(|| format!("layer {} has no {TITLE} annotation", layer.digest))?;
    let path = PathBuf::from(title);
    let plain = !title.is_empty()
        && path
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    if plain {
        Ok(path)
    } else {
        Err(format!(
            "layer title {title:?} is not a relative path inside the artifact"
        ))
    }
}

fn is_directory(layer: &OciDescriptor) -> bool {
    layer.media_type.ends_with("tar+gzip")
        || layer
            .annotations
            .as_ref()
            .and_then(|a| a.get(UNPACK))
            .is_some_and(|v| v == "true")
}

/// Unpacks a directory's layer into `into`, refusing entries that are not plain files or
/// directories (links could point outside the cache) and paths that climb.
fn unpack(archive: &Path, into: &Path) -> Result<(), String> {
    let file = std::fs::File::open(archive).map_err(|e| e.to_string())?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(file));
    for entry in tar.entries().map_err(|e| e.to_string())? {
        let mut entry = entry.map_err(|e| e.to_string())?;
        let path = entry.path().map_err(|e| e.to_string())?.into_owned();
        let kind = entry.header().entry_type();
        if !(kind.is_file() || kind.is_dir()) {
            return Err(format!(
                "{}: only files and directories are unpacked",
                path.display()
            ));
        }
        if !entry
            .unpack_in(into)
            .map_err(|e| format!("{}: {e}", path.display()))?
        {
            return Err(format!("{}: climbs out of the artifact", path.display()));
        }
    }
    Ok(())
}

/// Removes the staging directories of pulls whose process is gone (a worker killed mid-pull):
/// each is named `<digest>.pull-<pid>-<n>`, and a live process keeps its own.
fn remove_dead_pulls(store: &Path) {
    let Ok(entries) = std::fs::read_dir(store) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((_, rest)) = name.split_once(".pull-") else {
            continue;
        };
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        let alive = pid.is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
        if !alive {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Pulls every layer of `manifest` into `dir` (which must not exist yet).
pub async fn pull_into(
    spec: &str,
    client: &Client,
    reference: &Reference,
    manifest: &OciImageManifest,
    dir: &Path,
) -> Result<(), SourceError> {
    let cache_error = |e: std::io::Error| SourceError::Cache {
        path: dir.display().to_string(),
        reason: e.to_string(),
    };
    let artifact_error = |detail: String| registry_error(spec, RegistryFailure::Artifact, detail);
    if manifest.layers.is_empty() {
        return Err(artifact_error("the artifact has no layers".into()));
    }
    let parent = dir.parent().unwrap_or(dir);
    std::fs::create_dir_all(parent).map_err(cache_error)?;
    // Of this pull alone: two tools of one worker may pull the same digest at once.
    static PULLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let staging = parent.join(format!(
        "{}.pull-{}-{}",
        dir.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("artifact"),
        std::process::id(),
        PULLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(cache_error)?;
    }
    remove_dead_pulls(parent);
    std::fs::create_dir_all(&staging).map_err(cache_error)?;
    let result = async {
        for layer in &manifest.layers {
            let title = title_path(layer).map_err(artifact_error)?;
            let directory = is_directory(layer);
            let target = if directory {
                staging.join(format!(".layer-{}", layer.digest.replace(':', "-")))
            } else {
                staging.join(&title)
            };
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent).map_err(cache_error)?;
            }
            let file = tokio::fs::File::create(&target)
                .await
                .map_err(cache_error)?;
            client
                .pull_blob(reference, layer, file)
                .await
                .map_err(|e| failed(spec, &e))?;
            if directory {
                let into = staging.clone();
                let archive = target.clone();
                tokio::task::spawn_blocking(move || unpack(&archive, &into))
                    .await
                    .map_err(|e| artifact_error(e.to_string()))?
                    .map_err(|e| artifact_error(format!("layer {}: {e}", title.display())))?;
                std::fs::remove_file(&target).map_err(cache_error)?;
            }
        }
        Ok(())
    }
    .await;
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e);
    }
    match std::fs::rename(&staging, dir) {
        Ok(()) => Ok(()),
        // Another puller put the same digest in place first: its copy is as good.
        Err(_) if dir.is_dir() => {
            let _ = std::fs::remove_dir_all(&staging);
            Ok(())
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&staging);
            Err(cache_error(e))
        }
    }
}

/// A directory's top-level entries as layers (or a file alone as one): a file as itself, a
/// directory as a gzipped tar of it (its name the tar's top entry), in name order so the same
/// files push the same digest.
pub fn pack(dir: &Path) -> std::io::Result<Vec<ImageLayer>> {
    let mut entries: Vec<(String, PathBuf)> = if std::fs::metadata(dir)?.is_file() {
        let name = dir.file_name().unwrap_or_default();
        vec![(name.to_string_lossy().into_owned(), dir.to_owned())]
    } else {
        std::fs::read_dir(dir)?
            .map(|e| e.map(|e| (e.file_name().to_string_lossy().into_owned(), e.path())))
            .collect::<Result<_, _>>()?
    };
    entries.sort();
    let mut layers = Vec::new();
    for (name, path) in entries {
        let mut annotations = BTreeMap::from([(TITLE.to_owned(), name.clone())]);
        // Follows links, as a model directory from the Hugging Face cache is made of them.
        let metadata = std::fs::metadata(&path)?;
        if metadata.is_dir() {
            let mut tar = tar::Builder::new(flate2::write::GzEncoder::new(
                Vec::new(),
                flate2::Compression::default(),
            ));
            tar.follow_symlinks(true);
            tar.mode(tar::HeaderMode::Deterministic);
            tar.append_dir_all(&name, &path)?;
            let data = tar.into_inner()?.finish()?;
            annotations.insert(UNPACK.to_owned(), "true".to_owned());
            layers.push(ImageLayer::new(
                data,
                DIRECTORY_MEDIA_TYPE.to_owned(),
                Some(annotations),
            ));
        } else if metadata.is_file() {
            layers.push(ImageLayer::new(
                std::fs::read(&path)?,
                FILE_MEDIA_TYPE.to_owned(),
                Some(annotations),
            ));
        }
    }
    if layers.is_empty() {
        return Err(std::io::Error::other("no files to push"));
    }
    Ok(layers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn descriptor(title: Option<&str>) -> OciDescriptor {
        OciDescriptor {
            digest: "sha256:00".into(),
            annotations: title
                .map(|t| std::collections::BTreeMap::from([(TITLE.to_owned(), t.to_owned())])),
            ..Default::default()
        }
    }

    #[test]
    fn a_dead_pulls_staging_is_removed_and_a_live_ones_kept() {
        let store = std::env::temp_dir().join(format!("nomad-pulls-{}", std::process::id()));
        // No process has this pid (above the kernel's pid_max).
        let dead = store.join("sha256-ab.pull-4194305-0");
        let live = store.join(format!("sha256-ab.pull-{}-0", std::process::id()));
        let stored = store.join("sha256-cd");
        for dir in [&dead, &live, &stored] {
            std::fs::create_dir_all(dir).unwrap();
        }
        remove_dead_pulls(&store);
        assert!(!dead.exists());
        assert!(live.exists() && stored.exists());
        std::fs::remove_dir_all(&store).unwrap();
    }

    #[test]
    fn a_layer_title_that_could_leave_the_artifact_is_refused() {
        assert_eq!(
            title_path(&descriptor(Some("model.safetensors"))).unwrap(),
            PathBuf::from("model.safetensors")
        );
        assert_eq!(
            title_path(&descriptor(Some("onnx/model.onnx"))).unwrap(),
            PathBuf::from("onnx/model.onnx")
        );
        for bad in ["../escape", "/etc/passwd", "a/../../b", ""] {
            let error = title_path(&descriptor(Some(bad))).unwrap_err();
            assert!(
                error.contains("not a relative path inside the artifact"),
                "{bad}: {error}"
            );
        }
        assert!(
            title_path(&descriptor(None))
                .unwrap_err()
                .contains("has no org.opencontainers.image.title")
        );
    }

    #[test]
    fn a_packed_directory_unpacks_to_the_same_files_and_links_are_refused() {
        let root = std::env::temp_dir().join(format!("nomad-layers-{}", std::process::id()));
        let model = root.join("model");
        std::fs::create_dir_all(model.join("tokenizer")).unwrap();
        std::fs::write(model.join("config.json"), "{}").unwrap();
        std::fs::write(model.join("tokenizer/vocab.txt"), "a\nb\n").unwrap();
        let layers = pack(&model).unwrap();
        assert_eq!(layers.len(), 2);
        assert_eq!(layers[0].media_type, FILE_MEDIA_TYPE);
        assert_eq!(layers[1].media_type, DIRECTORY_MEDIA_TYPE);
        // The same files pack to the same bytes (so the same digest).
        assert_eq!(pack(&model).unwrap()[1].data, layers[1].data);
        let archive = root.join("layer.tar.gz");
        std::fs::write(&archive, &layers[1].data).unwrap();
        let out = root.join("out");
        std::fs::create_dir_all(&out).unwrap();
        unpack(&archive, &out).unwrap();
        assert_eq!(
            std::fs::read_to_string(out.join("tokenizer/vocab.txt")).unwrap(),
            "a\nb\n"
        );

        // A tar with a link pointing out of the cache is refused by the link's name.
        let mut tar = tar::Builder::new(flate2::write::GzEncoder::new(
            Vec::new(),
            flate2::Compression::fast(),
        ));
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Symlink);
        header.set_size(0);
        tar.append_link(&mut header, "weights/escape", "/etc")
            .unwrap();
        std::fs::write(&archive, tar.into_inner().unwrap().finish().unwrap()).unwrap();
        let error = unpack(&archive, &out).unwrap_err();
        assert!(
            error.contains("weights/escape: only files and directories"),
            "{error}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}

//! Where a config names its models (`fmod_models[].name_or_path`, `tools[].source`), and
//! rewriting those in the YAML as written (keys in order, other values untouched): `nomad
//! export` names where each model went, `nomad up` pins the run's kept copy to what it served.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Context as _;

/// The sections whose entries name a model: the key holding the source, the one holding the
/// tool's name.
pub const SOURCE_KEYS: [(&str, &str, &str); 2] = [
    ("fmod_models", "name_or_path", "tool_name"),
    ("tools", "source", "name"),
];

/// Sets `key` of `section[index]` in `document`.
pub fn set_value(
    document: &mut serde_yaml::Value,
    section: &str,
    index: usize,
    key: &str,
    value: serde_yaml::Value,
) -> anyhow::Result<()> {
    let entry = document
        .get_mut(section)
        .and_then(|s| s.get_mut(index))
        .and_then(|e| e.as_mapping_mut())
        .with_context(|| format!("{section}[{index}] is not a mapping in the file"))?;
    entry.insert(key.into(), value);
    Ok(())
}

/// Rewrites the YAML config `file` (a copy of `config`, which gives the `${VAR}`-expanded
/// sources) with each source in `pins` replaced by what it was pinned to; returns how many.
pub fn pin_file(
    file: &Path,
    config: &Path,
    pins: &HashMap<String, String>,
) -> anyhow::Result<usize> {
    let text = std::fs::read_to_string(file).with_context(|| file.display().to_string())?;
    let mut document: serde_yaml::Value = serde_yaml::from_str(&text)?;
    let expanded = nomad_config::ConfigFile::load(Some(config))?;
    let mut pinned = 0;
    for (section, key, _) in SOURCE_KEYS {
        let entries: Vec<serde_json::Value> = expanded.section(section).unwrap_or_default();
        for (index, entry) in entries.iter().enumerate() {
            let source = entry.get(key).and_then(|s| s.as_str()).unwrap_or_default();
            if let Some(to) = pins.get(source) {
                set_value(&mut document, section, index, key, to.as_str().into())?;
                pinned += 1;
            }
        }
    }
    if pinned > 0 {
        let header = "# The config this run started from, each model source pinned to the digest \
                      or commit it served.\n";
        std::fs::write(
            file,
            format!("{header}{}", serde_yaml::to_string(&document)?),
        )?;
    }
    Ok(pinned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_config_names_the_commits_and_digests_it_served() {
        let dir = std::env::temp_dir().join(format!("nomad-pin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("nomad.yml");
        let text = "tools:\n  - {name: embed, kind: embed, source: 'oras://r:5000/m:v1'}\n  \
                    - {name: local, kind: mlp, source: models/mlp}\n\
                    fmod_models:\n  - model_class: a.B\n    name_or_path: hf://org/m\n";
        std::fs::write(&config, text).unwrap();
        let copy = dir.join("kept.yml");
        std::fs::write(&copy, text).unwrap();
        let pins = HashMap::from([
            (
                "oras://r:5000/m:v1".to_owned(),
                "oras://r:5000/m@sha256:ab".to_owned(),
            ),
            ("hf://org/m".to_owned(), "hf://org/m@0123".to_owned()),
        ]);
        assert_eq!(pin_file(&copy, &config, &pins).unwrap(), 2);
        let kept: serde_yaml::Value =
            serde_yaml::from_str(&std::fs::read_to_string(&copy).unwrap()).unwrap();
        assert_eq!(kept["tools"][0]["source"], "oras://r:5000/m@sha256:ab");
        assert_eq!(kept["tools"][1]["source"], "models/mlp");
        assert_eq!(kept["fmod_models"][0]["name_or_path"], "hf://org/m@0123");
        assert_eq!(kept["fmod_models"][0]["model_class"], "a.B");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

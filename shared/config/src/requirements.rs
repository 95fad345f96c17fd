//! `env:` as a file: a `requirements.txt` (pip's format) or a `pyproject.toml` (its
//! `[project] dependencies`), path relative to the config file. Read here into the list the
//! worker installs, so the environment is named by what the file says, not by its path.

use std::path::{Path, PathBuf};

/// How deep `-r other.txt` may nest (a loop of includes stops here, named).
const MAX_INCLUDE_DEPTH: usize = 8;

/// Whether `text` (one `env:` string) names a requirements file rather than one requirement.
pub fn is_file(text: &str) -> bool {
    let text = text.trim();
    let lower = text.to_ascii_lowercase();
    !text.contains(char::is_whitespace)
        && !text.contains(['=', '<', '>', '~', '!', ';', '['])
        && (lower.ends_with(".txt") || lower.ends_with(".toml"))
}

/// The requirements (and installer options, each argument on its own) that `file` names.
pub fn read(file: &str, base_dir: &str) -> Result<Vec<String>, String> {
    let path = Path::new(base_dir).join(file);
    if !path.is_file() {
        return Err(format!(
            "`env` names the requirements file {}, which does not exist (a relative path is \
             read from the config file's directory)",
            path.display()
        ));
    }
    let is_pyproject = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.to_ascii_lowercase().ends_with(".toml"));
    let requirements = if is_pyproject {
        pyproject(&path)?
    } else {
        let mut out = Vec::new();
        requirements_txt(&path, 0, &mut out)?;
        out
    };
    if requirements.is_empty() {
        return Err(format!(
            "`env` names {}, which lists no requirements",
            path.display()
        ));
    }
    Ok(requirements)
}

fn pyproject(path: &Path) -> Result<Vec<String>, String> {
    #[derive(serde::Deserialize)]
    struct Pyproject {
        project: Option<Project>,
    }
    #[derive(serde::Deserialize)]
    struct Project {
        #[serde(default)]
        dependencies: Vec<String>,
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let parsed: Pyproject = toml::from_str(&text)
        .map_err(|e| format!("{}: not a valid pyproject.toml: {e}", path.display()))?;
    let Some(project) = parsed.project else {
        return Err(format!(
            "{}: has no [project] table; `env` reads its `dependencies`",
            path.display()
        ));
    };
    Ok(project.dependencies)
}

/// A local path in a requirement (`./pkg`, `../wheel.whl`, `-e ./pkg`, `file:`) made absolute,
/// since the installer runs elsewhere.
fn absolute(argument: &str, dir: &Path) -> String {
    if argument.starts_with("./") || argument.starts_with("../") {
        dir.join(argument).to_string_lossy().into_owned()
    } else {
        argument.to_owned()
    }
}

/// pip's requirements format: comments, blank lines, `\` continuations, `-r`/`--requirement`
/// includes (relative to the including file), options split into their arguments.
fn requirements_txt(path: &Path, depth: usize, out: &mut Vec<String>) -> Result<(), String> {
    if depth > MAX_INCLUDE_DEPTH {
        return Err(format!(
            "{}: requirements files include each other more than {MAX_INCLUDE_DEPTH} deep",
            path.display()
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let joined = text.replace("\\\n", "");
    for (number, line) in joined.lines().enumerate() {
        // A comment starts a line or follows whitespace (a URL's `#egg=` fragment stays).
        let line = match line.find(" #").or_else(|| line.find("\t#")) {
            Some(at) => &line[..at],
            None if line.trim_start().starts_with('#') => "",
            None => line,
        };
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        match words[0] {
            "-r" | "--requirement" | "-c" | "--constraint" => {
                let Some(target) = words.get(1) else {
                    return Err(format!(
                        "{}:{}: {} needs a file",
                        path.display(),
                        number + 1,
                        words[0]
                    ));
                };
                let target: PathBuf = dir.join(target);
                if matches!(words[0], "-r" | "--requirement") {
                    requirements_txt(&target, depth + 1, out)?;
                } else {
                    out.push("-c".into());
                    out.push(target.to_string_lossy().into_owned());
                }
            }
            word if word.starts_with('-') => {
                out.extend(words.iter().map(|w| absolute(w, dir)));
            }
            _ => out.push(absolute(line, dir)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requirements_file_is_told_from_a_requirement() {
        for file in [
            "requirements.txt",
            "envs/model.txt",
            "pyproject.toml",
            "../Pyproject.TOML",
        ] {
            assert!(is_file(file), "{file}");
        }
        for requirement in [
            "numpy",
            "numpy==2.1",
            "torch>=2; python_version>'3.9'",
            "scifm[all]",
            "nomad-scifm",
        ] {
            assert!(!is_file(requirement), "{requirement}");
        }
    }

    #[test]
    fn requirements_files_are_read_as_pip_and_pyproject_read_them() {
        let dir = std::env::temp_dir().join(format!("nomad-requirements-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("envs")).unwrap();
        for (name, text) in [
            (
                "envs/base.txt",
                "# shared\nsix==1.16.0  # pinned\n--extra-index-url https://example.org/simple\n",
            ),
            (
                "requirements.txt",
                "-r envs/base.txt\n\nnumpy>=1.26 \\\n  ; python_version >= '3.9'\n./local_pkg\n\
                 pkg @ https://example.org/pkg.zip#egg=pkg\n",
            ),
        ] {
            std::fs::write(dir.join(name), text).unwrap();
        }
        let base = dir.to_string_lossy().into_owned();
        assert_eq!(
            read("requirements.txt", &base).unwrap(),
            vec![
                "six==1.16.0".to_owned(),
                "--extra-index-url".into(),
                "https://example.org/simple".into(),
                "numpy>=1.26   ; python_version >= '3.9'".into(),
                dir.join("./local_pkg").to_string_lossy().into_owned(),
                "pkg @ https://example.org/pkg.zip#egg=pkg".into(),
            ]
        );
        std::fs::write(
            dir.join("pyproject.toml"),
            "[project]\nname = \"m\"\ndependencies = [\"numpy>=1.26\", \"six\"]\n",
        )
        .unwrap();
        assert_eq!(
            read("pyproject.toml", &base).unwrap(),
            vec!["numpy>=1.26", "six"]
        );

        std::fs::write(dir.join("loop.txt"), "-r loop.txt\n").unwrap();
        std::fs::write(dir.join("tool.toml"), "[tool.x]\na = 1\n").unwrap();
        std::fs::write(dir.join("empty.txt"), "# nothing\n").unwrap();
        for (file, expected) in [
            ("missing.txt", "which does not exist"),
            ("loop.txt", "include each other more than 8 deep"),
            ("tool.toml", "has no [project] table"),
            ("empty.txt", "lists no requirements"),
        ] {
            let error = read(file, &base).unwrap_err();
            assert!(error.contains(expected), "{file}: {error}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

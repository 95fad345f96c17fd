//! A Python model's environment: its `env` requirements installed into a virtual environment
//! named by what it holds (the requirements, Nomad's version, the interpreter), built once per
//! host under a file lock and reused by every later start. Each build happens in a directory of
//! its own and is renamed into place whole, so an interrupted build, or an installer that
//! outlives a killed worker, never leaves the cache unusable.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use sha2::{Digest as _, Sha256};

/// The oldest interpreter the model host runs on.
const MIN_PYTHON: (u32, u32) = (3, 9);
/// `nomad-scifm` (the original's `TorchModuleTool`) needs this one.
const SCIFM_PYTHON: (u32, u32) = (3, 12);
/// Lines of the installer's output a failure quotes.
const QUOTED_LINES: usize = 25;

#[derive(Debug, Clone, thiserror::Error)]
pub enum EnvError {
    #[error("python interpreter {python:?}: {reason}")]
    Interpreter { python: String, reason: String },
    #[error(
        "installing the environment ({requirements}) with {installer} failed{status}; its last \
         lines:\n{tail}\n(full log: {log})"
    )]
    Install {
        requirements: String,
        installer: &'static str,
        status: String,
        tail: String,
        log: String,
    },
    #[error("installing the environment ({requirements}) took over {} s; stopped", .timeout.as_secs())]
    Timeout {
        requirements: String,
        timeout: Duration,
    },
    #[error("environment cache {path}: {reason}")]
    Cache { path: String, reason: String },
}

/// Where environments are kept, and how long building one may take.
#[derive(Debug, Clone)]
pub struct EnvCache {
    pub root: PathBuf,
    pub timeout: Duration,
}

/// An interpreter, as it reports itself.
#[derive(Debug, Clone)]
pub struct Interpreter {
    pub path: PathBuf,
    pub version: (u32, u32, u32),
}

impl Interpreter {
    /// Asks `python` (a path or a name on PATH) where it is and which version it is.
    pub async fn probe(python: &str) -> Result<Self, EnvError> {
        let fail = |reason: String| EnvError::Interpreter {
            python: python.to_owned(),
            reason,
        };
        let output = tokio::time::timeout(
            Duration::from_secs(30),
            tokio::process::Command::new(python)
                .args([
                    "-c",
                    "import sys; print(sys.executable); print(*sys.version_info[:3])",
                ])
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output(),
        )
        .await
        .map_err(|_| fail("no answer within 30 s".into()))?
        .map_err(|e| {
            fail(format!(
                "cannot run it: {e} (set `python:` to an interpreter)"
            ))
        })?;
        if !output.status.success() {
            return Err(fail(format!(
                "exited with {}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )));
        }
        let text = String::from_utf8_lossy(&output.stdout);
        let mut lines = text.lines();
        let path = PathBuf::from(lines.next().unwrap_or_default());
        let numbers: Vec<u32> = lines
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|n| n.parse().ok())
            .collect();
        let [major, minor, patch] = numbers[..] else {
            return Err(fail(format!("unexpected answer {text:?}")));
        };
        let version = (major, minor, patch);
        if (major, minor) < MIN_PYTHON {
            return Err(fail(format!(
                "is Python {major}.{minor}; the model host needs {}.{} or newer",
                MIN_PYTHON.0, MIN_PYTHON.1
            )));
        }
        Ok(Self { path, version })
    }

    fn version_text(&self) -> String {
        let (a, b, c) = self.version;
        format!("{a}.{b}.{c}")
    }
}

/// Whether a requirement names the original Nomad's package.
fn needs_scifm(requirement: &str) -> bool {
    let name: String = requirement
        .trim()
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .collect();
    name.to_ascii_lowercase().replace(['_', '.'], "-") == "nomad-scifm"
}

/// The directory name of an environment: a digest of everything that makes it what it is.
pub fn key(interpreter: &Interpreter, requirements: &[String]) -> String {
    let mut hash = Sha256::new();
    hash.update(b"nomad-env-v1\n");
    hash.update(env!("CARGO_PKG_VERSION").as_bytes());
    hash.update(b"\n");
    hash.update(interpreter.path.as_os_str().as_encoded_bytes());
    hash.update(b"\n");
    hash.update(interpreter.version_text().as_bytes());
    for r in requirements {
        hash.update(b"\n");
        hash.update(r.trim().as_bytes());
    }
    hash.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A file whose presence says the environment in its directory is complete.
const READY: &str = ".nomad-env-ready";

/// The interpreter to run a host with, and whether this call built its environment.
#[derive(Debug, Clone, PartialEq)]
pub struct Ensured {
    pub python: PathBuf,
    pub built: bool,
}

impl EnvCache {
    /// The interpreter to run the host with: `python` itself without requirements, else the one
    /// of the environment holding them, built here first when no worker built it before.
    pub async fn ensure(
        &self,
        tool: &str,
        python: &str,
        requirements: &[String],
    ) -> Result<Ensured, EnvError> {
        let interpreter = Interpreter::probe(python).await?;
        if requirements.iter().any(|r| needs_scifm(r)) && interpreter.version < (3, 12, 0) {
            return Err(EnvError::Interpreter {
                python: python.to_owned(),
                reason: format!(
                    "is Python {}; nomad-scifm needs {}.{} or newer: set `python:` on the tool \
                     (or `model_host.python`) to such an interpreter",
                    interpreter.version_text(),
                    SCIFM_PYTHON.0,
                    SCIFM_PYTHON.1
                ),
            });
        }
        if requirements.is_empty() {
            return Ok(Ensured {
                python: interpreter.path,
                built: false,
            });
        }
        let dir = self.root.join("envs").join(key(&interpreter, requirements));
        let python = dir.join("bin").join("python");
        if dir.join(READY).is_file() {
            tracing::info!(%tool, env = %dir.display(), "model environment reused");
            return Ok(Ensured {
                python,
                built: false,
            });
        }
        let deadline = Instant::now() + self.timeout;
        let lock = self.lock(&dir, tool, requirements, deadline).await?;
        // Another worker may have built it while this one waited for the lock.
        let built = !dir.join(READY).is_file();
        if built {
            self.build(tool, &interpreter, requirements, &dir, deadline)
                .await?;
        } else {
            tracing::info!(%tool, env = %dir.display(), "model environment reused");
        }
        drop(lock);
        Ok(Ensured { python, built })
    }

    /// Holds `<dir>.lock` exclusively, waiting for another builder until `deadline`.
    async fn lock(
        &self,
        dir: &Path,
        tool: &str,
        requirements: &[String],
        deadline: Instant,
    ) -> Result<std::fs::File, EnvError> {
        let cache_error = |path: &Path, e: std::io::Error| EnvError::Cache {
            path: path.display().to_string(),
            reason: e.to_string(),
        };
        let parent = dir.parent().expect("an environment lives in a directory");
        std::fs::create_dir_all(parent).map_err(|e| cache_error(parent, e))?;
        let path = dir.with_extension("lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| cache_error(&path, e))?;
        let mut told = false;
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(file),
                Err(std::fs::TryLockError::WouldBlock) => {}
                Err(std::fs::TryLockError::Error(e)) => return Err(cache_error(&path, e)),
            }
            if !told {
                tracing::info!(%tool, env = %dir.display(), "another process is building this model environment; waiting for it");
                told = true;
            }
            if Instant::now() >= deadline {
                return Err(EnvError::Timeout {
                    requirements: requirements.join(", "),
                    timeout: self.timeout,
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn build(
        &self,
        tool: &str,
        interpreter: &Interpreter,
        requirements: &[String],
        dir: &Path,
        deadline: Instant,
    ) -> Result<(), EnvError> {
        let listed = requirements.join(", ");
        let cache_error = |e: std::io::Error| EnvError::Cache {
            path: dir.display().to_string(),
            reason: e.to_string(),
        };
        // Builders that died left their staging directories (an installer of theirs may still
        // write into one): removed where it can be, never reused.
        remove_leftovers(dir);
        let staging = dir.with_extension(format!("build-{}", unique()));
        let log = dir.with_extension("log");
        let installer = Installer::find();
        tracing::info!(%tool, env = %dir.display(), installer = installer.name(), requirements = %listed, "building the model environment (once per host; later starts reuse it)");
        let started = Instant::now();
        let python_in_env = staging.join("bin").join("python");
        let steps = installer.steps(&interpreter.path, &staging, &python_in_env, requirements);
        let built = self
            .run_steps(steps, &listed, &installer, &log, deadline)
            .await;
        let published = built.and_then(|()| {
            std::fs::write(staging.join(READY), requirements.join("\n")).map_err(cache_error)?;
            publish(&staging, dir).map_err(cache_error)
        });
        if published.is_err() {
            let _ = std::fs::remove_dir_all(&staging);
        }
        published?;
        tracing::info!(%tool, env = %dir.display(), seconds = started.elapsed().as_secs_f64(), "model environment built");
        Ok(())
    }

    /// Runs the installer's steps in turn, each within what is left of `deadline`.
    async fn run_steps(
        &self,
        steps: Vec<tokio::process::Command>,
        listed: &str,
        installer: &Installer,
        log: &Path,
        deadline: Instant,
    ) -> Result<(), EnvError> {
        let cache_error = |e: std::io::Error| EnvError::Cache {
            path: log.display().to_string(),
            reason: e.to_string(),
        };
        let log_file = std::fs::File::create(log).map_err(cache_error)?;
        for mut step in steps {
            let out = log_file.try_clone().map_err(cache_error)?;
            let err = log_file.try_clone().map_err(cache_error)?;
            step.stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .kill_on_drop(true);
            // An installer dies with its worker (a worker SIGKILLed mid-build leaves no writer
            // behind, so the next build can clear what it left).
            // SAFETY: prctl is async-signal-safe and touches only the child being started.
            unsafe {
                step.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            let mut child = step.spawn().map_err(|e| EnvError::Install {
                requirements: listed.to_owned(),
                installer: installer.name(),
                status: String::new(),
                tail: format!("cannot start it: {e}"),
                log: log.display().to_string(),
            })?;
            let left = deadline.saturating_duration_since(Instant::now());
            let status = match tokio::time::timeout(left, child.wait()).await {
                Ok(status) => status.map_err(cache_error)?,
                Err(_) => {
                    let _ = child.kill().await;
                    return Err(EnvError::Timeout {
                        requirements: listed.to_owned(),
                        timeout: self.timeout,
                    });
                }
            };
            if !status.success() {
                return Err(EnvError::Install {
                    requirements: listed.to_owned(),
                    installer: installer.name(),
                    status: format!(" ({status})"),
                    tail: tail(log, QUOTED_LINES),
                    log: log.display().to_string(),
                });
            }
        }
        Ok(())
    }
}

/// A name no other build on this host takes: this process and the moment.
fn unique() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}-{nanos}", std::process::id())
}

/// Puts the complete environment `staging` in place at `dir`: a complete one already there is
/// kept (and `staging` dropped); anything else there (an older build's partial directory) is
/// moved aside first, so nothing still writing into it can get in the way.
fn publish(staging: &Path, dir: &Path) -> std::io::Result<()> {
    if dir.join(READY).is_file() {
        let _ = std::fs::remove_dir_all(staging);
        return Ok(());
    }
    if dir.exists() {
        let aside = dir.with_extension(format!("stale-{}", unique()));
        std::fs::rename(dir, &aside)?;
        let _ = std::fs::remove_dir_all(&aside);
    }
    std::fs::rename(staging, dir)
}

/// Removes, as far as it can, what earlier builds of `dir` left beside it: their staging and
/// moved-aside directories (an installer that outlived its worker may still be writing into
/// one, which then stays until a later start).
fn remove_leftovers(dir: &Path) {
    let (Some(parent), Some(name)) = (dir.parent(), dir.file_name().and_then(|n| n.to_str()))
    else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let other = entry.file_name();
        let other = other.to_string_lossy();
        let leftover = other
            .strip_prefix(name)
            .is_some_and(|rest| rest.starts_with(".build-") || rest.starts_with(".stale-"));
        if leftover {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// What builds environments: `uv` (`NOMAD_UV`, else on PATH; much faster), else `venv` and
/// `pip`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Installer {
    Uv(PathBuf),
    Pip,
}

impl Installer {
    fn find() -> Self {
        let uv = std::env::var_os("NOMAD_UV")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("uv"));
        let works = std::process::Command::new(&uv)
            .arg("--version")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if works {
            Installer::Uv(uv)
        } else {
            Installer::Pip
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Installer::Uv(_) => "uv",
            Installer::Pip => "pip",
        }
    }

    fn steps(
        &self,
        python: &Path,
        dir: &Path,
        python_in_env: &Path,
        requirements: &[String],
    ) -> Vec<tokio::process::Command> {
        let command = |program: &Path| tokio::process::Command::new(program);
        match self {
            Installer::Uv(uv) => {
                let mut venv = command(uv);
                // Relocatable: its scripts keep working once it is renamed into place.
                venv.arg("venv")
                    .arg("--quiet")
                    .arg("--relocatable")
                    .arg("--python")
                    .arg(python)
                    .arg(dir);
                let mut install = command(uv);
                install
                    .args(["pip", "install", "--python"])
                    .arg(python_in_env)
                    .args(requirements);
                vec![venv, install]
            }
            Installer::Pip => {
                let mut venv = command(python);
                venv.args(["-m", "venv"]).arg(dir);
                let mut install = command(python_in_env);
                install
                    .args([
                        "-m",
                        "pip",
                        "install",
                        "--disable-pip-version-check",
                        "--no-input",
                        "--progress-bar",
                        "off",
                    ])
                    .args(requirements);
                vec![venv, install]
            }
        }
    }
}

/// The last `lines` lines of a log file.
fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn interpreter(path: &str, version: (u32, u32, u32)) -> Interpreter {
        Interpreter {
            path: path.into(),
            version,
        }
    }

    #[test]
    fn the_key_changes_with_every_input_and_nothing_else() {
        let reqs = |r: &[&str]| r.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let a = key(&interpreter("/py", (3, 12, 1)), &reqs(&["numpy==2.0"]));
        assert_eq!(
            a,
            key(&interpreter("/py", (3, 12, 1)), &reqs(&[" numpy==2.0 "]))
        );
        assert_ne!(
            a,
            key(&interpreter("/py", (3, 12, 2)), &reqs(&["numpy==2.0"]))
        );
        assert_ne!(
            a,
            key(&interpreter("/other", (3, 12, 1)), &reqs(&["numpy==2.0"]))
        );
        assert_ne!(
            a,
            key(&interpreter("/py", (3, 12, 1)), &reqs(&["numpy==2.1"]))
        );
        assert_eq!(a.len(), 16);
    }

    /// Builds a real environment from PyPI: two builders at once on an empty cache build it once,
    /// and a later start reuses it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_builders_at_once_build_an_environment_once_and_later_starts_reuse_it() {
        let root = std::env::temp_dir().join(format!("nomad-env-test-{}", std::process::id()));
        let cache = EnvCache {
            root: root.clone(),
            timeout: Duration::from_secs(600),
        };
        let requirements = vec!["six==1.16.0".to_owned()];
        let (a, b) = tokio::join!(
            cache.ensure("a", "python3", &requirements),
            cache.ensure("b", "python3", &requirements)
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.python, b.python);
        assert_eq!(
            [a.built, b.built].iter().filter(|b| **b).count(),
            1,
            "exactly one of two builders builds"
        );
        let again = cache.ensure("c", "python3", &requirements).await.unwrap();
        assert!(!again.built);
        let imported = std::process::Command::new(&again.python)
            .args(["-c", "import six; print(six.__version__)"])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&imported.stdout).trim(), "1.16.0");
        let broken = cache
            .ensure(
                "d",
                "python3",
                &["nomad-test-no-such-package==0.0.1".to_owned()],
            )
            .await
            .unwrap_err()
            .to_string();
        assert!(
            broken.contains("installing the environment (nomad-test-no-such-package==0.0.1)")
                && broken.contains("nomad-test-no-such-package"),
            "{broken}"
        );
        let missing = cache
            .ensure("e", "/nonexistent/python3", &requirements)
            .await
            .unwrap_err()
            .to_string();
        assert!(missing.contains("cannot run it"), "{missing}");
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_build_goes_in_whole_past_a_partial_one_that_something_still_writes_into() {
        let root = std::env::temp_dir().join(format!("nomad-env-{}", unique()));
        let dir = root.join("envs").join("abc");
        std::fs::create_dir_all(dir.join("lib")).unwrap();
        // A killed build's installer, still writing into the partial environment.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let orphan = {
            let (lib, stop) = (dir.join("lib"), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = std::fs::write(lib.join(format!("f{n}")), b"x");
                    n += 1;
                }
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        let staging = dir.with_extension(format!("build-{}", unique()));
        std::fs::create_dir_all(staging.join("bin")).unwrap();
        std::fs::write(staging.join(READY), "numpy").unwrap();
        publish(&staging, &dir).unwrap();
        assert!(dir.join(READY).is_file() && dir.join("bin").is_dir());
        assert!(!staging.exists());
        // A second complete build keeps the first in place and drops its own.
        let again = dir.with_extension(format!("build-{}", unique()));
        std::fs::create_dir_all(&again).unwrap();
        std::fs::write(again.join(READY), "numpy").unwrap();
        std::fs::write(again.join("marker"), "second").unwrap();
        publish(&again, &dir).unwrap();
        assert!(!dir.join("marker").exists() && !again.exists());
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        orphan.join().unwrap();
        // What dead builders left beside it goes; the environment, its lock and log stay.
        for leftover in ["abc.build-1-2", "abc.stale-3-4"] {
            std::fs::create_dir_all(root.join("envs").join(leftover).join("x")).unwrap();
        }
        std::fs::write(root.join("envs").join("abc.lock"), "").unwrap();
        remove_leftovers(&dir);
        let mut left: Vec<String> = std::fs::read_dir(root.join("envs"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with("abc.stale-"))
            .collect();
        left.sort();
        assert_eq!(left, ["abc", "abc.lock"]);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn the_original_package_is_recognised_in_any_spelling() {
        for r in [
            "nomad-scifm==0.2.1",
            "nomad_scifm",
            "Nomad.SciFM>=0.2",
            " nomad-scifm [otel]",
        ] {
            assert!(needs_scifm(r), "{r}");
        }
        for r in [
            "nomad",
            "nomad-scifm-extra",
            "torch",
            "pkg @ file:///nomad-scifm",
        ] {
            assert!(!needs_scifm(r), "{r}");
        }
    }
}

//! The run id: `NOMAD_OTEL_RUN_ID` (already folded into the telemetry settings), else
//! `SLURM_JOB_ID`, else 12 hex digits of a random UUID. It names the run directory, so it must be
//! a plain name.

use std::path::{Path, PathBuf};

use nomad_config::Env;
use nomad_telemetry::TelemetrySettings;

/// The final run id, checked, and written back into `settings` so telemetry carries it.
pub fn assign(
    settings: &mut TelemetrySettings,
    env: &(impl Env + ?Sized),
) -> anyhow::Result<String> {
    let (id, source) = match (&settings.run_id, env.non_empty("SLURM_JOB_ID")) {
        (Some(id), _) => (id.clone(), "NOMAD_OTEL_RUN_ID (or telemetry.run_id)"),
        (None, Some(job)) => (job, "SLURM_JOB_ID"),
        (None, None) => (random(), "a random id"),
    };
    check(&id).map_err(|e| anyhow::anyhow!("run id {id:?} from {source}: {e}"))?;
    settings.run_id = Some(id.clone());
    Ok(id)
}

/// 12 hex digits of a random UUID.
pub fn random() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

/// 1 to 64 of `A-Z a-z 0-9 . _ -`, and not `.` or `..`.
pub fn check(id: &str) -> Result<(), String> {
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if id.is_empty() || id.len() > 64 || !id.chars().all(plain) || id == "." || id == ".." {
        return Err(
            "a run id is 1 to 64 of the characters A-Z a-z 0-9 . _ - (it names the run \
                    directory)"
                .into(),
        );
    }
    Ok(())
}

/// The run a reading command names: `--from DIR` (its run id given, or `latest` for the
/// directory's own name, as `nomad up` names it), else [`locate`] under `runs`.
pub fn resolve(
    runs: &Path,
    from: Option<&Path>,
    run_id: &str,
) -> anyhow::Result<(String, PathBuf)> {
    let Some(dir) = from else {
        return locate(runs, run_id);
    };
    anyhow::ensure!(dir.is_dir(), "--from {}: no such directory", dir.display());
    if run_id != "latest" {
        check(run_id).map_err(|e| anyhow::anyhow!("run id {run_id:?}: {e}"))?;
        return Ok((run_id.to_owned(), dir.to_owned()));
    }
    let absolute = std::path::absolute(dir).unwrap_or_else(|_| dir.to_owned());
    match absolute.file_name().and_then(|n| n.to_str()) {
        Some(name) if check(name).is_ok() => Ok((name.to_owned(), dir.to_owned())),
        _ => anyhow::bail!(
            "`latest` with --from {} takes the run id from the directory's name, which is not \
             one; give the run id instead of `latest`",
            dir.display()
        ),
    }
}

/// The directory of run `run_id` under `runs` (`latest`: the newest run there). An unknown run
/// is refused naming where it looked and the runs that are there, newest first.
pub fn locate(runs: &Path, run_id: &str) -> anyhow::Result<(String, PathBuf)> {
    let where_ = std::path::absolute(runs).unwrap_or_else(|_| runs.to_owned());
    let known = runs_in(runs);
    if run_id == "latest" {
        return match known.first() {
            Some(id) => Ok((id.clone(), runs.join(id))),
            None => anyhow::bail!(
                "no runs in {} yet: `nomad up --demo` makes one (or give --from DIR)",
                where_.display()
            ),
        };
    }
    check(run_id).map_err(|e| anyhow::anyhow!("run id {run_id:?}: {e}"))?;
    let dir = runs.join(run_id);
    if dir.is_dir() {
        return Ok((run_id.to_owned(), dir));
    }
    let there = if known.is_empty() {
        " (there are no runs there)".to_owned()
    } else {
        let shown: Vec<&str> = known.iter().take(10).map(String::as_str).collect();
        let more = if known.len() > 10 { ", ..." } else { "" };
        format!(" (runs there, newest first: {}{more})", shown.join(", "))
    };
    anyhow::bail!(
        "no run {run_id:?} in {}{there}; give one of them, `latest`, or --from DIR",
        where_.display()
    )
}

/// The run directories under `runs`, newest first (by modification time).
fn runs_in(runs: &Path) -> Vec<String> {
    let mut found: Vec<(std::time::SystemTime, String)> = std::fs::read_dir(runs)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let modified = e.metadata().and_then(|m| m.modified()).ok()?;
            check(&name).is_ok().then_some((modified, name))
        })
        .collect();
    found.sort_by(|a, b| b.cmp(a));
    found.into_iter().map(|(_, name)| name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_is_found_by_id_or_as_latest_and_an_unknown_one_names_the_others() {
        let runs = std::env::temp_dir().join(format!("nomad-runs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&runs);
        let said = locate(&runs, "latest").unwrap_err().to_string();
        assert!(
            said.contains("no runs in") && said.contains("nomad up --demo"),
            "{said}"
        );
        for id in ["older", "newer"] {
            std::fs::create_dir_all(runs.join(id)).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(
            locate(&runs, "older").unwrap(),
            ("older".into(), runs.join("older"))
        );
        assert_eq!(locate(&runs, "latest").unwrap().0, "newer");
        let said = locate(&runs, "nope").unwrap_err().to_string();
        assert!(
            said.contains("no run \"nope\"") && said.contains("newest first: newer, older"),
            "{said}"
        );
        assert!(
            locate(&runs, "../x")
                .unwrap_err()
                .to_string()
                .contains("1 to 64")
        );
        std::fs::remove_dir_all(&runs).unwrap();
    }

    #[test]
    fn from_a_directory_latest_is_its_name_and_a_given_id_is_checked() {
        let runs = std::env::temp_dir().join(format!("nomad-from-{}", std::process::id()));
        let dir = runs.join("a1b2c3");
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(
            resolve(Path::new("elsewhere"), Some(&dir), "latest").unwrap(),
            ("a1b2c3".into(), dir.clone())
        );
        assert_eq!(resolve(&runs, Some(&dir), "mine").unwrap().0, "mine");
        let said = resolve(&runs, Some(&dir), "../x").unwrap_err().to_string();
        assert!(said.contains("1 to 64"), "{said}");
        let said = resolve(&runs, Some(&runs.join("gone")), "latest")
            .unwrap_err()
            .to_string();
        assert!(said.contains("no such directory"), "{said}");
        // Without --from, the runs directory given is where `latest` is looked for.
        assert_eq!(resolve(&runs, None, "latest").unwrap().0, "a1b2c3");
        std::fs::remove_dir_all(&runs).unwrap();
    }

    #[test]
    fn configured_then_slurm_then_random() {
        let env: &[(&str, &str)] = &[("SLURM_JOB_ID", "4242")];
        let mut settings = TelemetrySettings::disabled();
        settings.run_id = Some("mine".into());
        assert_eq!(assign(&mut settings, env).unwrap(), "mine");
        settings.run_id = None;
        assert_eq!(assign(&mut settings, env).unwrap(), "4242");
        assert_eq!(settings.run_id.as_deref(), Some("4242"));
        settings.run_id = None;
        let random = assign(&mut settings, &[] as &[(&str, &str)]).unwrap();
        assert_eq!(random.len(), 12);
        assert!(random.chars().all(|c| c.is_ascii_hexdigit()));
    }

    #[test]
    fn a_run_id_that_is_not_a_plain_name_is_refused() {
        for bad in ["../x", "/abs", "", ".", "..", "a b", "x/y", &"a".repeat(65)] {
            let mut settings = TelemetrySettings::disabled();
            settings.run_id = Some(bad.to_owned());
            let e = assign(&mut settings, &[] as &[(&str, &str)])
                .unwrap_err()
                .to_string();
            assert!(e.contains("1 to 64"), "{bad:?}: {e}");
        }
        let env: &[(&str, &str)] = &[("SLURM_JOB_ID", "../../etc")];
        let mut settings = TelemetrySettings::disabled();
        let e = assign(&mut settings, env).unwrap_err().to_string();
        assert!(e.contains("SLURM_JOB_ID"), "{e}");
        assert!(check("job-12.3_a").is_ok());
    }
}

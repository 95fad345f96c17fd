//! The run id: `NOMAD_OTEL_RUN_ID` (already folded into the telemetry settings), else
//! `SLURM_JOB_ID`, else 12 hex digits of a random UUID. It names the run directory, so it must be
//! a plain name.

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

#[cfg(test)]
mod tests {
    use super::*;

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

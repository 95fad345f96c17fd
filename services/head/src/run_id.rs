//! The run id: `NOMAD_OTEL_RUN_ID` (already folded into the telemetry settings), else
//! `SLURM_JOB_ID`, else 12 hex digits of a random UUID.

use nomad_config::Env;

pub fn resolve(configured: Option<&str>, env: &(impl Env + ?Sized)) -> String {
    configured
        .map(str::to_owned)
        .or_else(|| env.non_empty("SLURM_JOB_ID"))
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string()[..12].to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configured_then_slurm_then_random() {
        let env: &[(&str, &str)] = &[("SLURM_JOB_ID", "4242")];
        assert_eq!(resolve(Some("mine"), env), "mine");
        assert_eq!(resolve(None, env), "4242");
        let random = resolve(None, &[] as &[(&str, &str)]);
        assert_eq!(random.len(), 12);
        assert!(random.chars().all(|c| c.is_ascii_hexdigit()));
    }
}

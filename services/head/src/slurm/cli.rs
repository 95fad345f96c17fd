//! Slurm's command-line tools (`sbatch`, `scontrol`, `squeue`, `sacct`, `sinfo`, `scancel`), each
//! call failing with the command and what it printed.

use std::process::Command;

/// Runs `program args` and returns its stdout; an error names the command and its stderr.
pub fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new(program).args(args).output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            anyhow::anyhow!(
                "{program} is not installed or not on PATH: this needs a Slurm client \
                 (for a local test cluster: scripts/slurm-local start)"
            )
        } else {
            anyhow::anyhow!("running {program}: {e}")
        }
    })?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        anyhow::bail!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            output.status,
            stderr.trim()
        );
    }
    Ok(stdout)
}

/// The job id in `sbatch --parsable` output (`id` or `id;cluster`).
pub fn parse_job_id(parsable: &str) -> anyhow::Result<String> {
    let id = parsable.trim().split(';').next().unwrap_or_default();
    anyhow::ensure!(
        !id.is_empty() && id.chars().all(|c| c.is_ascii_digit()),
        "sbatch printed {parsable:?}, not a job id"
    );
    Ok(id.to_owned())
}

/// The partitions `sinfo` lists.
pub fn partitions() -> anyhow::Result<Vec<String>> {
    Ok(run("sinfo", &["-h", "-o", "%R"])?
        .lines()
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect())
}

/// The node names of a Slurm host list (`n[1-2]` → n1, n2).
pub fn hostnames(list: &str) -> anyhow::Result<Vec<String>> {
    Ok(run("scontrol", &["show", "hostnames", list])?
        .lines()
        .map(str::to_owned)
        .collect())
}

/// `squeue`'s state of a job (`PENDING`, `RUNNING`, ...); `None` once it has left the queue.
pub fn queue_state(job: &str) -> anyhow::Result<Option<String>> {
    // A job that has left the queue is an error for some Slurm versions, empty output for others.
    match run("squeue", &["-h", "-j", job, "-o", "%T"]) {
        Ok(out) => Ok(out.lines().next().map(|s| s.trim().to_owned())),
        Err(e) if e.to_string().contains("Invalid job id") => Ok(None),
        Err(e) => Err(e),
    }
}

/// The running steps of a job: `(step id, name, nodes)`.
pub fn steps(job: &str) -> anyhow::Result<Vec<(String, String, String)>> {
    Ok(run("squeue", &["-h", "-s", "-j", job, "-o", "%i|%j|%N"])?
        .lines()
        .filter_map(|l| {
            let mut parts = l.split('|');
            Some((
                parts.next()?.to_owned(),
                parts.next()?.to_owned(),
                parts.next()?.to_owned(),
            ))
        })
        .collect())
}

/// `key=value` fields of `scontrol show job` (one job, all on one record).
pub fn job_fields(job: &str) -> anyhow::Result<Vec<(String, String)>> {
    let text = run("scontrol", &["show", "job", "-o", job])?;
    Ok(parse_fields(&text))
}

fn parse_fields(text: &str) -> Vec<(String, String)> {
    text.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_ids_come_from_parsable_output() {
        assert_eq!(parse_job_id("1234\n").unwrap(), "1234");
        assert_eq!(parse_job_id("77;cluster-a\n").unwrap(), "77");
        assert!(parse_job_id("Submitted batch job 5").is_err());
    }

    #[test]
    fn scontrol_fields_are_split() {
        let fields = parse_fields("JobId=7 JobName=nomad JobState=RUNNING StdOut=/r/7/job.out");
        assert!(fields.contains(&("StdOut".into(), "/r/7/job.out".into())));
        assert!(fields.contains(&("JobState".into(), "RUNNING".into())));
    }
}

//! Landlock, the second wall around the view: reads only of what the view holds, writes only to
//! the run's own directories, no TCP, and abstract Unix sockets and signals scoped to the run.

use std::path::PathBuf;

use landlock::{
    ABI, Access, AccessFs, AccessNet, CompatLevel, Compatible, LandlockStatus, Ruleset,
    RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope,
};

use crate::error::{Failed, Step as _};
use crate::spec::{Entry, RUNTIME_DIR, Spec, WORKSPACE};

/// What a run may read, and write: the view and its own directories.
pub fn paths(spec: &Spec) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let mut read: Vec<PathBuf> = spec
        .view
        .iter()
        .filter_map(|e| match e {
            Entry::ReadOnly { path } => Some(path.clone()),
            Entry::Symlink { .. } => None,
        })
        .collect();
    if spec.namespaces {
        read.extend(["/etc", "/dev", RUNTIME_DIR].map(PathBuf::from));
        if spec.proc {
            read.push("/proc".into());
        }
        let write = [WORKSPACE, "/tmp", "/dev/shm", "/dev/null"].map(PathBuf::from);
        (read, write.into())
    } else {
        read.push(spec.runtime.clone());
        read.extend(["/dev/urandom", "/dev/random", "/dev/zero"].map(PathBuf::from));
        let mut write: Vec<PathBuf> = spec.host_workspace.iter().cloned().collect();
        write.push("/dev/null".into());
        (read, write)
    }
}

/// Restricts the calling thread; returns the ABI in force and whether everything asked for is
/// enforced.
pub fn restrict(read: &[PathBuf], write: &[PathBuf]) -> Result<(u32, bool), Failed> {
    let abi = ABI::V6;
    let status = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(abi))
        .and_then(|r| r.handle_access(AccessNet::from_all(abi)))
        .and_then(|r| r.scope(Scope::AbstractUnixSocket | Scope::Signal))
        .and_then(|r| r.create())
        .and_then(|r| r.add_rules(landlock::path_beneath_rules(read, AccessFs::from_read(abi))))
        .and_then(|r| r.add_rules(landlock::path_beneath_rules(write, AccessFs::from_all(abi))))
        .and_then(|r| r.restrict_self())
        .step("Landlock")?;
    let enforced = match status.landlock {
        LandlockStatus::Available { effective_abi, .. }
            if status.ruleset != RulesetStatus::NotEnforced =>
        {
            (effective_abi as u32).min(abi as u32)
        }
        _ => 0,
    };
    Ok((enforced, status.ruleset == RulesetStatus::FullyEnforced))
}

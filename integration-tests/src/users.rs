//! The users a service runs as in the containment tests: root, and an unprivileged user with a
//! supplementary group (`scripts/test` creates both when run as root: `nomad-test`, in group
//! `nomad-test-secret` besides its own), and the processes a service left behind.

use std::path::Path;

/// The unprivileged account the tests use.
pub const TEST_USER: &str = "nomad-test";
/// Its supplementary group: files of this group must stay out of the sandbox's reach.
pub const TEST_GROUP: &str = "nomad-test-secret";

/// A user to run a service as; `None` ids mean "as the test itself runs".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunAs {
    pub label: &'static str,
    pub ids: Option<(u32, u32, Vec<u32>)>,
}

impl RunAs {
    pub fn uid(&self) -> u32 {
        // SAFETY: geteuid has no preconditions.
        self.ids
            .as_ref()
            .map_or_else(|| unsafe { libc::geteuid() }, |(uid, _, _)| *uid)
    }

    /// Wraps `program` so it starts as this user (util-linux `setpriv`).
    pub fn command(&self, program: &Path) -> tokio::process::Command {
        match &self.ids {
            None => tokio::process::Command::new(program),
            Some((uid, gid, groups)) => {
                let mut cmd = tokio::process::Command::new("setpriv");
                cmd.arg(format!("--reuid={uid}"))
                    .arg(format!("--regid={gid}"));
                if groups.is_empty() {
                    cmd.arg("--clear-groups");
                } else {
                    let list: Vec<String> = groups.iter().map(u32::to_string).collect();
                    cmd.arg(format!("--groups={}", list.join(",")));
                }
                cmd.arg("--").arg(program);
                cmd
            }
        }
    }

    /// Gives a directory the test made to this user, so the service can write in it.
    pub fn own(&self, dir: &Path) {
        if let Some((uid, gid, _)) = &self.ids {
            std::os::unix::fs::chown(dir, Some(*uid), Some(*gid)).unwrap();
        }
    }
}

fn id(args: &[&str]) -> Option<u32> {
    let out = std::process::Command::new("id").args(args).output().ok()?;
    String::from_utf8(out.stdout).ok()?.trim().parse().ok()
}

/// The gid of group `name`.
pub fn group_id(name: &str) -> Option<u32> {
    let out = std::process::Command::new("getent")
        .args(["group", name])
        .output()
        .ok()?;
    String::from_utf8(out.stdout)
        .ok()?
        .split(':')
        .nth(2)?
        .trim()
        .parse()
        .ok()
}

/// Root and the unprivileged test user when the tests run as root; otherwise only the current
/// (unprivileged) user, since nothing else can be tried.
pub fn gateway_users() -> Vec<RunAs> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: the containment tests run the gateway as this user only");
        return vec![RunAs {
            label: "unprivileged",
            ids: None,
        }];
    }
    let uid = id(&["-u", TEST_USER]);
    let gid = id(&["-g", TEST_USER]);
    let secret = group_id(TEST_GROUP);
    let (Some(uid), Some(gid), Some(secret)) = (uid, gid, secret) else {
        panic!(
            "user {TEST_USER} (in group {TEST_GROUP}) is missing: run ./scripts/test, which \
             creates both when it runs as root"
        );
    };
    vec![
        RunAs {
            label: "root",
            ids: None,
        },
        RunAs {
            label: "unprivileged",
            ids: Some((uid, gid, vec![gid, secret])),
        },
    ]
}

/// Pids of every descendant of `pid` (children, their children, ...).
pub fn descendants(pid: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
            // The name may hold spaces and parentheses: fields follow the last ')'.
            let after = &stat[stat.rfind(')')? + 2..];
            let ppid = after.split_whitespace().nth(1)?.parse().ok()?;
            Some((p, ppid))
        })
        .collect();
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    found.remove(0);
    found
}

/// Descendants of `pid` whose command line contains `needle`.
pub fn descendants_running(pid: u32, needle: &str) -> usize {
    descendants(pid)
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .count()
}

/// The peak resident memory (`VmHWM`) of process `pid`, in KiB.
pub fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// What only a sandboxed Python's command line holds.
pub const RUNNER: &str = "-B\0/nomad/runner.py";

/// The sandboxed Pythons of runs under the gateway `pid`: every process with the runner's command
/// line but the fork server's own two kinds, the zygote (whose parent is the init) and each run's
/// waiter (whose parent is the zygote); a forked run's PID 1 and whatever it forks count, as a
/// run's Python started by an init does.
pub fn sandbox_runs(pid: u32) -> usize {
    let cmdline = |p: u32| std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
    let is_runner = |p: u32| String::from_utf8_lossy(&cmdline(p)).contains(RUNNER);
    let parent = parent_of;
    descendants(pid)
        .into_iter()
        .filter(|&p| is_runner(p))
        .filter(|&p| {
            let forked = String::from_utf8_lossy(&cmdline(p)).contains("\0--zygote");
            let up = parent(p);
            !(forked && (!is_runner(up) || !is_runner(parent(up))))
        })
        .count()
}

/// The parent of process `pid` (0 when it is gone).
pub fn parent_of(pid: u32) -> u32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The name may hold spaces and parentheses: fields follow the last ')'.
    stat.rfind(')')
        .and_then(|i| stat[i + 2..].split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

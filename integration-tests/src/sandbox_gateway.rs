//! A gateway on its own, as the sandbox's containment tests start it (no scheduler needed: the
//! code they run calls no tools), with its runs forked from the fork server or each started as
//! an interpreter of its own.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_proto::v1::{ExecuteCodeRequest, ExecuteResponse, GatewayStatus, GatewayStatusRequest};
use serde_json::Value;
use tonic::codegen::{Body, Bytes, StdError};

use crate::Fleet;
use crate::process::{binary, send_signal, wait_for_file};
use crate::users::{RunAs, gateway_users, sandbox_runs};

/// Runs `code` through the gateway's `ExecuteCode`: its answer (the call itself must succeed).
pub async fn run_code<T>(client: &mut GatewayClient<T>, code: impl Into<String>) -> ExecuteResponse
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<StdError>,
    T::ResponseBody: Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as Body>::Error: Into<StdError> + Send,
{
    client
        .execute_code(ExecuteCodeRequest {
            code: code.into(),
            env: Default::default(),
        })
        .await
        .unwrap()
        .into_inner()
}

/// How a run's process starts: each containment test runs on both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Forked from the fork server (the default).
    Forked,
    /// A new interpreter started by `sandbox-init` (`sandbox.fork_server: false`, and where runs
    /// have a cgroup of their own).
    Spawned,
}

impl Start {
    pub const BOTH: [Start; 2] = [Start::Forked, Start::Spawned];

    /// The `sandbox:` lines that select it.
    pub fn yaml(self) -> &'static str {
        match self {
            Start::Forked => "",
            Start::Spawned => "  fork_server: false\n",
        }
    }
}

/// A gateway on its own.
pub struct Gateway {
    pub child: tokio::process::Child,
    pub dir: PathBuf,
    pub config: PathBuf,
    pub client: GatewayClient<nomad_rpc::Channel>,
    pub pid: u32,
    /// The MCP (HTTP) listener's address.
    pub mcp_addr: String,
}

impl Gateway {
    pub async fn start(run_as: &RunAs, sandbox_yaml: &str) -> Gateway {
        Self::start_with_scheduler(run_as, sandbox_yaml, "127.0.0.1:9").await
    }

    /// A gateway whose runs start by `start` (the log must say so).
    pub async fn start_on(run_as: &RunAs, start: Start, sandbox_yaml: &str) -> Gateway {
        let gateway = Self::start(run_as, &format!("{}{sandbox_yaml}", start.yaml())).await;
        let forks = gateway.stderr().contains("forked from a fork server");
        assert_eq!(
            forks,
            start == Start::Forked,
            "{} {start:?}: the gateway's runs do not start that way:\n{}",
            run_as.label,
            gateway.stderr()
        );
        gateway
    }

    /// A gateway whose scheduler is at `scheduler` (by default a closed port: calls fail fast).
    pub async fn start_with_scheduler(
        run_as: &RunAs,
        sandbox_yaml: &str,
        scheduler: &str,
    ) -> Gateway {
        Self::start_niced(run_as, sandbox_yaml, scheduler, 0).await
    }

    /// A gateway started at `niceness` (as `nice -n` starts it).
    pub async fn start_niced(
        run_as: &RunAs,
        sandbox_yaml: &str,
        scheduler: &str,
        niceness: i32,
    ) -> Gateway {
        let dir = Fleet::new_dir();
        run_as.own(&dir);
        let config = dir.join("nomad.yaml");
        std::fs::write(
            &config,
            format!("sandbox:\n  timeout_seconds: 5\n{sandbox_yaml}"),
        )
        .unwrap();
        let addr_file = dir.join("gateway.addr");
        let log = dir.join("gateway.stderr");
        let mut command = run_as.command(&binary("nomad-gateway"));
        command
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("RUST_LOG", "info")
            .env("GATEWAY_SECRET", "hunter2")
            .arg("--config")
            .arg(&config)
            .args(["--listen", "127.0.0.1:0", "--mcp-listen", "127.0.0.1:0"])
            .args(["--scheduler", scheduler, "--addr-file"])
            .arg(&addr_file)
            .arg("--mcp-addr-file")
            .arg(dir.join("gateway.mcp.addr"))
            .stdout(std::fs::File::create(dir.join("gateway.stdout")).unwrap())
            .stderr(std::fs::File::create(&log).unwrap())
            .kill_on_drop(true);
        if niceness != 0 {
            // SAFETY: setpriority is async-signal-safe; nothing else runs between fork and exec.
            unsafe {
                command.pre_exec(move || {
                    match libc::setpriority(libc::PRIO_PROCESS, 0, niceness) {
                        0 => Ok(()),
                        _ => Err(std::io::Error::last_os_error()),
                    }
                });
            }
        }
        let mut child = command.spawn().unwrap();
        let addr = wait_for_file(&addr_file, &mut child, "nomad-gateway", &log).await;
        let mcp_addr = wait_for_file(
            &dir.join("gateway.mcp.addr"),
            &mut child,
            "nomad-gateway",
            &log,
        )
        .await;
        // Carries the tests' token (a gateway without one ignores it).
        let client = GatewayClient::new(crate::fleet::rpc_channel(&addr));
        let pid = child.id().unwrap();
        Gateway {
            child,
            dir,
            config,
            client,
            pid,
            mcp_addr,
        }
    }

    pub async fn run(&self, code: impl Into<String>) -> ExecuteResponse {
        run_code(&mut self.client.clone(), code).await
    }

    /// The gateway's `Status`: its sandbox's layers, runs and memory.
    pub async fn status(&self) -> GatewayStatus {
        let mut client = self.client.clone();
        client
            .status(GatewayStatusRequest {})
            .await
            .unwrap()
            .into_inner()
    }

    /// RESULT of `code`, which must succeed.
    pub async fn result(&self, label: impl std::fmt::Display, code: &str) -> Value {
        let reply = self.run(code).await;
        assert!(
            reply.error.is_empty(),
            "{label}: {}\nstderr: {}",
            reply.error,
            reply.stderr
        );
        serde_json::from_str(&reply.result_json).unwrap()
    }

    /// The gateway still answers, and no process of a finished run is left (a warm runner's
    /// Python has `--preload` on its command line; with `warm: 0` there are none).
    pub async fn still_serving(&self, after: &str) {
        let alive = self.run("RESULT = 40 + 2").await;
        assert_eq!(alive.result_json, "42", "after {after}: {}", alive.error);
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let left = sandbox_runs(self.pid);
            if left == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "after {after}: {left} sandbox processes left behind"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The last check of a test: [`Self::still_serving`] after `after`, then [`Self::stop`].
    pub async fn finish(self, after: &str) {
        self.still_serving(after).await;
        self.stop().await;
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.join("gateway.stderr")).unwrap_or_default()
    }

    /// SIGTERM, and the gateway must exit cleanly.
    pub async fn stop(mut self) {
        send_signal(self.pid, libc::SIGTERM);
        let status = tokio::time::timeout(Duration::from_secs(15), self.child.wait())
            .await
            .expect("the gateway exits within 15 s of SIGTERM")
            .unwrap();
        assert!(status.success(), "{status}: {}", self.stderr());
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// SIGKILL: the gateway gets no chance to end its runs itself.
    pub async fn kill(mut self) {
        send_signal(self.pid, libc::SIGKILL);
        let _ = self.child.wait().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// Descriptors the gateway holds now.
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid)).map_or(0, |d| d.count())
    }
}

/// Python that calls `syscall(nr, *args)` through ctypes and names the errno (`OK` on success).
pub const SYSCALL_HELPER: &str = "\
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return errno.errorcode.get(ctypes.get_errno(), 'OK') if r == -1 else 'OK'
";

/// Every user the gateway runs as (see [`gateway_users`]), with each way a run starts.
pub fn users_and_starts() -> Vec<Case> {
    gateway_users()
        .into_iter()
        .flat_map(|run_as| {
            Start::BOTH.map(|start| Case {
                run_as: run_as.clone(),
                start,
            })
        })
        .collect()
}

/// One way a containment test runs: the gateway's user and how its runs start.
pub struct Case {
    pub run_as: RunAs,
    pub start: Start,
}

/// Names the case in every assertion message (`root Forked`).
impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:?}", self.run_as.label, self.start)
    }
}

impl Case {
    /// A gateway of this case's user whose runs start this case's way.
    pub async fn gateway(&self, sandbox_yaml: &str) -> Gateway {
        Gateway::start_on(&self.run_as, self.start, sandbox_yaml).await
    }
}

/// Processes anywhere on the host whose name (`/proc/<pid>/comm`) is `name`: what a run that
/// escaped its end would leave behind, wherever it was reparented.
pub fn processes_named(name: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|comm| comm.trim_end() == name)
        })
        .collect()
}

//! Real protocol peers for tests, from the official MCP Python SDK (`.venv-test`, made by
//! scripts/test): an upstream MCP server and an MCP client.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

/// The Python with the MCP SDK: `NOMAD_TEST_PYTHON`, or the repository's `.venv-test`.
pub fn python_sdk() -> PathBuf {
    let python = std::env::var_os("NOMAD_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-test/bin/python"));
    assert!(
        python.exists(),
        "{} is missing: run scripts/test (it makes .venv-test with the MCP Python SDK)",
        python.display()
    );
    python
}

pub fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(name)
}

/// An upstream MCP server over Streamable HTTP; killed on drop.
pub struct HttpUpstream {
    pub url: String,
    child: tokio::process::Child,
}

impl HttpUpstream {
    /// The SDK's upstream server over streamable HTTP, recording each call it serves to
    /// `<dir>/http-record.jsonl` (its stderr in `<dir>/upstream-<id>.stderr`).
    pub async fn start(dir: &Path) -> Self {
        let id = uuid::Uuid::new_v4().simple();
        let port_file = dir.join(format!("upstream-{id}.port"));
        let log = dir.join(format!("upstream-{id}.stderr"));
        let mut child = tokio::process::Command::new(python_sdk())
            .arg(script("upstream_server.py"))
            .args(["--transport", "http", "--record"])
            .arg(dir.join("http-record.jsonl"))
            .arg("--port-file")
            .arg(&port_file)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let port =
            crate::process::wait_for_file(&port_file, &mut child, "the upstream", &log).await;
        let addr = format!("127.0.0.1:{port}");
        let (within, every) = (Duration::from_secs(30), Duration::from_millis(50));
        crate::wait_until_async("the upstream listening", within, every, async || {
            tokio::net::TcpStream::connect(&addr).await.is_ok()
        })
        .await;
        Self {
            url: format!("http://{addr}/mcp"),
            child,
        }
    }
}

impl Drop for HttpUpstream {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// Runs `calls` against `url` with the Python SDK client; one JSON value per call.
pub async fn mcp_client(url: &str, mode: &str, token: Option<&str>, calls: &Value) -> Vec<Value> {
    let mut args = vec![url.to_owned(), mode.to_owned()];
    args.extend(token.map(str::to_owned));
    run_client(&args, calls).await
}

/// Runs `calls` against a stdio MCP server the Python SDK client spawns as `command`.
/// The names of the tools the MCP endpoint at `url` lists (the official client, `auto` mode).
pub async fn mcp_tool_names(url: &str, token: Option<&str>) -> std::collections::BTreeSet<String> {
    let listed = mcp_client(url, "auto", token, &serde_json::json!([{"list": true}])).await;
    listed[0]["tools"]
        .as_array()
        .unwrap_or_else(|| panic!("no tool list: {}", listed[0]))
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_owned())
        .collect()
}

pub async fn mcp_client_stdio(command: &[String], calls: &Value) -> Vec<Value> {
    let mut args = vec!["stdio".to_owned(), "auto".to_owned()];
    args.extend(command.iter().cloned());
    run_client(&args, calls).await
}

async fn run_client(args: &[String], calls: &Value) -> Vec<Value> {
    let (lines, stderr) = run_script("mcp_client.py", args, calls, Duration::from_secs(120)).await;
    assert!(
        !lines.is_empty(),
        "the MCP client printed nothing; stderr:\n{stderr}"
    );
    lines
}

/// The Python peer `name` (from `integration-tests/python`, in the test environment) with
/// `args`, its stdin piped; killed if dropped.
fn peer(name: &str, args: &[String]) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(python_sdk());
    command
        .arg(script(name))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .kill_on_drop(true);
    command
}

/// Runs the Python peer `name` (from `integration-tests/python`, in the test environment) with
/// `args` and `input` as JSON on its stdin, for at most `limit`: the JSON lines it printed, and
/// its stderr.
pub async fn run_script(
    name: &str,
    args: &[String],
    input: &Value,
    limit: Duration,
) -> (Vec<Value>, String) {
    use tokio::io::AsyncWriteExt as _;
    let mut child = crate::process::spawn_piped(&mut peer(name, args));
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input.to_string().as_bytes()).await.unwrap();
    drop(stdin);
    let output = tokio::time::timeout(limit, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{name} hung"))
        .unwrap();
    let lines = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (lines, String::from_utf8_lossy(&output.stderr).into_owned())
}

/// A client of the MCP Tasks extension (fastmcp-tasks, `tasks_client.py`) at `url`, held open
/// for one command at a time; killed on drop.
pub struct TasksClient {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    stdout: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl TasksClient {
    pub fn start(url: &str, token: &str) -> Self {
        Self::spawn(&[url.to_owned(), token.to_owned()])
    }

    /// A client that starts `command` as a stdio MCP server and talks to it.
    pub fn stdio(command: &[String]) -> Self {
        let mut args = vec!["stdio".to_owned()];
        args.extend(command.iter().cloned());
        Self::spawn(&args)
    }

    fn spawn(args: &[String]) -> Self {
        let mut child = peer("tasks_client.py", args)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use tokio::io::AsyncBufReadExt as _;
        let stdin = child.stdin.take().unwrap();
        let stdout = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        Self {
            child,
            stdin,
            stdout,
        }
    }

    /// Sends one command (see `tasks_client.py`); its answer.
    pub async fn ask(&mut self, command: Value) -> Value {
        use tokio::io::AsyncWriteExt as _;
        self.stdin
            .write_all(format!("{command}\n").as_bytes())
            .await
            .unwrap();
        let line = tokio::time::timeout(Duration::from_secs(150), self.stdout.next_line())
            .await
            .unwrap_or_else(|_| panic!("the tasks client did not answer {command}"))
            .unwrap()
            .unwrap_or_else(|| panic!("the tasks client exited at {command}"));
        serde_json::from_str(&line).unwrap()
    }
}

impl Drop for TasksClient {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

//! The code-mode gateway end to end: the official MCP Python SDK as client and as upstream
//! servers, the sandbox's containment, spans and metrics through the OTLP receiver.

use std::collections::BTreeSet;
use std::path::Path;

use nomad_integration_tests::assert_status;
use nomad_integration_tests::fleet::models_dir;
use nomad_integration_tests::peers::{
    HttpUpstream, mcp_client, mcp_client_stdio, python_sdk, script,
};
use nomad_integration_tests::process::binary;
use nomad_integration_tests::process::send_signal;
use nomad_integration_tests::receiver::MetricRecord;
use nomad_integration_tests::sandbox_gateway::run_code;
use nomad_integration_tests::strings_of;
use nomad_integration_tests::{Fleet, FleetOptions, OtlpReceiver, Service};
use nomad_proto::v1::ExecuteCodeRequest;
use nomad_proto::v1::ExecuteScriptRequest;
use serde::Deserialize as _;
use serde_json::{Value, json};
use tonic::Code;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

/// Tools (embed), the two Python upstreams, a workspace root and a 3 s sandbox timeout;
/// `extra` goes into the `gateway:` section.
fn options(dir: &Path, http_upstream: &str, extra: &str) -> FleetOptions {
    options_with_sandbox(dir, http_upstream, extra, "")
}

fn options_with_sandbox(
    dir: &Path,
    http_upstream: &str,
    extra: &str,
    sandbox: &str,
) -> FleetOptions {
    let record = dir.join("stdio-record.jsonl");
    let root = dir.join("scripts");
    std::fs::create_dir_all(&root).unwrap();
    FleetOptions {
        tools_yaml: Some(format!(
            "tools:\n  - {{name: embed, kind: embed, source: {}, batch_size: 8}}\n\
             tool_manager:\n  heartbeat_interval_ms: 200\n",
            models_dir().join("all-minilm-l6-v2").display()
        )),
        config_yaml: format!(
            "servers:\n\
             \x20 echo_stdio: {{command: {python}, args: [{server}, --transport, stdio, --record, {record}], env: {{UPSTREAM_GREETING: hi}}}}\n\
             \x20 echo_http: {{url: \"{http_upstream}\"}}\n\
             gateway:\n  workspace_root: {root}\n{extra}\
             sandbox:\n  timeout_seconds: 3\n{sandbox}",
            python = python_sdk().display(),
            server = script("upstream_server.py").display(),
            record = record.display(),
            root = root.display(),
        ),
        ..Default::default()
    }
}

fn records(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

const CODE: &str = "\
from mcp_tools.echo_stdio import shout as shout_stdio
from mcp_tools.echo_http import shout_async
from mcp_tools.nomad import embed
secret_argument = 'hello-sandbox'
loud = shout_stdio(secret_argument)
louder = await shout_async(text=secret_argument)
vector = embed('Nomad runs code near its tools.')['output']
RESULT = {'stdio': loud, 'http': louder, 'dims': len(vector)}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxed_code_calls_every_kind_of_upstream_inside_the_callers_trace() {
    let dir = Fleet::new_dir();
    let http_record = dir.join("http-record.jsonl");
    let upstream = HttpUpstream::start(&dir).await;
    let receiver = OtlpReceiver::grpc().await;
    let options = options(&dir, &upstream.url, "")
        .exporting_to(&receiver)
        .env("OTEL_BSP_SCHEDULE_DELAY", "600000");
    let mut fleet = Fleet::start(options).await;

    // The same call from a client on the newest protocol and from one on the initialize handshake.
    let calls = json!([{
        "tool": "execute_mcp_code",
        "arguments": {"code": CODE},
        "meta": {
            "traceparent": format!("00-{TRACE_ID}-00f067aa0ba902b7-01"),
            "baggage": "nomad.run.id=run-gw,nomad.rollout.id=rollout-gw",
        },
    }]);
    for mode in ["auto", "legacy"] {
        let replies = mcp_client(&fleet.gateway_mcp_url(), mode, None, &calls).await;
        let reply = &replies[0];
        assert_eq!(reply["is_error"], false, "{mode}: {reply}");
        assert_eq!(
            reply["structured"]["result"],
            // The Python SDK wraps a returned string as structured content {"result": ...}, and
            // the gateway passes structured content on as the server sent it.
            json!({"stdio": {"result": "HELLO-SANDBOX"}, "http": {"result": "HELLO-SANDBOX"}, "dims": 384}),
            "{mode}: {reply}"
        );
        assert_eq!(reply["structured"]["returncode"], 0);
    }

    // Both Python upstreams saw the caller's trace and its run id.
    let stdio_record = dir.join("stdio-record.jsonl");
    for (name, record) in [("stdio", &stdio_record), ("http", &http_record)] {
        let seen = records(record);
        assert_eq!(seen.len(), 2, "{name}: {seen:?}");
        for s in &seen {
            let traceparent = s["traceparent"].as_str().unwrap_or_default();
            assert!(traceparent.contains(TRACE_ID), "{name} got {traceparent:?}");
            assert!(
                s["baggage"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("nomad.run.id=run-gw")
            );
        }
    }
    fleet.terminate().await;

    let spans = receiver.spans();
    let ours: Vec<_> = spans.iter().filter(|s| s.trace_id == TRACE_ID).collect();
    let count = |name: &str| ours.iter().filter(|s| s.name == name).count();
    assert_eq!(count("nomad.gateway.execute_mcp_code"), 2);
    assert_eq!(count("nomad.gateway.sandbox.run"), 2);
    // Each run's wait for a slot is a span of its own, under its sandbox.run.
    let runs: BTreeSet<&str> = ours
        .iter()
        .filter(|s| s.name == "nomad.gateway.sandbox.run")
        .map(|s| s.span_id.as_str())
        .collect();
    let waits: Vec<_> = ours
        .iter()
        .filter(|s| s.name == "nomad.gateway.sandbox.queue_wait")
        .collect();
    assert_eq!(waits.len(), 2);
    assert!(
        waits
            .iter()
            .all(|s| runs.contains(s.parent_span_id.as_deref().unwrap_or_default())),
        "a queue_wait span outside its run"
    );
    assert_eq!(count("nomad.gateway.upstream_tool"), 6);
    assert!(
        count("nomad.tool.request") >= 2,
        "the embed calls reach the scheduler in the same trace"
    );
    for s in ours
        .iter()
        .filter(|s| s.name == "nomad.gateway.execute_mcp_code")
    {
        assert!(
            s.attr("nomad.gateway.request_id")
                .is_some_and(|v| !v.is_empty())
        );
        assert_eq!(
            s.attr("nomad.gateway.code_size"),
            Some(CODE.len().to_string().as_str())
        );
        assert_eq!(s.attr("nomad.gateway.tool_call_count"), Some("3"));
        assert_eq!(s.attr("nomad.gateway.returncode"), Some("0"));
        assert_eq!(s.attr("nomad.gateway.status"), Some("ok"));
        assert_eq!(s.attr("nomad.gateway.timeout_seconds"), Some("3"));
        assert_eq!(s.attr("nomad.rollout.id"), Some("rollout-gw"));
    }
    let upstream_calls: BTreeSet<(String, String)> = ours
        .iter()
        .filter(|s| s.name == "nomad.gateway.upstream_tool")
        .map(|s| {
            (
                s.attr("nomad.gateway.server").unwrap().to_owned(),
                s.attr("nomad.gateway.tool").unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        upstream_calls,
        [
            ("echo_http", "shout"),
            ("echo_stdio", "shout"),
            ("nomad", "embed")
        ]
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
        .into()
    );
    // Never the code text or an argument value.
    for s in spans.iter().filter(|s| s.service_name == "nomad/gateway") {
        for value in s.attributes.values() {
            assert!(
                !value.contains("hello-sandbox") && !value.contains("mcp_tools"),
                "{}: {value}",
                s.name
            );
        }
    }

    let metrics = receiver.latest_metrics();
    for (name, kind, unit) in [
        ("nomad.gateway.requests", "counter", "{request}"),
        ("nomad.gateway.request.duration", "histogram", "s"),
        ("nomad.gateway.sandbox.duration", "histogram", "s"),
        ("nomad.gateway.upstream_tool.calls", "counter", "{call}"),
        ("nomad.gateway.upstream_tool.duration", "histogram", "s"),
    ] {
        let points: Vec<&MetricRecord> = metrics.iter().filter(|m| m.name == name).collect();
        assert!(!points.is_empty(), "{name} was never exported");
        for p in points {
            assert_eq!(
                (p.service_name.as_str(), p.kind, p.unit.as_str()),
                ("nomad/gateway", kind, unit),
                "{name}"
            );
        }
    }
    let value = |name: &str, filter: &[(&str, &str)]| -> f64 {
        metrics
            .iter()
            .filter(|m| {
                m.name == name
                    && filter
                        .iter()
                        .all(|(k, v)| m.attributes.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|m| m.value)
            .sum()
    };
    assert_eq!(
        value(
            "nomad.gateway.requests",
            &[("request.kind", "execute_mcp_code")]
        ),
        2.0
    );
    assert_eq!(
        value(
            "nomad.gateway.request.duration",
            &[
                ("request.kind", "execute_mcp_code"),
                ("status", "ok"),
                ("returncode", "0")
            ]
        ),
        2.0
    );
    assert_eq!(
        value(
            "nomad.gateway.sandbox.duration",
            &[("status", "ok"), ("returncode", "0")]
        ),
        2.0
    );
    // The sandbox says what holds: every layer but the per-run cgroup (none is delegated here)
    // at 1, and the two runs counted as started.
    let layers: std::collections::BTreeMap<&str, f64> = metrics
        .iter()
        .filter(|m| m.name == "nomad.gateway.sandbox.isolation")
        .map(|m| (m.attributes["layer"].as_str(), m.value))
        .collect();
    for layer in [
        "user_namespace",
        "mount_namespace",
        "network_namespace",
        "pid_namespace",
        "seccomp",
        "landlock",
        "no_new_privs",
        "capabilities_dropped",
        "unprivileged_user",
        "rlimits",
    ] {
        assert_eq!(layers.get(layer), Some(&1.0), "{layer}: {layers:?}");
    }
    assert_eq!(layers.get("cgroup"), Some(&0.0), "{layers:?}");
    assert_eq!(value("nomad.gateway.sandbox.starts", &[]), 2.0);
    assert_eq!(
        value(
            "nomad.gateway.sandbox.queue_wait",
            &[("outcome", "admitted")]
        ),
        2.0,
        "two admitted runs in the queue-wait histogram"
    );
    for (server, tool) in [
        ("echo_stdio", "shout"),
        ("echo_http", "shout"),
        ("nomad", "embed"),
    ] {
        let attrs = [("server", server), ("tool", tool), ("status", "ok")];
        assert_eq!(
            value("nomad.gateway.upstream_tool.calls", &attrs),
            2.0,
            "{server}.{tool}"
        );
        assert_eq!(
            value("nomad.gateway.upstream_tool.duration", &attrs),
            2.0,
            "{server}.{tool}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_endpoint_needs_the_bearer_token() {
    let dir = Fleet::new_dir();
    let upstream = HttpUpstream::start(&dir).await;
    let mut fleet = Fleet::start(FleetOptions {
        auth: true,
        ..options(
            &dir,
            &upstream.url,
            "  mcp_allowed_hosts: [\"gateway.example:7010\"]\n  \
             mcp_allowed_origins: [\"https://app.example:443\"]\n",
        )
    })
    .await;
    let calls = json!([{"tool": "search_code_tools", "arguments": {"query": "shout"}}]);
    // The endpoint answers 401 with a Bearer challenge, before any MCP processing.
    let addr = std::fs::read_to_string(fleet.dir.join("gateway-mcp.addr")).unwrap();
    for (auth, why) in [
        ("", "send the header `Authorization: Bearer <token>`"),
        (
            "Authorization: Bearer wrong-token-0123456789abcdef\r\n",
            "the bearer token is not this fleet's token",
        ),
        ("Authorization: Token x\r\n", "must be `Bearer <token>`"),
    ] {
        let response = raw_post(addr.trim(), auth).await;
        assert!(response.starts_with("HTTP/1.1 401"), "{auth:?}: {response}");
        assert!(response.contains(why), "{auth:?}: {response}");
        assert!(
            response
                .to_ascii_lowercase()
                .contains("www-authenticate: bearer"),
            "{response}"
        );
    }
    // With the token: a Host it was told of is served, any other refused (DNS rebinding).
    let token = format!(
        "Authorization: Bearer {}\r\n",
        nomad_integration_tests::fleet::TEST_TOKEN
    );
    for (host, expected) in [
        ("gateway.example:7010", "HTTP/1.1 200"),
        (addr.trim(), "HTTP/1.1 200"),
        ("attacker.example", "HTTP/1.1 403"),
    ] {
        let response = raw_post_as(addr.trim(), host, &token).await;
        assert!(response.starts_with(expected), "Host {host}: {response}");
    }
    // A browser page of an origin it was not told of is refused; the allowed one is served.
    for (origin, expected) in [
        ("https://app.example", "HTTP/1.1 200"),
        ("https://attacker.example", "HTTP/1.1 403"),
    ] {
        let headers = format!("{token}Origin: {origin}\r\n");
        let response = raw_post_as(addr.trim(), addr.trim(), &headers).await;
        assert!(
            response.starts_with(expected),
            "Origin {origin}: {response}"
        );
    }
    for token in [None, Some("wrong-token-0123456789abcdef")] {
        let replies = mcp_client(&fleet.gateway_mcp_url(), "auto", token, &calls).await;
        assert!(
            replies[0].get("exception").is_some(),
            "{token:?} got through: {}",
            replies[0]
        );
    }
    let replies = mcp_client(
        &fleet.gateway_mcp_url(),
        "auto",
        Some(nomad_integration_tests::fleet::TEST_TOKEN),
        &calls,
    )
    .await;
    let tools = replies[0]["structured"]["tools"]
        .as_array()
        .expect("search results");
    let names: BTreeSet<&str> = tools
        .iter()
        .map(|t| t["server"].as_str().unwrap())
        .collect();
    assert_eq!(names, BTreeSet::from(["echo_http", "echo_stdio"]));
    assert_eq!(tools[0]["signature"], "shout(text: str) -> Any");
    // What clients are told of each tool's effects: code reaches beyond the fleet and may
    // change anything; search only reads.
    let listed = mcp_client(
        &fleet.gateway_mcp_url(),
        "auto",
        Some(nomad_integration_tests::fleet::TEST_TOKEN),
        &json!([{"list": true}]),
    )
    .await;
    let hints = |name: &str| {
        listed[0]["tools"]
            .as_array()
            .and_then(|tools| tools.iter().find(|t| t["name"] == name))
            .map(|t| t["annotations"].clone())
            .unwrap_or_else(|| panic!("no {name} in {}", listed[0]))
    };
    assert_eq!(
        hints("execute_mcp_code"),
        json!({"readOnlyHint": false, "idempotentHint": false, "openWorldHint": true})
    );
    assert_eq!(
        hints("search_code_tools"),
        json!({"readOnlyHint": true, "idempotentHint": true, "openWorldHint": false})
    );
    assert_eq!(
        tools[0]["import"],
        format!(
            "from mcp_tools.{} import shout",
            tools[0]["server"].as_str().unwrap()
        )
    );
    fleet.terminate().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Sandboxed Pythons of runs still running under this gateway.
fn runner_processes(gateway_pid: u32) -> usize {
    nomad_integration_tests::users::sandbox_runs(gateway_pid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxed_code_cannot_escape_and_the_gateway_keeps_serving() {
    let dir = Fleet::new_dir();
    let upstream = HttpUpstream::start(&dir).await;
    // No warm runners: every process under the gateway after a run is one left behind.
    let options = options_with_sandbox(&dir, &upstream.url, "", "  warm: 0\n").service_env(
        Service::Gateway,
        "GATEWAY_SECRET",
        "hunter2",
    );
    let mut fleet = Fleet::start(options).await;
    let gateway_pid = fleet.pid(Service::Gateway);
    let mut gateway = fleet.gateway_client().await;

    // Things outside the sandbox that the code will go after.
    let outside = dir.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::set_permissions(
        &outside,
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let secret = outside.join("secret.txt");
    std::fs::write(&secret, "top-secret-content").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let before = nomad_integration_tests::users::peak_rss_kib(gateway_pid);

    let cases: Vec<(&str, String, &str)> = vec![
        ("infinite loop", "while True:\n    pass\n".into(), "timeout"),
        ("memory bomb", "blob = bytearray(8 * 1024**3)\n".into(), "MemoryError"),
        ("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n".into(), "timeout"),
        ("100 MB of stdout", "import sys\nline = 'x' * 1023 + '\\n'\nfor _ in range(100 * 1024):\n    sys.stdout.write(line)\nRESULT = 'flooded'\n".into(), ""),
        ("read a secret file", format!("try:\n    RESULT = open({:?}).read()\nexcept OSError as e:\n    RESULT = 'blocked: ' + type(e).__name__\n", secret), "blocked"),
        ("write outside the workspace", format!("try:\n    open({:?}, 'w').write('x')\n    RESULT = 'wrote'\nexcept OSError as e:\n    RESULT = 'blocked: ' + type(e).__name__\n", outside.join("escaped.txt")), "blocked"),
        ("connect to a loopback port", format!("import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    RESULT = 'connected'\nexcept OSError as e:\n    RESULT = 'blocked: ' + type(e).__name__\n"), "blocked"),
        ("read the gateway's env", format!("import os\nenviron = ''\ntry:\n    environ = open('/proc/{gateway_pid}/environ').read()\nexcept OSError:\n    pass\nRESULT = 'leaked' if ('hunter2' in environ or 'hunter2' in str(os.environ)) else 'blocked'\n"), "blocked"),
        ("signal the gateway", format!("import os, signal\ntry:\n    os.kill({gateway_pid}, signal.SIGKILL)\n    RESULT = 'signalled'\nexcept OSError as e:\n    RESULT = 'blocked: ' + type(e).__name__\n"), "blocked"),
    ];
    for (name, code, expected) in cases {
        let reply = gateway
            .execute_code(ExecuteCodeRequest {
                code,
                env: Default::default(),
            })
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .into_inner();
        let seen = format!("{} {}", reply.result_json, reply.error);
        match name {
            "100 MB of stdout" => {
                assert_eq!(reply.result_json, "\"flooded\"", "{name}: {}", reply.error);
                assert!(
                    reply.stdout.len() < 80 << 10,
                    "{name}: kept {} bytes of stdout",
                    reply.stdout.len()
                );
                assert!(reply.stdout.contains("more bytes dropped"), "{name}");
            }
            _ => assert!(
                seen.contains(expected),
                "{name}: expected {expected:?}, got {seen}"
            ),
        }
        assert!(
            !seen.contains("top-secret-content") && !seen.contains("hunter2"),
            "{name}: {seen}"
        );
        if expected == "timeout" {
            assert_eq!(reply.returncode, -1, "{name}: killed, so no exit status");
        }
        // The whole process tree is gone, and the gateway still answers.
        assert_eq!(
            runner_processes(gateway_pid),
            0,
            "{name}: sandbox processes left behind"
        );
        let alive = run_code(&mut gateway, "RESULT = 40 + 2").await;
        assert_eq!(alive.result_json, "42", "after {name}: {}", alive.error);
    }
    assert!(
        listener.accept().is_err(),
        "the sandbox reached the loopback listener"
    );
    assert!(!outside.join("escaped.txt").exists());
    let growth_mib =
        (nomad_integration_tests::users::peak_rss_kib(gateway_pid).saturating_sub(before)) / 1024;
    assert!(
        growth_mib < 64,
        "the gateway's peak RSS grew {growth_mib} MiB during the runs"
    );
    fleet.terminate().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_run_only_from_inside_the_workspace_root() {
    let dir = Fleet::new_dir();
    let upstream = HttpUpstream::start(&dir).await;
    let mut fleet = Fleet::start(options(&dir, &upstream.url, "")).await;
    let root = dir.join("scripts");
    std::fs::write(root.join("job.py"), "RESULT = 6 * 7\n").unwrap();
    std::fs::write(dir.join("outside.py"), "RESULT = 'outside'\n").unwrap();
    std::os::unix::fs::symlink(dir.join("outside.py"), root.join("link.py")).unwrap();
    // A FIFO would hold a read forever; a directory is no script.
    let made = std::process::Command::new("mkfifo")
        .arg(root.join("fifo.py"))
        .status()
        .unwrap();
    assert!(made.success());
    std::fs::create_dir(root.join("dir.py")).unwrap();
    std::fs::write(root.join("huge.py"), "#".repeat(5 << 20)).unwrap();
    let mut gateway = fleet.gateway_client().await;
    let run = |path: String| {
        let mut gateway = gateway.clone();
        async move {
            gateway
                .execute_script(ExecuteScriptRequest {
                    script_path: path,
                    env: Default::default(),
                })
                .await
        }
    };
    let ok = run("job.py".into()).await.unwrap().into_inner();
    assert_eq!(ok.result_json, "42", "{}", ok.error);
    // With a workspace root, code mode offers scripts.
    let offered =
        nomad_integration_tests::peers::mcp_tool_names(&fleet.gateway_mcp_url(), None).await;
    assert!(offered.contains("execute_mcp_script"), "{offered:?}");
    for path in [
        "../outside.py".to_owned(),
        dir.join("outside.py").display().to_string(),
        "link.py".to_owned(),
        "missing.py".to_owned(),
        "fifo.py".to_owned(),
        "dir.py".to_owned(),
    ] {
        let err = run(path.clone()).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{path}");
        assert!(
            err.message()
                .contains("not a file inside the workspace root"),
            "{path}: {}",
            err.message()
        );
    }
    let err = run("huge.py".into()).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("5242880 bytes") && err.message().contains("at most 4194304"),
        "{}",
        err.message()
    );
    // The gRPC client of this test is still usable.
    assert!(
        gateway
            .search_tools(nomad_proto::v1::SearchToolsRequest::default())
            .await
            .is_ok()
    );
    fleet.terminate().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// An MCP `initialize` POST over plain HTTP/1.1; returns the raw response head.
async fn raw_post(addr: &str, auth_header: &str) -> String {
    raw_post_as(addr, addr, auth_header).await
}

/// As [`raw_post`], with `Host: host`.
async fn raw_post_as(addr: &str, host: &str, auth_header: &str) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-03-26","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}"#;
    let request = format!(
        "POST /mcp HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\n{auth_header}Content-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        stream.read_to_end(&mut response),
    )
    .await;
    String::from_utf8_lossy(&response).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_stdio_the_gateway_serves_the_same_tools_and_applies_its_allowlist() {
    let dir = Fleet::new_dir();
    let upstream = HttpUpstream::start(&dir).await;
    let mut fleet = Fleet::start(
        options(
            &dir,
            &upstream.url,
            "  allowlist: [\"nomad:*\", \"echo_stdio:*\"]\n",
        )
        .service_env(Service::Gateway, "GATEWAY_SECRET", "hunter2"),
    )
    .await;
    // A second gateway, spawned by the Python client as a stdio MCP server, same config.
    let command = vec![
        binary("nomad-gateway").display().to_string(),
        "--mcp-stdio".to_owned(),
        "--config".to_owned(),
        fleet.config_path.display().to_string(),
        "--scheduler".to_owned(),
        fleet.scheduler_addr.clone(),
    ];
    let calls = json!([
        {"tool": "execute_mcp_code", "arguments": {"code": "from mcp_tools.echo_stdio import shout\nRESULT = shout('quiet')"}},
        {"tool": "execute_mcp_code", "arguments": {"code": "from mcp_tools.echo_http import shout\nRESULT = shout('quiet')"}},
        {"tool": "search_code_tools", "arguments": {"query": "shout"}},
    ]);
    let replies = mcp_client_stdio(&command, &calls).await;
    assert_eq!(replies.len(), 3, "{replies:?}");
    assert_eq!(
        replies[0]["structured"]["result"],
        json!({"result": "QUIET"}),
        "{}",
        replies[0]
    );
    // echo_http is configured but not in the allowlist: its tools are not even listed, and
    // importing one says why (as calling it would)...
    assert_eq!(replies[1]["is_error"], true);
    let error = replies[1]["structured"]["error"]
        .as_str()
        .unwrap_or_default();
    assert!(
        error.contains("ToolError: echo_http:shout is not in the gateway's allowlist"),
        "{error}"
    );
    // ...and a direct call is refused too.
    let mut gateway = fleet.gateway_client().await;
    let refused = gateway
        .call_tool(nomad_proto::v1::GatewayCallToolRequest {
            server: "echo_http".into(),
            tool: "shout".into(),
            arguments_json: r#"{"text": "x"}"#.into(),
        })
        .await
        .unwrap_err();
    assert_status(
        &refused,
        Code::PermissionDenied,
        "not in the gateway's allowlist",
    );

    // A stdio upstream starts with a clean environment: none of the gateway's (its secret, its
    // telemetry and fleet settings), only what a program needs and the server's own `env`.
    let env = gateway
        .call_tool(nomad_proto::v1::GatewayCallToolRequest {
            server: "echo_stdio".into(),
            tool: "environment".into(),
            arguments_json: "{}".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let names: Value = serde_json::from_str(&env.result_json).unwrap();
    let names = BTreeSet::<&str>::deserialize(&names["result"]).unwrap();
    assert!(
        names.contains("PATH") && names.contains("UPSTREAM_GREETING"),
        "{names:?}"
    );
    for leaked in ["GATEWAY_SECRET", "RUST_LOG"] {
        assert!(
            !names.contains(leaked),
            "{leaked} reached the upstream: {names:?}"
        );
    }

    // A dead upstream session is opened again on the next call.
    let shout = |text: &str| nomad_proto::v1::GatewayCallToolRequest {
        server: "echo_stdio".into(),
        tool: "shout".into(),
        arguments_json: json!({"text": text}).to_string(),
    };
    let first = gateway.call_tool(shout("one")).await.unwrap().into_inner();
    assert_eq!(first.result_json, r#"{"result":"ONE"}"#);
    let record = dir.join("stdio-record.jsonl").display().to_string();
    let upstreams = processes_with(&record);
    assert!(!upstreams.is_empty(), "no stdio upstream running");
    for pid in upstreams {
        send_signal(pid, libc::SIGKILL);
    }
    let again = gateway.call_tool(shout("two")).await.unwrap().into_inner();
    assert_eq!(again.result_json, r#"{"result":"TWO"}"#);
    let servers: BTreeSet<&str> = strings_of(&replies[2]["structured"]["tools"], "server")
        .into_iter()
        .collect();
    assert_eq!(servers, BTreeSet::from(["echo_stdio"]));
    fleet.terminate().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Pids of processes whose command line contains `needle`.
fn processes_with(needle: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_server_and_tool_names_never_become_metric_attributes() {
    let dir = Fleet::new_dir();
    let upstream = HttpUpstream::start(&dir).await;
    let receiver = OtlpReceiver::grpc().await;
    let options = options_with_sandbox(
        &dir,
        &upstream.url,
        "",
        "  timeout_seconds: 120\n  max_tool_calls: 20000\n  warm: 0\n",
    )
    .exporting_to(&receiver);
    let mut fleet = Fleet::start(options).await;
    let mut gateway = fleet.gateway_client().await;
    // 10,000 calls, each naming a server or tool nobody has (half of them on the real `nomad`
    // server), straight over the bridge.
    let code = "\
import sys
bridge = next(f for f in sys.meta_path if hasattr(f, 'bridge')).bridge
failed = 0
for i in range(10000):
    server = 'nomad' if i % 2 else f'bogus-server-{i}'
    try:
        bridge.request('call_tool', {'server': server, 'tool': f'made-up-tool-{i}', 'arguments': {'text': 'x'}})
    except Exception:
        failed += 1
RESULT = failed
";
    let reply = run_code(&mut gateway, code).await;
    assert_eq!(reply.result_json, "10000", "{}", reply.error);
    fleet.terminate().await;
    let metrics = receiver.latest_metrics();
    let labels = |name: &str, key: &str| -> BTreeSet<String> {
        metrics
            .iter()
            .filter(|m| m.name == name)
            .filter_map(|m| m.attributes.get(key).cloned())
            .collect()
    };
    assert_eq!(
        labels("nomad.gateway.upstream_tool.calls", "tool"),
        BTreeSet::from(["unknown".to_owned()])
    );
    assert_eq!(
        labels("nomad.gateway.upstream_tool.calls", "server"),
        BTreeSet::from(["nomad".to_owned(), "unknown".to_owned()])
    );
    assert_eq!(
        labels("nomad.tool.request_rejections", "tool"),
        BTreeSet::from(["unknown".to_owned()])
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_upstream_times_out_without_stalling_the_others() {
    let dir = Fleet::new_dir();
    let upstream = HttpUpstream::start(&dir).await;
    // Accepts connections and never answers.
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hole_addr = hole.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = hole.accept().await {
            held.push(socket);
        }
    });
    let mut options = options(&dir, &upstream.url, "");
    options.config_yaml = options.config_yaml.replacen(
        "servers:\n",
        &format!(
            "servers:\n  black: {{url: \"http://{hole_addr}/mcp\", connect_timeout_seconds: 3}}\n"
        ),
        1,
    );
    let mut fleet = Fleet::start(options).await;
    let gateway = fleet.gateway_client().await;
    let call = |server: &str| {
        let mut gateway = gateway.clone();
        let request = nomad_proto::v1::GatewayCallToolRequest {
            server: server.into(),
            tool: "shout".into(),
            arguments_json: r#"{"text": "hi"}"#.into(),
        };
        async move {
            let started = std::time::Instant::now();
            let result = gateway.call_tool(request).await;
            (result, started.elapsed())
        }
    };
    // The stdio server's first session costs a Python start-up (about a second on a loaded
    // 2-core machine); open it first so the timed call below measures only stalling.
    let (warm, _) = call("echo_stdio").await;
    warm.unwrap();
    let (black, quick) = tokio::join!(call("black"), async {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        call("echo_stdio").await
    });
    let (quick, quick_took) = quick;
    assert_eq!(
        quick.unwrap().into_inner().result_json,
        r#"{"result":"HI"}"#
    );
    assert!(
        quick_took < std::time::Duration::from_millis(1500),
        "{quick_took:?}"
    );
    let (black, black_took) = black;
    let error = black.unwrap_err();
    assert_status(&error, Code::Unavailable, "no session within 3 s");
    assert!(
        black_took < std::time::Duration::from_secs(8),
        "{black_took:?}"
    );
    fleet.terminate().await;
    let _ = std::fs::remove_dir_all(dir);
}

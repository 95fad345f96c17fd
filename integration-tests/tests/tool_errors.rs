//! A failed tool call keeps its code from where it failed to whoever called: sandboxed Python
//! catches `ToolError` with `.code`, and the gateway's gRPC `CallTool` answers with that code.

use nomad_integration_tests::peers::{python_sdk, script};
use nomad_integration_tests::sandbox_gateway::run_code;
use nomad_integration_tests::{Fleet, FleetOptions};
use nomad_proto::v1::GatewayCallToolRequest;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxed_code_tells_failures_apart_by_code() {
    let dir = Fleet::new_dir();
    let options = FleetOptions {
        config_yaml: format!(
            "servers:\n  echo_stdio: {{command: {python}, args: [{server}, --transport, stdio, --record, {record}]}}\n\
             sandbox:\n  warm: 0\n  max_tool_calls: 12\n",
            python = python_sdk().display(),
            server = script("upstream_server.py").display(),
            record = dir.join("stdio-record.jsonl").display(),
        ),
        ..Default::default()
    }
    .in_dir(&dir);
    let mut fleet = Fleet::start(options).await;
    let mut gateway = fleet.gateway_client().await;
    // Each failure as (code, message), caught the way agent code catches it.
    let code = "\
import sys
from mcp_tools import ToolError, nomad
from mcp_tools.echo_stdio import shout
bridge = next(f for f in sys.meta_path if hasattr(f, 'bridge')).bridge

def failure(call):
    try:
        call()
    except ToolError as e:
        return [e.code, str(e)]
    return ['no error', '']

RESULT = {
    'wrong arguments': failure(lambda: nomad.mlp(text='x')),
    'unknown tool': failure(lambda: bridge.request(
        'call_tool', {'server': 'nomad', 'tool': 'nope', 'arguments': {}})),
    'unknown server': failure(lambda: bridge.request(
        'call_tool', {'server': 'bogus', 'tool': 'x', 'arguments': {}})),
    'the tool failed': failure(lambda: shout()),
    'works': failure(lambda: nomad.mlp([0.5] * 6)),
    'over budget': next(
        f for f in (failure(lambda: bridge.request('list_servers', {})) for _ in range(50))
        if f[0] != 'no error'
    ),
}
";
    let reply = run_code(&mut gateway, code).await;
    let failures: Value = serde_json::from_str(&reply.result_json)
        .unwrap_or_else(|e| panic!("{e}: {} / {}", reply.result_json, reply.error));
    let expect = |case: &str, code: &str, words: &str| {
        let seen = &failures[case];
        assert_eq!(seen[0], code, "{case}: {seen}");
        assert!(
            seen[1].as_str().unwrap().contains(words),
            "{case}: the message should say {words:?}: {seen}"
        );
    };
    expect("wrong arguments", "INVALID_ARGUMENT", "input");
    expect("unknown tool", "NOT_FOUND", "nope");
    expect(
        "unknown server",
        "NOT_FOUND",
        "unknown upstream server \"bogus\"",
    );
    expect("the tool failed", "UNKNOWN", "echo_stdio.shout failed");
    assert_eq!(failures["works"], json!(["no error", ""]));
    expect(
        "over budget",
        "RESOURCE_EXHAUSTED",
        "bridge calls (sandbox.max_tool_calls)",
    );

    // The gateway's own CallTool answers with the same codes.
    for (tool, arguments, code) in [
        ("nope", "{}", tonic::Code::NotFound),
        ("mlp", r#"{"text": "x"}"#, tonic::Code::InvalidArgument),
    ] {
        let refused = gateway
            .call_tool(GatewayCallToolRequest {
                server: String::new(),
                tool: tool.into(),
                arguments_json: arguments.into(),
            })
            .await
            .unwrap_err();
        assert_eq!(refused.code(), code, "{tool}: {}", refused.message());
    }
    fleet.terminate().await;
    let _ = std::fs::remove_dir_all(dir);
}

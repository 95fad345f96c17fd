//! `search_code_tools` end to end: real MCP servers from PyPI as upstreams beside the fleet's
//! own tools, plain-language queries ranked by words and meaning, a dead upstream reported, a
//! tool added upstream found without a restart, and a run's tool calls returned.

use std::time::{Duration, Instant};

use nomad_integration_tests::catalog;
use nomad_integration_tests::fleet::rpc_channel;
use nomad_integration_tests::peers::{HttpUpstream, python_sdk, script};
use nomad_integration_tests::{Fleet, FleetOptions};
use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_proto::v1::{
    ExecuteCodeRequest, GatewayCallToolRequest, SearchToolsRequest, SearchToolsResponse,
};

/// Recall@5 the hybrid ranking keeps on `data/tool-queries.json`: measured 0.953 (BM25 with
/// name tiers alone 0.828, the former substring search 0.094; BENCHMARKS.md, "Tool search"),
/// with room for one more miss on another machine's arithmetic.
const MIN_RECALL_AT_5: f64 = 0.93;

type Gateway = GatewayClient<nomad_rpc::Channel>;

async fn search(gateway: &mut Gateway, query: &str, limit: u32) -> SearchToolsResponse {
    gateway
        .search_tools(SearchToolsRequest {
            query: query.into(),
            limit,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

/// Waits until the index ranks by meaning (the tools' texts are embedded after start-up).
async fn wait_for_hybrid(gateway: &mut Gateway) {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let reply = search(gateway, "probe", 1).await;
        if reply.ranking == "hybrid" {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the index never ranked by meaning: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_requests_find_their_tool_among_real_upstreams() {
    let dir = Fleet::new_dir();
    let mut fleet = Fleet::start(FleetOptions {
        tools_yaml: Some(catalog::tools_yaml()),
        // Beside the catalog, a server that dies at once.
        config_yaml: format!(
            "{}  dead: {{command: /bin/false}}\n",
            catalog::servers_yaml(&dir)
        ),
        ..Default::default()
    })
    .await;
    fleet.wait_for_workers(1).await;
    let mut gateway = GatewayClient::new(rpc_channel(&fleet.gateway_addr));
    wait_for_hybrid(&mut gateway).await;

    // The dead server is named with why; every other server's tools are listed.
    let everything = search(&mut gateway, "", 0).await;
    assert_eq!(everything.unavailable_servers.len(), 1, "{everything:?}");
    assert_eq!(everything.unavailable_servers[0].server, "dead");
    assert!(
        everything.unavailable_servers[0]
            .error
            .contains("connecting to MCP server \"dead\""),
        "{:?}",
        everything.unavailable_servers[0]
    );
    let servers: std::collections::BTreeSet<&str> =
        everything.tools.iter().map(|t| t.server.as_str()).collect();
    assert_eq!(
        servers,
        ["excel", "fetch", "git", "nomad", "time"].into(),
        "an empty query lists every server's tools"
    );
    assert!(everything.tools.len() >= 60, "{}", everything.tools.len());

    let queries = catalog::queries();
    assert!(queries.len() >= 60);
    let (mut found_at_5, mut first, mut reciprocal) = (0u32, 0u32, 0.0);
    let mut misses = Vec::new();
    for q in &queries {
        let reply = search(&mut gateway, &q.query, 5).await;
        assert_eq!(reply.ranking, "hybrid", "{}", q.query);
        let names: Vec<String> = reply
            .tools
            .iter()
            .map(|t| format!("{}:{}", t.server, t.name))
            .collect();
        match names.iter().position(|n| *n == q.tool) {
            Some(rank) => {
                found_at_5 += 1;
                first += u32::from(rank == 0);
                reciprocal += 1.0 / (rank as f64 + 1.0);
            }
            None => misses.push(format!("{:?} wanted {}, got {names:?}", q.query, q.tool)),
        }
    }
    let n = queries.len() as f64;
    let recall_at_5 = f64::from(found_at_5) / n;
    println!(
        "recall@1 {:.3} recall@5 {recall_at_5:.3} MRR@5 {:.3} over {} queries; misses: {misses:#?}",
        f64::from(first) / n,
        reciprocal / n,
        queries.len()
    );
    assert!(
        recall_at_5 >= MIN_RECALL_AT_5,
        "recall@5 {recall_at_5:.3} < {MIN_RECALL_AT_5}: {misses:#?}"
    );

    // A query that names a tool finds it first; brief results say how to import and call it.
    let named = search(&mut gateway, "git status", 3).await;
    let top = &named.tools[0];
    assert_eq!(
        (top.server.as_str(), top.name.as_str()),
        ("git", "git_status")
    );
    assert_eq!(top.import_path, "from mcp_tools.git import git_status");
    assert!(
        top.python_signature
            .starts_with("git_status(repo_path: str"),
        "{top:?}"
    );
    assert!(
        top.input_schema_json.is_empty(),
        "brief leaves the schema out"
    );
    // Full detail adds the schemas; the server filter keeps to one server.
    let full = gateway
        .search_tools(SearchToolsRequest {
            query: "current time".into(),
            server_filter: "time".into(),
            detail_level: "full".into(),
            limit: 10,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(full.tools.iter().all(|t| t.server == "time"), "{full:?}");
    assert_eq!(full.tools[0].name, "get_current_time");
    assert!(full.tools[0].input_schema_json.contains("timezone"));
    assert!(
        !full.tools[0].output_schema_json.is_empty(),
        "{:?}",
        full.tools[0]
    );
    // Bad input is named.
    for (request, wanted) in [
        (
            SearchToolsRequest {
                server_filter: "nope".into(),
                ..Default::default()
            },
            "unknown server \"nope\"",
        ),
        (
            SearchToolsRequest {
                query: "x".repeat(2000),
                ..Default::default()
            },
            "query is 2000 bytes; the limit is 1024",
        ),
    ] {
        let err = gateway.search_tools(request).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains(wanted), "{}", err.message());
    }
    fleet.terminate().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_added_upstream_is_found_without_a_restart_and_calls_are_recorded() {
    let dir = Fleet::new_dir();
    let http = HttpUpstream::start(&dir).await;
    let mut fleet = Fleet::start(FleetOptions {
        config_yaml: format!(
            "servers:\n\
             \x20 echo_stdio: {{command: {python}, args: [{server}, --transport, stdio, --record, {record}]}}\n\
             \x20 echo_http: {{url: \"{url}\"}}\n\
             gateway:\n\
             \x20 tools_ttl_seconds: 3600\n\
             \x20 search: {{embed_tool: \"\"}}\n\
             \x20 record_tool_calls: true\n\
             \x20 record_tool_call_payloads: true\n",
            python = python_sdk().display(),
            server = script("upstream_server.py").display(),
            record = dir.join("stdio-record.jsonl").display(),
            url = http.url,
        ),
        ..Default::default()
    })
    .await;
    let mut gateway = GatewayClient::new(rpc_channel(&fleet.gateway_addr));

    let reply = search(&mut gateway, "shout", 10).await;
    assert!(reply.unavailable_servers.is_empty(), "{reply:?}");
    assert_eq!(reply.ranking, "lexical", "no embedding tool configured");
    assert!(
        reply
            .tools
            .iter()
            .any(|t| t.server == "echo_stdio" && t.name == "shout")
    );

    // Each upstream adds a tool and says so; with an hour's listing TTL, every server listed and
    // nothing to embed (no retry pending), only that notice can bring the tool into the index.
    for (server, tool) in [
        ("echo_stdio", "zebra_counter"),
        ("echo_http", "heron_counter"),
    ] {
        let animal = tool.split('_').next().unwrap();
        assert!(
            !search(&mut gateway, &format!("{animal}s"), 10)
                .await
                .tools
                .iter()
                .any(|t| t.name == tool),
            "{tool} before it exists"
        );
        gateway
            .call_tool(GatewayCallToolRequest {
                server: server.into(),
                tool: "add_tool".into(),
                arguments_json: serde_json::json!({
                    "name": tool,
                    "description": format!("Counts the {animal}s crossing the road."),
                })
                .to_string(),
            })
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let reply = search(&mut gateway, &format!("how many {animal}s crossed"), 5).await;
            if reply
                .tools
                .iter()
                .any(|t| t.server == server && t.name == tool)
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{server}:{tool} never indexed: {reply:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    // The run's tool calls come back in order, with their payloads as configured.
    let ran = gateway
        .execute_code(ExecuteCodeRequest {
            code: "from mcp_tools.echo_stdio import shout, zebra_counter\n\
                   from mcp_tools.echo_http import shout as shout_http\n\
                   a = shout('one')\n\
                   b = zebra_counter()\n\
                   try:\n    shout_http()\nexcept Exception as e:\n    c = 'failed'\n\
                   RESULT = [a, b, c]\n"
                .into(),
            env: Default::default(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ran.status, "ok", "{ran:?}");
    assert!(ran.duration_seconds > 0.0);
    let calls: Vec<(&str, &str, &str)> = ran
        .tool_calls
        .iter()
        .map(|c| (c.server.as_str(), c.tool.as_str(), c.status.as_str()))
        .collect();
    assert_eq!(
        calls,
        [
            ("echo_stdio", "shout", "ok"),
            ("echo_stdio", "zebra_counter", "ok"),
            ("echo_http", "shout", "error"),
        ]
    );
    assert_eq!(ran.tool_calls[0].arguments_json, r#"{"text":"one"}"#);
    assert!(
        ran.tool_calls[0].output_json.contains("ONE"),
        "{:?}",
        ran.tool_calls[0]
    );
    assert!(!ran.tool_calls[2].error.is_empty());
    // The failure's code comes with it (gRPC's canonical name); a call that answered has none.
    let code = &ran.tool_calls[2].code;
    assert!(
        !code.is_empty() && code.chars().all(|c| c.is_ascii_uppercase() || c == '_'),
        "{:?}",
        ran.tool_calls[2]
    );
    assert_eq!(ran.tool_calls[0].code, "");
    let offsets: Vec<f64> = ran
        .tool_calls
        .iter()
        .map(|c| c.start_offset_seconds)
        .collect();
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");

    // A rollout driven by `nomad run` keeps them in its result line, for a replay.
    let code = "from mcp_tools.echo_stdio import shout\nRESULT = shout('two')";
    let run = fleet
        .run_head(&[serde_json::json!({"id": "replay", "code": code})], 1)
        .await;
    assert!(run.success, "{}", run.stderr);
    let recorded = &run.results[0]["tool_calls"];
    assert_eq!(recorded[0]["tool"], "shout", "{}", run.results[0]);
    assert_eq!(recorded[0]["arguments"], serde_json::json!({"text": "two"}));
    assert_eq!(recorded[0]["status"], "ok");
    fleet.terminate().await;
    drop(http);
    let _ = std::fs::remove_dir_all(dir);
}

//! The gateway's HTTP listener as a caller without the token meets it: slow headers are cut at
//! their deadline, connections are bounded with the unauthenticated closed first, a 401 closes
//! its connection, a slow body is cut once authenticated, and MCP sessions are bounded in number
//! and idle time. An authorised caller is answered throughout, over HTTP and gRPC.

use std::time::{Duration, Instant};

use nomad_integration_tests::fleet::TEST_TOKEN;
use nomad_integration_tests::sandbox_gateway::Gateway;
use nomad_integration_tests::users::RunAs;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

const INITIALIZE: &str = r#"{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bounds", "version": "1"}}}"#;

fn me() -> RunAs {
    RunAs {
        label: "test user",
        ids: None,
    }
}

/// A gateway with the tests' token and the given `gateway.http` lines.
async fn gateway(http: &str) -> Gateway {
    Gateway::start(
        &me(),
        &format!("  warm: 0\ngateway:\n  http:\n{http}auth: {{token: {TEST_TOKEN}}}\n"),
    )
    .await
}

/// Whether the server has closed `stream` (end of stream, or a reset), within `within`; what it
/// sent before is skipped.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    let mut buffer = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buffer)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}

/// One authorised request (an MCP `initialize`, which needs no scheduler), answered: its status
/// and how long it took.
async fn authorised(addr: &str) -> (u16, Duration) {
    let started = Instant::now();
    let response = nomad_integration_tests::http()
        .build()
        .unwrap()
        .post(format!("http://{addr}/mcp"))
        .bearer_auth(TEST_TOKEN)
        .header("accept", "application/json, text/event-stream")
        .header("content-type", "application/json")
        .body(INITIALIZE)
        .timeout(Duration::from_secs(10))
        .send()
        .await;
    let status = response.map_or(0, |r| r.status().as_u16());
    (status, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_callers_without_the_token_cannot_hold_the_gateway() {
    let gateway = gateway(
        "    header_timeout_seconds: 2\n    body_timeout_seconds: 2\n    max_connections: 32\n",
    )
    .await;
    let addr = gateway.mcp_addr.clone();
    let fds = gateway.open_fds();

    // 200 connections that send part of their headers and then trickle.
    let mut slow = Vec::new();
    for _ in 0..200 {
        let mut stream = TcpStream::connect(&addr).await.unwrap();
        stream
            .write_all(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            .await
            .unwrap();
        slow.push(stream);
    }
    // The gateway holds no more of them than its bound (plus what it held before).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = gateway.open_fds();
    assert!(
        held <= fds + 32 + 4,
        "the gateway holds {held} descriptors, {fds} before 200 slow connections"
    );
    // The oldest were closed for the newest (none authenticated).
    assert!(
        closed_within(&mut slow[0], Duration::from_secs(1)).await,
        "the oldest unauthenticated connection is still open"
    );
    // An authorised caller is answered at once, over HTTP and over gRPC.
    let (status, took) = authorised(&addr).await;
    assert_eq!(status, 200, "an authorised request under the flood");
    assert!(took < Duration::from_secs(3), "answered after {took:?}");
    let reply = gateway.run("RESULT = 40 + 2").await;
    assert_eq!(reply.result_json, "42", "{}", reply.error);
    // Trickling a byte a second does not keep a connection past the header deadline.
    let last = slow.len() - 1;
    let started = Instant::now();
    loop {
        let _ = slow[last].write_all(b"x").await;
        if closed_within(&mut slow[last], Duration::from_secs(1)).await {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "a trickling connection outlived the 2 s header deadline"
        );
    }

    // A request without the token gets its 401, and the connection closes.
    let mut stream = TcpStream::connect(&addr).await.unwrap();
    stream
        .write_all(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .unwrap();
    let mut answer = vec![0u8; 1024];
    let n = stream.read(&mut answer).await.unwrap();
    assert!(
        String::from_utf8_lossy(&answer[..n]).starts_with("HTTP/1.1 401"),
        "{}",
        String::from_utf8_lossy(&answer[..n])
    );
    assert!(
        closed_within(&mut stream, Duration::from_secs(2)).await,
        "a 401 left its connection open"
    );

    // With the token, a body that does not arrive is cut at its deadline.
    let mut stream = TcpStream::connect(&addr).await.unwrap();
    stream
        .write_all(
            format!(
                "POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \
                 {TEST_TOKEN}\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    assert!(
        closed_within(&mut stream, Duration::from_secs(5)).await,
        "a body that never arrived held its connection past the 2 s body deadline"
    );
    gateway.stop().await;
}

/// `initialize` over and over without closing: the gateway keeps at most `max_sessions`, the
/// one idle longest making room for each new one, and ends every session idle for
/// `session_idle_seconds`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_sessions_are_bounded_in_number_and_idle_time() {
    let gateway = gateway("    max_sessions: 8\n    session_idle_seconds: 3\n").await;
    let url = format!("http://{}/mcp", gateway.mcp_addr);
    let client = nomad_integration_tests::http().build().unwrap();
    let post = |session: Option<&str>, body: serde_json::Value| {
        let mut request = client
            .post(&url)
            .bearer_auth(TEST_TOKEN)
            .header("accept", "application/json, text/event-stream")
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(id) = session {
            request = request.header("mcp-session-id", id);
        }
        request.send()
    };
    let initialize: serde_json::Value = serde_json::from_str(INITIALIZE).unwrap();
    let initialized = serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let mut sessions = Vec::new();
    for _ in 0..30 {
        let response = post(None, initialize.clone()).await.unwrap();
        assert_eq!(response.status(), 200);
        let id = response.headers()["mcp-session-id"]
            .to_str()
            .unwrap()
            .to_owned();
        drop(response.bytes().await);
        sessions.push(id);
    }
    let alive = |status: reqwest::StatusCode| status.is_success();
    let mut live = Vec::new();
    for id in &sessions {
        let status = post(Some(id), initialized.clone()).await.unwrap().status();
        live.push(alive(status));
    }
    assert_eq!(
        live.iter().filter(|l| **l).count(),
        8,
        "sessions still open after 30 initialize: {live:?}"
    );
    assert!(
        live[22..].iter().all(|l| *l),
        "the newest sessions were the ones kept: {live:?}"
    );
    // Idle past the bound: none left.
    tokio::time::sleep(Duration::from_secs(5)).await;
    for id in &sessions[22..] {
        let status = post(Some(id), initialized.clone()).await.unwrap().status();
        assert_eq!(status, 404, "session {id} outlived its idle time");
    }
    gateway.stop().await;
}

//! The OpenAI front door's overhead: the same `embed` call through the gateway's
//! `POST /v1/embeddings` (HTTP/1.1, JSON, the bearer token) and through its gRPC `CallTool`,
//! samples interleaved on one fleet, one call at a time, each path over its own kept-alive
//! connection. The difference of the two is what the HTTP front door adds.
//!
//! Run: `cargo build --release --workspace --bins && target/release/nomad-openai-bench
//! [--samples 400]`.

use std::time::{Duration, Instant};

use nomad_integration_tests::fleet::{TEST_TOKEN, models_dir};
use nomad_integration_tests::{Fleet, FleetOptions, Service, arg, check_args};
use nomad_proto::v1::GatewayCallToolRequest;
use nomad_proto::v1::gateway_client::GatewayClient;

const TEXT: &str = "A sentence to embed.";

fn quantile(samples: &mut [Duration], q: f64) -> f64 {
    samples.sort();
    let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
    samples[i].as_secs_f64() * 1000.0
}

const USAGE: &str = "\
Usage: nomad-openai-bench [--samples 400]
The same embed call through POST /v1/embeddings and through the gateway's gRPC CallTool,
interleaved, one at a time.";

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    check_args(USAGE, &["--samples"], &[]);
    let samples: usize = arg("--samples", "400")
        .parse()
        .expect("--samples: a number");
    let fleet = Fleet::start(
        FleetOptions {
            tools_yaml: Some(format!(
                "tools:\n  - {{name: embed, kind: embed, source: {}, batch_size: 8}}\n\
                 tool_manager:\n  heartbeat_interval_ms: 200\n  max_batch_delay_ms: 0\n",
                models_dir().join("all-minilm-l6-v2").display()
            )),
            auth: true,
            ..Default::default()
        }
        .service_env(Service::Gateway, "RUST_LOG", "warn"),
    )
    .await;
    let url = fleet.gateway_mcp_url().replace("/mcp", "/v1/embeddings");
    let http = nomad_integration_tests::http().build().unwrap();
    let body = serde_json::json!({"model": "embed", "input": TEXT}).to_string();
    let over_http = || async {
        let started = Instant::now();
        let response = http
            .post(&url)
            .bearer_auth(TEST_TOKEN)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert!(response.status().is_success(), "{}", response.status());
        let answer: serde_json::Value = serde_json::from_slice(&response.bytes().await.unwrap())
            .expect("an OpenAI embeddings answer");
        assert_eq!(
            answer["data"][0]["embedding"].as_array().map(Vec::len),
            Some(384)
        );
        started.elapsed()
    };
    let grpc = GatewayClient::new(nomad_integration_tests::fleet::rpc_channel(
        &fleet.gateway_addr,
    ));
    let request = GatewayCallToolRequest {
        server: "nomad".into(),
        tool: "embed".into(),
        arguments_json: serde_json::json!({"text": TEXT}).to_string(),
    };
    let over_grpc = || {
        let (mut client, request) = (grpc.clone(), request.clone());
        async move {
            let started = Instant::now();
            let answer = client.call_tool(request).await.unwrap().into_inner();
            assert!(answer.result_json.contains("\"output\""));
            started.elapsed()
        }
    };
    // Warm-up: load the model, open both connections.
    for _ in 0..10 {
        over_http().await;
        over_grpc().await;
    }
    let (mut http_samples, mut grpc_samples, mut differences) =
        (Vec::new(), Vec::new(), Vec::new());
    for i in 0..samples {
        // Alternate which path goes first, so neither always follows the other.
        let (h, g) = if i % 2 == 0 {
            let h = over_http().await;
            (h, over_grpc().await)
        } else {
            let g = over_grpc().await;
            (over_http().await, g)
        };
        http_samples.push(h);
        grpc_samples.push(g);
        differences.push(h.as_secs_f64() * 1000.0 - g.as_secs_f64() * 1000.0);
    }
    differences.sort_by(f64::total_cmp);
    println!("\n{samples} calls of each, interleaved, one at a time:\n");
    println!("| path | p50 | p99 |\n|---|---|---|");
    println!(
        "| `POST /v1/embeddings` | {:.2} ms | {:.2} ms |",
        quantile(&mut http_samples, 0.5),
        quantile(&mut http_samples, 0.99)
    );
    println!(
        "| gRPC `CallTool` | {:.2} ms | {:.2} ms |",
        quantile(&mut grpc_samples, 0.5),
        quantile(&mut grpc_samples, 0.99)
    );
    println!(
        "\nThe front door's overhead (HTTP minus gRPC, pair by pair): p50 {:.2} ms",
        differences[differences.len() / 2]
    );
    drop(grpc);
}

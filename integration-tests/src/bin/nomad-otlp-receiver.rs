//! The OTLP test receiver as a process, standing in for the Collector and Jaeger where they
//! cannot run (the compose test): OTLP/gRPC in, Jaeger's api_v3 `QueryService` out.
//!
//!   nomad-otlp-receiver [--otlp 0.0.0.0:4317] [--query 0.0.0.0:16685]

use std::sync::Arc;

use nomad_integration_tests::OtlpReceiver;
use nomad_integration_tests::jaeger::JaegerQuery;

#[tokio::main]
async fn main() {
    let mut otlp = "0.0.0.0:4317".to_owned();
    let mut query = "0.0.0.0:16685".to_owned();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next();
        match (flag.as_str(), value) {
            ("--otlp", Some(v)) => otlp = v,
            ("--query", Some(v)) => query = v,
            (other, _) => {
                eprintln!(
                    "usage: nomad-otlp-receiver [--otlp ADDR] [--query ADDR] (got {other:?})"
                );
                std::process::exit(2);
            }
        }
    }
    let receiver = Arc::new(OtlpReceiver::grpc_at(&otlp).await);
    let _query = JaegerQuery::start_at(receiver.clone(), &query).await;
    eprintln!(
        "OTLP/gRPC on {}, Jaeger api_v3 query on {query}",
        receiver.addr
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

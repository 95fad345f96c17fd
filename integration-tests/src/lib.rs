//! Harness for Nomad's end-to-end tests: real service binaries on loopback ports, an OTLP
//! receiver speaking the real protocol (gRPC and HTTP/protobuf), and checks over the spans.

pub mod catalog;
pub mod encoders;
pub mod fleet;
pub mod hub;
pub mod jaeger;
pub mod model_host;
pub mod peers;
pub mod process;
pub mod receiver;
pub mod reference;
pub mod registry;
pub mod sandbox_gateway;
pub mod spans;
pub mod users;

pub use fleet::{Fleet, FleetOptions, HeadRun, Service};
pub use receiver::OtlpReceiver;
pub use spans::SpanRecord;

/// A loopback port free now (another process could take it before it is bound).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A run id no other test takes: `prefix` and eight random hex digits.
pub fn unique_run_id(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// Waits until `done` holds, checking every 50 ms; panics naming `what` after `within`.
pub async fn wait_until(what: &str, within: std::time::Duration, mut done: impl FnMut() -> bool) {
    let every = std::time::Duration::from_millis(50);
    wait_until_async(what, within, every, async || done()).await;
}

/// [`wait_until`] for a check that awaits (a call, a query), made every `every`.
pub async fn wait_until_async(
    what: &str,
    within: std::time::Duration,
    every: std::time::Duration,
    mut done: impl AsyncFnMut() -> bool,
) {
    let deadline = std::time::Instant::now() + within;
    while !done().await {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within {within:?}"
        );
        tokio::time::sleep(every).await;
    }
}

/// A bench's measuring window over callers that run until `stop`: one second of warm-up (loads,
/// connections), then `counting` set for `seconds`, then `stop` set. The seconds it counted.
pub async fn count_for(
    seconds: f64,
    counting: &std::sync::atomic::AtomicBool,
    stop: &std::sync::atomic::AtomicBool,
) -> f64 {
    use std::sync::atomic::Ordering::Relaxed;
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    counting.store(true, Relaxed);
    let started = std::time::Instant::now();
    tokio::time::sleep(std::time::Duration::from_secs_f64(seconds)).await;
    counting.store(false, Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    stop.store(true, Relaxed);
    elapsed
}

/// An HTTP client for tests and benches: the process's TLS provider installed first (the
/// workspace's reqwest has rustls without a provider of its own).
pub fn http() -> reqwest::ClientBuilder {
    nomad_rpc::install_crypto_provider();
    reqwest::Client::builder()
}

/// Checks a bench's command line: `--help` (or `-h`) prints `usage` and exits; an argument that
/// is none of the options (`values` take the argument after them, `switches` none) or an option
/// missing its value is refused, naming it, with the usage (exit status 2).
pub fn check_args(usage: &str, values: &[&str], switches: &[&str]) {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let refuse = |why: String| -> ! {
        eprintln!("{why}\n\n{usage}");
        std::process::exit(2)
    };
    let mut at = 0;
    while let Some(a) = args.get(at).map(String::as_str) {
        match a {
            "--help" | "-h" => {
                println!("{usage}");
                std::process::exit(0)
            }
            _ if values.contains(&a) && at + 1 < args.len() => at += 2,
            _ if values.contains(&a) => refuse(format!("{a} needs a value")),
            _ if switches.contains(&a) => at += 1,
            _ => refuse(format!("unknown argument {a:?}")),
        }
    }
}

/// The value after `name` on the command line, else `default` (the benchmarks' flags).
pub fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_owned())
}

/// The JSON objects of a JSONL file (results, console telemetry); none when it is missing, and
/// a line that is not JSON is skipped.
pub fn read_jsonl(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The string `field` of each object in a JSON array (a report's rows, a fleet's servers).
pub fn strings_of<'a>(array: &'a serde_json::Value, field: &str) -> Vec<&'a str> {
    let items = array
        .as_array()
        .unwrap_or_else(|| panic!("not an array: {array}"));
    items
        .iter()
        .map(|item| {
            item[field]
                .as_str()
                .unwrap_or_else(|| panic!("no string {field:?} in {item}"))
        })
        .collect()
}

/// Asserts that a call was refused with `code` and a message that says `needle`.
#[track_caller]
pub fn assert_status(status: &tonic::Status, code: tonic::Code, needle: &str) {
    assert_eq!(status.code(), code, "{status:?}");
    assert!(
        status.message().contains(needle),
        "the message does not say {needle:?}: {status:?}"
    );
}

/// Asserts that `value[field]` is a text that says `needle` (the whole value shown where not).
#[track_caller]
pub fn assert_says(value: &serde_json::Value, field: &str, needle: &str) {
    let said = value[field].as_str();
    assert!(
        said.is_some_and(|text| text.contains(needle)),
        "`{field}` does not say {needle:?}: {value}"
    );
}

/// A text as a tool's input, with its options as a JSON object (empty: none).
pub fn text_input(
    text: impl Into<String>,
    options: impl Into<String>,
) -> nomad_proto::v1::ToolInput {
    nomad_proto::v1::ToolInput {
        value: Some(nomad_proto::v1::tool_input::Value::Text(text.into())),
        options_json: options.into(),
    }
}

/// A call of `tool` on a text, with its options as a JSON object (empty: none).
pub fn text_call(
    tool: impl Into<String>,
    text: impl Into<String>,
    options: impl Into<String>,
) -> nomad_proto::v1::CallToolRequest {
    nomad_proto::v1::CallToolRequest {
        tool: tool.into(),
        input: Some(text_input(text, options)),
    }
}

/// Polls the head's run `run_id` every `every` until it has finished, at most `within`, `during`
/// seeing each state on the way: the finished run.
pub async fn finished_run<T>(
    head: &mut nomad_proto::v1::head_client::HeadClient<T>,
    run_id: &str,
    (within, every): (std::time::Duration, std::time::Duration),
    mut during: impl FnMut(&nomad_proto::v1::Run),
) -> nomad_proto::v1::Run
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    let deadline = std::time::Instant::now() + within;
    loop {
        let request = nomad_proto::v1::GetRunRequest {
            run_id: run_id.to_owned(),
        };
        let run = head.get_run(request).await.unwrap().into_inner();
        if run.state == nomad_proto::v1::RunState::Finished as i32 {
            return run;
        }
        during(&run);
        assert!(
            std::time::Instant::now() < deadline,
            "run {run_id} did not finish within {within:?}: {run:?}"
        );
        tokio::time::sleep(every).await;
    }
}

//! `generate` through the scheduler beside llama.cpp's `llama-server` on the same GGUF, one
//! run, interleaved per concurrency: output tokens/s, time to first token and request latency
//! at 1, 4, 8 and 16 callers, each request 64 greedy tokens after the same prompt. Both keep
//! prompt caches as they do by default (llama-server per slot, Nomad across sequences); the
//! prompt tokens each actually computed are reported beside.
//!
//! With `--openai`, both are asked through their OpenAI-compatible
//! `POST /v1/chat/completions` (Nomad's gateway, llama-server's own with `--jinja`), so each
//! renders the model's own chat template; `--model` serves another GGUF on both sides.
//!
//! Run: `cargo build --release --workspace --bins && target/release/nomad-generate-bench
//! [--llama-server PATH [--llama-model GGUF]] [--model GGUF] [--openai]
//! [--concurrency 1,4,8,16] [--dense-prefill] [--unique-prefix]`
//! (without `--llama-server`, Nomad alone); the worker runs on `NOMAD_TEST_DEVICE` when it is
//! set.

use std::time::{Duration, Instant};

use futures::StreamExt as _;
use nomad_integration_tests::{Fleet, FleetOptions, Service, arg, check_args, fleet, text_call};
use nomad_proto::v1::call_tool_stream_event;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_rpc::Channel;

const TOKENS: u32 = 64;
const TOPICS: [&str; 16] = [
    "a lighthouse keeper",
    "a lost robot",
    "a city under the sea",
    "a dragon who bakes",
    "a time traveller",
    "a desert caravan",
    "a haunted library",
    "a mountain village",
    "a pirate astronomer",
    "a clockwork garden",
    "a river that talks",
    "a winter festival",
    "a detective cat",
    "a floating market",
    "an old violin",
    "a secret tunnel",
];

/// The `n`th request's number when prompts must not share a prefix (`--unique-prefix`).
fn unique_prefix() -> String {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    if std::env::args().any(|a| a == "--unique-prefix") {
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("Request {n}. ")
    } else {
        String::new()
    }
}

/// The same text both servers get: SmolLM2's chat template around a user turn. With
/// `--unique-prefix`, the system line starts with a number no other request of the run has, so
/// no two prompts share more than their first few tokens and no prompt cache helps.
fn prompt(i: usize) -> String {
    let unique = unique_prefix();
    format!(
        "<|im_start|>system\n{unique}You are a helpful AI assistant named SmolLM, trained by \
         Hugging Face<|im_end|>\n<|im_start|>user\nTell me a long story about {}.<|im_end|>\n\
         <|im_start|>assistant\n",
        TOPICS[i % TOPICS.len()]
    )
}

/// One request's measurements.
struct Sample {
    first_token: Duration,
    total: Duration,
    tokens: u64,
    /// Prompt tokens computed (not taken from a cache).
    prefilled: u64,
}

impl Sample {
    /// A request started at `started` that ends now, its first token seen at `first` (none:
    /// counted as now).
    fn ended(started: Instant, first: Option<Duration>, tokens: u64, prefilled: u64) -> Self {
        let total = started.elapsed();
        Sample {
            first_token: first.unwrap_or(total),
            total,
            tokens,
            prefilled,
        }
    }
}

struct Level {
    tokens_per_second: f64,
    prefilled_mean: f64,
    ttft: (Duration, Duration),
    latency: (Duration, Duration),
}

fn p50_p99(mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort();
    let at = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    (at(0.5), at(0.99))
}

fn level(samples: Vec<Sample>, wall: Duration) -> Level {
    let tokens: u64 = samples.iter().map(|s| s.tokens).sum();
    let prefilled: u64 = samples.iter().map(|s| s.prefilled).sum();
    Level {
        tokens_per_second: tokens as f64 / wall.as_secs_f64(),
        prefilled_mean: prefilled as f64 / samples.len() as f64,
        ttft: p50_p99(samples.iter().map(|s| s.first_token).collect()),
        latency: p50_p99(samples.iter().map(|s| s.total).collect()),
    }
}

async fn nomad_request(client: SchedulerClient<Channel>, i: usize) -> Sample {
    let started = Instant::now();
    let mut stream = client
        .clone()
        .call_tool_stream(text_call(
            "generate",
            prompt(i),
            format!(r#"{{"max_tokens": {TOKENS}, "chat": false}}"#),
        ))
        .await
        .expect("CallToolStream")
        .into_inner();
    let mut first = None;
    let (mut tokens, mut prefilled) = (0, 0);
    while let Some(event) = stream.next().await {
        match event.expect("stream event").event {
            Some(call_tool_stream_event::Event::Text(_)) => {
                first.get_or_insert_with(|| started.elapsed());
            }
            Some(call_tool_stream_event::Event::Done(done)) => {
                if let Some(g) = done.generation {
                    tokens = u64::from(g.completion_tokens);
                    prefilled = u64::from(g.prompt_tokens - g.cached_prompt_tokens);
                }
            }
            None => {}
        }
    }
    Sample::ended(started, first, tokens, prefilled)
}

/// Each `data:` event of a server-sent-events reply, as JSON, to `on` (others, `[DONE]` among
/// them, are skipped).
async fn each_event(reply: reqwest::Response, mut on: impl FnMut(&serde_json::Value)) {
    let mut stream = reply.bytes_stream();
    let mut buffer = String::new();
    while let Some(chunk) = stream.next().await {
        buffer.push_str(&String::from_utf8_lossy(&chunk.expect("event stream")));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            if let Some(v) = event
                .trim()
                .strip_prefix("data: ")
                .and_then(|data| serde_json::from_str(data).ok())
            {
                on(&v);
            }
        }
    }
}

async fn llama_request(http: reqwest::Client, url: String, i: usize) -> Sample {
    let body = serde_json::json!({
        "prompt": prompt(i), "n_predict": TOKENS, "temperature": 0.0, "stream": true,
        "cache_prompt": true,
    });
    let started = Instant::now();
    let reply = http
        .post(format!("{url}/completion"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("llama-server request");
    let (mut first, mut tokens, mut prefilled) = (None, 0, 0);
    each_event(reply, |v| {
        if v["content"].as_str().is_some_and(|c| !c.is_empty()) {
            first.get_or_insert_with(|| started.elapsed());
        }
        if v["stop"].as_bool() == Some(true) {
            tokens = v["tokens_predicted"].as_u64().unwrap_or(0);
            prefilled = v["timings"]["prompt_n"].as_u64().unwrap_or(0);
        }
    })
    .await;
    Sample::ended(started, first, tokens, prefilled)
}

/// `--openai`: one chat turn through `POST /v1/chat/completions`, streamed, with the final usage
/// chunk; the server applies the model's own template. `token` is the bearer token, if any.
async fn chat_request(
    http: reqwest::Client,
    url: String,
    token: Option<String>,
    i: usize,
) -> Sample {
    let body = serde_json::json!({
        "model": "generate", "max_tokens": TOKENS, "temperature": 0.0, "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": format!(
            "{}Tell me a long story about {}.", unique_prefix(), TOPICS[i % TOPICS.len()])}],
    });
    let started = Instant::now();
    let mut request = http
        .post(format!("{url}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let reply = request.send().await.expect("chat completion request");
    assert!(
        reply.status().is_success(),
        "chat completion: {}",
        reply.status()
    );
    let (mut first, mut tokens, mut prefilled) = (None, 0, 0);
    each_event(reply, |v| {
        if v["choices"][0]["delta"]["content"]
            .as_str()
            .is_some_and(|c| !c.is_empty())
        {
            first.get_or_insert_with(|| started.elapsed());
        }
        if let Some(usage) = v.get("usage").filter(|u| u.is_object()) {
            tokens = usage["completion_tokens"].as_u64().unwrap_or(0);
            let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
            // llama-server reports what it computed in its own timings.
            prefilled = match (v["timings"]["prompt_n"].as_u64(), cached) {
                (Some(n), _) => n,
                (None, c) => usage["prompt_tokens"].as_u64().unwrap_or(0) - c.unwrap_or(0),
            };
        }
    })
    .await;
    Sample::ended(started, first, tokens, prefilled)
}

/// `2 * concurrency` requests (at least 4), `concurrency` at a time.
async fn run<F, Fut>(concurrency: usize, one: F) -> Level
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Sample>,
{
    let total = (2 * concurrency).max(4);
    let started = Instant::now();
    let samples: Vec<Sample> = futures::stream::iter(0..total)
        .map(one)
        .buffer_unordered(concurrency)
        .collect()
        .await;
    level(samples, started.elapsed())
}

struct LlamaServer {
    child: std::process::Child,
    url: String,
}

impl LlamaServer {
    async fn start(binary: &str, model: &std::path::Path, parallel: usize, jinja: bool) -> Self {
        let port = nomad_integration_tests::free_port();
        let dir = std::path::Path::new(binary).parent().unwrap().to_owned();
        let child = std::process::Command::new(binary)
            .args(["-m", model.to_str().unwrap(), "--host", "127.0.0.1"])
            .args([
                "--port",
                &port.to_string(),
                "--parallel",
                &parallel.to_string(),
            ])
            .args(["--ctx-size", &(parallel * 512).to_string()])
            .args(jinja.then_some("--jinja"))
            .env(
                "LD_LIBRARY_PATH",
                std::env::var("LD_LIBRARY_PATH").unwrap_or_else(|_| dir.display().to_string()),
            )
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("starting llama-server");
        // Owned before the wait, so a server that never comes up is killed by the panic.
        let mut server = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let http = nomad_integration_tests::http().build().unwrap();
        for _ in 0..600 {
            if let Ok(r) = http.get(format!("{}/health", server.url)).send().await
                && r.status().is_success()
            {
                return server;
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("llama-server exited before it was ready: {status}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("llama-server did not come up within 60 s");
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn row(system: &str, c: usize, l: &Level) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "| {c} | {system} | {:.1} | {:.0} ms | {:.0} ms | {:.0} ms | {:.0} ms | {:.1} |",
        l.tokens_per_second,
        ms(l.ttft.0),
        ms(l.ttft.1),
        ms(l.latency.0),
        ms(l.latency.1),
        l.prefilled_mean
    );
}

async fn bench(llama: Option<String>, levels: Vec<usize>) {
    let models = fleet::models_dir();
    let shipped = models.join("smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    // `--model`: another GGUF, served by both (the worker reads its family from the file).
    let gguf = std::path::PathBuf::from(arg("--model", shipped.to_str().unwrap()));
    // The worker serves the Q4_1 file as shipped on CPUs with AVX2, FMA and F16C (elsewhere it
    // re-quantizes to Q8_0 at load: then give llama-server the same weights with
    // `llama-quantize --allow-requantize <Q4_1> <out> Q8_0` and `--llama-model <out>`).
    let llama_model = std::path::PathBuf::from(arg("--llama-model", gguf.to_str().unwrap()));
    let most = *levels.iter().max().unwrap();
    // `--dense-prefill`: the tool's f32 prompt path (README, "Generation").
    let dense = std::env::args().any(|a| a == "--dense-prefill");
    let openai = std::env::args().any(|a| a == "--openai");
    let mut options = FleetOptions {
        tools_yaml: Some(format!(
            "tools:\n  - {{name: generate, kind: generate, source: {}, max_running: {most}, \
             dense_prefill: {dense}}}\n",
            gguf.display()
        )),
        auth: openai,
        ..Default::default()
    }
    .service_env(Service::Gateway, "RUST_LOG", "warn");
    // The quantized matmuls' thread count (the worker's default is 1; README, "Devices").
    if let Ok(threads) = std::env::var("CANDLE_NUM_THREADS") {
        options = options.service_env(Service::DeviceWorker, "CANDLE_NUM_THREADS", threads);
    }
    let mut fleet = Fleet::start(options).await;
    let client = SchedulerClient::new(fleet::rpc_channel(&fleet.scheduler_addr));
    let gateway = fleet.gateway_mcp_url().replace("/mcp", "");
    let http = nomad_integration_tests::http().build().unwrap();
    let nomad = |i| -> futures::future::BoxFuture<'static, Sample> {
        if openai {
            Box::pin(chat_request(
                http.clone(),
                gateway.clone(),
                Some(fleet::TEST_TOKEN.into()),
                i,
            ))
        } else {
            Box::pin(nomad_request(client.clone(), i))
        }
    };
    nomad(0).await; // loads and places the model
    println!(
        "| callers | server | output tokens/s | TTFT p50 | TTFT p99 | latency p50 | latency p99 \
         | prompt tokens computed (mean) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut nomad1 = None;
    for &c in &levels {
        if let Some(binary) = &llama {
            let server = LlamaServer::start(binary, &llama_model, c, openai).await;
            // A new connection per request: llama-server closes a streamed response's
            // connection, and reusing it from the pool fails the next request at random.
            let http = nomad_integration_tests::http()
                .pool_max_idle_per_host(0)
                .build()
                .expect("an HTTP client");
            let one = |i| -> futures::future::BoxFuture<'static, Sample> {
                if openai {
                    Box::pin(chat_request(http.clone(), server.url.clone(), None, i))
                } else {
                    Box::pin(llama_request(http.clone(), server.url.clone(), i))
                }
            };
            one(0).await; // warm-up
            let l = run(c, one).await;
            row("llama-server", c, &l);
        }
        let l = run(c, &nomad).await;
        row("Nomad", c, &l);
        match nomad1 {
            None => nomad1 = Some(l.tokens_per_second),
            Some(one) => eprintln!(
                "Nomad at {c} callers: {:.2}x its 1-caller throughput",
                l.tokens_per_second / one
            ),
        }
    }
    fleet.terminate().await;
}

const USAGE: &str = "\
Usage: nomad-generate-bench [--llama-server PATH [--llama-model GGUF]] [--model GGUF] [--openai]
                            [--concurrency 1,4,8,16] [--dense-prefill] [--unique-prefix]
`generate` through the scheduler (and llama-server on the same GGUF, interleaved, with
--llama-server): output tokens/s, time to first token and latency per number of callers, each
request 64 greedy tokens. --openai asks both through POST /v1/chat/completions (the model's own
chat template on each side); --model serves another GGUF (default: the shipped SmolLM2). CANDLE_NUM_THREADS is passed to the worker; NOMAD_TEST_DEVICE picks its
device.";

fn main() {
    check_args(
        USAGE,
        &[
            "--llama-server",
            "--llama-model",
            "--model",
            "--concurrency",
        ],
        &["--dense-prefill", "--unique-prefix", "--openai"],
    );
    let llama = Some(arg("--llama-server", "")).filter(|s| !s.is_empty());
    let levels: Vec<usize> = arg("--concurrency", "1,4,8,16")
        .split(',')
        .map(|c| c.parse().expect("--concurrency"))
        .collect();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(bench(llama, levels));
}

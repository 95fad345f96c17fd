//! Generation served continuously, through real processes: a scheduler and candle workers
//! running SmolLM2 (`scripts/fetch-models`).

use std::time::{Duration, Instant};

use futures::StreamExt as _;
use nomad_integration_tests::fleet::models_dir;
use nomad_integration_tests::peers::mcp_client;
use nomad_integration_tests::text_call;
use nomad_integration_tests::{Fleet, FleetOptions};
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_proto::v1::{CallToolRequest, CallToolResponse, call_tool_stream_event, tool_output};
use nomad_rpc::Channel;
use serde_json::json;

fn tools(max_running: u32, max_devices: u32) -> String {
    format!(
        "tools:\n  - {{name: generate, kind: generate, source: {}, max_running: {max_running}, \
         max_devices: {max_devices}}}\ntool_manager:\n  heartbeat_interval_ms: 200\n",
        models_dir().join("smollm2-135m-instruct").display()
    )
}

fn request(prompt: &str, max_tokens: u32) -> CallToolRequest {
    text_call(
        "generate",
        prompt,
        json!({ "max_tokens": max_tokens }).to_string(),
    )
}

fn answer(reply: &CallToolResponse) -> String {
    match reply.output.as_ref().and_then(|o| o.value.as_ref()) {
        Some(tool_output::Value::Text(t)) => t.clone(),
        other => panic!("not a text answer: {other:?}"),
    }
}

async fn call(
    client: &SchedulerClient<Channel>,
    prompt: &str,
    max_tokens: u32,
) -> Result<CallToolResponse, tonic::Status> {
    client
        .clone()
        .call_tool(request(prompt, max_tokens))
        .await
        .map(tonic::Response::into_inner)
}

const PROMPTS: [&str; 8] = [
    "Name a planet.",
    "What is 3 + 4?",
    "Write one word about the mountains.",
    "Say goodbye in Spanish.",
    "List two vegetables.",
    "What month comes after June?",
    "Give me a short farewell.",
    "Why do leaves fall in autumn? Answer in one sentence.",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_concurrent_generations_run_together_and_answer_as_each_would_alone() {
    let mut fleet = Fleet::start(FleetOptions::serving(tools(8, 1))).await;
    let client = fleet.scheduler_client().await;
    let mut alone = Vec::new();
    for p in PROMPTS {
        alone.push(answer(&call(&client, p, 16).await.unwrap()));
    }
    let together = futures::future::join_all(PROMPTS.iter().map(|p| call(&client, p, 16))).await;
    let replies: Vec<CallToolResponse> = together.into_iter().map(Result::unwrap).collect();
    let texts: Vec<String> = replies.iter().map(answer).collect();
    assert_eq!(texts, alone, "batching changed an answer");
    // They ran side by side: some joined while others were running.
    let most = replies.iter().map(|r| r.batch_size).max().unwrap();
    assert!(most >= 4, "at most {most} ran together");
    for r in &replies {
        let g = r.generation.as_ref().expect("generation stats");
        assert!(g.prompt_tokens > 10 && g.completion_tokens > 0, "{g:?}");
        assert!(g.time_to_first_token_seconds > 0.0, "{g:?}");
    }
    fleet.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_yields_the_text_of_the_unary_call_as_it_is_made() {
    let mut fleet = Fleet::start(FleetOptions::serving(tools(8, 1))).await;
    let client = fleet.scheduler_client().await;
    let unary = answer(&call(&client, PROMPTS[4], 24).await.unwrap());
    let mut stream = client
        .clone()
        .call_tool_stream(request(PROMPTS[4], 24))
        .await
        .unwrap()
        .into_inner();
    let (mut streamed, mut pieces, mut done) = (String::new(), 0, None);
    while let Some(event) = stream.next().await {
        match event.unwrap().event {
            Some(call_tool_stream_event::Event::Text(t)) => {
                assert!(done.is_none(), "text after the end");
                streamed.push_str(&t);
                pieces += 1;
            }
            Some(call_tool_stream_event::Event::Done(reply)) => done = Some(reply),
            None => panic!("an empty event"),
        }
    }
    let done = done.expect("the stream ended without its response");
    assert_eq!(streamed, unary);
    assert_eq!(answer(&done), unary);
    assert!(pieces > 3, "the text came in {pieces} piece(s)");
    fleet.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_decode_has_its_running_requests_served_by_the_other() {
    let mut fleet = Fleet::start(FleetOptions {
        candle_workers: 2,
        ..FleetOptions::serving(tools(8, 1))
    })
    .await;
    let client = fleet.scheduler_client().await;
    let first = call(&client, PROMPTS[0], 4).await.unwrap();
    let holder: usize = first
        .worker_id
        .strip_prefix("worker-")
        .and_then(|n| n.parse().ok())
        .expect("worker ids are worker-N");
    // Each answer with when it came: one may end (a short answer, its end-of-turn token) before
    // the kill, on the worker that held it; every one still running then must be served by the
    // other.
    let running = {
        let client = client.clone();
        tokio::spawn(async move {
            futures::future::join_all(PROMPTS[..4].iter().map(|p| {
                let client = client.clone();
                async move { (call(&client, p, 48).await, Instant::now()) }
            }))
            .await
        })
    };
    // Into decoding, then the worker dies.
    tokio::time::sleep(Duration::from_millis(400)).await;
    // An answer the worker sent just before it died may still arrive a moment after: 100 ms
    // of grace (an answer served again from the start on the other takes longer).
    let killed = Instant::now() + Duration::from_millis(100);
    fleet.kill_worker(holder);
    let replies = tokio::time::timeout(Duration::from_secs(120), running)
        .await
        .expect("requests hung after the worker died")
        .unwrap();
    let other = format!("worker-{}", 1 - holder);
    let mut answers = Vec::new();
    let mut after = 0;
    for (i, (r, at)) in replies.into_iter().enumerate() {
        let r = r.unwrap_or_else(|s| panic!("request {i} failed: {s}"));
        if at > killed {
            assert_eq!(r.worker_id, other, "request {i}, answered after the kill");
            after += 1;
        }
        answers.push(answer(&r));
    }
    assert!(
        after >= 2,
        "only {after} of 4 were still running at the kill: too fast to test"
    );
    // Served again from the start: the same greedy answers as alone.
    for (i, p) in PROMPTS[..4].iter().enumerate() {
        assert_eq!(answer(&call(&client, p, 48).await.unwrap()), answers[i]);
    }
    fleet.reap_killed().await;
    fleet.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_caller_asking_for_progress_gets_the_text_as_it_is_generated() {
    let mut fleet = Fleet::start(FleetOptions::serving(tools(4, 1))).await;
    let code = "from mcp_tools.nomad import generate\n\
                RESULT = generate(text='Why is the sky blue? Answer in one sentence.', max_tokens=24)['text']\n";
    // The same run on the newest protocol and on the initialize handshake, and once without
    // a progress token.
    let call = |progress: bool| json!({"tool": "execute_mcp_code", "arguments": {"code": code}, "progress": progress});
    for mode in ["auto", "legacy"] {
        let replies = mcp_client(
            &fleet.gateway_mcp_url(),
            mode,
            None,
            &json!([call(true), call(false)]),
        )
        .await;
        let streamed = &replies[0];
        assert_eq!(streamed["is_error"], false, "{mode}: {streamed}");
        let answer = streamed["structured"]["result"]
            .as_str()
            .unwrap()
            .to_owned();
        let notes = streamed["progress"].as_array().unwrap();
        assert!(notes.len() >= 2, "{mode}: {notes:?}");
        // Progress counts pieces; the pieces, in order, are the answer.
        let counts: Vec<f64> = notes.iter().map(|n| n[0].as_f64().unwrap()).collect();
        assert!(counts.windows(2).all(|w| w[0] < w[1]), "{mode}: {counts:?}");
        let text: String = notes.iter().map(|n| n[1].as_str().unwrap()).collect();
        assert_eq!(text, answer, "{mode}");
        // Without a token: the same greedy answer, no notifications.
        let plain = &replies[1];
        assert_eq!(plain["structured"]["result"], answer.as_str(), "{mode}");
        assert!(plain.get("progress").is_none());
    }
    fleet.terminate().await;
}

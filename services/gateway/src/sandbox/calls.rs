//! The bridge server: the runner's requests (list servers and tools, call a tool) answered from
//! a [`ToolHost`], within the run's budget of calls, until the runner closes the bridge.

use std::sync::Arc;

use serde::Deserialize;
use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;
use tokio::sync::Mutex;

use super::ToolHost;
use super::bridge::{self, Decoder, Response};
use crate::tool_error::{ToolError, ToolErrorCode};

#[derive(Debug, Deserialize)]
pub struct DoneError {
    #[serde(rename = "type", default)]
    pub kind: String,
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub traceback: String,
}

#[derive(Debug, Deserialize)]
pub struct Done {
    #[serde(default)]
    pub result: Value,
    #[serde(default)]
    pub error: Option<DoneError>,
    /// The size of a RESULT over the run's limit, sent instead of it.
    #[serde(default)]
    pub result_bytes: Option<usize>,
}

/// Bridge calls one run may make: at once, and in all.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    pub in_flight: usize,
    pub total: u64,
}

#[derive(Debug, Default)]
pub struct BridgeEnd {
    pub done: Option<Done>,
    pub tool_calls: u32,
    /// A protocol violation that ended the bridge.
    pub error: Option<String>,
}

/// Serves the runner's requests until it closes the bridge. At most `max_calls_in_flight` calls
/// run at once: frames past that stay undecoded in the buffer, and the runner's writes block
/// once the socket fills.
pub async fn serve(
    stream: UnixStream,
    mut decoder: Decoder,
    host: &impl ToolHost,
    budget: Budget,
    end: &mut BridgeEnd,
) {
    use futures::StreamExt as _;
    let (mut reader, writer) = stream.into_split();
    let writer = Arc::new(Mutex::new(writer));
    let mut buffer = vec![0u8; 64 << 10];
    let mut calls = futures::stream::FuturesUnordered::new();
    let mut total_calls = 0u64;
    let mut eof = false;
    loop {
        // Take every frame the budget allows before reading more.
        while calls.len() < budget.in_flight {
            let message = match decoder.next_frame() {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    end.error = Some(e.to_string());
                    eof = true;
                    break;
                }
            };
            match message.method.as_str() {
                "done" => {
                    end.done = serde_json::from_value(message.params).ok();
                    continue;
                }
                "ready" => continue,
                _ => {}
            }
            let Some(id) = message.id else { continue };
            let budget_left = total_calls < budget.total;
            total_calls += 1;
            if message.method == "call_tool" {
                end.tool_calls = end.tool_calls.saturating_add(1);
            }
            let writer = writer.clone();
            let max = budget.total;
            calls.push(async move {
                let response = if budget_left {
                    handle(host, id, &message.method, message.params).await
                } else {
                    Response::error(
                        id,
                        ToolError::new(
                            ToolErrorCode::ResourceExhausted,
                            format!(
                                "this run has used its {max} bridge calls (sandbox.max_tool_calls)"
                            ),
                        ),
                    )
                };
                if let Ok(frame) = bridge::encode(&response).or_else(|e| {
                    bridge::encode(&Response::error(id, ToolError::internal(e.to_string())))
                }) {
                    let _ = writer.lock().await.write_all(&frame).await;
                }
            });
        }
        if eof && calls.is_empty() {
            break;
        }
        tokio::select! {
            read = reader.read(&mut buffer), if !eof && calls.len() < budget.in_flight => {
                match read {
                    Ok(0) | Err(_) => eof = true,
                    Ok(n) => decoder.push(&buffer[..n]),
                }
            }
            Some(()) = calls.next(), if !calls.is_empty() => {}
        }
    }
}

async fn handle(host: &impl ToolHost, id: u64, method: &str, params: Value) -> Response {
    let text = |key: &str| {
        params
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    match method {
        "list_servers" => Response::ok(id, serde_json::json!(host.servers())),
        "list_tools" => match host.tools(&text("server")).await {
            Ok(tools) => Response::ok(id, serde_json::to_value(tools).unwrap_or_default()),
            Err(e) => Response::error(id, e),
        },
        "call_tool" => {
            let arguments = params
                .get("arguments")
                .cloned()
                .unwrap_or(Value::Object(Default::default()));
            match host.call(&text("server"), &text("tool"), arguments).await {
                Ok(value) => Response::ok(id, value),
                Err(e) => Response::error(id, e),
            }
        }
        other => Response::error(
            id,
            ToolError::invalid_argument(format!("unknown bridge method {other:?}")),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// Counts calls in flight; each takes 20 ms.
    #[derive(Default)]
    struct Slow {
        now: AtomicUsize,
        most: AtomicUsize,
        calls: AtomicUsize,
    }

    impl ToolHost for Slow {
        fn servers(&self) -> Vec<String> {
            vec!["s".into()]
        }

        async fn tools(&self, _server: &str) -> Result<Vec<super::super::ToolSpec>, ToolError> {
            Ok(Vec::new())
        }

        async fn call(
            &self,
            _server: &str,
            _tool: &str,
            arguments: Value,
        ) -> Result<Value, ToolError> {
            let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            self.calls.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(20)).await;
            self.now.fetch_sub(1, Ordering::SeqCst);
            Ok(arguments)
        }
    }

    #[tokio::test]
    async fn frames_past_the_in_flight_budget_wait_and_the_total_budget_refuses() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        // 40 calls written at once, so every frame is in the first reads.
        let mut frames = Vec::new();
        for id in 1..=40u64 {
            frames.extend(
                bridge::encode(&serde_json::json!({
                    "id": id, "method": "call_tool",
                    "params": {"server": "s", "tool": "t", "arguments": {"n": id}}
                }))
                .unwrap(),
            );
        }
        theirs.write_all(&frames).await.unwrap();
        let host = Slow::default();
        let budget = Budget {
            in_flight: 4,
            total: 30,
        };
        let mut end = BridgeEnd::default();
        let reader = tokio::spawn(async move {
            let mut decoder = Decoder::default();
            let mut replies = Vec::new();
            let mut buffer = [0u8; 4096];
            while replies.len() < 40 {
                let n = theirs.read(&mut buffer).await.unwrap();
                decoder.push(&buffer[..n]);
                while let Some(reply) = decoder.next_as::<Value>().unwrap() {
                    replies.push(reply);
                }
            }
            replies
        });
        let served = serve(ours, Decoder::default(), &host, budget, &mut end);
        let (_, replies) = tokio::join!(
            tokio::time::timeout(Duration::from_secs(10), served),
            reader
        );
        let replies = replies.unwrap();
        assert!(
            host.most.load(Ordering::SeqCst) <= 4,
            "{} at once",
            host.most.load(Ordering::SeqCst)
        );
        assert_eq!(
            host.calls.load(Ordering::SeqCst),
            30,
            "the host served past the total budget"
        );
        let refused = replies
            .iter()
            .filter(|r| {
                r["error"]["code"] == "RESOURCE_EXHAUSTED"
                    && r["error"]["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("sandbox.max_tool_calls"))
            })
            .count();
        assert_eq!(refused, 10);
        assert_eq!(end.tool_calls, 40);
    }
}

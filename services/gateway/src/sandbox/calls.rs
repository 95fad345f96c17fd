//! The bridge server: the runner's requests (list servers and tools, call a tool) answered from
//! a [`ToolHost`], within the run's budget of calls, until the runner closes the bridge.

use std::sync::Arc;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore};

use super::ToolHost;
use super::bridge::{self, CallParams, Decoder, Method, Response, ToolParams};
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

/// What all runs' bridges may hold in the gateway at once (`sandbox.bridge_memory_bytes`),
/// counted in KiB: bytes as they are read from a run, and a frame, from when it is parsed until
/// its call ends, at [`PARSE_FACTOR`] times its length. A run that finds no room waits (its
/// reads stop, so its writes block); its calls in flight go on and give room back as they end.
#[derive(Debug, Clone)]
pub struct BridgeMemory(Arc<Semaphore>);

/// What parsed JSON may cost per byte of its text: a `serde_json::Value` is 32 bytes, the
/// smallest array element (`0,`) 2 bytes, and a growing array may hold twice its length.
pub const PARSE_FACTOR: usize = 32;

/// Bytes read from a run at a time.
const CHUNK: usize = 64 << 10;

impl BridgeMemory {
    pub fn new(bytes: u64) -> Self {
        let kib = usize::try_from(bytes / 1024).unwrap_or(usize::MAX);
        Self(Arc::new(Semaphore::new(kib.min(Semaphore::MAX_PERMITS))))
    }

    fn kib(bytes: usize) -> u32 {
        u32::try_from(bytes.div_ceil(1024).max(1)).unwrap_or(u32::MAX)
    }

    async fn acquire(&self, bytes: usize) -> OwnedSemaphorePermit {
        self.0
            .clone()
            .acquire_many_owned(Self::kib(bytes))
            .await
            .expect("the bridge memory semaphore is never closed")
    }

    fn try_acquire(&self, bytes: usize) -> Option<OwnedSemaphorePermit> {
        self.0.clone().try_acquire_many_owned(Self::kib(bytes)).ok()
    }
}

/// Gives back what `held` counts beyond `bytes`.
fn keep_only(held: &mut Option<OwnedSemaphorePermit>, bytes: usize) {
    let keep = if bytes == 0 {
        0
    } else {
        BridgeMemory::kib(bytes) as usize
    };
    if let Some(permit) = held {
        let extra = permit.num_permits().saturating_sub(keep);
        if extra > 0 {
            drop(permit.split(extra));
        }
        if permit.num_permits() == 0 {
            *held = None;
        }
    }
}

/// Serves the runner's requests until it closes the bridge. At most `max_calls_in_flight` calls
/// run at once: frames past that stay undecoded in the buffer, and the runner's writes block
/// once the socket fills. What the run's bridge holds counts against `memory`.
pub async fn serve(
    stream: UnixStream,
    mut decoder: Decoder,
    host: &impl ToolHost,
    budget: Budget,
    memory: &BridgeMemory,
    end: &mut BridgeEnd,
) {
    use futures::StreamExt as _;
    let (mut reader, writer) = stream.into_split();
    let writer = Arc::new(Mutex::new(writer));
    let mut buffer = vec![0u8; CHUNK];
    let mut calls = futures::stream::FuturesUnordered::new();
    let mut total_calls = 0u64;
    let mut eof = false;
    // The decoder's bytes, and the room for the next whole frame once it is wholly read.
    let mut raw: Option<OwnedSemaphorePermit> = None;
    let mut room: Option<OwnedSemaphorePermit> = None;
    loop {
        // Take every frame the budget and the room allow before reading more.
        let mut waiting = None;
        while calls.len() < budget.in_flight {
            let len = match decoder.ready_len() {
                Ok(Some(len)) => len,
                Ok(None) => break,
                Err(e) => {
                    end.error = Some(bridge::refused(&e));
                    eof = true;
                    break;
                }
            };
            let Some(parsed) = room
                .take()
                .or_else(|| memory.try_acquire(PARSE_FACTOR * len))
            else {
                waiting = Some(len);
                break;
            };
            let message = match decoder.next_as::<bridge::Message>() {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    end.error = Some(bridge::refused(&e));
                    eof = true;
                    break;
                }
            };
            keep_only(&mut raw, decoder.buffered());
            match message.method {
                Method::Done => {
                    end.done = serde_json::from_value(message.params).ok();
                    continue;
                }
                Method::Ready => continue,
                _ => {}
            }
            let Some(id) = message.id else { continue };
            let budget_left = total_calls < budget.total;
            total_calls += 1;
            if message.method == Method::CallTool {
                end.tool_calls = end.tool_calls.saturating_add(1);
            }
            let writer = writer.clone();
            let max = budget.total;
            calls.push(async move {
                let response = if budget_left {
                    handle(host, id, message.method, message.params).await
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
                // The call's arguments are gone; its room goes back with its answer.
                drop(parsed);
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
        let reading = !eof && calls.len() < budget.in_flight && waiting.is_none();
        tokio::select! {
            // Room for a whole frame, while this run's calls go on.
            parsed = memory.acquire(PARSE_FACTOR * waiting.unwrap_or(0)), if waiting.is_some() => {
                room = Some(parsed);
            }
            // Room for a chunk, then the chunk.
            (chunk, read) = async {
                let chunk = memory.acquire(CHUNK).await;
                (chunk, reader.read(&mut buffer).await)
            }, if reading => {
                match read {
                    Ok(0) | Err(_) => eof = true,
                    Ok(n) => {
                        decoder.push(&buffer[..n]);
                        match &mut raw {
                            Some(held) => held.merge(chunk),
                            None => raw = Some(chunk),
                        }
                        keep_only(&mut raw, decoder.buffered());
                    }
                }
            }
            Some(()) = calls.next(), if !calls.is_empty() => {}
        }
    }
}

async fn handle(host: &impl ToolHost, id: u64, method: Method, params: Value) -> Response {
    match answer(host, method, params).await {
        Ok(value) => Response::ok(id, value),
        Err(e) => Response::error(id, e),
    }
}

/// What a request asks, answered; its parameters read as the method's own (a missing one is
/// named to the run).
async fn answer(host: &impl ToolHost, method: Method, params: Value) -> Result<Value, ToolError> {
    fn read<T: DeserializeOwned>(method: Method, params: Value) -> Result<T, ToolError> {
        serde_json::from_value(params).map_err(|e| {
            ToolError::invalid_argument(format!("the bridge's {method:?} request: {e}"))
        })
    }
    match method {
        Method::ListServers => Ok(serde_json::json!(host.servers())),
        Method::ListTools => {
            let p: ToolParams = read(method, params)?;
            let tools = host.tools(&p.server).await?;
            Ok(serde_json::to_value(tools).unwrap_or_default())
        }
        Method::WhyMissing => {
            let p: ToolParams = read(method, params)?;
            Err(host.missing(&p.server, &p.tool).await)
        }
        // Moved, not copied: the call holds the run's arguments once.
        Method::CallTool => {
            let p: CallParams = read(method, params)?;
            host.call(&p.server, &p.tool, p.arguments).await
        }
        Method::Ready | Method::Done | Method::Unknown => Err(ToolError::invalid_argument(
            "not a bridge request: the runner asks list_servers, list_tools, call_tool or \
             why_missing",
        )),
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

    fn run_decoder() -> Decoder {
        bridge::decoder(bridge::MAX_FRAME)
    }

    #[tokio::test]
    async fn a_request_is_read_as_its_methods_parameters_and_a_missing_one_is_named() {
        let host = Slow::default();
        let answer = |message: serde_json::Value| {
            let message: bridge::Message = serde_json::from_value(message).unwrap();
            handle(&host, 1, message.method, message.params)
        };
        let called = answer(serde_json::json!({"id": 1, "method": "call_tool",
            "params": {"server": "s", "tool": "t", "arguments": {"x": 1}}}))
        .await;
        assert_eq!(called.result, Some(serde_json::json!({"x": 1})));
        for (message, refusal) in [
            (
                serde_json::json!({"id": 1, "method": "call_tool", "params": {"tool": "t"}}),
                "the bridge's CallTool request: missing field `server`",
            ),
            (
                serde_json::json!({"id": 1, "method": "rm_rf"}),
                "not a bridge request",
            ),
        ] {
            let error = answer(message).await.error.unwrap();
            assert_eq!(error.code, ToolErrorCode::InvalidArgument);
            assert!(error.message.starts_with(refusal), "{}", error.message);
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
            let mut decoder = run_decoder();
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
        let memory = BridgeMemory::new(1 << 30);
        let served = serve(ours, run_decoder(), &host, budget, &memory, &mut end);
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

    /// Calls whose parsed arguments fill the gateway's bridge memory wait for room: with room
    /// for three, never more than three run at once, and every call is still answered.
    #[tokio::test]
    async fn calls_past_the_bridge_memory_wait_for_room() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let frame = |id: u64| {
            bridge::encode(&serde_json::json!({
                "id": id, "method": "call_tool",
                "params": {"server": "s", "tool": "t", "arguments": {"text": "x".repeat(10_000)}}
            }))
            .unwrap()
        };
        let len = frame(10).len() - 4;
        let per_call = BridgeMemory::kib(PARSE_FACTOR * len) as u64 * 1024;
        // Room for one chunk read, what stays buffered, and three calls' arguments parsed.
        let memory = BridgeMemory::new(2 * CHUNK as u64 + 3 * per_call + 1024);
        let host = Slow::default();
        let budget = Budget {
            in_flight: 16,
            total: 100,
        };
        let mut end = BridgeEnd::default();
        let peer = tokio::spawn(async move {
            let (mut read_half, mut write_half) = theirs.split();
            let write = async {
                for id in 10..50u64 {
                    write_half.write_all(&frame(id)).await.unwrap();
                }
            };
            let read = async {
                let mut decoder = run_decoder();
                let mut replies = 0;
                let mut buffer = [0u8; 4096];
                while replies < 40 {
                    let n = read_half.read(&mut buffer).await.unwrap();
                    decoder.push(&buffer[..n]);
                    while decoder.next_as::<Value>().unwrap().is_some() {
                        replies += 1;
                    }
                }
                replies
            };
            let ((), replies) = tokio::join!(write, read);
            replies
        });
        let served = serve(ours, run_decoder(), &host, budget, &memory, &mut end);
        let (_, replies) =
            tokio::join!(tokio::time::timeout(Duration::from_secs(20), served), peer);
        assert_eq!(replies.unwrap(), 40, "every call is answered");
        let most = host.most.load(Ordering::SeqCst);
        assert!(
            (2..=3).contains(&most),
            "{most} calls at once with room for three"
        );
        assert_eq!(
            memory.0.available_permits() as u64,
            (2 * CHUNK as u64 + 3 * per_call + 1024) / 1024,
            "every byte's room is given back"
        );
    }
}

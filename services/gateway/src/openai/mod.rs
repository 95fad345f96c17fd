//! An OpenAI-compatible front door over the scheduler's tools, for every client and framework
//! that speaks that API: `GET /v1/models`, `POST /v1/embeddings` (`embed` tools),
//! `POST /v1/chat/completions` and `POST /v1/completions` (`generate` tools, unary or streamed
//! as server-sent events), `POST /v1/rerank` (`rerank` tools, in the shape Cohere's and Jina's
//! rerank APIs use). Each input is one scheduler request through the same queues, batches,
//! spans and metrics as every other call (an upstream call of the `nomad` server); a W3C
//! `traceparent` header continues the caller's trace; errors come in OpenAI's shape with the
//! status a client expects. The bearer token is checked before any of this, by the listener.
//!
//! - `types`: the bodies; `error`: the error shape and its statuses.

mod error;
mod types;

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use nomad_proto::kinds::Kind;
use nomad_telemetry::Context;
use serde_json::{Value, json};

pub use self::error::ApiError;
use self::types::{ChatRequest, CompletionRequest, EmbeddingsRequest, Input, RerankRequest, Usage};
use crate::execute::Gateway;
use crate::upstream::nomad;

/// Largest request body (a batch of inputs, a long conversation).
const MAX_BODY: usize = 16 << 20;
/// Inputs one embeddings request may hold.
const MAX_INPUTS: usize = 2048;
/// Events a stream buffers before it waits for the client to read.
const STREAM_BUFFER: usize = 64;
/// Text pieces a streamed call may have waiting: more than a generation can make (at most
/// 2048 tokens, one piece or fewer each).
const PIECES: usize = 2048 + 64;

/// The routes, for the gateway's HTTP listener (behind its bearer token layer).
pub fn router(gateway: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/rerank", post(rerank))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(gateway)
}

type Gw = State<Arc<Gateway>>;

/// A body as JSON of `T`, or a 400 naming what is wrong with it.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(None, format!("the request body: {e}")))
}

/// The caller's trace context, from its `traceparent` (and `tracestate`, `baggage`) headers.
fn caller(headers: &HeaderMap) -> Context {
    nomad_telemetry::propagation::extract_headers(headers)
}

/// `model` checked against the scheduler's tools: it exists and is of one of `kinds`.
async fn model(gateway: &Gateway, name: &str, kinds: &[Kind]) -> Result<Kind, ApiError> {
    let listed = gateway
        .upstreams
        .model_kinds()
        .await
        .map_err(ApiError::from_tool_error)?;
    let served = |kind: &str| Kind::named(kind).filter(|k| kinds.contains(k));
    match listed.iter().find(|(n, _)| n == name) {
        Some((_, kind)) => served(kind).ok_or_else(|| {
            let names: Vec<&str> = kinds.iter().map(|k| k.name()).collect();
            ApiError::invalid(
                Some("model"),
                format!(
                    "model {name:?} is a {kind} tool; this endpoint serves {} tools",
                    names.join(" or ")
                ),
            )
        }),
        None => {
            let fitting: Vec<&str> = listed
                .iter()
                .filter(|(_, k)| served(k).is_some())
                .map(|(n, _)| n.as_str())
                .collect();
            Err(ApiError::model_not_found(name, &fitting))
        }
    }
}

/// How many of one request's texts are queued at once: half the tool's queue bound, so one
/// request never fills the queue alone (all of them when the bound is not known).
fn embedding_window(max_pending: Option<u32>) -> usize {
    max_pending.map_or(MAX_INPUTS, |bound| (bound as usize / 2).max(1))
}

async fn call(
    gateway: &Gateway,
    cx: &Context,
    tool: &str,
    arguments: &Value,
    progress: Option<&tokio::sync::mpsc::Sender<String>>,
) -> Result<Value, ApiError> {
    gateway
        .upstreams
        .call(cx, nomad::NAME, tool, arguments, progress)
        .await
        .map_err(ApiError::from_tool_error)
}

async fn models(State(gateway): Gw) -> Result<Json<Value>, ApiError> {
    let listed = gateway
        .upstreams
        .model_kinds()
        .await
        .map_err(ApiError::from_tool_error)?;
    Ok(Json(json!({
        "object": "list",
        "data": listed
            .iter()
            .map(|(name, kind)| json!({"id": name, "object": "model", "created": 0,
                                       "owned_by": "nomad", "kind": kind}))
            .collect::<Vec<_>>(),
    })))
}

async fn embeddings(
    State(gateway): Gw,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    let request: EmbeddingsRequest = parse(&body)?;
    if request.dimensions.is_some() {
        return Err(ApiError::invalid(
            Some("dimensions"),
            "`dimensions` is not supported: the model's own vectors are returned whole",
        ));
    }
    let base64 = match request.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                Some("encoding_format"),
                format!("encoding_format {other:?}: use float or base64"),
            ));
        }
    };
    let inputs = match serde_json::from_value::<Input>(request.input) {
        Ok(Input::One(text)) => vec![text],
        Ok(Input::Many(texts)) => texts,
        Err(_) => {
            return Err(ApiError::invalid(
                Some("input"),
                "`input` must be a string or a list of strings (token arrays are not accepted)",
            ));
        }
    };
    if inputs.is_empty() || inputs.len() > MAX_INPUTS {
        return Err(ApiError::invalid(
            Some("input"),
            format!(
                "`input` must hold 1 to {MAX_INPUTS} texts; it has {}",
                inputs.len()
            ),
        ));
    }
    model(&gateway, &request.model, &[Kind::Embed]).await?;
    let window = embedding_window(
        gateway
            .upstreams
            .model_max_pending(&request.model)
            .await
            .map_err(ApiError::from_tool_error)?,
    );
    let cx = caller(&headers);
    // Each text one scheduler request, in order, at most `window` of them queued at once (so a
    // request of more texts than the tool queues is admitted a window at a time, and leaves
    // room to other callers); the first failure ends the request, and its texts still in the
    // queue leave it.
    use futures::{StreamExt as _, TryStreamExt as _};
    let (gateway, cx, model) = (&gateway, &cx, &request.model);
    let answers: Vec<Value> = futures::stream::iter(inputs.into_iter().enumerate())
        .map(|(index, text)| async move {
            call(gateway, cx, model, &json!({"text": text}), None)
                .await
                .map_err(|e| e.at_input(index))
        })
        .buffered(window)
        .try_collect()
        .await?;
    let mut data = Vec::with_capacity(answers.len());
    for (index, answer) in answers.into_iter().enumerate() {
        let vector: Vec<f32> = answer
            .get("output")
            .and_then(Value::as_array)
            .map(|v| {
                v.iter()
                    .filter_map(Value::as_f64)
                    .map(|x| x as f32)
                    .collect()
            })
            .ok_or_else(|| ApiError::internal("the embed tool answered without a vector"))?;
        let embedding = if base64 {
            use base64::Engine as _;
            let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
            json!(base64::engine::general_purpose::STANDARD.encode(bytes))
        } else {
            json!(vector)
        };
        data.push(json!({"object": "embedding", "index": index, "embedding": embedding}));
    }
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": request.model,
        // The embed tool does not report its token counts.
        "usage": {"prompt_tokens": 0, "total_tokens": 0},
    })))
}

/// The `generate` arguments of a chat or completion request's sampling, checked.
fn generation(
    sampling: &types::Sampling,
    extra: &serde_json::Map<String, Value>,
) -> Result<serde_json::Map<String, Value>, ApiError> {
    // Fields that change nothing here are let through (those below, and any other at a value
    // that asks for nothing: null, false, 0, empty); any other is refused by name, so a client
    // never gets an answer computed differently than it asked.
    const HARMLESS: &[&str] = &[
        "user",
        "store",
        "metadata",
        "service_tier",
        "parallel_tool_calls",
        "prompt_cache_key",
        "safety_identifier",
    ];
    let nothing = |v: &Value| match v {
        Value::Null | Value::Bool(false) => true,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(_) | Value::Bool(true) => false,
    };
    if let Some((key, _)) = extra
        .iter()
        .find(|(k, v)| !HARMLESS.contains(&k.as_str()) && !nothing(v))
    {
        return Err(ApiError::invalid(
            Some(key),
            format!("`{key}` is not supported by Nomad's generate tools"),
        ));
    }
    if let Some(n) = sampling.n
        && n != 1
    {
        return Err(ApiError::invalid(
            Some("n"),
            format!("n = {n}: only 1 is supported"),
        ));
    }
    let mut options = serde_json::Map::new();
    if let Some(max) = sampling.max_completion_tokens.or(sampling.max_tokens) {
        options.insert("max_tokens".into(), json!(max));
    }
    if let Some(t) = sampling.temperature {
        options.insert("temperature".into(), json!(t));
    }
    if let Some(p) = sampling.top_p {
        options.insert("top_p".into(), json!(p));
    }
    if let Some(seed) = sampling.seed {
        options.insert("seed".into(), json!(seed));
    }
    if let Some(stop) = &sampling.stop {
        let stop = match stop {
            types::Stop::One(s) => vec![s.clone()],
            types::Stop::Many(v) => v.clone(),
        };
        options.insert("stop".into(), json!(stop));
    }
    Ok(options)
}

async fn chat(
    State(gateway): Gw,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let request: ChatRequest = parse(&body)?;
    let mut arguments = generation(&request.sampling, &request.extra)?;
    let messages = request
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let content = match &m.content {
                Value::String(s) => s.clone(),
                // The parts form: text parts only.
                Value::Array(parts) => parts
                    .iter()
                    .map(|p| {
                        match (
                            p.get("type").and_then(Value::as_str),
                            p.get("text").and_then(Value::as_str),
                        ) {
                            (Some("text"), Some(text)) => Ok(text),
                            _ => Err(ApiError::invalid(
                                Some(&format!("messages[{i}].content")),
                                "only text content parts are supported",
                            )),
                        }
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .join(""),
                _ => {
                    return Err(ApiError::invalid(
                        Some(&format!("messages[{i}].content")),
                        "content must be a string or a list of text parts",
                    ));
                }
            };
            let role = if m.role == "developer" {
                "system"
            } else {
                m.role.as_str()
            };
            Ok(json!({"role": role, "content": content}))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    if messages.is_empty() {
        return Err(ApiError::invalid(Some("messages"), "`messages` is empty"));
    }
    arguments.insert("messages".into(), json!(messages));
    respond(
        &gateway,
        &headers,
        request.model,
        arguments,
        &request.sampling,
        true,
    )
    .await
}

async fn completions(
    State(gateway): Gw,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let request: CompletionRequest = parse(&body)?;
    let mut arguments = generation(&request.sampling, &request.extra)?;
    let prompt = match &request.prompt {
        Value::String(s) => s.clone(),
        Value::Array(items) if items.len() == 1 && items[0].is_string() => {
            items[0].as_str().unwrap_or_default().to_owned()
        }
        _ => {
            return Err(ApiError::invalid(
                Some("prompt"),
                "`prompt` must be one string (a list of prompts or token arrays is not accepted)",
            ));
        }
    };
    arguments.insert("text".into(), json!(prompt));
    arguments.insert("chat".into(), json!(false));
    respond(
        &gateway,
        &headers,
        request.model,
        arguments,
        &request.sampling,
        false,
    )
    .await
}

fn usage(answer: &Value) -> Usage {
    let count = |k: &str| answer.get(k).and_then(Value::as_u64).unwrap_or(0);
    Usage {
        prompt_tokens: count("prompt_tokens"),
        completion_tokens: count("completion_tokens"),
        total_tokens: count("prompt_tokens") + count("completion_tokens"),
        prompt_tokens_details: types::PromptTokensDetails {
            cached_tokens: count("cached_prompt_tokens"),
        },
    }
}

/// A generation's answer: one JSON body, or server-sent events of its text as it is made.
async fn respond(
    gateway: &Arc<Gateway>,
    headers: &HeaderMap,
    model: String,
    arguments: serde_json::Map<String, Value>,
    sampling: &types::Sampling,
    chat: bool,
) -> Result<Response, ApiError> {
    let (cx, arguments) = (caller(headers), Value::Object(arguments));
    self::model(gateway, &model, &[Kind::Generate]).await?;
    let id = format!(
        "{}-{}",
        if chat { "chatcmpl" } else { "cmpl" },
        uuid::Uuid::new_v4().simple()
    );
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let object = if chat {
        "chat.completion"
    } else {
        "text_completion"
    };
    if !sampling.stream {
        let answer = call(gateway, &cx, &model, &arguments, None).await?;
        let text = answer
            .get("text")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let finish = answer
            .get("finish_reason")
            .and_then(Value::as_str)
            .unwrap_or("stop");
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": null})
        };
        return Ok(Json(
            json!({"id": id, "object": object, "created": created, "model": model,
                              "choices": [choice], "usage": usage(&answer)}),
        )
        .into_response());
    }
    let include_usage = sampling
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
    let chunk_object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let model_name = model.clone();
    let chunk = move |choices: Value, usage: Option<&Usage>| {
        let mut c = json!({"id": id, "object": chunk_object, "created": created, "model": model,
                           "choices": choices});
        if let Some(u) = usage {
            c["usage"] = json!(u);
        }
        Event::default().data(c.to_string())
    };
    let delta = move |text: &str, first: bool| {
        if chat {
            let mut d = json!({"content": text});
            if first {
                d["role"] = json!("assistant");
            }
            json!([{"index": 0, "delta": d, "finish_reason": null}])
        } else {
            json!([{"index": 0, "text": text, "finish_reason": null, "logprobs": null}])
        }
    };
    let (events, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(STREAM_BUFFER);
    let gateway = gateway.clone();
    let tool = model_name;
    tokio::spawn(async move {
        // Room for every piece a generation can make (one token or more each), so none is
        // dropped on the way.
        let (texts, mut pieces) = tokio::sync::mpsc::channel::<String>(PIECES);
        let called = call(&gateway, &cx, &tool, &arguments, Some(&texts));
        tokio::pin!(called);
        let mut first = true;
        let result = loop {
            tokio::select! {
                biased;
                Some(text) = pieces.recv() => {
                    // A client that went away drops this task, and with it the call.
                    if events.send(Ok(chunk(delta(&text, first), None))).await.is_err() {
                        return;
                    }
                    first = false;
                }
                result = &mut called => break result,
            }
        };
        while let Ok(text) = pieces.try_recv() {
            let _ = events.send(Ok(chunk(delta(&text, first), None))).await;
            first = false;
        }
        match result {
            Ok(answer) => {
                let finish = answer
                    .get("finish_reason")
                    .and_then(Value::as_str)
                    .unwrap_or("stop")
                    .to_owned();
                let last = if chat {
                    json!([{"index": 0, "delta": {}, "finish_reason": finish}])
                } else {
                    json!([{"index": 0, "text": "", "finish_reason": finish, "logprobs": null}])
                };
                let _ = events.send(Ok(chunk(last, None))).await;
                if include_usage {
                    let _ = events
                        .send(Ok(chunk(json!([]), Some(&usage(&answer)))))
                        .await;
                }
            }
            Err(error) => {
                let _ = events
                    .send(Ok(Event::default().data(error.body().to_string())))
                    .await;
            }
        }
        let _ = events.send(Ok(Event::default().data("[DONE]"))).await;
    });
    Ok(Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx)).into_response())
}

async fn rerank(
    State(gateway): Gw,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    let request: RerankRequest = parse(&body)?;
    let documents: Vec<String> = request
        .documents
        .iter()
        .enumerate()
        .map(|(i, d)| match d {
            Value::String(s) => Ok(s.clone()),
            Value::Object(o) if o.get("text").is_some_and(Value::is_string) => {
                Ok(o["text"].as_str().unwrap_or_default().to_owned())
            }
            _ => Err(ApiError::invalid(
                Some(&format!("documents[{i}]")),
                "a document is a string or {\"text\": \"...\"}",
            )),
        })
        .collect::<Result<_, _>>()?;
    model(&gateway, &request.model, &[Kind::Rerank]).await?;
    let mut arguments = json!({"text": request.query, "documents": documents});
    if let Some(n) = request.top_n {
        arguments["top_n"] = json!(n);
    }
    let answer = call(
        &gateway,
        &caller(&headers),
        &request.model,
        &arguments,
        None,
    )
    .await?;
    let results: Vec<Value> = answer
        .as_array()
        .ok_or_else(|| ApiError::internal("the rerank tool answered without a list"))?
        .iter()
        .map(|r| {
            let index = r["index"].as_u64().unwrap_or(0) as usize;
            let mut item = json!({"index": index, "relevance_score": r["score"]});
            if request.return_documents {
                item["document"] = json!({"text": documents.get(index)});
            }
            item
        })
        .collect();
    Ok(Json(
        json!({"id": uuid::Uuid::new_v4().to_string(), "model": request.model, "results": results}),
    ))
}

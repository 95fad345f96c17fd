//! What an MCP `tools/call` carries beside its arguments, for both of the gateway's MCP front
//! ends: the caller's W3C trace context in `params._meta`, and a progress token whose
//! notifications carry the text a tool streams.

use std::collections::HashMap;

use rmcp::RoleServer;
use rmcp::model::{CallToolRequestParams, ProgressNotificationParam, ProgressToken};
use rmcp::service::RequestContext;

/// The trace context a call carries in `params._meta` (or the request's own meta), extracted.
pub fn trace_context(
    request: &CallToolRequestParams,
    context: &RequestContext<RoleServer>,
) -> nomad_telemetry::Context {
    nomad_telemetry::propagation::extract_map(&carrier(request, context))
}

/// The trace context's fields a call carries in `params._meta` (or the request's own meta).
fn carrier(
    request: &CallToolRequestParams,
    context: &RequestContext<RoleServer>,
) -> HashMap<String, String> {
    request
        .meta
        .as_ref()
        .map(|m| &m.0.0)
        .into_iter()
        .chain(std::iter::once(&context.meta.0.0))
        .flat_map(|m| m.iter())
        .filter(|(k, _)| matches!(k.as_str(), "traceparent" | "tracestate" | "baggage"))
        .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_owned())))
        .collect()
}

/// Pieces of streamed text waiting to become progress notifications; more are dropped (the
/// answer holds all of the text anyway).
const PROGRESS_BUFFER: usize = 256;

/// Sends each piece of text a run's tools stream as a `notifications/progress` for `token`
/// (progress = pieces so far, message = the text), until the run ends.
async fn forward_progress(
    mut texts: tokio::sync::mpsc::Receiver<String>,
    peer: rmcp::Peer<RoleServer>,
    token: ProgressToken,
) {
    let mut pieces = 0u64;
    while let Some(text) = texts.recv().await {
        pieces += 1;
        let note = ProgressNotificationParam::new(token.clone(), pieces as f64).with_message(text);
        if peer.notify_progress(note).await.is_err() {
            // The client went away; the run still finishes and is recorded.
            return;
        }
    }
}

/// Where a call's streamed text goes: with a progress token, a channel whose pieces a task sends
/// on as notifications (await it after the call so they all go out before the answer).
pub fn progress(
    request: &CallToolRequestParams,
    context: &RequestContext<RoleServer>,
) -> (
    Option<tokio::sync::mpsc::Sender<String>>,
    Option<tokio::task::JoinHandle<()>>,
) {
    let token = request
        .meta
        .as_ref()
        .and_then(|m| m.get_progress_token())
        .or_else(|| context.meta.get_progress_token());
    match token {
        Some(token) => {
            let (tx, rx) = tokio::sync::mpsc::channel(PROGRESS_BUFFER);
            let forwarding = tokio::spawn(forward_progress(rx, context.peer.clone(), token));
            (Some(tx), Some(forwarding))
        }
        None => (None, None),
    }
}

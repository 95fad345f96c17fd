//! W3C trace context and baggage on every carrier Nomad uses: gRPC metadata (HTTP/2 headers),
//! string maps (MCP `params._meta`, the sandbox's environment).

use std::collections::HashMap;

use opentelemetry::Context;
use opentelemetry::global;
use opentelemetry::propagation::TextMapCompositePropagator;
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_sdk::propagation::{BaggagePropagator, TraceContextPropagator};

/// Installs TraceContext + Baggage as the global propagator. Done by `init` whether or not
/// export is on, so a process that records nothing still passes context along.
pub fn install() {
    global::set_text_map_propagator(TextMapCompositePropagator::new(vec![
        Box::new(TraceContextPropagator::new()),
        Box::new(BaggagePropagator::new()),
    ]));
}

/// The remote context carried by `headers` (empty when there is none).
pub fn extract_headers(headers: &http::HeaderMap) -> Context {
    global::get_text_map_propagator(|p| {
        p.extract_with_context(&Context::new(), &HeaderExtractor(headers))
    })
}

/// Writes `cx`'s trace context and baggage into `headers`.
pub fn inject_headers(cx: &Context, headers: &mut http::HeaderMap) {
    global::get_text_map_propagator(|p| p.inject_context(cx, &mut HeaderInjector(headers)));
}

/// `traceparent`, `tracestate` and `baggage` of `cx` as a map (for MCP `_meta` or env).
pub fn inject_map(cx: &Context) -> HashMap<String, String> {
    let mut map = HashMap::new();
    global::get_text_map_propagator(|p| p.inject_context(cx, &mut map));
    map
}

/// The context carried by a map of `traceparent` / `tracestate` / `baggage`.
pub fn extract_map(map: &HashMap<String, String>) -> Context {
    global::get_text_map_propagator(|p| p.extract_with_context(&Context::new(), map))
}

/// Environment variables that hand `cx` to a child process (`TRACEPARENT`, `TRACESTATE`,
/// `BAGGAGE`), as the OpenTelemetry environment carrier spells them.
pub fn inject_env(cx: &Context) -> Vec<(String, String)> {
    inject_map(cx)
        .into_iter()
        .map(|(k, v)| (k.to_ascii_uppercase(), v))
        .collect()
}

/// The context a parent process handed down with [`inject_env`] (empty when there is none).
pub fn extract_env(env: &(impl nomad_config::Env + ?Sized)) -> Context {
    let map: HashMap<String, String> = ["traceparent", "tracestate", "baggage"]
        .into_iter()
        .filter_map(|k| {
            env.non_empty(&k.to_ascii_uppercase())
                .map(|v| (k.to_owned(), v))
        })
        .collect();
    extract_map(&map)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::baggage;
    use opentelemetry::trace::{SpanContext, TraceContextExt, TraceFlags, TraceState};
    use opentelemetry::trace::{SpanId, TraceId};

    fn remote() -> Context {
        let sc = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
            SpanId::from_hex("00f067aa0ba902b7").unwrap(),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        baggage::with_ids(
            &Context::new().with_remote_span_context(sc),
            "run-1",
            Some("ro-9"),
        )
    }

    #[test]
    fn headers_round_trip_trace_context_and_run_ids() {
        install();
        let mut headers = http::HeaderMap::new();
        inject_headers(&remote(), &mut headers);
        assert_eq!(
            headers["traceparent"],
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        let back = extract_headers(&headers);
        assert_eq!(
            back.span().span_context().trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(baggage::run_id(&back).as_deref(), Some("run-1"));
        assert_eq!(baggage::rollout_id(&back).as_deref(), Some("ro-9"));
    }

    #[test]
    fn maps_round_trip_for_mcp_meta() {
        install();
        let map = inject_map(&remote());
        assert!(map.contains_key("traceparent") && map.contains_key("baggage"));
        let back = extract_map(&map);
        assert_eq!(baggage::run_id(&back).as_deref(), Some("run-1"));
        assert!(back.span().span_context().is_remote());
    }

    #[test]
    fn a_child_process_continues_the_trace_from_its_environment() {
        install();
        let env = inject_env(&remote());
        assert!(env.iter().any(|(k, _)| k == "TRACEPARENT"), "{env:?}");
        let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let back = extract_env(pairs.as_slice());
        assert_eq!(
            back.span().span_context().trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(baggage::run_id(&back).as_deref(), Some("run-1"));
        assert!(
            !extract_env(&[] as &[(&str, &str)])
                .span()
                .span_context()
                .is_valid()
        );
    }

    #[test]
    fn no_headers_give_an_empty_context() {
        install();
        let cx = extract_headers(&http::HeaderMap::new());
        assert!(!cx.span().span_context().is_valid());
        assert_eq!(baggage::run_id(&cx), None);
    }
}

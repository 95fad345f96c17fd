//! A test double of Jaeger's api_v3 `QueryService` (gRPC), serving what an [`OtlpReceiver`]
//! received. It answers `FindTraces` as Jaeger does: the traces with a span matching every
//! query attribute (span or resource attribute) and starting in the time window, at most
//! `search_depth` of them, each trace's spans streamed as OTLP `ResourceSpans`.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

use nomad_proto::jaeger::query_service_server::{QueryService, QueryServiceServer};
use nomad_proto::jaeger::{FindTracesRequest, TracesData};
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans};
use prost::Message as _;

use crate::receiver::OtlpReceiver;
use crate::spans::kv_map;

type Stream = std::pin::Pin<
    Box<dyn futures::Stream<Item = Result<TracesData, tonic::Status>> + Send + 'static>,
>;

#[derive(Clone)]
struct Query(Arc<OtlpReceiver>);

fn nanos(t: &Option<prost_types::Timestamp>) -> Option<u64> {
    t.as_ref()
        .map(|t| t.seconds.max(0) as u64 * 1_000_000_000 + t.nanos.max(0) as u64)
}

#[tonic::async_trait]
impl QueryService for Query {
    type FindTracesStream = Stream;

    async fn find_traces(
        &self,
        request: tonic::Request<FindTracesRequest>,
    ) -> Result<tonic::Response<Stream>, tonic::Status> {
        let query = request
            .into_inner()
            .query
            .ok_or_else(|| tonic::Status::invalid_argument("missing query"))?;
        let (min, max) = (nanos(&query.start_time_min), nanos(&query.start_time_max));
        if min.is_none() || max.is_none() {
            // Jaeger requires the window.
            return Err(tonic::Status::invalid_argument(
                "start_time_min and start_time_max are required",
            ));
        }
        let (min, max) = (min.unwrap(), max.unwrap());
        // Each span on its own, keyed by trace, keeping its resource and scope.
        let mut traces: BTreeMap<Vec<u8>, Vec<ResourceSpans>> = BTreeMap::new();
        let mut matching: Vec<Vec<u8>> = Vec::new();
        for rs in self.0.resource_spans() {
            let resource = rs
                .resource
                .as_ref()
                .map(|r| kv_map(&r.attributes))
                .unwrap_or_default();
            for scope in &rs.scope_spans {
                for span in &scope.spans {
                    let attributes = kv_map(&span.attributes);
                    let hit = query
                        .attributes
                        .iter()
                        .all(|(k, v)| attributes.get(k).or_else(|| resource.get(k)) == Some(v))
                        && (min..=max).contains(&span.start_time_unix_nano);
                    if hit && !matching.contains(&span.trace_id) {
                        matching.push(span.trace_id.clone());
                    }
                    traces
                        .entry(span.trace_id.clone())
                        .or_default()
                        .push(ResourceSpans {
                            resource: rs.resource.clone(),
                            scope_spans: vec![ScopeSpans {
                                scope: scope.scope.clone(),
                                spans: vec![span.clone()],
                                schema_url: scope.schema_url.clone(),
                            }],
                            schema_url: rs.schema_url.clone(),
                        });
                }
            }
        }
        let depth = if query.search_depth > 0 {
            query.search_depth as usize
        } else {
            20
        };
        let mut chunks: HashMap<Vec<u8>, Vec<ResourceSpans>> = traces.into_iter().collect();
        let replies: Vec<Result<TracesData, tonic::Status>> = matching
            .into_iter()
            .take(depth)
            .map(|trace_id| {
                Ok(TracesData {
                    resource_spans: chunks
                        .remove(&trace_id)
                        .unwrap_or_default()
                        .iter()
                        .map(|rs| rs.encode_to_vec())
                        .collect(),
                })
            })
            .collect();
        Ok(tonic::Response::new(Box::pin(futures::stream::iter(
            replies,
        ))))
    }
}

/// Serves `receiver`'s spans over the api_v3 query API on a free loopback port.
pub struct JaegerQuery {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl JaegerQuery {
    pub async fn start(receiver: Arc<OtlpReceiver>) -> Self {
        Self::start_at(receiver, "127.0.0.1:0").await
    }

    /// The same on `address`.
    pub async fn start_at(receiver: Arc<OtlpReceiver>, address: &str) -> Self {
        let listener = tokio::net::TcpListener::bind(address).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(QueryServiceServer::new(Query(receiver)))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
                .unwrap();
        });
        Self { addr, task }
    }
}

impl Drop for JaegerQuery {
    fn drop(&mut self) {
        self.task.abort();
    }
}

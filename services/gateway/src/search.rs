//! `search_code_tools`: an index of every upstream's tools, built when the gateway starts and
//! rebuilt when a server's tools change (a new session, `notifications/tools/list_changed`) or
//! its listing expires (`tools_ttl_seconds`); a search never lists a server. Tools are ranked
//! by `nomad_tool_search` (BM25 with name tiers, fused with the embedding tool's similarity when
//! there is one).

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use lru::LruCache;
use nomad_tool_search::{DEFAULT_FUSION, Index, Query, Ranking, ToolDoc};
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::config::SearchConfig;
use crate::sandbox::ToolSpec;
use crate::schema;
use crate::upstream::Upstreams;

/// Tools a catalog holds at most; the rest are left out with a warning.
const MAX_TOOLS: usize = 20_000;
/// Bytes of a query.
pub const MAX_QUERY_BYTES: usize = 1024;
/// How long listing one server may take while indexing; a slower one is reported unavailable
/// and asked again at the next refresh.
const LIST_DEADLINE: Duration = Duration::from_secs(10);
/// Tool texts embedded at once while indexing (the scheduler batches them).
const EMBED_CONCURRENCY: usize = 32;
/// How long embedding one tool's text may take while indexing (it may queue behind the fleet's
/// own embedding work; nothing waits for it but the hybrid index).
const INDEX_EMBED_DEADLINE: Duration = Duration::from_secs(60);
/// The first wait before asking again after a failure; it doubles up to the listing TTL.
const RETRY_FIRST: Duration = Duration::from_secs(2);
/// How long a search waits for the first index.
const FIRST_INDEX_WAIT: Duration = Duration::from_secs(30);

/// How much of each tool a search returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DetailLevel {
    /// Description's first line, import and signature.
    #[default]
    Brief,
    /// Also the whole description and the input and output schemas.
    Full,
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("detail_level {0:?}: use brief or full")]
pub struct UnknownDetailLevel(String);

impl DetailLevel {
    /// The level a caller asked for; nothing (or an empty string, gRPC's unset) is brief.
    pub fn parse(given: Option<&str>) -> Result<Self, UnknownDetailLevel> {
        match given.unwrap_or_default() {
            "" | "brief" => Ok(Self::Brief),
            "full" => Ok(Self::Full),
            other => Err(UnknownDetailLevel(other.to_owned())),
        }
    }
}

/// One search's parameters, checked.
pub struct SearchRequest<'a> {
    pub query: &'a str,
    pub server_filter: &'a str,
    pub detail: DetailLevel,
    /// `None`: 20 for a query, every tool for an empty one.
    pub limit: Option<usize>,
}

#[derive(Debug)]
pub struct SearchReply {
    pub tools: Vec<Value>,
    pub ranking: Ranking,
    /// Servers whose tools could not be listed: (server, why).
    pub unavailable: Vec<(String, String)>,
}

impl SearchReply {
    pub fn to_json(&self) -> Value {
        json!({
            "tools": self.tools,
            "ranking": self.ranking.as_str(),
            "unavailable_servers": self.unavailable.iter()
                .map(|(server, error)| json!({"server": server, "error": error}))
                .collect::<Vec<_>>(),
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SearchError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotReady(String),
}

impl SearchError {
    pub fn status(&self) -> tonic::Status {
        match self {
            SearchError::BadRequest(m) => tonic::Status::invalid_argument(m),
            SearchError::NotReady(m) => tonic::Status::unavailable(m),
        }
    }
}

/// A built index and what it was built from.
struct Catalog {
    index: Index,
    /// (server, tool) in the index's order.
    tools: Vec<(String, ToolSpec)>,
    unavailable: Vec<(String, String)>,
    /// Query embeddings already made for this index: rollouts repeat their searches (many
    /// samples of one task), and a repeated query then costs no model call.
    queries: Mutex<LruCache<String, Arc<Vec<f32>>>>,
}

/// Query embeddings one index keeps (about 6 MiB of 384-dimension vectors and their texts).
const CACHED_QUERIES: NonZeroUsize = NonZeroUsize::new(4096).expect("not zero");

/// The embedding tool, as `server` and `tool`.
#[derive(Clone)]
struct Embedder {
    server: String,
    tool: String,
    /// How long a query's embedding may take.
    timeout: Duration,
}

pub struct ToolSearch {
    upstreams: Arc<Upstreams>,
    current: watch::Receiver<Option<Arc<Catalog>>>,
    embedder: Option<Embedder>,
}

impl ToolSearch {
    /// Starts indexing in the background; searches wait for the first index.
    pub fn start(
        upstreams: Arc<Upstreams>,
        config: &SearchConfig,
        ttl: Duration,
    ) -> Result<Self, String> {
        let embedder = match config.embed_tool.trim() {
            "" => None,
            spec => {
                let (server, tool) = spec.split_once(':').ok_or_else(|| {
                    format!("gateway.search.embed_tool {spec:?}: write it as server:tool")
                })?;
                Some(Embedder {
                    server: server.to_owned(),
                    tool: tool.to_owned(),
                    timeout: nomad_config::seconds(
                        "gateway.search.embed_timeout_seconds",
                        config.embed_timeout_seconds,
                    )?,
                })
            }
        };
        let (tx, current) = watch::channel(None);
        tokio::spawn(refresh(upstreams.clone(), embedder.clone(), tx, ttl));
        Ok(Self {
            upstreams,
            current,
            embedder,
        })
    }

    pub async fn search(&self, request: &SearchRequest<'_>) -> Result<SearchReply, SearchError> {
        if request.query.len() > MAX_QUERY_BYTES {
            return Err(SearchError::BadRequest(format!(
                "query is {} bytes; the limit is {MAX_QUERY_BYTES}",
                request.query.len()
            )));
        }
        let servers = self.upstreams.server_names();
        let filter = match request.server_filter {
            "" => None,
            s if servers.iter().any(|n| n == s) => Some(s),
            s => {
                return Err(SearchError::BadRequest(format!(
                    "unknown server {:?}; configured: {}",
                    nomad_tool_search::text::clip(s, 256),
                    servers.join(", ")
                )));
            }
        };
        let mut current = self.current.clone();
        let catalog =
            match tokio::time::timeout(FIRST_INDEX_WAIT, current.wait_for(Option::is_some)).await {
                Ok(Ok(c)) => c.clone().expect("waited for an index"),
                _ => {
                    return Err(SearchError::NotReady(format!(
                        "the tool index is not built yet (no listing within {} s)",
                        FIRST_INDEX_WAIT.as_secs()
                    )));
                }
            };
        let embedding = match &self.embedder {
            Some(e) if catalog.index.has_embeddings() && !request.query.trim().is_empty() => {
                let spec = catalog
                    .tools
                    .iter()
                    .find(|(s, t)| *s == e.server && t.name == e.tool)
                    .map(|(_, t)| t);
                let cached = catalog
                    .queries
                    .lock()
                    .expect("query cache lock")
                    .get(request.query)
                    .cloned();
                match (cached, spec) {
                    (Some(v), _) => Some(v),
                    (None, Some(spec)) => {
                        match embed(&self.upstreams, e, spec, request.query, e.timeout).await {
                            Ok(v) => {
                                let v = Arc::new(v);
                                let mut queries = catalog.queries.lock().expect("query cache lock");
                                queries.put(request.query.to_owned(), v.clone());
                                Some(v)
                            }
                            Err(err) => {
                                tracing::info!(
                                    "embedding the query failed, ranking lexically: {err}"
                                );
                                None
                            }
                        }
                    }
                    (None, None) => None,
                }
            }
            _ => None,
        };
        let limit = match request.limit {
            Some(n) => n,
            None if request.query.trim().is_empty() => usize::MAX,
            None => 20,
        };
        let (hits, ranking) = catalog
            .index
            .search(&Query {
                text: request.query,
                embedding: embedding.as_deref().map(Vec::as_slice),
                server: filter,
                limit,
                fusion: DEFAULT_FUSION,
            })
            .map_err(SearchError::NotReady)?;
        let tools = hits
            .iter()
            .map(|hit| {
                let (server, tool) = &catalog.tools[hit.doc];
                entry(server, tool, request.detail == DetailLevel::Full)
            })
            .collect();
        Ok(SearchReply {
            tools,
            ranking,
            unavailable: catalog
                .unavailable
                .iter()
                .filter(|(s, _)| filter.is_none_or(|f| f == s))
                .cloned()
                .collect(),
        })
    }
}

/// A tool as a search returns it: brief (description's first line, import, signature) or full
/// (the whole description, input and output schema, the async form).
fn entry(server: &str, tool: &ToolSpec, full: bool) -> Value {
    let name = schema::identifier(&tool.name);
    let mut entry = json!({
        "server": server,
        "name": tool.name,
        "description": if full { tool.description.as_str() } else { tool.description.lines().next().unwrap_or_default() },
        "signature": schema::python_signature(&tool.name, &tool.input_schema),
        "import": format!("from mcp_tools.{} import {name}", schema::identifier(server)),
    });
    if !tool.title.is_empty() {
        entry["title"] = json!(tool.title);
    }
    if full {
        entry["input_schema"] = tool.input_schema.clone();
        entry["output_schema"] = tool.output_schema.clone().unwrap_or(Value::Null);
        entry["async"] = json!(format!("await {name}_async(...)"));
    }
    entry
}

/// The embedding of `text` by the embedding tool `spec`, within `deadline`.
async fn embed(
    upstreams: &Upstreams,
    embedder: &Embedder,
    spec: &ToolSpec,
    text: &str,
    deadline: Duration,
) -> Result<Vec<f32>, String> {
    let mut arguments = json!({ "text": text });
    if spec.input_schema.pointer("/properties/truncate").is_some() {
        arguments["truncate"] = json!(true);
    }
    let called = tokio::time::timeout(
        deadline,
        upstreams.call_unrecorded(&embedder.server, &embedder.tool, &arguments),
    )
    .await
    .map_err(|_| format!("no embedding within {} s", deadline.as_secs_f64()))?
    .map_err(|e| e.message)?;
    let output = called
        .get("output")
        .and_then(Value::as_array)
        .ok_or("the embedding tool's answer has no `output` list")?;
    output
        .iter()
        .map(|x| x.as_f64().map(|x| x as f32))
        .collect::<Option<Vec<f32>>>()
        .filter(|v| !v.is_empty())
        .ok_or_else(|| "the embedding tool's `output` is not a list of numbers".to_owned())
}

/// Every server's tools, listed at once, and the servers that could not be listed.
async fn list_all(upstreams: &Upstreams) -> (Vec<(String, ToolSpec)>, Vec<(String, String)>) {
    let listings = futures::future::join_all(upstreams.server_names().into_iter().map(
        |server| async move {
            let listed = tokio::time::timeout(LIST_DEADLINE, upstreams.tools(&server))
                .await
                .map_err(|_| format!("no tool listing within {} s", LIST_DEADLINE.as_secs()))
                .and_then(|listed| listed.map_err(|e| e.message));
            (server, listed)
        },
    ))
    .await;
    let mut tools = Vec::new();
    let mut unavailable = Vec::new();
    for (server, listed) in listings {
        match listed {
            Ok(listed) => tools.extend(listed.into_iter().map(|t| (server.clone(), t))),
            Err(e) => unavailable.push((server, e)),
        }
    }
    if tools.len() > MAX_TOOLS {
        tracing::warn!(
            "{} tools listed; indexing the first {MAX_TOOLS}",
            tools.len()
        );
        tools.truncate(MAX_TOOLS);
    }
    (tools, unavailable)
}

fn docs_of(tools: &[(String, ToolSpec)]) -> Vec<ToolDoc> {
    tools
        .iter()
        .map(|(server, t)| ToolDoc::new(server, &t.name, &t.title, &t.description, &t.input_schema))
        .collect()
}

/// Keeps the index current: lists, builds and publishes the lexical index at once, then embeds
/// the tool texts it has not embedded yet and publishes again; waits for a change or the TTL.
async fn refresh(
    upstreams: Arc<Upstreams>,
    embedder: Option<Embedder>,
    tx: watch::Sender<Option<Arc<Catalog>>>,
    ttl: Duration,
) {
    let changed = upstreams.changed();
    let mut indexer = Indexer {
        upstreams,
        embedder,
        tx,
        vectors: HashMap::new(),
    };
    let mut last: Option<Built> = None;
    // After a failure (a server not listed, texts not embedded) ask again sooner, backing off.
    let mut retry = RETRY_FIRST;
    loop {
        // Register for a change before listing, so one that arrives meanwhile is not lost.
        let notified = changed.notified();
        let (tools, unavailable) = list_all(&indexer.upstreams).await;
        let docs = docs_of(&tools);
        let unchanged = last
            .as_ref()
            .is_some_and(|b| b.complete_index && b.docs == docs && b.unavailable == unavailable);
        if !unchanged {
            for (server, error) in &unavailable {
                tracing::warn!(%server, "tools not indexed: {error}");
            }
            let complete_index = indexer.publish(&tools, &docs, &unavailable).await;
            last = Some(Built {
                docs,
                unavailable,
                complete_index,
            });
        }
        let complete = last
            .as_ref()
            .is_some_and(|b| b.complete_index && b.unavailable.is_empty());
        let wait = if complete {
            retry = RETRY_FIRST;
            ttl
        } else {
            let wait = retry.min(ttl);
            retry = (retry * 2).min(ttl);
            wait
        };
        tokio::select! {
            _ = notified => {}
            _ = tokio::time::sleep(wait) => {}
            _ = indexer.tx.closed() => return,
        }
    }
}

/// What the last index was built from.
struct Built {
    docs: Vec<ToolDoc>,
    unavailable: Vec<(String, String)>,
    /// Every tool embedded, or no embedding tool to embed with.
    complete_index: bool,
}

struct Indexer {
    upstreams: Arc<Upstreams>,
    embedder: Option<Embedder>,
    tx: watch::Sender<Option<Arc<Catalog>>>,
    /// Embeddings by text, kept for the tools of the last catalog only.
    vectors: HashMap<String, Vec<f32>>,
}

impl Indexer {
    /// Publishes the lexical index, then, when every tool text has an embedding, the hybrid
    /// one. Says whether the index is complete: embedded, or no embedding tool to embed with
    /// (none configured, or not among the listed tools); an incomplete one is built again.
    async fn publish(
        &mut self,
        tools: &[(String, ToolSpec)],
        docs: &[ToolDoc],
        unavailable: &[(String, String)],
    ) -> bool {
        let catalog = |index: Index| {
            Arc::new(Catalog {
                index,
                tools: tools.to_vec(),
                unavailable: unavailable.to_vec(),
                queries: Mutex::new(LruCache::new(CACHED_QUERIES)),
            })
        };
        let build = || {
            Index::build(docs.to_vec())
                .inspect_err(|e| tracing::error!("{e}"))
                .ok()
        };
        let publish_lexical = || match build() {
            Some(index) => {
                self.tx.send_replace(Some(catalog(index)));
                true
            }
            None => false,
        };
        let Some(embedder) = &self.embedder else {
            return publish_lexical();
        };
        let Some((_, spec)) = tools
            .iter()
            .find(|(s, t)| *s == embedder.server && t.name == embedder.tool)
        else {
            // A fleet without the tool ranks by words until a listing brings it (which
            // changes the catalog and so rebuilds the index): nothing to retry meanwhile.
            tracing::info!(
                "the embedding tool {}:{} is not among the listed tools; ranking lexically",
                embedder.server,
                embedder.tool
            );
            return publish_lexical();
        };
        let texts: Vec<String> = docs.iter().map(ToolDoc::embedding_text).collect();
        let wanted: std::collections::HashSet<&String> = texts.iter().collect();
        self.vectors.retain(|text, _| wanted.contains(text));
        let missing: Vec<String> = texts
            .iter()
            .filter(|t| !self.vectors.contains_key(*t))
            .cloned()
            .collect();
        // Words first while the new texts are embedded; with none new, one build does.
        if !missing.is_empty() && !publish_lexical() {
            return false;
        }
        let upstreams = &self.upstreams;
        let fresh: Vec<(String, Result<Vec<f32>, String>)> = futures::stream::iter(missing)
            .map(|text: String| async move {
                let embedded = embed(upstreams, embedder, spec, &text, INDEX_EMBED_DEADLINE).await;
                (text, embedded)
            })
            .buffer_unordered(EMBED_CONCURRENCY)
            .collect()
            .await;
        let mut failures = 0;
        for (text, embedded) in fresh {
            match embedded {
                Ok(v) => {
                    self.vectors.insert(text, v);
                }
                Err(e) => {
                    failures += 1;
                    if failures == 1 {
                        tracing::warn!("embedding a tool's text failed: {e}");
                    }
                }
            }
        }
        if failures > 0 {
            tracing::warn!(
                "{failures} tool texts not embedded; ranking lexically until the next refresh"
            );
            return false;
        }
        let Some(mut index) = build() else {
            return false;
        };
        let ordered = texts.iter().map(|t| self.vectors[t].clone()).collect();
        if let Err(e) = index.set_embeddings(ordered) {
            tracing::warn!("tool embeddings not used: {e}");
            return false;
        }
        self.tx.send_replace(Some(catalog(index)));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MCP's `detail_level` and gRPC's read the same way: unset or empty is brief.
    #[test]
    fn detail_level_is_read_one_way() {
        assert_eq!(DetailLevel::parse(None), Ok(DetailLevel::Brief));
        assert_eq!(DetailLevel::parse(Some("")), Ok(DetailLevel::Brief));
        assert_eq!(DetailLevel::parse(Some("full")), Ok(DetailLevel::Full));
        assert_eq!(
            DetailLevel::parse(Some("FULL")).unwrap_err().to_string(),
            "detail_level \"FULL\": use brief or full"
        );
    }
}

//! Tool search quality and speed on the real catalog (`nomad_integration_tests::catalog`: git,
//! time, fetch and Excel MCP servers from PyPI beside the fleet's `embed` and `generate`) and the
//! 64 plain-language queries of `data/tool-queries.json`:
//! - recall@1, recall@5 and MRR@5 of the previous substring search (every query word inside the
//!   name or description, name matches first), of BM25 with name tiers, of the embedding alone,
//!   and of the fusions of the two, each ranked by `nomad_tool_search` over the same listing and
//!   the same `embed` vectors the gateway uses;
//! - search latency with 1,000 indexed tools (the real ones varied: other servers, suffixed
//!   names, reworded descriptions), the query's embedding through the scheduler included, and
//!   end to end through the gateway's `SearchTools` on the real catalog.
//!
//! Run: `cargo build --release --workspace --bins && target/release/nomad-search-bench
//! [--rounds 10]`.

use std::time::{Duration, Instant};

use futures::StreamExt as _;
use nomad_integration_tests::fleet::rpc_channel;
use nomad_integration_tests::{Fleet, FleetOptions, arg, catalog, check_args, text_call};
use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_proto::v1::{SearchToolsRequest, tool_output};
use nomad_tool_search::{Fusion, Index, Query, ToolDoc};

/// The previous `search_code_tools`: keep a tool when every query word is a substring of its
/// name or description; tools whose name holds every word first, in listing order.
fn substring_search(docs: &[ToolDoc], query: &str, limit: usize) -> Vec<usize> {
    let words: Vec<String> = query.split_whitespace().map(str::to_lowercase).collect();
    let mut found: Vec<(usize, usize)> = docs
        .iter()
        .enumerate()
        .filter_map(|(i, d)| {
            let name = d.name.to_lowercase();
            let text = format!("{name} {}", d.description.to_lowercase());
            if !words.iter().all(|w| text.contains(w.as_str())) {
                return None;
            }
            Some((
                usize::from(!words.iter().all(|w| name.contains(w.as_str()))),
                i,
            ))
        })
        .collect();
    found.sort_by_key(|(rank, _)| *rank);
    found.into_iter().take(limit).map(|(_, i)| i).collect()
}

async fn embed(
    scheduler: &SchedulerClient<nomad_rpc::Channel>,
    text: &str,
) -> anyhow::Result<Vec<f32>> {
    let reply = scheduler
        .clone()
        .call_tool(text_call("embed", text, r#"{"truncate": true}"#))
        .await?
        .into_inner();
    match reply.output.and_then(|o| o.value) {
        Some(tool_output::Value::Tensor(t)) => Ok(t.to_f32_vec()?),
        other => anyhow::bail!("embed answered {other:?}"),
    }
}

async fn embed_all(
    scheduler: &SchedulerClient<nomad_rpc::Channel>,
    texts: &[String],
) -> anyhow::Result<Vec<Vec<f32>>> {
    futures::stream::iter(texts)
        .map(|t| embed(scheduler, t))
        .buffered(32)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}

struct Quality {
    recall_1: f64,
    recall_5: f64,
    mrr: f64,
}

fn quality(ranked: &[Vec<String>], wanted: &[String]) -> Quality {
    let n = wanted.len() as f64;
    let rank = |i: usize| ranked[i].iter().take(5).position(|t| *t == wanted[i]);
    let ranks: Vec<Option<usize>> = (0..wanted.len()).map(rank).collect();
    Quality {
        recall_1: ranks.iter().filter(|r| **r == Some(0)).count() as f64 / n,
        recall_5: ranks.iter().filter(|r| r.is_some()).count() as f64 / n,
        mrr: ranks
            .iter()
            .flatten()
            .map(|r| 1.0 / (*r as f64 + 1.0))
            .sum::<f64>()
            / n,
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1000.0)
}

/// `docs` varied until there are `count`: each copy on another server, with a suffixed name and
/// a reworded start of its description.
fn varied(docs: &[ToolDoc], count: usize) -> Vec<ToolDoc> {
    const SUFFIXES: [&str; 8] = [
        "v2", "beta", "batch", "legacy", "pro", "lite", "remote", "x",
    ];
    const OPENINGS: [&str; 8] = [
        "Variant:",
        "Experimental:",
        "Batch form:",
        "Deprecated:",
        "Extended:",
        "Lightweight:",
        "Remote:",
        "Alternative:",
    ];
    let mut out = docs.to_vec();
    let mut copy = 0;
    while out.len() < count {
        for d in docs {
            if out.len() == count {
                break;
            }
            let k = copy % SUFFIXES.len();
            let mut v = d.clone();
            v.server = format!("{}{}", d.server, copy + 2);
            v.name = format!("{}_{}", d.name, SUFFIXES[k]);
            v.import_path = format!("mcp_tools.{}.{}", v.server, v.name);
            v.description = format!("{} {}", OPENINGS[k], d.description);
            out.push(v);
        }
        copy += 1;
    }
    out
}

const USAGE: &str = "\
Usage: nomad-search-bench [--rounds N]
Tool search's recall and MRR on the real catalog's 64 queries, and its latency with 1,000\nindexed tools (default: 10 rounds).";

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    check_args(USAGE, &["--rounds"], &[]);
    let rounds: usize = arg("--rounds", "10").parse()?;
    let dir = Fleet::new_dir();
    let mut fleet = Fleet::start(FleetOptions {
        tools_yaml: Some(catalog::tools_yaml()),
        config_yaml: catalog::servers_yaml(&dir),
        ..Default::default()
    })
    .await;
    fleet.wait_for_workers(1).await;
    let scheduler = SchedulerClient::new(rpc_channel(&fleet.scheduler_addr));
    let mut gateway = GatewayClient::new(rpc_channel(&fleet.gateway_addr));

    // The catalog as the gateway indexed it.
    let deadline = Instant::now() + Duration::from_secs(180);
    let listing = loop {
        let reply = gateway
            .search_tools(SearchToolsRequest {
                detail_level: "full".into(),
                ..Default::default()
            })
            .await?
            .into_inner();
        let probe = gateway
            .search_tools(SearchToolsRequest {
                query: "probe".into(),
                limit: 1,
                ..Default::default()
            })
            .await?
            .into_inner();
        if probe.ranking == "hybrid" && reply.unavailable_servers.is_empty() {
            break reply.tools;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the gateway never ranked by meaning"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let docs: Vec<ToolDoc> = listing
        .iter()
        .map(|t| {
            let schema = serde_json::from_str(&t.input_schema_json).unwrap_or_default();
            ToolDoc::new(&t.server, &t.name, &t.title, &t.description, &schema)
        })
        .collect();
    let queries = catalog::queries();
    let wanted: Vec<String> = queries.iter().map(|q| q.tool.clone()).collect();
    let key = |d: &ToolDoc| format!("{}:{}", d.server, d.name);
    println!("catalog: {} tools; {} queries", docs.len(), queries.len());

    let texts: Vec<String> = docs.iter().map(ToolDoc::embedding_text).collect();
    let mut index = Index::build(docs.clone()).map_err(anyhow::Error::msg)?;
    index
        .set_embeddings(embed_all(&scheduler, &texts).await?)
        .map_err(anyhow::Error::msg)?;
    let query_texts: Vec<String> = queries.iter().map(|q| q.query.clone()).collect();
    let query_vectors = embed_all(&scheduler, &query_texts).await?;

    let rank = |embedding: bool, fusion: Fusion| -> Vec<Vec<String>> {
        queries
            .iter()
            .zip(&query_vectors)
            .map(|(q, v)| {
                let (hits, _) = index
                    .search(&Query {
                        text: &q.query,
                        embedding: embedding.then_some(v.as_slice()),
                        server: None,
                        limit: 5,
                        fusion,
                    })
                    .expect("search");
                hits.iter().map(|h| key(&docs[h.doc])).collect()
            })
            .collect()
    };
    let substring: Vec<Vec<String>> = queries
        .iter()
        .map(|q| {
            substring_search(&docs, &q.query, 5)
                .iter()
                .map(|&i| key(&docs[i]))
                .collect()
        })
        .collect();
    let rrf = |k| Fusion::ReciprocalRank { k };
    let weighted = |lexical| Fusion::Weighted { lexical };
    let mut rows: Vec<(String, Vec<Vec<String>>)> = vec![
        ("substring (previous)".into(), substring),
        ("BM25 + name tiers".into(), rank(false, rrf(10.0))),
        ("embedding only".into(), rank(true, weighted(0.0))),
    ];
    for k in [2.0, 10.0, 60.0] {
        rows.push((format!("hybrid, RRF k={k}"), rank(true, rrf(k))));
    }
    for w in [0.1, 0.2, 0.3, 0.5] {
        rows.push((
            format!("hybrid, weighted {w} BM25"),
            rank(true, weighted(w)),
        ));
    }
    println!("\n| ranking | recall@1 | recall@5 | MRR@5 |\n|---|---|---|---|");
    for (name, ranked) in &rows {
        let q = quality(ranked, &wanted);
        println!(
            "| {name} | {:.3} | {:.3} | {:.3} |",
            q.recall_1, q.recall_5, q.mrr
        );
    }

    // 1,000 tools: the query's embedding through the scheduler, then the ranking.
    let many = varied(&docs, 1000);
    let many_texts: Vec<String> = many.iter().map(ToolDoc::embedding_text).collect();
    let started = Instant::now();
    let mut big = Index::build(many.clone()).map_err(anyhow::Error::msg)?;
    let built = started.elapsed();
    let many_vectors = embed_all(&scheduler, &many_texts).await?;
    let embedded = started.elapsed() - built;
    big.set_embeddings(many_vectors)
        .map_err(anyhow::Error::msg)?;
    let (mut embed_times, mut rank_times, mut totals) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        for q in &queries {
            let t0 = Instant::now();
            let v = embed(&scheduler, &q.query).await?;
            let t1 = Instant::now();
            let (hits, _) = big
                .search(&Query {
                    text: &q.query,
                    embedding: Some(&v),
                    server: None,
                    limit: 20,
                    fusion: nomad_tool_search::DEFAULT_FUSION,
                })
                .map_err(anyhow::Error::msg)?;
            let t2 = Instant::now();
            assert!(!hits.is_empty());
            embed_times.push(t1 - t0);
            rank_times.push(t2 - t1);
            totals.push(t2 - t0);
        }
    }
    // End to end through the gateway on the real catalog: each query's first search embeds it,
    // later ones find its embedding kept.
    let (mut first, mut repeated) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for q in &queries {
            let t0 = Instant::now();
            gateway
                .search_tools(SearchToolsRequest {
                    query: q.query.clone(),
                    ..Default::default()
                })
                .await?;
            if round == 0 {
                &mut first
            } else {
                &mut repeated
            }
            .push(t0.elapsed());
        }
    }
    println!(
        "\n1,000 tools: lexical index built in {} ms, 1,000 tool texts embedded in {:.1} s",
        ms(built),
        embedded.as_secs_f64()
    );
    println!("\n| search | searches | p50 ms | p99 ms |\n|---|---|---|---|");
    for (name, times) in [
        ("query embedding (scheduler CallTool)", &mut embed_times),
        (
            "ranking 1,000 tools (BM25 + cosine + fusion)",
            &mut rank_times,
        ),
        ("both: search at 1,000 tools", &mut totals),
        (
            "gateway SearchTools, real catalog, a query's first search",
            &mut first,
        ),
        (
            "gateway SearchTools, real catalog, repeated queries",
            &mut repeated,
        ),
    ] {
        if times.is_empty() {
            continue;
        }
        times.sort();
        println!(
            "| {name} | {} | {} | {} |",
            times.len(),
            ms(percentile(times, 0.5)),
            ms(percentile(times, 0.99))
        );
    }
    fleet.terminate().await;
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

//! `nomad traces RUN_ID`: the run's rollouts, each as a waterfall of its spans (service, span,
//! start offset, duration, status), slowest first. From a run directory's console-exporter
//! files, or from Jaeger's api_v3 query service.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use nomad_proto::jaeger::query_service_client::QueryServiceClient;
use nomad_proto::jaeger::{FindTracesRequest, TraceQueryParameters};
use opentelemetry_proto::tonic::trace::v1::ResourceSpans;
use prost::Message as _;
use serde_json::{Value, json};

pub use nomad_telemetry::records::SpanRecord as Span;

/// One rollout's trace.
#[derive(Debug, Clone)]
pub struct Rollout {
    pub trace_id: String,
    pub root: Span,
    pub spans: Vec<Span>,
}

impl Rollout {
    pub fn rollout_id(&self) -> &str {
        self.root
            .attributes
            .get("nomad.rollout.id")
            .map_or("", String::as_str)
    }
}

/// The telemetry files of a run directory: every `*.jsonl` in it and in its `otel/` (a Slurm
/// job's collector writes there).
pub fn telemetry_files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| anyhow::anyhow!("reading run directory {}: {e}", dir.display()))?;
    let collected = std::fs::read_dir(dir.join("otel")).into_iter().flatten();
    Ok(entries
        .chain(collected)
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect())
}

/// Span lines of every telemetry file in `dir` (other lines are skipped).
pub fn load_dir(dir: &Path) -> anyhow::Result<Vec<Span>> {
    let mut spans = Vec::new();
    for path in telemetry_files(dir)? {
        let text = std::fs::read_to_string(&path)?;
        // A line a killed process left half-written is skipped.
        spans.extend(nomad_telemetry::records::from_console(&text).0);
    }
    Ok(spans)
}

/// Spans of `run_id` from Jaeger's api_v3 query service at `url` (gRPC, e.g. :16685).
pub async fn load_jaeger(
    url: &str,
    run_id: &str,
    lookback: Duration,
    depth: i32,
) -> anyhow::Result<Vec<Span>> {
    let channel = nomad_rpc::channel(url)?;
    let mut client = QueryServiceClient::new(channel);
    let now = SystemTime::now();
    let timestamp = |t: SystemTime| {
        let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        prost_types::Timestamp {
            seconds: d.as_secs() as i64,
            nanos: d.subsec_nanos() as i32,
        }
    };
    let request = FindTracesRequest {
        query: Some(TraceQueryParameters {
            attributes: HashMap::from([("nomad.run.id".to_owned(), run_id.to_owned())]),
            start_time_min: Some(timestamp(now - lookback)),
            start_time_max: Some(timestamp(now)),
            search_depth: depth,
            ..Default::default()
        }),
    };
    let mut stream = client
        .find_traces(request)
        .await
        .map_err(|s| anyhow::anyhow!("Jaeger at {url}: {:?}: {}", s.code(), s.message()))?
        .into_inner();
    let mut spans = Vec::new();
    while let Some(chunk) = stream
        .message()
        .await
        .map_err(|s| anyhow::anyhow!("Jaeger at {url}: {}", s.message()))?
    {
        let decoded: Vec<ResourceSpans> = chunk
            .resource_spans
            .iter()
            .map(|b| ResourceSpans::decode(b.as_slice()))
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow::anyhow!("Jaeger sent spans that do not decode: {e}"))?;
        spans.extend(nomad_telemetry::records::from_otlp(&decoded));
    }
    Ok(spans)
}

/// The run's rollouts: traces rooted at `nomad.rollout` whose root carries `run_id`,
/// slowest first.
pub fn rollouts(spans: Vec<Span>, run_id: &str) -> Vec<Rollout> {
    let mut traces: HashMap<String, Vec<Span>> = HashMap::new();
    for span in spans {
        traces.entry(span.trace_id.clone()).or_default().push(span);
    }
    let mut rollouts: Vec<Rollout> = traces
        .into_iter()
        .filter_map(|(trace_id, mut spans)| {
            spans.sort_by_key(|s| s.start_ns);
            spans.dedup_by(|a, b| a.span_id == b.span_id);
            let root = spans
                .iter()
                .find(|s| s.parent_span_id.is_none() && s.name == "nomad.rollout")?
                .clone();
            (root.run_id() == Some(run_id)).then_some(Rollout {
                trace_id,
                root,
                spans,
            })
        })
        .collect();
    rollouts.sort_by(|a, b| b.root.duration_ms().total_cmp(&a.root.duration_ms()));
    rollouts
}

/// A waterfall of one rollout: each span under its parent, with start offset, duration,
/// status and a bar on the rollout's timeline.
pub fn waterfall(rollout: &Rollout) -> String {
    const BAR: usize = 30;
    let start = rollout.root.start_ns;
    let total = rollout.root.end_ns.saturating_sub(start).max(1);
    let ids: std::collections::HashSet<&str> =
        rollout.spans.iter().map(|s| s.span_id.as_str()).collect();
    let mut children: HashMap<Option<&str>, Vec<&Span>> = HashMap::new();
    for s in &rollout.spans {
        // A span whose parent is missing hangs from the root, marked.
        let parent = s.parent_span_id.as_deref().filter(|p| ids.contains(p));
        children.entry(parent).or_default().push(s);
    }
    let mut out = format!(
        "rollout {} (task {})  trace {}  {:.1} ms  {}\n",
        rollout.rollout_id(),
        rollout
            .root
            .attributes
            .get("nomad.task.id")
            .map_or("?", String::as_str),
        rollout.trace_id,
        rollout.root.duration_ms(),
        rollout.root.status,
    );
    let mut stack: Vec<(&Span, usize)> = children
        .get(&None)
        .map(|roots| roots.iter().rev().map(|s| (*s, 0)).collect())
        .unwrap_or_default();
    while let Some((span, depth)) = stack.pop() {
        let offset = span.start_ns.saturating_sub(start);
        let from = (offset * BAR as u128 / total) as usize;
        let width =
            ((span.end_ns.saturating_sub(span.start_ns) * BAR as u128 / total) as usize).max(1);
        let bar: String = (0..BAR)
            .map(|i| {
                if i >= from && i < from + width {
                    '#'
                } else {
                    '.'
                }
            })
            .collect();
        let orphan = if span.parent_span_id.is_some() && depth == 0 {
            " (parent missing)"
        } else {
            ""
        };
        out.push_str(&format!(
            "  {bar} {:>9.2} {:>9.2}  {:<20} {}{}{}{}\n",
            offset as f64 / 1e6,
            span.duration_ms(),
            span.service_name,
            "  ".repeat(depth),
            span.name,
            if span.status == "error" {
                "  ERROR"
            } else {
                ""
            },
            orphan,
        ));
        if let Some(kids) = children.get(&Some(span.span_id.as_str())) {
            for kid in kids.iter().rev() {
                stack.push((kid, depth + 1));
            }
        }
    }
    out
}

pub fn to_json(rollouts: &[Rollout]) -> Value {
    json!(
        rollouts
            .iter()
            .map(|r| json!({
                "trace_id": r.trace_id,
                "rollout_id": r.rollout_id(),
                "task_id": r.root.attributes.get("nomad.task.id"),
                "duration_ms": r.root.duration_ms(),
                "status": r.root.status,
                "spans": r.spans.iter().map(|s| json!({
                    "span_id": s.span_id,
                    "parent_span_id": s.parent_span_id,
                    "service": s.service_name,
                    "name": s.name,
                    "start_offset_ms": s.start_ns.saturating_sub(r.root.start_ns) as f64 / 1e6,
                    "duration_ms": s.duration_ms(),
                    "status": s.status,
                })).collect::<Vec<_>>(),
            }))
            .collect::<Vec<_>>()
    )
}

/// One line per rollout: task, rollout, trace, duration, span count, services, status.
pub fn table(rollouts: &[Rollout]) -> String {
    let mut out = format!(
        "{:<16} {:<32} {:<32} {:>10} {:>5} {:>8}  status\n",
        "task", "rollout", "trace", "ms", "spans", "services"
    );
    for r in rollouts {
        let services: std::collections::BTreeSet<&str> =
            r.spans.iter().map(|s| s.service_name.as_str()).collect();
        out.push_str(&format!(
            "{:<16} {:<32} {:<32} {:>10.1} {:>5} {:>8}  {}\n",
            r.root
                .attributes
                .get("nomad.task.id")
                .map_or("?", String::as_str),
            r.rollout_id(),
            r.trace_id,
            r.root.duration_ms(),
            r.spans.len(),
            services.len(),
            r.root.status,
        ));
    }
    out
}

/// Prints the run's rollouts: a line for each, then the waterfalls of the `limit` slowest.
/// With `json`, every rollout and its spans as one JSON array.
pub fn print(rollouts: &[Rollout], json: bool, limit: usize) {
    if json {
        println!("{}", to_json(rollouts));
        return;
    }
    println!("{} rollouts, slowest first", rollouts.len());
    println!("{}", table(rollouts));
    for r in rollouts.iter().take(limit) {
        println!("{}", waterfall(r));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn span(
        trace: &str,
        id: &str,
        parent: Option<&str>,
        name: &str,
        start: u128,
        end: u128,
        run: &str,
    ) -> Span {
        Span {
            trace_id: trace.into(),
            span_id: id.into(),
            parent_span_id: parent.map(str::to_owned),
            name: name.into(),
            service_name: "nomad/head".into(),
            start_ns: start,
            end_ns: end,
            status: "ok".into(),
            attributes: BTreeMap::from([
                ("nomad.run.id".to_owned(), run.to_owned()),
                ("nomad.rollout.id".to_owned(), format!("ro-{trace}")),
            ]),
            resource: BTreeMap::new(),
            links: Vec::new(),
        }
    }

    #[test]
    fn only_the_runs_rollouts_slowest_first() {
        let spans = vec![
            span("t1", "a", None, "nomad.rollout", 0, 10_000_000, "run"),
            span("t1", "b", Some("a"), "child", 1_000_000, 5_000_000, "run"),
            span("t2", "c", None, "nomad.rollout", 0, 30_000_000, "run"),
            span("t3", "d", None, "nomad.rollout", 0, 50_000_000, "other-run"),
            span("t4", "e", None, "nomad.job", 0, 90_000_000, "run"),
        ];
        let r = rollouts(spans, "run");
        assert_eq!(
            r.iter().map(|r| r.trace_id.as_str()).collect::<Vec<_>>(),
            ["t2", "t1"]
        );
        let tree = waterfall(&r[1]);
        assert!(
            tree.contains("rollout ro-t1") && tree.contains("  child"),
            "{tree}"
        );
        assert_eq!(to_json(&r)[1]["spans"][1]["start_offset_ms"], 1.0);
    }

    #[test]
    fn an_orphan_is_shown_and_marked() {
        let spans = vec![
            span("t", "a", None, "nomad.rollout", 0, 10, "run"),
            span("t", "b", Some("gone"), "lost", 2, 4, "run"),
        ];
        assert!(waterfall(&rollouts(spans, "run")[0]).contains("lost (parent missing)"));
    }

    #[test]
    fn a_read_right_after_a_rollout_or_with_orphans_says_spans_may_be_on_their_way() {
        let root = |end_ms: u128| Span {
            service_name: "nomad/head".into(),
            resource: Default::default(),
            trace_id: "t".into(),
            span_id: "root".into(),
            parent_span_id: None,
            name: "nomad.rollout".into(),
            start_ns: 0,
            end_ns: end_ms * 1_000_000,
            status: "ok".into(),
            attributes: Default::default(),
            links: vec![],
        };
        let rollout = |end_ms: u128, orphan: bool| {
            let mut child = root(end_ms);
            child.span_id = "child".into();
            child.name = "nomad.v1.Gateway/ExecuteCode".into();
            child.parent_span_id = Some(if orphan { "gone" } else { "root" }.into());
            Rollout {
                trace_id: "t".into(),
                root: root(end_ms),
                spans: vec![root(end_ms), child],
            }
        };
        let at = |ms: u64| SystemTime::UNIX_EPOCH + Duration::from_millis(ms);
        // Long over and whole: nothing to say.
        assert_eq!(in_flight_note(&[rollout(1_000, false)], at(60_000)), None);
        let recent = in_flight_note(&[rollout(1_000, false)], at(3_000)).unwrap();
        assert!(
            recent.contains("1 rollout(s) ended within the last 7 s"),
            "{recent}"
        );
        let orphaned = in_flight_note(&[rollout(1_000, true)], at(60_000)).unwrap();
        assert!(
            orphaned.contains("1 rollout(s) have spans whose parent"),
            "{orphaned}"
        );
    }
}

#[derive(clap::Args)]
pub struct TracesArgs {
    /// The run id (`nomad.run.id`); `latest` is the newest run under the runs directory.
    pub run_id: String,
    /// A run directory of console-exporter files (default: <runs dir>/<RUN_ID>); with
    /// `latest`, its name is the run id.
    #[arg(long, conflicts_with = "jaeger")]
    pub from: Option<PathBuf>,
    /// Where the run directories are.
    #[arg(long, default_value = "runs", conflicts_with_all = ["from", "jaeger"])]
    pub runs_dir: PathBuf,
    /// Query Jaeger's api_v3 gRPC QueryService at this address (e.g. 127.0.0.1:16685).
    #[arg(long)]
    pub jaeger: Option<String>,
    /// How far back to search Jaeger, in hours.
    #[arg(long, default_value_t = 24.0)]
    pub lookback_hours: f64,
    /// Most traces Jaeger is asked for.
    #[arg(long, default_value_t = 1000)]
    pub search_depth: i32,
    /// Print every rollout with its spans as JSON.
    #[arg(long)]
    pub json: bool,
    /// Waterfalls to print (the slowest rollouts).
    #[arg(long, default_value_t = 5)]
    pub limit: usize,
}

/// Returns whether the run has any rollouts.
pub async fn show(args: TracesArgs) -> anyhow::Result<bool> {
    let mut run_id = args.run_id.clone();
    let spans = match &args.jaeger {
        Some(url) => {
            let lookback = nomad_config::seconds(
                "--lookback-hours (in seconds)",
                args.lookback_hours * 3600.0,
            )
            .map_err(anyhow::Error::msg)?;
            anyhow::ensure!(args.search_depth > 0, "--search-depth must be at least 1");
            load_jaeger(url, &args.run_id, lookback, args.search_depth).await?
        }
        None => {
            let (id, dir) = crate::run_id::resolve(&args.runs_dir, args.from.as_deref(), &run_id)?;
            run_id = id;
            load_dir(&dir)?
        }
    };
    let local = args.jaeger.is_none();
    let rollouts = rollouts(spans, &run_id);
    let note = local
        .then(|| in_flight_note(&rollouts, std::time::SystemTime::now()))
        .flatten();
    if rollouts.is_empty() {
        eprintln!("no rollouts of run {run_id} found");
        if let Some(note) = note {
            eprintln!("{note}");
        }
        return Ok(false);
    }
    print(&rollouts, args.json, args.limit);
    if let Some(note) = note {
        eprintln!("{note}");
    }
    Ok(true)
}

/// How long a service may hold a finished span before its batch reaches the run directory (the
/// batch span processor's default delay, 5 s, with a margin).
const EXPORT_DELAY: Duration = Duration::from_secs(7);

/// Says so when what was read may not be all there is: spans whose parent is missing, or a
/// rollout that ended within [`EXPORT_DELAY`] of `now`, whose services' spans may still be on
/// their way in their next export batch.
pub fn in_flight_note(rollouts: &[Rollout], now: SystemTime) -> Option<String> {
    let orphaned = rollouts
        .iter()
        .filter(|r| {
            let ids: std::collections::HashSet<&str> =
                r.spans.iter().map(|s| s.span_id.as_str()).collect();
            r.spans.iter().any(|s| {
                s.parent_span_id
                    .as_deref()
                    .is_some_and(|p| !ids.contains(p))
            })
        })
        .count();
    let now_ns = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let recent = rollouts
        .iter()
        .filter(|r| now_ns.saturating_sub(r.root.end_ns) < EXPORT_DELAY.as_nanos())
        .count();
    match (orphaned, recent) {
        (0, 0) => None,
        (0, _) => Some(format!(
            "note: {recent} rollout(s) ended within the last {} s; services export spans in \
             batches every few seconds, so their traces may still be filling in: run this again \
             shortly for the whole picture",
            EXPORT_DELAY.as_secs()
        )),
        _ => Some(format!(
            "note: {orphaned} rollout(s) have spans whose parent has not been written (marked \
             \"parent missing\"): spans still on their way from a running service, or lost with \
             a service that was killed; run this again shortly to tell which"
        )),
    }
}

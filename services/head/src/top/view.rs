//! What `nomad top` shows, and how: one frame from one poll of the fleet.

use nomad_proto::v1::{GatewayStatus, SchedulerSnapshot};
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Paragraph, Row, Table};

/// A run's rollouts so far, from its results file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rollouts {
    pub done: usize,
    pub failed: usize,
    /// Rollouts finished per second since the previous poll.
    pub rate: f64,
}

/// One poll of the fleet.
#[derive(Debug, Clone)]
pub struct View {
    pub scheduler_address: String,
    pub scheduler: Result<SchedulerSnapshot, String>,
    /// `None` when no gateway was given.
    pub gateway: Option<Result<GatewayStatus, String>>,
    pub rollouts: Option<Rollouts>,
    /// The fleet's restarts so far (`nomad up`'s `servers.json`), in a line.
    pub restarts: Option<String>,
    pub run_id: Option<String>,
}

fn mib(bytes: Option<u64>) -> String {
    bytes.map_or("-".into(), |b| {
        format!("{:.0}", b as f64 / (1 << 20) as f64)
    })
}

fn ms(seconds: f64) -> String {
    format!("{:.1}", seconds * 1e3)
}

pub fn draw(frame: &mut Frame, view: &View) {
    let bold = Style::default().add_modifier(Modifier::BOLD);
    let [header, tools, workers, footer] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Min(4),
        Constraint::Min(4),
        Constraint::Length(4),
    ])
    .areas(frame.area());

    let title = match &view.run_id {
        Some(run) => format!(
            "nomad top — run {run} — scheduler {} — q quits",
            view.scheduler_address
        ),
        None => format!("nomad top — scheduler {} — q quits", view.scheduler_address),
    };
    frame.render_widget(Paragraph::new(Line::styled(title, bold)), header);

    match &view.scheduler {
        Ok(snapshot) => {
            let window = snapshot.window_seconds;
            let rows = snapshot.tools.iter().map(|t| {
                Row::new(vec![
                    t.name.clone(),
                    t.queue_length.to_string(),
                    t.in_flight.to_string(),
                    t.configured_batch_size.to_string(),
                    format!("{:.1}", t.recent_batch_size),
                    format!("{:.1}", t.requests_per_second),
                    ms(t.latency_p50_seconds),
                    ms(t.latency_p99_seconds),
                ])
            });
            let table = Table::new(
                rows,
                [
                    Constraint::Min(16),
                    Constraint::Length(7),
                    Constraint::Length(9),
                    Constraint::Length(7),
                    Constraint::Length(8),
                    Constraint::Length(8),
                    Constraint::Length(9),
                    Constraint::Length(9),
                ],
            )
            .header(
                Row::new([
                    "tool",
                    "queue",
                    "in flight",
                    "batch",
                    "recent",
                    "req/s",
                    "p50 ms",
                    "p99 ms",
                ])
                .style(bold),
            )
            .block(Block::bordered().title(format!(" tools (rates over the last {window:.0} s) ")));
            frame.render_widget(table, tools);

            let rows = snapshot.workers.iter().map(|w| {
                let device = w.device.clone().unwrap_or_default();
                let stats = w.stats.clone().unwrap_or_default();
                let loaded: Vec<String> = stats
                    .models
                    .iter()
                    .map(|m| format!("{}{}", m.tool, if m.on_device { "" } else { " (host)" }))
                    .collect();
                Row::new(vec![
                    w.worker_id.clone(),
                    format!("{} {}", device.r#type, device.index),
                    format!(
                        "{} / {}",
                        mib(stats.memory_allocated_bytes),
                        mib(device.memory_total_bytes)
                    ),
                    stats
                        .utilization
                        .map_or("-".into(), |u| format!("{:.0}%", u * 100.0)),
                    loaded.join(", "),
                ])
            });
            let table = Table::new(
                rows,
                [
                    Constraint::Min(14),
                    Constraint::Length(8),
                    Constraint::Length(16),
                    Constraint::Length(6),
                    Constraint::Min(20),
                ],
            )
            .header(
                Row::new(["worker", "device", "memory MiB", "util", "loaded tools"]).style(bold),
            )
            .block(Block::bordered().title(" device workers "));
            frame.render_widget(table, workers);
        }
        Err(e) => {
            let text = Paragraph::new(format!("the scheduler did not answer: {e}"))
                .block(Block::bordered().title(" tools "));
            frame.render_widget(text, tools);
        }
    }

    let mut lines = Vec::new();
    match &view.gateway {
        Some(Ok(g)) => lines.push(format!(
            "sandbox: {} running, {} queued, {} warm (at most {} at once, {} queued); starts {} warm / {} cold",
            g.runs_active, g.runs_queued, g.runners_warm, g.max_concurrent, g.max_queued, g.warm_starts, g.cold_starts
        )),
        Some(Err(e)) => lines.push(format!("the gateway did not answer: {e}")),
        None => lines.push("no gateway given (--gateway or --fleet)".into()),
    }
    if let Some(r) = &view.rollouts {
        lines.push(format!(
            "rollouts: {} done, {} failed, {:.1}/s",
            r.done, r.failed, r.rate
        ));
    }
    if let Some(restarts) = &view.restarts {
        lines.push(restarts.clone());
    }
    let text: Vec<Line> = lines.into_iter().map(Line::from).collect();
    frame.render_widget(
        Paragraph::new(text).block(Block::bordered().title(" gateway and run ")),
        footer,
    );
}

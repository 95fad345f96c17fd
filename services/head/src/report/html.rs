//! The report as one self-contained HTML file: inline SVG plots (plotters' SVG backend), the
//! figures they plot as JSON, and the slowest rollouts' waterfalls. Nothing is fetched when it
//! is opened.

use plotters::prelude::*;

use super::about::About;
use super::data::{Figures, Held, Histogram, Series};
use super::summary::Summary;

const WIDTH: u32 = 900;
const HEIGHT: u32 = 320;

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn plot_error(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("drawing a plot: {e}")
}

/// A number in three decimals at most, without trailing zeros (a reward: `0.151`, `1`).
fn short(value: f64) -> String {
    let text = format!("{value:.3}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    if text == "-0" {
        "0".to_owned()
    } else {
        text.to_owned()
    }
}

/// An axis label for counts: whole numbers only (no "0.2 rollouts" between 0 and 1).
fn whole(value: &f64) -> String {
    if value.fract() == 0.0 {
        format!("{value:.0}")
    } else {
        String::new()
    }
}

/// A histogram as SVG bars.
fn histogram_svg(h: &Histogram, x_desc: &str) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let lo = h.bins.first().map_or(0.0, |b| b.lo);
        let hi = h.bins.last().map_or(1.0, |b| b.hi);
        let top = h.bins.iter().map(|b| b.count).max().unwrap_or(1).max(1) as f64 * 1.1;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(lo..hi, 0.0..top)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc("rollouts")
            .y_label_formatter(&whole)
            .draw()
            .map_err(plot_error)?;
        chart
            .draw_series(h.bins.iter().map(|b| {
                Rectangle::new(
                    [(b.lo, 0.0), (b.hi, b.count as f64)],
                    BLUE.mix(0.6).filled(),
                )
            }))
            .map_err(plot_error)?;
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

/// Series as lines (or points), one colour per name, with a legend.
fn series_svg(
    series: &Series,
    y_desc: &str,
    points_only: bool,
    steps: bool,
) -> anyhow::Result<String> {
    let all = series.values().flatten();
    let x_max = all.clone().map(|p| p.0).fold(0.0, f64::max).max(1e-3) * 1.02;
    // Counts (batch sizes, queue lengths) get whole-number labels only.
    let counts = all.clone().all(|p| p.1.fract() == 0.0);
    let y_max = all.map(|p| p.1).fold(0.0, f64::max).max(1e-3) * 1.1;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)
            .map_err(plot_error)?;
        let mut mesh = chart.configure_mesh();
        mesh.x_desc("seconds since the run began").y_desc(y_desc);
        if counts {
            mesh.y_label_formatter(&whole);
        }
        mesh.draw().map_err(plot_error)?;
        for (i, (name, points)) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            if !points_only && points.len() < 2 {
                // A line needs two points: show a lone sample as a point.
                chart
                    .draw_series(
                        points
                            .iter()
                            .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
                    )
                    .map_err(plot_error)?;
            }
            let drawn = if points_only {
                chart
                    .draw_series(
                        points
                            .iter()
                            .map(|&(x, y)| Circle::new((x, y), 2, color.filled())),
                    )
                    .map_err(plot_error)?
            } else {
                let mut line = Vec::with_capacity(points.len() * 2);
                for (i, &(x, y)) in points.iter().enumerate() {
                    if steps && i > 0 {
                        line.push((x, points[i - 1].1));
                    }
                    line.push((x, y));
                }
                chart
                    .draw_series(LineSeries::new(line, color.stroke_width(2)))
                    .map_err(plot_error)?
            };
            drawn.label(name.clone()).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(3))
            });
        }
        legend(&mut chart)?;
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

/// The series' names in a box at the upper right.
fn legend<'a, 'b: 'a>(
    chart: &mut ChartContext<
        'a,
        SVGBackend<'b>,
        Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
    >,
) -> anyhow::Result<()> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(plot_error)
}

/// Each worker as a row of its batches over time, coloured by tool: which tool held it when.
fn timeline_svg(workers: &std::collections::BTreeMap<String, Vec<Held>>) -> anyhow::Result<String> {
    let rows: Vec<&String> = workers.keys().collect();
    let batches = || workers.values().flatten();
    let x_max = batches().map(|b| b.end).fold(0.0, f64::max).max(1e-3) * 1.02;
    let tools: std::collections::BTreeSet<&str> = batches().map(|b| b.tool.as_str()).collect();
    let mut svg = String::new();
    {
        let height = HEIGHT.min(120 + 40 * rows.len() as u32);
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(120)
            .build_cartesian_2d(0.0..x_max, 0.0..rows.len() as f64)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .x_desc("seconds since the run began")
            .y_labels(rows.len() * 2 + 1)
            .y_label_formatter(&|y| {
                // A label at each row's middle only.
                let row = y.floor();
                if (y - row - 0.5).abs() < 1e-6 {
                    rows.get(row as usize)
                        .map_or(String::new(), |r| r.to_string())
                } else {
                    String::new()
                }
            })
            .draw()
            .map_err(plot_error)?;
        for (i, tool) in tools.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(rows.iter().enumerate().flat_map(|(row, worker)| {
                    workers[*worker]
                        .iter()
                        .filter(|b| b.tool == *tool)
                        .map(move |b| {
                            let y = row as f64;
                            Rectangle::new([(b.start, y + 0.15), (b.end, y + 0.85)], color.filled())
                        })
                }))
                .map_err(plot_error)?
                .label(tool.to_string())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(6))
                });
        }
        legend(&mut chart)?;
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

/// The services' versions and the run's config file.
fn about_section(out: &mut String, about: &About) {
    out.push_str("<h2>What the run ran on</h2>\n<table id=\"versions\">\n");
    if about.versions.is_empty() {
        out.push_str("<tr><td class=\"empty\">No service versions in the run's spans.</td></tr>\n");
    }
    for (service, version) in &about.versions {
        out.push_str(&format!(
            "<tr><th>{}</th><td>{}</td></tr>\n",
            escape(service),
            escape(version)
        ));
    }
    out.push_str("</table>\n");
    match &about.config {
        Some(config) => out.push_str(&format!(
            "<p>Config, as kept in the run directory ({}; values of keys that name a token, \
             secret, password or authorization hidden):</p>\n<pre id=\"config\">{}</pre>\n",
            escape(&config.name),
            escape(&config.text)
        )),
        None => out.push_str("<p class=\"empty\">No config file in the run directory.</p>\n"),
    }
    if !about.servers.is_empty() {
        let restarted = about.servers.iter().filter(|s| s.restarts > 0).count();
        out.push_str(&format!(
            "<h3>Restarts</h3>\n<p>{restarted} of {} servers were started again after they \
             exited on their own (supervise:).</p>\n<table id=\"restarts\">\n\
             <tr><th>server</th><th>restarts</th><th>last exit</th></tr>\n",
            about.servers.len()
        ));
        for server in &about.servers {
            out.push_str(&format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td></tr>\n",
                escape(&server.name),
                server.restarts,
                escape(server.last_exit.as_deref().unwrap_or("")),
            ));
        }
        out.push_str("</table>\n");
    }
}

fn figure(out: &mut String, id: &str, title: &str, note: &str, svg: Option<String>) {
    out.push_str(&format!(
        "<figure id=\"{id}\"><figcaption><b>{}</b> {}</figcaption>\n",
        escape(title),
        escape(note)
    ));
    match svg {
        Some(svg) => out.push_str(&svg),
        None => out.push_str("<p class=\"empty\">No data for this plot in the run's files.</p>"),
    }
    out.push_str("</figure>\n");
}

/// The run at a glance: counts, throughput, each tool's latency and tokens, and the rollouts
/// that failed or did not pass.
fn summary_table(out: &mut String, s: &Summary) {
    let rate = |r: Option<f64>| r.map_or("-".to_owned(), |r| format!("{r:.2}"));
    out.push_str("<table id=\"summary\">\n");
    let mut row = |k: &str, v: String| {
        out.push_str(&format!(
            "<tr><th>{}</th><td>{}</td></tr>\n",
            escape(k),
            escape(&v)
        ));
    };
    row(
        "rollouts",
        format!("{} ({} ok, {} failed)", s.rollouts, s.ok, s.rollouts - s.ok),
    );
    row(
        "verified",
        if s.verified == 0 {
            "none verified".to_owned()
        } else {
            format!(
                "{} of {} passed ({:.1} %)",
                s.passed,
                s.verified,
                100.0 * s.passed as f64 / s.verified as f64
            )
        },
    );
    row(
        "throughput",
        format!(
            "{} rollouts/s over {:.1} s",
            rate(s.rollouts_per_second),
            s.wall_seconds
        ),
    );
    out.push_str("</table>\n");
    if !s.tools.is_empty() {
        out.push_str(
            "<table id=\"tools\"><tr><th>tool</th><th>requests</th><th>errors</th>\
             <th>p50</th><th>p99</th><th title=\"the median of each call's tokens per second, \
             its queue wait left out\">tokens/s a call</th><th title=\"all tokens per second of \
             the time the tool had a call running\">tokens/s in all</th></tr>\n",
        );
        for t in &s.tools {
            out.push_str(&format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.1} ms</td><td>{:.1} ms</td>\
                 <td>{}</td><td>{}</td></tr>\n",
                escape(&t.tool),
                t.requests,
                t.errors,
                t.p50_ms,
                t.p99_ms,
                rate(t.tokens_per_second_per_call),
                rate(t.tokens_per_second)
            ));
        }
        out.push_str("</table>\n");
    }
    if !s.not_passed.is_empty() {
        out.push_str(
            "<h2>Rollouts that failed or did not pass</h2>\n<table id=\"not-passed\">\
             <tr><th>task</th><th>outcome</th><th>reward</th><th>why</th></tr>\n",
        );
        for n in &s.not_passed {
            out.push_str(&format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td></tr>\n",
                escape(&n.task_id),
                n.outcome,
                n.reward.map_or("-".to_owned(), short),
                escape(&n.why)
            ));
        }
        out.push_str("</table>\n");
        if s.not_passed_unlisted > 0 {
            out.push_str(&format!(
                "<p>... and {} more (results.jsonl has them all).</p>\n",
                s.not_passed_unlisted
            ));
        }
    }
}

/// The whole page.
pub fn render(
    run_id: &str,
    figures: &Figures,
    waterfalls: &[String],
    about: &About,
) -> anyhow::Result<String> {
    let mut body = String::new();
    summary_table(&mut body, &figures.summary);
    let hist = |h: &Histogram, x: &str| -> anyhow::Result<Option<String>> {
        (h.count > 0).then(|| histogram_svg(h, x)).transpose()
    };
    let lines =
        |s: &Series, y: &str, points: bool, steps: bool| -> anyhow::Result<Option<String>> {
            (!s.is_empty())
                .then(|| series_svg(s, y, points, steps))
                .transpose()
        };
    figure(
        &mut body,
        "rollout-durations",
        "Rollout duration",
        &format!("{} rollouts, {} failed", figures.rollouts, figures.failed),
        hist(&figures.rollout_seconds, "seconds")?,
    );
    figure(
        &mut body,
        "rewards",
        "Reward",
        &format!("{} rollouts with a reward", figures.rewards.count),
        hist(&figures.rewards, "reward")?,
    );
    figure(
        &mut body,
        "request-latency",
        "Tool request latency",
        "each request at its arrival, from the scheduler's spans",
        lines(&figures.request_latency_ms, "milliseconds", true, false)?,
    );
    figure(
        &mut body,
        "batch-size",
        "Batch size",
        "each batch at its start",
        lines(&figures.batch_size, "requests", true, false)?,
    );
    figure(
        &mut body,
        "queue-length",
        "Queue length",
        "requests waiting per tool",
        lines(&figures.queue_length, "requests", false, true)?,
    );
    figure(
        &mut body,
        "memory",
        "Memory",
        "resident set per server, sampled by the head's memory profiler",
        lines(&figures.memory_mib, "MiB", false, false)?,
    );
    figure(
        &mut body,
        "sandbox-wait",
        "Wait for a sandbox slot",
        "each sandboxed run's wait before it started, at the time it began waiting",
        lines(&figures.sandbox_wait_ms, "milliseconds", true, false)?,
    );
    figure(
        &mut body,
        "worker-time",
        "What held each worker",
        "each batch on its device worker, coloured by tool",
        (!figures.worker_batches.is_empty())
            .then(|| timeline_svg(&figures.worker_batches))
            .transpose()?,
    );
    body.push_str("<h2>Slowest rollouts</h2>\n");
    if waterfalls.is_empty() {
        body.push_str("<p class=\"empty\">No rollout traces in the run's files.</p>\n");
    }
    for w in waterfalls {
        body.push_str(&format!("<pre class=\"waterfall\">{}</pre>\n", escape(w)));
    }
    about_section(&mut body, about);
    // The plotted figures, for anyone who wants the numbers (and the report's tests).
    let data = serde_json::to_string(figures)?.replace("</", "<\\/");
    Ok(format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>Nomad run {id}</title>\n<style>\
         body{{font-family:sans-serif;margin:24px;max-width:960px}}\
         figure{{margin:24px 0}}figcaption{{margin-bottom:6px}}\
         pre{{font-size:11px;overflow-x:auto;background:#f6f6f6;padding:8px}}\
         .empty{{color:#777}}table{{border-collapse:collapse;margin:12px 0}}\
         th,td{{text-align:left;padding:2px 12px 2px 0;vertical-align:top}}</style></head>\n<body>\n<h1>Nomad run {id}</h1>\n{body}\
         <script type=\"application/json\" id=\"figures\">{data}</script>\n</body></html>\n",
        id = escape(run_id),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewards_are_short_and_count_axes_whole() {
        assert_eq!(short(0.1514520180257778), "0.151");
        assert_eq!(short(1.0), "1");
        assert_eq!(short(0.5), "0.5");
        assert_eq!(short(-0.0001), "0");
        assert_eq!(whole(&2.0), "2");
        assert_eq!(whole(&0.2), "");
    }
}

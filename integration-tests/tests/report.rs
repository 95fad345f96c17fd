//! `nomad up --demo` writes the run's report, and it opens in a real browser (Debian's headless
//! `chromium`): every plot is drawn, nothing is fetched, and what is plotted adds up to the
//! run's results and spans.

use std::path::{Path, PathBuf};

use nomad_integration_tests::fleet::models_dir;
use nomad_integration_tests::process::clean;
use nomad_integration_tests::spans::from_console;
use nomad_integration_tests::strings_of;
use nomad_integration_tests::unique_run_id;
use nomad_integration_tests::{Fleet, read_jsonl};
use serde_json::Value;

/// Headless Chromium on `page` with `args`; returns (stdout, stderr).
async fn chromium(page: &Path, args: &[String]) -> (String, String) {
    let out = tokio::process::Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
        ])
        .args(["--enable-logging=stderr", "--v=0"])
        .args(args)
        .arg(format!("file://{}", page.display()))
        .output()
        .await
        .expect("Debian's chromium package (apt-get install chromium)");
    assert!(
        out.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_report_opens_offline_and_plots_what_the_run_did() {
    let dir = Fleet::new_dir();
    let run_id = unique_run_id("it-report");
    let up = clean("nomad")
        .args(["up", "--demo", "--runs-dir"])
        .arg(dir.join("runs"))
        .arg("--models-dir")
        .arg(models_dir())
        .env("NOMAD_OTEL_RUN_ID", &run_id)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&up.stdout);
    assert!(
        up.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&up.stderr)
    );
    let run_dir = dir.join("runs").join(&run_id);
    let report: PathBuf = stdout
        .lines()
        .find_map(|l| l.strip_prefix("Report: "))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("nomad up printed no report path:\n{stdout}"));
    assert_eq!(report, run_dir.join("report.html"));
    let html = std::fs::read_to_string(&report).unwrap();

    // Self-contained: nothing to fetch (the SVG namespace is a name, not a request).
    for needle in ["src=", "href=", "@import", "url("] {
        assert!(
            !html.contains(needle),
            "the report refers out with {needle}"
        );
    }

    // The browser parses it into eight figures, each drawn as SVG, and logs no error.
    let (dom, log) = chromium(&report, &["--dump-dom".into()]).await;
    for id in [
        "rollout-durations",
        "rewards",
        "request-latency",
        "batch-size",
        "queue-length",
        "memory",
        "sandbox-wait",
        "worker-time",
    ] {
        let at = dom
            .find(&format!("<figure id=\"{id}\">"))
            .unwrap_or_else(|| panic!("no figure {id}"));
        let end = dom[at..].find("</figure>").unwrap() + at;
        assert!(dom[at..end].contains("<svg"), "figure {id} has no plot");
    }
    assert!(
        !log.lines()
            .any(|l| l.contains("CONSOLE") || l.contains("Uncaught")),
        "the page logged:\n{log}"
    );
    let shot = dir.join("report.png");
    chromium(
        &report,
        &[
            format!("--screenshot={}", shot.display()),
            "--window-size=1000,2600".into(),
        ],
    )
    .await;
    assert!(
        std::fs::metadata(&shot).unwrap().len() > 20_000,
        "an empty screenshot"
    );

    // What is plotted is what happened.
    let start = html
        .find("<script type=\"application/json\" id=\"figures\">")
        .unwrap();
    let json = &html[start..];
    let json = &json[json.find('>').unwrap() + 1..json.find("</script>").unwrap()];
    let figures: Value = serde_json::from_str(json).unwrap();
    let results = read_jsonl(&run_dir.join("results.jsonl"));
    assert_eq!(results.len(), 20);
    let bin_total = |h: &Value| -> u64 {
        h["bins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["count"].as_u64().unwrap())
            .sum()
    };
    assert_eq!(figures["rollouts"], 20);
    // The summary table counts what the results say, and lists each rollout that did not pass.
    let summary = &figures["summary"];
    let count = |f: &dyn Fn(&Value) -> bool| results.iter().filter(|r| f(r)).count() as u64;
    assert_eq!(summary["rollouts"], 20);
    assert_eq!(summary["ok"], count(&|r| r["status"] == "ok"));
    assert_eq!(summary["verified"], count(&|r| r["passed"].is_boolean()));
    assert_eq!(summary["passed"], count(&|r| r["passed"] == true));
    assert!(
        summary["rollouts_per_second"].as_f64().unwrap() > 0.0,
        "{summary}"
    );
    let listed = strings_of(&summary["not_passed"], "task_id");
    let not_passed: Vec<&str> = results
        .iter()
        .filter(|r| r["status"] != "ok" || r["passed"] == false)
        .map(|r| r["task_id"].as_str().unwrap())
        .collect();
    assert_eq!(listed, not_passed);
    // A verified rollout that did not pass carries its task's expected answer (from the demo's
    // own task file), and the report shows it beside the output.
    let tasks = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../services/head/demo/tasks.jsonl"),
    )
    .unwrap();
    let expected_of: std::collections::HashMap<String, Value> = tasks
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|t| (t["id"].as_str().unwrap().to_owned(), t["expected"].clone()))
        .collect();
    for r in results.iter().filter(|r| r["passed"] == false) {
        let id = r["task_id"].as_str().unwrap();
        assert_eq!(r["expected"], expected_of[id], "{id}: {r}");
        let why = summary["not_passed"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["task_id"] == id)
            .unwrap()["why"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(why.starts_with("expected: "), "{id}: {why}");
    }
    for r in results.iter().filter(|r| r["passed"] != false) {
        assert!(
            r.get("expected").is_none(),
            "expected kept where nothing failed: {r}"
        );
    }
    let tools = strings_of(&summary["tools"], "tool");
    assert!(
        tools.contains(&"generate") && tools.contains(&"embed"),
        "{tools:?}"
    );
    assert!(dom.contains("<table id=\"summary\">"), "no summary table");
    // Each slowest rollout's waterfall says where it waited for a sandbox slot, under the run.
    let waterfalls: Vec<&str> = html
        .split("<pre class=\"waterfall\">")
        .skip(1)
        .map(|w| &w[..w.find("</pre>").unwrap()])
        .collect();
    assert_eq!(waterfalls.len(), 3, "the default --waterfalls");
    for w in &waterfalls {
        assert!(
            w.contains("nomad.gateway.sandbox.queue_wait")
                && w.contains("nomad.gateway.sandbox.run"),
            "{w}"
        );
    }
    assert_eq!(figures["rollout_seconds"]["count"], 20);
    assert_eq!(bin_total(&figures["rollout_seconds"]), 20);
    let rewarded = results.iter().filter(|r| r["reward"].is_number()).count() as u64;
    assert_eq!(bin_total(&figures["rewards"]), rewarded);
    let spans = from_console(&std::fs::read_to_string(run_dir.join("scheduler.jsonl")).unwrap());
    let points = |series: &Value| -> usize {
        series
            .as_object()
            .unwrap()
            .values()
            .map(|p| p.as_array().unwrap().len())
            .sum()
    };
    let requests = spans
        .iter()
        .filter(|s| s.name == "nomad.tool.request")
        .count();
    let batches = spans
        .iter()
        .filter(|s| s.name == "nomad.tool.batch")
        .count();
    assert!(requests > 0 && batches > 0);
    assert_eq!(points(&figures["request_latency_ms"]), requests);
    assert_eq!(points(&figures["batch_size"]), batches);
    // Every batch is on the worker that ran it, and every sandboxed run's wait for a slot is
    // plotted (the gateway's own spans counted).
    let held: usize = figures["worker_batches"]
        .as_object()
        .unwrap()
        .values()
        .map(|b| b.as_array().unwrap().len())
        .sum();
    assert_eq!(held, batches);
    let gateway = from_console(&std::fs::read_to_string(run_dir.join("gateway.jsonl")).unwrap());
    let waits = gateway
        .iter()
        .filter(|s| s.name == "nomad.gateway.sandbox.queue_wait")
        .count();
    assert!(waits >= 20, "{waits} sandbox waits for 20 rollouts");
    assert_eq!(points(&figures["sandbox_wait_ms"]), waits);
    // What the run ran on: each service's version, and the config it kept.
    let version = env!("CARGO_PKG_VERSION");
    for service in ["nomad/gateway", "nomad/scheduler"] {
        assert!(
            dom.contains(&format!("<tr><th>{service}</th><td>{version}</td></tr>")),
            "no version for {service}"
        );
    }
    let config = std::fs::read_to_string(run_dir.join("nomad.yaml")).unwrap();
    let first = config.lines().find(|l| !l.trim().is_empty()).unwrap();
    assert!(
        dom.contains("<pre id=\"config\">") && dom.contains(first.trim()),
        "the report does not show the run's config (first line {first:?})"
    );
    // Every queue empties by the end of the run.
    for (tool, steps) in figures["queue_length"].as_object().unwrap() {
        let last = steps.as_array().unwrap().last().unwrap();
        assert_eq!(last[1], 0.0, "{tool}'s queue ends at {last}");
    }
    // The memory profiler sampled every server more than once (points every 2 s).
    let memory = figures["memory_mib"].as_object().unwrap();
    assert_eq!(memory.len(), 3, "{memory:?}");
    for (server, points) in memory {
        assert!(points.as_array().unwrap().len() >= 2, "{server}: {points}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

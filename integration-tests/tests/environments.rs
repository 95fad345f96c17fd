//! A Python model's environment whose build is killed (the worker SIGKILLed) at several points,
//! each time with a worker started again on the same cache: the next start builds it and serves,
//! and no partial build is left behind. The model's package takes seconds to build (its
//! setup.py sleeps), so the kills land inside the installer, not only before it.

use std::path::Path;
use std::time::{Duration, Instant};

use nomad_integration_tests::model_host::{described_tools, uv};
use nomad_integration_tests::{Fleet, FleetOptions, Service, wait_until};
use nomad_proto::v1::{CallToolRequest, ToolInput, ToolState, tool_input, tool_output};
use serde_json::{Value, json};

/// A package whose build sleeps, in a directory of `dir`; its requirement.
fn slow_package(dir: &Path) -> String {
    let package = dir.join("slow-build");
    std::fs::create_dir_all(&package).unwrap();
    for (name, text) in [
        (
            "pyproject.toml",
            "[build-system]\nrequires = [\"setuptools>=61\"]\nbuild-backend = \"setuptools.build_meta\"\n\n\
             [project]\nname = \"nomad-slow-build\"\nversion = \"1.0\"\n",
        ),
        (
            "setup.py",
            "import time\n\ntime.sleep(3)\nfrom setuptools import setup\n\nsetup(py_modules=[\"slow_build\"])\n",
        ),
        (
            "slow_build.py",
            "def double(x: float) -> float:\n    \"\"\"Twice x.\"\"\"\n    return 2 * x\n",
        ),
    ] {
        std::fs::write(package.join(name), text).unwrap();
    }
    format!("nomad-slow-build @ file://{}", package.display())
}

fn options(dir: &Path, cache: &Path, requirement: &str) -> FleetOptions {
    let mut options = FleetOptions {
        tools_yaml: Some(format!(
            "tools:\n  - tool: slow_build.double\n    name: double\n    env: [{}]\n\
             tool_manager:\n  heartbeat_interval_ms: 200\n",
            json!(requirement)
        )),
        ..Default::default()
    }
    .env("NOMAD_CACHE_DIR", cache.display().to_string())
    // The built wheel is not cached, so every start builds (and sleeps) again.
    .env("UV_NO_CACHE", "1")
    .env("PIP_NO_CACHE_DIR", "1");
    if let Some(uv) = uv() {
        options = options.env("NOMAD_UV", uv.display().to_string());
    }
    options.in_dir(dir)
}

fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Waits until the worker's log says the environment's build started.
async fn build_started(fleet: &Fleet) {
    wait_until(
        "the environment's build never started",
        Duration::from_secs(120),
        || {
            fleet
                .stderr(Service::DeviceWorker)
                .contains("building the model environment")
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_environment_build_killed_at_any_point_is_built_again_by_the_next_start() {
    let dir = Fleet::new_dir();
    let cache = dir.join("cache");
    let requirement = slow_package(&dir);
    // As the build starts (the environment being created), and twice while the package builds
    // (the installer running); each time the build is left unfinished.
    for (attempt, after) in [0, 800, 2000].into_iter().enumerate() {
        let mut fleet = Fleet::start(options(
            &dir.join(format!("killed-{attempt}")),
            &cache,
            &requirement,
        ))
        .await;
        build_started(&fleet).await;
        tokio::time::sleep(Duration::from_millis(after)).await;
        fleet.kill_worker(0);
        let deadline = Instant::now() + Duration::from_secs(10);
        while fleet
            .pids()
            .iter()
            .any(|(s, _)| *s == Service::DeviceWorker)
        {
            assert!(
                Instant::now() < deadline,
                "the killed worker is still running"
            );
            fleet.reap_killed().await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        fleet.terminate().await;
        let envs = entries(&cache.join("envs"));
        assert!(
            (attempt == 0 || envs.iter().any(|e| e.contains(".build-")))
                && envs.iter().all(|e| e.contains('.')),
            "attempt {attempt}: the kill did not land inside the build: {envs:?}"
        );
    }
    let mut fleet = Fleet::start(options(&dir.join("served"), &cache, &requirement)).await;
    let mut client = fleet.scheduler_client().await;
    let tools = described_tools(&mut client, Duration::from_secs(300)).await;
    let double = tools.iter().find(|t| t.name == "double").unwrap();
    assert_eq!(double.state(), ToolState::Ready, "{}", double.error);
    let reply = client
        .call_tool(CallToolRequest {
            tool: "double".into(),
            input: Some(ToolInput {
                value: Some(tool_input::Value::Json(json!({"x": 2.5}).to_string())),
                options_json: String::new(),
            }),
        })
        .await
        .unwrap()
        .into_inner();
    let Some(tool_output::Value::Json(text)) = reply.output.and_then(|o| o.value) else {
        panic!("double: not JSON");
    };
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), json!(5.0));
    fleet.terminate().await;
    // One environment, complete; nothing a killed build left behind (its installer died with
    // its worker, and the next build cleared its directory).
    let envs: Vec<String> = entries(&cache.join("envs"))
        .into_iter()
        .filter(|name| !name.ends_with(".lock") && !name.ends_with(".log"))
        .collect();
    assert_eq!(envs.len(), 1, "{envs:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

//! What the Python model tests need: an interpreter of Python 3.12 or newer (the original Nomad,
//! `nomad-scifm`, needs it), the test's own model packages at paths named by their content (so
//! their environments are built once and reused by every later run), model directories with
//! fixed weights, and a wait until the scheduler has described a tool.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_proto::v1::{CallToolResponse, ListToolsRequest, ToolInfo, ToolState};
use serde_json::{Value, json};

/// Python 3.12 or newer: `NOMAD_TEST_PYTHON312`, else pyenv's newest 3.12+, else `python3.13` or
/// `python3.12` on PATH. Panics naming what it tried: these tests cannot run without one.
pub fn python312() -> PathBuf {
    if let Some(p) = std::env::var_os("NOMAD_TEST_PYTHON312") {
        return PathBuf::from(p);
    }
    let pyenv = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pyenv")));
    if let Some(root) = &pyenv {
        let mut found: Vec<(Vec<u32>, PathBuf)> = std::fs::read_dir(root.join("versions"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let version: Vec<u32> = name
                    .split('.')
                    .map(|p| p.parse().ok())
                    .collect::<Option<_>>()?;
                let python = e.path().join("bin/python");
                (version.len() >= 2 && version[0] == 3 && version[1] >= 12 && python.is_file())
                    .then_some((version, python))
            })
            .collect();
        found.sort();
        if let Some((_, python)) = found.pop() {
            return python;
        }
    }
    for name in ["python3.13", "python3.12"] {
        let ok = std::process::Command::new(name)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return PathBuf::from(name);
        }
    }
    panic!(
        "no Python 3.12 or newer: set NOMAD_TEST_PYTHON312, or install one (pyenv under {}, or \
         python3.12 on PATH); the original Nomad (nomad-scifm) needs it",
        pyenv.map(|p| p.display().to_string()).unwrap_or_default()
    );
}

/// Where these tests keep environments, clones and packages across runs.
pub fn cache_dir() -> PathBuf {
    let dir = std::env::var_os("NOMAD_TEST_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/nomad-test-cache")
        });
    std::fs::create_dir_all(&dir).unwrap();
    dir.canonicalize().unwrap()
}

/// What every process of a fleet serving Python models needs: the shared cache, an interpreter
/// of 3.12 or newer, and uv when there is one.
pub fn host_env() -> Vec<(String, String)> {
    let mut env = vec![
        (
            "NOMAD_CACHE_DIR".to_owned(),
            cache_dir().display().to_string(),
        ),
        ("NOMAD_PYTHON".to_owned(), python312().display().to_string()),
    ];
    if let Some(uv) = uv() {
        env.push(("NOMAD_UV".to_owned(), uv.display().to_string()));
    }
    env
}

/// `uv` when scripts/test installed it (environments build in seconds instead of minutes).
pub fn uv() -> Option<PathBuf> {
    let uv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-test/bin/uv");
    uv.is_file().then_some(uv)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if name == "build" || name.to_string_lossy().ends_with(".egg-info") || name == "__pycache__"
        {
            continue;
        }
        let target = to.join(&name);
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

fn digest_dir(dir: &Path, hash: &mut u64) {
    let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == "build" || name.ends_with(".egg-info") || name == "__pycache__" {
            continue;
        }
        for b in name.bytes() {
            *hash = (*hash ^ u64::from(b)).wrapping_mul(0x100000001b3);
        }
        if entry.file_type().unwrap().is_dir() {
            digest_dir(&entry.path(), hash);
        } else {
            for b in std::fs::read(entry.path()).unwrap() {
                *hash = (*hash ^ u64::from(b)).wrapping_mul(0x100000001b3);
            }
        }
    }
}

/// The test package `name` (under `integration-tests/python/`) copied to a path named by its
/// content; returns the PEP 508 requirement that installs it (`name @ file:///...`).
pub fn package(name: &str) -> String {
    let source = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(name);
    let mut hash = 0xcbf29ce484222325u64;
    digest_dir(&source, &mut hash);
    let target = cache_dir()
        .join("packages")
        .join(format!("{name}-{hash:016x}"));
    if !target.join("pyproject.toml").is_file() {
        let partial = target.with_extension(format!("partial-{}", std::process::id()));
        copy_dir(&source, &partial);
        let _ = std::fs::rename(&partial, &target);
        let _ = std::fs::remove_dir_all(&partial);
    }
    format!("{name} @ file://{}", target.display())
}

/// The fixed weights of the toy surrogate (`toy_scifm`), and a model card.
pub const TOY_WEIGHTS: &str = r#"{"weight": [[0.5, -0.25, 0.125, 0.0], [0.1, 0.2, 0.3, 0.4],
 [-0.3, 0.0, 0.7, -0.1], [0.05, -0.6, 0.2, 0.9]], "bias": [0.01, -0.02, 0.03, -0.04]}"#;

/// A model directory of the toy surrogate under `dir`.
pub fn toy_weights(dir: &Path) -> PathBuf {
    let model = dir.join("toy-weights");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(model.join("weights.json"), TOY_WEIGHTS).unwrap();
    std::fs::write(
        model.join("README.md"),
        "# Toy surrogate\n\nA fixed tanh layer over four features.\n",
    )
    .unwrap();
    model
}

/// The scheduler's tools once none is pending (every one described or failed), within
/// `timeout` (an environment may be building).
pub async fn described_tools(
    client: &mut SchedulerClient<nomad_rpc::Channel>,
    timeout: Duration,
) -> Vec<ToolInfo> {
    let deadline = Instant::now() + timeout;
    loop {
        let tools = client
            .list_tools(ListToolsRequest {})
            .await
            .unwrap()
            .into_inner()
            .tools;
        if tools.iter().all(|t| t.state() != ToolState::Pending) {
            return tools;
        }
        assert!(
            Instant::now() < deadline,
            "tools still pending after {} s: {:?}",
            timeout.as_secs(),
            tools
                .iter()
                .filter(|t| t.state() == ToolState::Pending)
                .map(|t| &t.name)
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The interpreter of the environment the worker built for `requirements` (its ready marker
/// lists them), to compute references with the very same packages.
pub fn env_python(requirements: &[String]) -> PathBuf {
    let envs = cache_dir().join("envs");
    let wanted = requirements.join("\n");
    std::fs::read_dir(&envs)
        .unwrap_or_else(|e| panic!("{}: {e}", envs.display()))
        .flatten()
        .find(|e| {
            std::fs::read_to_string(e.path().join(".nomad-env-ready")).is_ok_and(|t| t == wanted)
        })
        .map(|e| e.path().join("bin/python"))
        .unwrap_or_else(|| {
            panic!(
                "no environment in {} holds {requirements:?}",
                envs.display()
            )
        })
}

/// The toy surrogate's environment: the original Nomad and the test's package.
pub fn scifm_requirements() -> Vec<String> {
    vec!["nomad-scifm==0.2.1".to_owned(), package("toy-scifm")]
}

/// Calls the toy surrogate directly in its own environment, one input at a time (the original's
/// `tool(input)`), for the reference answers.
pub fn reference_toy(weights: &Path, inputs: &[Value]) -> Vec<Value> {
    const SCRIPT: &str = "import json, sys\n\
        from toy_scifm.model import ToySurrogate, PointIn\n\
        tool = ToySurrogate.from_pretrained(sys.argv[1])\n\
        inputs = json.loads(sys.stdin.read())\n\
        print(json.dumps([tool(PointIn(**a)).model_dump(mode='json') for a in inputs]))\n";
    run_python(
        &env_python(&scifm_requirements()),
        SCRIPT,
        &[weights],
        inputs,
    )
}

pub fn run_python(python: &Path, script: &str, args: &[&Path], input: &[Value]) -> Vec<Value> {
    use std::io::Write as _;
    let mut child = std::process::Command::new(python)
        .arg("-c")
        .arg(script)
        .args(args)
        // A file that exists: the reference never dies on purpose.
        .env("TOY_SCIFM_ONCE", "/")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(json!(input).to_string().as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "the reference failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str::<Vec<Value>>(last).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

pub fn assert_close(got: &Value, want: &Value, what: &str) {
    match (got, want) {
        (Value::Number(a), Value::Number(b)) => {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "{what}: {a} vs {b}"
            );
        }
        (Value::Array(a), Value::Array(b)) => {
            assert_eq!(a.len(), b.len(), "{what}: {got} vs {want}");
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert_close(x, y, &format!("{what}[{i}]"));
            }
        }
        (Value::Object(a), Value::Object(b)) => {
            assert_eq!(
                a.keys().collect::<Vec<_>>(),
                b.keys().collect::<Vec<_>>(),
                "{what}"
            );
            for (k, y) in b {
                assert_close(&a[k], y, &format!("{what}.{k}"));
            }
        }
        _ => assert_eq!(got, want, "{what}"),
    }
}

/// An `fmod_models` entry of the toy surrogate (with `extra` lines of its own).
pub fn toy_entry(weights: &Path, extra: &str) -> String {
    format!(
        "  - model_class: toy_scifm.ToySurrogate\n    name_or_path: {}\n    env: {}\n{extra}",
        weights.display(),
        json!(scifm_requirements())
    )
}

/// The tool `name` among `listed`, which must be in `state` (its error shown where it is not).
pub fn listed_as<'a>(listed: &'a [ToolInfo], name: &str, state: ToolState) -> &'a ToolInfo {
    let tool =
        (listed.iter().find(|t| t.name == name)).unwrap_or_else(|| panic!("{name}: not listed"));
    assert_eq!(tool.state(), state, "{name}: {}", tool.error);
    tool
}

/// Text calls of `tool`, each its text and options (JSON), sent at once so that they share
/// batches: their answers, in order.
pub async fn text_calls_at_once(
    client: &SchedulerClient<nomad_rpc::Channel>,
    tool: &str,
    calls: Vec<(String, String)>,
) -> Vec<Result<CallToolResponse, tonic::Status>> {
    futures::future::join_all(calls.into_iter().map(|(text, options)| {
        let mut client = client.clone();
        async move {
            let request = crate::text_call(tool, text, options);
            client
                .call_tool(request)
                .await
                .map(tonic::Response::into_inner)
        }
    }))
    .await
}

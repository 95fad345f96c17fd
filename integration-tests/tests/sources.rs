//! Models that travel: `oras://` sources from a real registry on loopback (Debian's
//! `docker-registry`) holding artifacts a third-party client pushed (`oras` from PyPI), answering
//! as the same files from a path do; a digest of another artifact refused; a second start with
//! the registry stopped served from the cache; `nomad export --to oras --pin` read back by
//! oras-py file for file, and its written config serving the same answers; `nomad export --to
//! disk`; `hf://` downloaded from a stand-in for the Hub (which the tests cannot reach) into the
//! cache layout the Hub's own library reads, pinned in the run's kept config, served offline.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nomad_integration_tests::fleet::models_dir;
use nomad_integration_tests::hub::{HubDouble, read_with_huggingface_hub};
use nomad_integration_tests::model_host::described_tools;
use nomad_integration_tests::process::send_signal;
use nomad_integration_tests::process::{
    binary, refused_saying, start_fleet, succeeded, succeeded_blocking, up_command,
};
use nomad_integration_tests::registry::Registry;
use nomad_integration_tests::text_call;
use nomad_integration_tests::{Fleet, FleetOptions};
use nomad_proto::v1::{CallToolRequest, ToolInput, ToolState, tool_input, tool_output};
use serde_json::{Value, json};

const MANAGER: &str = "tool_manager:\n  heartbeat_interval_ms: 200\n";
const DESCRIBED_WITHIN: Duration = Duration::from_secs(300);

/// A model class in the original's duck-typed shape, standard library only: a weighted sum of
/// four features, its weights the model's files.
const SCALE_PY: &str = r#"import json, os


class Scale:
    """A weighted sum of four features."""

    description = "A weighted sum of four features; the weights are the model's files."
    args_schema = {
        "type": "object",
        "properties": {"x": {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4}},
        "required": ["x"],
    }
    batch_size = 4

    def __init__(self, weights, bias):
        self.weights, self.bias = weights, bias

    @classmethod
    def from_pretrained(cls, path):
        with open(os.path.join(path, "weights.json")) as f:
            weights = json.load(f)
        with open(os.path.join(path, "bias", "value.txt")) as f:
            bias = float(f.read())
        return cls(weights, bias)

    def preprocess(self, batch):
        return [item["x"] for item in batch]

    def _forward(self, rows):
        return [sum(w * x for w, x in zip(self.weights, row)) + self.bias for row in rows]

    def postprocess(self, ys):
        return [{"y": y} for y in ys]
"#;

const WEIGHTS: [f64; 4] = [0.5, -1.25, 2.0, 0.125];
const BIAS: f64 = 0.75;

/// The scale model's files: weights, and a directory (so the artifact has a directory layer).
fn scale_model(dir: &Path) -> PathBuf {
    let model = dir.join("scale-model");
    std::fs::create_dir_all(model.join("bias")).unwrap();
    std::fs::write(model.join("weights.json"), json!(WEIGHTS).to_string()).unwrap();
    std::fs::write(model.join("bias/value.txt"), BIAS.to_string()).unwrap();
    std::fs::write(model.join("README.md"), "# Scale\n\nA weighted sum.\n").unwrap();
    model
}

/// A fleet directory with the scale module beside its config.
fn fleet_dir(dir: &Path, name: &str) -> PathBuf {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("scale.py"), SCALE_PY).unwrap();
    d
}

/// A fleet in `fleet_dir` with a cache of its own (so every pull is a real one); environments
/// build with uv when scripts/test installed it.
fn options(fleet_dir: &Path, cache: &Path, tools: String) -> FleetOptions {
    let mut options =
        FleetOptions::serving(tools).env("NOMAD_CACHE_DIR", cache.display().to_string());
    if let Some(uv) = nomad_integration_tests::model_host::uv() {
        options = options.env("NOMAD_UV", uv.display().to_string());
    }
    options.in_dir(fleet_dir)
}

const SENTENCES: [&str; 3] = [
    "Nomad serves models as tools to agents.",
    "A registry carries the weights to nodes without the Hub.",
    "The same files give the same embedding.",
];

async fn embeddings(fleet: &Fleet, tool: &str) -> Vec<Vec<f32>> {
    let mut client = fleet.scheduler_client().await;
    let mut out = Vec::new();
    for sentence in SENTENCES {
        let reply = client
            .call_tool(text_call(tool, sentence, ""))
            .await
            .unwrap_or_else(|e| panic!("{tool}: {e}"))
            .into_inner();
        match reply.output.and_then(|o| o.value) {
            Some(tool_output::Value::Tensor(t)) => out.push(t.to_f32_vec().unwrap()),
            other => panic!("{tool}: not a tensor: {other:?}"),
        }
    }
    out
}

const ROWS: [[f64; 4]; 3] = [
    [1.0, 2.0, 3.0, 4.0],
    [0.0, -1.0, 0.5, 8.0],
    [0.25, 0.0, 0.0, 0.0],
];

async fn scaled(fleet: &Fleet, tool: &str) -> Vec<f64> {
    let mut client = fleet.scheduler_client().await;
    let mut out = Vec::new();
    for row in ROWS {
        let reply = client
            .call_tool(CallToolRequest {
                tool: tool.into(),
                input: Some(ToolInput {
                    value: Some(tool_input::Value::Json(json!({"x": row}).to_string())),
                    options_json: String::new(),
                }),
            })
            .await
            .unwrap_or_else(|e| panic!("{tool}: {e}"))
            .into_inner();
        let Some(tool_output::Value::Json(text)) = reply.output.and_then(|o| o.value) else {
            panic!("{tool}: not JSON");
        };
        let value: Value = serde_json::from_str(&text).unwrap();
        out.push(value["y"].as_f64().unwrap());
    }
    out
}

/// The scale model computed here, not by Nomad.
fn scale_reference() -> Vec<f64> {
    ROWS.iter()
        .map(|row| row.iter().zip(WEIGHTS).map(|(x, w)| x * w).sum::<f64>() + BIAS)
        .collect()
}

async fn tool_states(fleet: &Fleet) -> Vec<(String, ToolState, String)> {
    let mut client = fleet.scheduler_client().await;
    described_tools(&mut client, DESCRIBED_WITHIN)
        .await
        .into_iter()
        .map(|t| (t.name.clone(), t.state(), t.error.clone()))
        .collect()
}

fn state<'a>(
    tools: &'a [(String, ToolState, String)],
    name: &str,
) -> &'a (String, ToolState, String) {
    tools
        .iter()
        .find(|t| t.0 == name)
        .unwrap_or_else(|| panic!("no tool {name}: {tools:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_from_a_registry_answer_as_their_files_and_start_again_without_the_registry() {
    let dir = Fleet::new_dir();
    let mut registry = Registry::start(&dir.join("registry"), None);
    let minilm = models_dir().join("all-minilm-l6-v2");
    let scale = scale_model(&dir);
    let embed_digest = registry.oras_push(&minilm, "models/minilm:v1");
    let scale_digest = registry.oras_push(&scale, "models/scale:v1");
    let addr = registry.addr.clone();
    let cache = dir.join("cache");
    let tools = format!(
        "tools:\n\
         \x20 - {{name: embed_file, kind: embed, source: {minilm}, batch_size: 4}}\n\
         \x20 - {{name: embed_oras, kind: embed, source: 'oras://{addr}/models/minilm:v1', batch_size: 4}}\n\
         \x20 - {{name: embed_pinned_elsewhere, kind: embed, source: 'oras://{addr}/models/minilm@{scale_digest}'}}\n\
         \x20 - {{name: embed_missing_tag, kind: embed, source: 'oras://{addr}/models/minilm:v9'}}\n\
         fmod_models:\n\
         \x20 - {{model_class: scale.Scale, name_or_path: {scale}, tool_name: scale_file}}\n\
         \x20 - {{model_class: scale.Scale, name_or_path: 'oras://{addr}/models/scale@{scale_digest}', tool_name: scale_oras}}\n\
         {MANAGER}",
        minilm = minilm.display(),
        scale = scale.display(),
    );
    let mut fleet = Fleet::start(options(&fleet_dir(&dir, "first"), &cache, tools.clone())).await;
    let tools_now = tool_states(&fleet).await;
    for name in ["embed_file", "embed_oras", "scale_file", "scale_oras"] {
        let (_, state, error) = state(&tools_now, name);
        assert_eq!(*state, ToolState::Ready, "{name}: {error}");
    }
    // A digest that is not an artifact of that repository is refused, naming the source and
    // what to do.
    for (name, source) in [
        (
            "embed_pinned_elsewhere",
            format!("oras://{addr}/models/minilm@{scale_digest}"),
        ),
        (
            "embed_missing_tag",
            format!("oras://{addr}/models/minilm:v9"),
        ),
    ] {
        let (_, refused, error) = state(&tools_now, name);
        assert_eq!(*refused, ToolState::Failed, "{name}");
        assert!(
            error.contains(&source) && error.contains("check the repository, tag or digest"),
            "{name}: {error}"
        );
    }

    let from_file = embeddings(&fleet, "embed_file").await;
    assert_eq!(from_file[0].len(), 384);
    assert_eq!(embeddings(&fleet, "embed_oras").await, from_file);
    let reference = scale_reference();
    assert_eq!(scaled(&fleet, "scale_file").await, reference);
    assert_eq!(scaled(&fleet, "scale_oras").await, reference);
    // Stored by the manifest's digest, the directory layer unpacked.
    let stored = cache.join("oras").join(embed_digest.replace(':', "-"));
    assert_eq!(
        std::fs::read(stored.join("1_Pooling/config.json")).unwrap(),
        std::fs::read(minilm.join("1_Pooling/config.json")).unwrap()
    );
    fleet.terminate().await;

    // The registry stopped: the same config starts from the cache (the tag's digest remembered).
    registry.stop();
    let mut again = Fleet::start(options(&fleet_dir(&dir, "second"), &cache, tools)).await;
    let tools_now = tool_states(&again).await;
    for name in ["embed_oras", "scale_oras"] {
        let (_, state, error) = state(&tools_now, name);
        assert_eq!(*state, ToolState::Ready, "{name}: {error}");
    }
    // What was never pulled cannot be served, and the error says the registry is unreachable.
    let (_, refused, error) = state(&tools_now, "embed_pinned_elsewhere");
    assert_eq!(*refused, ToolState::Failed);
    assert!(
        error.contains("check the registry's address and that it is up"),
        "{error}"
    );
    assert_eq!(embeddings(&again, "embed_oras").await, from_file);
    assert_eq!(scaled(&again, "scale_oras").await, reference);
    again.terminate().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// `nomad export <config> <out> <args>`, with a cache of its own beside `out`.
fn export(config: &Path, out: &Path, args: &[&str]) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(binary("nomad"));
    command
        .arg("export")
        .arg(config)
        .arg(out)
        .args(args)
        .env("NOMAD_CACHE_DIR", out.with_extension("cache"));
    command
}

/// Every file under `dir`, by relative path, with its bytes.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let name = path.strip_prefix(dir).unwrap().display().to_string();
                if !name.starts_with('.') {
                    out.push((name, std::fs::read(&path).unwrap()));
                }
            }
        }
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nomad_export_pushes_every_model_and_its_pinned_config_serves_the_same_answers() {
    let dir = Fleet::new_dir();
    let registry = Registry::start(&dir.join("registry"), None);
    let addr = registry.addr.clone();
    let minilm = models_dir().join("all-minilm-l6-v2");
    let source = fleet_dir(&dir, "source");
    let scale = scale_model(&source);
    std::fs::write(
        source.join("requirements.txt"),
        "# the model's environment\nsix==1.16.0\n",
    )
    .unwrap();
    let tools = format!(
        "tools:\n\
         \x20 - {{name: embed, kind: embed, source: {minilm}, batch_size: 4}}\n\
         fmod_models:\n\
         \x20 - {{model_class: scale.Scale, name_or_path: scale-model, tool_name: scale, env: requirements.txt}}\n\
         {MANAGER}",
        minilm = minilm.display(),
    );
    let config = source.join("nomad.yml");
    std::fs::write(&config, &tools).unwrap();

    // Bad input first: each refused naming what to do.
    let out = dir.join("exported");
    let oras = ["--to", "oras", "--oras-registry"];
    refused_saying(
        &mut export(&config, &out, &oras[..2]),
        &["--to oras needs --oras-registry"],
    )
    .await;
    refused_saying(
        export(&config, &out, &oras).arg(format!("{addr}/Exported")),
        &["is not an OCI repository name"],
    )
    .await;

    let exported = succeeded(
        export(&config, &out, &oras)
            .arg(format!("{addr}/exported"))
            .arg("--pin"),
    )
    .await;
    let said = String::from_utf8_lossy(&exported.stderr);
    assert!(said.contains("pushing to oras://"), "{said}");
    let written = std::fs::read_to_string(out.join("nomad.yml")).unwrap();
    let pinned: Vec<&str> = written
        .lines()
        .filter_map(|l| {
            l.split_once(&format!("oras://{addr}/exported@sha256:"))
                .map(|(_, d)| d)
        })
        .collect();
    assert_eq!(pinned.len(), 2, "{written}");
    assert!(
        written.contains("six==1.16.0"),
        "the environment travels in the config: {written}"
    );
    let report = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(
        report.contains("| [embed](cards/embed.md)")
            && report.contains("| [scale](cards/scale.md)"),
        "{report}"
    );
    assert!(report.contains("scale.py"), "{report}");
    // The embed model's own card travels.
    let card = std::fs::read_to_string(out.join("cards/embed.md")).unwrap();
    assert!(card.contains("all-MiniLM-L6-v2"), "{card}");
    assert!(out.join("scale.py").is_file());

    // A third-party client reads what Nomad pushed, file for file.
    let embed_ref = written
        .lines()
        .find(|l| l.contains("source: oras://"))
        .and_then(|l| l.split_once(&format!("oras://{addr}/")))
        .map(|(_, r)| r.trim().trim_matches('\'').to_owned())
        .unwrap_or_else(|| panic!("no embed source in {written}"));
    let pulled = dir.join("pulled");
    registry.oras_pull(&embed_ref, &pulled);
    assert_eq!(files(&pulled), files(&minilm));

    // The source config and the written one, side by side: the same answers.
    let cache = dir.join("cache");
    let source_tools = tools
        .replace(
            "name_or_path: scale-model",
            &format!("name_or_path: {}", scale.display()),
        )
        .replace("env: requirements.txt", "env: [six==1.16.0]");
    let mut original = Fleet::start(options(
        &fleet_dir(&dir, "served-source"),
        &cache,
        source_tools,
    ))
    .await;
    let from_source = (
        embeddings(&original, "embed").await,
        scaled(&original, "scale").await,
    );
    original.terminate().await;
    let served = dir.join("served-export");
    std::fs::create_dir_all(&served).unwrap();
    std::fs::copy(out.join("scale.py"), served.join("scale.py")).unwrap();
    let mut from_export =
        Fleet::start(options(&served, &dir.join("fresh-cache"), written.clone())).await;
    let tools_now = tool_states(&from_export).await;
    for name in ["embed", "scale"] {
        let (_, state, error) = state(&tools_now, name);
        assert_eq!(*state, ToolState::Ready, "{name}: {error}");
    }
    assert_eq!(embeddings(&from_export, "embed").await, from_source.0);
    assert_eq!(scaled(&from_export, "scale").await, from_source.1);
    assert_eq!(from_source.1, scale_reference());
    from_export.terminate().await;

    // To a directory: every file copied, the config naming it relative to itself.
    let on_disk = dir.join("on-disk");
    succeeded(&mut export(&config, &on_disk, &["--to", "dir"])).await;
    let written = std::fs::read_to_string(on_disk.join("nomad.yml")).unwrap();
    assert!(
        written.contains("source: models/embed") && written.contains("name_or_path: models/scale"),
        "{written}"
    );
    assert_eq!(files(&on_disk.join("models/embed")), files(&minilm));
    assert_eq!(files(&on_disk.join("models/scale")), files(&scale));
    succeeded_blocking(
        std::process::Command::new(binary("nomad-scheduler"))
            .args(["--check", "--config"])
            .arg(on_disk.join("nomad.yml")),
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn copy_model(from: &Path, to: &Path) {
    for (name, bytes) in files(from) {
        let target = to.join(name);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        std::fs::write(target, bytes).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hub_models_download_into_the_shared_cache_are_pinned_and_serve_offline() {
    let dir = Fleet::new_dir();
    let minilm = models_dir().join("all-minilm-l6-v2");
    copy_model(&minilm, &dir.join("hub/org/minilm"));
    let mut hub = HubDouble::start(&dir.join("hub"), &dir);
    let hf_cache = dir.join("hf-cache");
    let config = dir.join("nomad.yml");
    std::fs::write(
        &config,
        format!(
            "tools:\n  - {{name: embed_hub, kind: embed, source: 'hf://org/minilm'}}\n{MANAGER}"
        ),
    )
    .unwrap();

    // `nomad up` downloads it and keeps the config it ran pinned to the commit it served.
    let run = dir.join("runs/hub-run");
    let (mut up, _) = start_fleet(
        up_command(&config, &dir.join("runs"), "hub-run")
            .args(["--ready-timeout", "120"])
            .env("NOMAD_CACHE_DIR", dir.join("cache"))
            .env("HF_ENDPOINT", &hub.endpoint)
            .env("HF_HUB_CACHE", &hf_cache),
        &run,
        Some(&dir.join("up.stderr")),
        Duration::from_secs(150),
    )
    .await;
    send_signal(up.id().unwrap(), libc::SIGTERM);
    assert!(up.wait().await.unwrap().success());

    // The Hub's own library reads what Nomad wrote: the ref, the snapshot, the files.
    let read = read_with_huggingface_hub(&hf_cache, "org/minilm");
    let commit = read["refs"]["main"]
        .as_str()
        .unwrap_or_else(|| panic!("{read}"))
        .to_owned();
    let snapshot = PathBuf::from(read["snapshot"].as_str().unwrap());
    assert_eq!(
        snapshot,
        hf_cache.join("models--org--minilm/snapshots").join(&commit)
    );
    assert_eq!(files(&snapshot), files(&minilm));
    let kept = std::fs::read_to_string(run.join("config.yml")).unwrap();
    assert!(
        kept.contains(&format!("hf://org/minilm@{commit}")),
        "{kept}"
    );

    // Served as the same files from a path are, by the Hub's ref, by the pinned commit, and
    // with the Hub gone.
    let tools = format!(
        "tools:\n\
         \x20 - {{name: embed_file, kind: embed, source: {minilm}, batch_size: 4}}\n\
         \x20 - {{name: embed_hub, kind: embed, source: 'hf://org/minilm', batch_size: 4}}\n\
         \x20 - {{name: embed_pinned, kind: embed, source: 'hf://org/minilm@{commit}', batch_size: 4}}\n\
         {MANAGER}",
        minilm = minilm.display(),
    );
    let (endpoint, hf_cache_text) = (hub.endpoint.clone(), hf_cache.display().to_string());
    let with_hub = move |options: FleetOptions| {
        options
            .env("HF_ENDPOINT", endpoint.clone())
            .env("HF_HUB_CACHE", hf_cache_text.clone())
    };
    let mut fleet = Fleet::start(with_hub(options(
        &dir.join("first"),
        &dir.join("cache"),
        tools.clone(),
    )))
    .await;
    let from_file = embeddings(&fleet, "embed_file").await;
    assert_eq!(embeddings(&fleet, "embed_hub").await, from_file);
    assert_eq!(embeddings(&fleet, "embed_pinned").await, from_file);
    fleet.terminate().await;
    hub.stop();
    let asked = hub.requests();
    let mut offline = Fleet::start(with_hub(options(
        &dir.join("second"),
        &dir.join("cache"),
        tools,
    )))
    .await;
    let tools_now = tool_states(&offline).await;
    for name in ["embed_hub", "embed_pinned"] {
        let (_, state, error) = state(&tools_now, name);
        assert_eq!(*state, ToolState::Ready, "{name}: {error}");
    }
    assert_eq!(embeddings(&offline, "embed_hub").await, from_file);
    assert_eq!(hub.requests(), asked);
    offline.terminate().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Docker auth file (config.json in its own directory, as DOCKER_CONFIG names it) holding
/// `user:password` for `registry`.
fn docker_config(dir: &Path, registry: &str, user: &str, password: &str) -> PathBuf {
    use base64::Engine as _;
    std::fs::create_dir_all(dir).unwrap();
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    std::fs::write(
        dir.join("config.json"),
        json!({"auths": {registry: {"auth": auth}}}).to_string(),
    )
    .unwrap();
    dir.to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_that_requires_a_login_is_read_with_the_users_credentials_only() {
    let dir = Fleet::new_dir();
    let password = "a-password-for-tests";
    // oras-py cannot answer a registry's basic-auth challenge: it pushes to an open registry,
    // and the fleet reads the same storage through one that requires a login.
    let open = Registry::start(&dir.join("open-registry"), None);
    let scale = scale_model(&dir);
    open.oras_push(&scale, "team/scale:v1");
    let registry = open.beside(
        &dir.join("registry"),
        Some(&Registry::htpasswd_line("scientist", password)),
    );
    let addr = registry.addr.clone();
    let tools = format!(
        "fmod_models:\n\
         \x20 - {{model_class: scale.Scale, name_or_path: 'oras://{addr}/team/scale:v1', tool_name: scale}}\n\
         {MANAGER}"
    );
    let start = |name: &str, docker: PathBuf| {
        let fleet_dir = fleet_dir(&dir, name);
        let cache = dir.join(format!("{name}-cache"));
        let options = options(&fleet_dir, &cache, tools.clone())
            .env("DOCKER_CONFIG", docker.display().to_string())
            .env("HOME", dir.display().to_string());
        Fleet::start(options)
    };

    // No credentials, then the wrong password: refused, saying how to log in.
    for (name, docker) in [
        ("anonymous", dir.join("no-docker-config")),
        (
            "wrong",
            docker_config(&dir.join("wrong"), &addr, "scientist", "not-it"),
        ),
    ] {
        let mut fleet = start(name, docker).await;
        let tools_now = tool_states(&fleet).await;
        let (_, refused, error) = state(&tools_now, "scale");
        assert_eq!(*refused, ToolState::Failed, "{name}");
        assert!(
            error.contains(&format!("oras://{addr}/team/scale:v1"))
                && error.contains("log in (`oras login` or `docker login`"),
            "{name}: {error}"
        );
        fleet.terminate().await;
    }
    // The auth file `docker login` writes: served.
    let mut fleet = start(
        "logged-in",
        docker_config(&dir.join("right"), &addr, "scientist", password),
    )
    .await;
    let tools_now = tool_states(&fleet).await;
    let (_, ready, error) = state(&tools_now, "scale");
    assert_eq!(*ready, ToolState::Ready, "{error}");
    assert_eq!(scaled(&fleet, "scale").await, scale_reference());
    fleet.terminate().await;

    // The config names the variables that hold the login (never the secret itself).
    let named = format!(
        "{tools}registries:\n  '{addr}': {{username_env: SCIFM_REGISTRY_USER, password_env: SCIFM_REGISTRY_TOKEN}}\n"
    );
    let with_names = |name: &str, token: Option<&str>| {
        let mut options = options(
            &fleet_dir(&dir, name),
            &dir.join(format!("{name}-cache")),
            named.clone(),
        )
        .env(
            "DOCKER_CONFIG",
            dir.join("no-docker-config").display().to_string(),
        )
        .env("HOME", dir.display().to_string())
        .env("SCIFM_REGISTRY_USER", "scientist");
        if let Some(token) = token {
            options = options.env("SCIFM_REGISTRY_TOKEN", token);
        }
        Fleet::start(options)
    };
    let mut fleet = with_names("named-unset", None).await;
    let tools_now = tool_states(&fleet).await;
    let (_, refused, error) = state(&tools_now, "scale");
    assert_eq!(*refused, ToolState::Failed);
    assert!(
        error.contains("names the variable SCIFM_REGISTRY_TOKEN, which is not set"),
        "{error}"
    );
    fleet.terminate().await;
    let mut fleet = with_names("named", Some(password)).await;
    let tools_now = tool_states(&fleet).await;
    let (_, ready, error) = state(&tools_now, "scale");
    assert_eq!(*ready, ToolState::Ready, "{error}");
    assert_eq!(scaled(&fleet, "scale").await, scale_reference());
    fleet.terminate().await;

    // `nomad export` pushes with the credentials of the environment.
    let source = fleet_dir(&dir, "export-source");
    std::fs::write(
        source.join("nomad.yml"),
        format!(
            "fmod_models:\n  - {{model_class: scale.Scale, name_or_path: {}, tool_name: scale}}\n",
            scale.display()
        ),
    )
    .unwrap();
    succeeded_blocking(
        std::process::Command::new(binary("nomad"))
            .arg("export")
            .arg(source.join("nomad.yml"))
            .arg(dir.join("exported"))
            .args([
                "--to",
                "oras",
                "--oras-registry",
                &format!("{addr}/team/exported"),
            ])
            .env("NOMAD_CACHE_DIR", dir.join("export-cache"))
            .env("DOCKER_CONFIG", dir.join("no-docker-config"))
            .env("NOMAD_REGISTRY_USERNAME", "scientist")
            .env("NOMAD_REGISTRY_PASSWORD", password),
    );
    let _ = std::fs::remove_dir_all(&dir);
}

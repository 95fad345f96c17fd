//! The deployment files hold together: the configs they mount start a real scheduler, and the
//! GPU override gives each worker its own GPU. (The compose stack itself runs in compose.rs;
//! the Kubernetes manifests are schema-checked by deploy/k8s/validate.)

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nomad_config::ConfigFile;
use nomad_integration_tests::Fleet;
use nomad_integration_tests::process::binary;
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A YAML file read as a config tree (compose files are not Nomad configs: no section check).
fn yaml(path: &Path) -> ConfigFile {
    ConfigFile::from_yaml_str(&std::fs::read_to_string(path).unwrap())
}

/// Starts the scheduler on `config` and waits for it to serve.
async fn scheduler_accepts(config: &Path) {
    let dir = Fleet::new_dir();
    let addr_file = dir.join("scheduler.addr");
    let mut child = tokio::process::Command::new(binary("nomad-scheduler"))
        .arg("--config")
        .arg(config)
        .args(["--listen", "127.0.0.1:0", "--addr-file"])
        .arg(&addr_file)
        .env("OTEL_SDK_DISABLED", "true")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let addr = loop {
        if let Ok(a) = std::fs::read_to_string(&addr_file)
            && !a.trim().is_empty()
        {
            break a.trim().to_owned();
        }
        if let Ok(Some(status)) = child.try_wait() {
            let out = child.wait_with_output().await.unwrap();
            panic!(
                "the scheduler refused {} ({status}):\n{}",
                config.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!(
            Instant::now() < deadline,
            "no scheduler on {}",
            config.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let health = tokio::process::Command::new(binary("nomad"))
        .args(["health", &addr])
        .status()
        .await
        .unwrap();
    assert!(health.success(), "{} is not serving", config.display());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_compose_and_kubernetes_configs_start_a_scheduler() {
    scheduler_accepts(&root().join("deploy/compose/nomad.yaml")).await;

    // The ConfigMap's nomad.yaml, as the pods see it.
    let k8s = std::fs::read_to_string(root().join("deploy/k8s/config.yaml")).unwrap();
    let first = k8s.split("\n---\n").next().unwrap();
    let data: Value = ConfigFile::from_yaml_str(first).section("data").unwrap();
    let dir = Fleet::new_dir();
    let config = dir.join("nomad.yaml");
    std::fs::write(&config, data["nomad.yaml"].as_str().unwrap()).unwrap();
    scheduler_accepts(&config).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn compose_gpus_gives_each_worker_its_own_gpu() {
    let out = std::process::Command::new(root().join("scripts/compose-gpus"))
        .arg("3")
        .output()
        .unwrap();
    assert!(out.status.success());
    let dir = Fleet::new_dir();
    let path = dir.join("gpus.yml");
    std::fs::write(&path, &out.stdout).unwrap();
    let services: Value = yaml(&path).section("services").unwrap();
    let services = services.as_object().unwrap();
    assert_eq!(services.len(), 3);
    for i in 0..3 {
        let worker = &services[&format!("device-worker-gpu-{i}")];
        let devices = &worker["deploy"]["resources"]["reservations"]["devices"][0];
        assert_eq!(devices["device_ids"], serde_json::json!([i.to_string()]));
        assert!(
            worker["command"]
                .as_array()
                .unwrap()
                .contains(&"cuda:0".into())
        );
    }
    let refused = std::process::Command::new(root().join("scripts/compose-gpus"))
        .arg("0")
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    let _ = std::fs::remove_dir_all(&dir);

    // The base file names the services the README and the test rely on.
    let base: Value = yaml(&root().join("docker-compose.yml"))
        .section("services")
        .unwrap();
    for service in [
        "models",
        "scheduler",
        "device-worker-cpu",
        "gateway",
        "head",
        "collector",
        "jaeger",
    ] {
        assert!(
            base.get(service).is_some(),
            "docker-compose.yml lacks {service}"
        );
    }
}

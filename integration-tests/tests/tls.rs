//! TLS on the internal gRPC hops: a fleet whose config has a `tls:` section serves and dials
//! only TLS, verified against the fleet's CA; plaintext and strangers are turned away.

use std::path::Path;
use std::time::Duration;

use nomad_integration_tests::Fleet;
use nomad_integration_tests::fleet::{make_mlp, mlp_tasks};
use nomad_integration_tests::process::{clean, refused_saying, start_fleet, succeeded, up_command};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};

/// A CA, and a server certificate it signed for localhost and 127.0.0.1, as PEM files in `dir`.
fn make_certificates(dir: &Path, name: &str) {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("{name} CA"));
    let ca_key = KeyPair::generate().unwrap();
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let params =
        CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
    std::fs::write(dir.join(format!("{name}-ca.pem")), ca.pem()).unwrap();
    std::fs::write(dir.join(format!("{name}-cert.pem")), cert.pem()).unwrap();
    std::fs::write(dir.join(format!("{name}-key.pem")), key.serialize_pem()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_fleet_serves_rollouts_and_refuses_plaintext_and_strangers() {
    let dir = Fleet::new_dir();
    make_certificates(&dir, "fleet");
    make_certificates(&dir, "stranger");
    make_mlp(&dir, "6,4", 0);
    let config = dir.join("nomad.yaml");
    std::fs::write(
        &config,
        format!(
            "tools:\n  - {{name: mlp, kind: mlp, source: {mlp}}}\n\
             tool_manager: {{heartbeat_interval_ms: 200}}\n\
             tls:\n  cert: {d}/fleet-cert.pem\n  key: {d}/fleet-key.pem\n  ca: {d}/fleet-ca.pem\n",
            mlp = dir.join("mlp").display(),
            d = dir.display()
        ),
    )
    .unwrap();
    let runs = dir.join("runs");
    let (_up, fleet) = start_fleet(
        up_command(&config, &runs, "tls").args(["--workers", "1"]),
        &runs.join("tls"),
        Some(&dir.join("up.stderr")),
        Duration::from_secs(60),
    )
    .await;
    let gateway = fleet["gateway"].as_str().unwrap();
    let scheduler = fleet["scheduler"].as_str().unwrap();

    // Rollouts over TLS end to end: head -> gateway -> scheduler -> worker (which registered
    // over TLS and is dialled back over TLS).
    let tasks_path = dir.join("tasks.jsonl");
    let results_path = dir.join("results.jsonl");
    let text: String = mlp_tasks(10).iter().map(|t| format!("{t}\n")).collect();
    std::fs::write(&tasks_path, text).unwrap();
    succeeded(
        clean("nomad")
            .arg("run")
            .arg("--config")
            .arg(&config)
            .arg("--tasks")
            .arg(&tasks_path)
            .arg("--out")
            .arg(&results_path)
            .arg("--fleet")
            .arg(runs.join("tls/fleet.json")),
    )
    .await;
    let results = std::fs::read_to_string(&results_path).unwrap();
    assert_eq!(
        results
            .lines()
            .filter(|l| l.contains(r#""status":"ok""#))
            .count(),
        10
    );

    let health = |ca: Option<&str>, address: &str| {
        let mut cmd = clean("nomad");
        cmd.args(["health", address]);
        if let Some(ca) = ca {
            cmd.env("NOMAD_TLS_CA", dir.join(ca));
        }
        async move { cmd.output().await.unwrap() }
    };
    for address in [gateway, scheduler] {
        assert!(health(Some("fleet-ca.pem"), address).await.status.success());
        // Plaintext to a TLS server: refused.
        let plain = health(None, address).await;
        assert!(!plain.status.success());
        // A client that trusts another CA: the server's certificate does not verify.
        let stranger = health(Some("stranger-ca.pem"), address).await;
        assert!(!stranger.status.success());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// With `tls.client_ca`, a server accepts only clients presenting a certificate that CA signed:
/// one from another CA, or none, is refused at the handshake.
#[tokio::test]
async fn mutual_tls_refuses_clients_without_the_fleets_certificate() {
    let dir = Fleet::new_dir();
    make_certificates(&dir, "fleet");
    make_certificates(&dir, "stranger");
    let config = dir.join("nomad.yaml");
    let d = dir.display();
    std::fs::write(
        &config,
        format!(
            "tls:\n  cert: {d}/fleet-cert.pem\n  key: {d}/fleet-key.pem\n  ca: {d}/fleet-ca.pem\n  \
             client_ca: {d}/fleet-ca.pem\n"
        ),
    )
    .unwrap();
    let mut command = clean("nomad-scheduler");
    command.arg("--config").arg(&config);
    let (_scheduler, address) = nomad_integration_tests::process::listening(
        command,
        "127.0.0.1:0",
        &dir,
        "scheduler",
        false,
    )
    .await;
    let health = |identity: Option<&str>| {
        let mut cmd = clean("nomad");
        cmd.args(["health", &address])
            .env("NOMAD_TLS_CA", dir.join("fleet-ca.pem"));
        if let Some(name) = identity {
            cmd.env("NOMAD_TLS_CERT", dir.join(format!("{name}-cert.pem")))
                .env("NOMAD_TLS_KEY", dir.join(format!("{name}-key.pem")))
                .env("NOMAD_TLS_CLIENT_CA", dir.join("fleet-ca.pem"));
        }
        async move { cmd.output().await.unwrap() }
    };
    let fleet = health(Some("fleet")).await;
    assert!(
        fleet.status.success(),
        "{}",
        String::from_utf8_lossy(&fleet.stderr)
    );
    for identity in [Some("stranger"), None] {
        let refused = health(identity).await;
        assert!(
            !refused.status.success(),
            "{identity:?} got through: {}",
            String::from_utf8_lossy(&refused.stderr)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn half_a_tls_config_is_refused_with_what_is_missing() {
    let dir = Fleet::new_dir();
    make_certificates(&dir, "fleet");
    let config = dir.join("nomad.yaml");
    std::fs::write(
        &config,
        format!("tls:\n  cert: {}/fleet-cert.pem\n", dir.display()),
    )
    .unwrap();
    refused_saying(
        clean("nomad-scheduler")
            .arg("--config")
            .arg(&config)
            .args(["--listen", "127.0.0.1:0"]),
        &["tls.cert is set but tls.key is not"],
    )
    .await;
    let _ = std::fs::remove_dir_all(&dir);
}

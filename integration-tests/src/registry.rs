//! A real OCI registry on loopback (Debian's `docker-registry`, the CNCF distribution registry),
//! and the third-party `oras` Python client (from PyPI, in .venv-test) pushing and pulling
//! artifacts in it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::succeeded_blocking;

pub struct Registry {
    /// host:port, as an `oras://` source names it.
    pub addr: String,
    dir: PathBuf,
    child: Option<Child>,
}

/// The registry binary, or a panic saying how to install it (scripts/test installs it as root).
fn binary() -> PathBuf {
    for dir in std::env::var("PATH").unwrap_or_default().split(':') {
        let candidate = Path::new(dir).join("docker-registry");
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!(
        "docker-registry is not installed: `apt-get install docker-registry` (scripts/test does as root)"
    );
}

impl Registry {
    /// Starts a registry storing under `dir`; with `htpasswd`, every request must carry one of
    /// its users (basic auth).
    pub fn start(dir: &Path, htpasswd: Option<&str>) -> Registry {
        Self::start_on(dir, &dir.join("storage"), htpasswd)
    }

    /// Another registry serving the same storage as this one, on an address of its own (e.g.
    /// one that requires a login beside an open one that a client without login support
    /// pushes to).
    pub fn beside(&self, dir: &Path, htpasswd: Option<&str>) -> Registry {
        Self::start_on(dir, &self.dir.join("storage"), htpasswd)
    }

    fn start_on(dir: &Path, storage: &Path, htpasswd: Option<&str>) -> Registry {
        std::fs::create_dir_all(dir).unwrap();
        let port = crate::free_port();
        let auth = match htpasswd {
            Some(lines) => {
                let file = dir.join("htpasswd");
                std::fs::write(&file, lines).unwrap();
                format!(
                    "auth:\n  htpasswd:\n    realm: nomad-test\n    path: {}\n",
                    file.display()
                )
            }
            None => String::new(),
        };
        let config = dir.join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
                 http:\n  addr: 127.0.0.1:{port}\n{auth}",
                storage.display()
            ),
        )
        .unwrap();
        let mut registry = Registry {
            addr: format!("127.0.0.1:{port}"),
            dir: dir.to_owned(),
            child: None,
        };
        registry.run(&config);
        registry
    }

    fn run(&mut self, config: &Path) {
        let log = std::fs::File::create(self.dir.join("registry.log")).unwrap();
        let child = Command::new(binary())
            .arg("serve")
            .arg(config)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(&self.addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "docker-registry did not listen in 30 s: {}",
                std::fs::read_to_string(self.dir.join("registry.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the registry (its storage stays, for [`Registry::restart`]).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn restart(&mut self) {
        self.stop();
        self.run(&self.dir.join("config.yml"));
    }

    /// An htpasswd line for `user` with `password` (bcrypt, by Python's bcrypt package).
    pub fn htpasswd_line(user: &str, password: &str) -> String {
        let output = succeeded_blocking(python_c("import sys, bcrypt\nprint(sys.argv[1] + ':' + bcrypt.hashpw(sys.argv[2].encode(), bcrypt.gensalt()).decode())")
            .args([user, password]));
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Pushes the top-level entries of `model` (each file a layer, each directory a tar.gz
    /// layer) to `target` (`repository:tag`) with oras-py, and returns the manifest's digest.
    pub fn oras_push(&self, model: &Path, target: &str) -> String {
        let mut files: Vec<String> = std::fs::read_dir(model)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| !name.starts_with('.'))
            .collect();
        files.sort();
        let script = "import json, sys\n\
            import oras.client\n\
            target, files = sys.argv[1], sys.argv[2:]\n\
            client = oras.client.OrasClient(insecure=True)\n\
            response = client.push(target=target, files=files)\n\
            response.raise_for_status()\n\
            print(response.headers['Docker-Content-Digest'])\n";
        let output = succeeded_blocking(
            python_c(script)
                .arg(format!("{}/{target}", self.addr))
                .args(&files)
                .current_dir(model),
        );
        let digest = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        assert!(
            digest.starts_with("sha256:"),
            "oras push {target} printed {digest:?}"
        );
        assert_eq!(self.digest(target), digest);
        digest
    }

    /// The digest `target` (`repository:tag`) names, asked of the registry over its HTTP API.
    pub fn digest(&self, target: &str) -> String {
        let (repository, tag) = target.rsplit_once(':').unwrap();
        let script = "import sys, requests\n\
            r = requests.head(sys.argv[1], headers={'Accept': 'application/vnd.oci.image.manifest.v1+json'})\n\
            r.raise_for_status()\n\
            print(r.headers['Docker-Content-Digest'])\n";
        let output = succeeded_blocking(python_c(script).arg(format!(
            "http://{}/v2/{repository}/manifests/{tag}",
            self.addr
        )));
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// Pulls `reference` (`repository:tag` or `repository@digest`) with oras-py into `into`.
    pub fn oras_pull(&self, reference: &str, into: &Path) {
        std::fs::create_dir_all(into).unwrap();
        let script = "import sys\nimport oras.client\n\
            oras.client.OrasClient(insecure=True).pull(target=sys.argv[1], outdir=sys.argv[2])\n";
        succeeded_blocking(
            python_c(script)
                .arg(format!("{}/{reference}", self.addr))
                .arg(into),
        );
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The test environment's Python running `script` (`python -c`), its arguments to follow.
fn python_c(script: &str) -> Command {
    let mut command = Command::new(crate::peers::python_sdk());
    command.arg("-c").arg(script);
    command
}

//! A stand-in for the Hugging Face Hub (`python/hub_double.py`: the Hub's own routes and
//! headers) serving model directories as `org/name` repositories, and the Hub's own Python
//! library (`huggingface_hub`, in .venv-test) reading the cache Nomad wrote.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct HubDouble {
    /// `http://127.0.0.1:PORT`, as HF_ENDPOINT takes it.
    pub endpoint: String,
    /// One line per request served.
    pub log: PathBuf,
    child: Child,
}

impl HubDouble {
    /// Serves `root/<org>/<name>/` as the repository `org/name`.
    pub fn start(root: &Path, dir: &Path) -> HubDouble {
        let port_file = dir.join("hub.port");
        let log = dir.join("hub.log");
        let child = Command::new(crate::peers::python_sdk())
            .arg(crate::peers::script("hub_double.py"))
            .arg("--root")
            .arg(root)
            .arg("--port-file")
            .arg(&port_file)
            .arg("--log")
            .arg(&log)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !port_file.is_file() {
            assert!(
                Instant::now() < deadline,
                "the Hub double did not start in 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let port = std::fs::read_to_string(&port_file).unwrap();
        HubDouble {
            endpoint: format!("http://127.0.0.1:{}", port.trim()),
            log,
            child,
        }
    }

    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Requests served so far.
    pub fn requests(&self) -> usize {
        std::fs::read_to_string(&self.log)
            .map(|t| t.lines().count())
            .unwrap_or(0)
    }
}

impl Drop for HubDouble {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What `huggingface_hub` reads from the cache at `cache` for `repo`: the commit `main` names,
/// the snapshot directory `snapshot_download(local_files_only=True)` gives, and the files.
pub fn read_with_huggingface_hub(cache: &Path, repo: &str) -> serde_json::Value {
    let script = "import json, sys\n\
        from huggingface_hub import scan_cache_dir, snapshot_download\n\
        cache, repo = sys.argv[1], sys.argv[2]\n\
        found = [r for r in scan_cache_dir(cache).repos if r.repo_id == repo]\n\
        revisions = found[0].revisions if found else []\n\
        print(json.dumps({\n\
            'refs': {ref: r.commit_hash for r in revisions for ref in r.refs},\n\
            'files': sorted(f.file_name for r in revisions for f in r.files),\n\
            'snapshot': snapshot_download(repo, cache_dir=cache, local_files_only=True),\n\
        }))\n";
    let output = Command::new(crate::peers::python_sdk())
        .arg("-c")
        .arg(script)
        .arg(cache)
        .arg(repo)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "huggingface_hub could not read {}: {}",
        cache.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

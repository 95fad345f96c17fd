//! The encoder and decoder test models (`python/make_encoders.py`, `python/make_decoders.py`)
//! and the reference libraries that make them and compute what they should answer
//! (sentence-transformers, transformers, torch, gguf, pinned), built once into the test cache.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::model_host::{cache_dir, python312, uv};

/// The reference libraries, pinned.
const REFERENCE: &[&str] = &[
    "sentence-transformers==6.3.0",
    "transformers==5.25.0",
    "torch==2.15.0",
    // transformers reads GGUF files with these (the decoder tests' reference).
    "gguf==0.19.0",
    "accelerate==1.16.0",
];

fn run(command: &mut std::process::Command, what: &str) {
    let output = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// An environment with the reference libraries, built once into the test cache.
pub fn reference_python() -> PathBuf {
    let dir = cache_dir().join(format!(
        "reference-env-{}",
        REFERENCE.join("-").replace(['=', '.'], "_")
    ));
    let python = dir.join("bin/python");
    if dir.join(".ready").is_file() {
        return python;
    }
    let _ = std::fs::remove_dir_all(&dir);
    match uv() {
        Some(uv) => {
            run(
                std::process::Command::new(&uv)
                    .args(["venv", "--quiet", "--python"])
                    .arg(python312())
                    .arg(&dir),
                "uv venv",
            );
            run(
                std::process::Command::new(&uv)
                    .args(["pip", "install", "--quiet", "--python"])
                    .arg(&python)
                    .args(REFERENCE),
                "installing the reference libraries",
            );
        }
        None => {
            run(
                std::process::Command::new(python312())
                    .args(["-m", "venv"])
                    .arg(&dir),
                "python -m venv",
            );
            run(
                std::process::Command::new(&python)
                    .args(["-m", "pip", "install", "--quiet"])
                    .args(REFERENCE),
                "installing the reference libraries",
            );
        }
    }
    std::fs::write(dir.join(".ready"), "").unwrap();
    python
}

/// The encoder test models and their references, made once per version of the script.
pub fn cases() -> (PathBuf, Vec<Value>) {
    made_by(
        "make_encoders.py",
        &crate::fleet::models_dir().join("all-minilm-l6-v2"),
    )
}

/// The decoder test models (GGUF files) and their references, made once per version of the
/// script.
pub fn decoder_cases() -> (PathBuf, Vec<Value>) {
    made_by(
        "make_decoders.py",
        &crate::fleet::models_dir().join("smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"),
    )
}

/// What `script` makes into a directory of the test cache, and the `cases.json` it writes.
fn made_by(script: &str, input: &Path) -> (PathBuf, Vec<Value>) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(script);
    let text = std::fs::read(&path).unwrap();
    let hash = text.iter().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100000001b3)
    });
    let stem = script.trim_start_matches("make_").trim_end_matches(".py");
    let out = cache_dir().join(format!("{stem}-{hash:016x}"));
    if !out.join("cases.json").is_file() {
        let _ = std::fs::remove_dir_all(&out);
        run(
            std::process::Command::new(reference_python())
                .arg(&path)
                .arg(&out)
                .arg(input)
                .env("HF_HUB_OFFLINE", "1"),
            script,
        );
    }
    let cases =
        serde_json::from_str(&std::fs::read_to_string(out.join("cases.json")).unwrap()).unwrap();
    (out, cases)
}

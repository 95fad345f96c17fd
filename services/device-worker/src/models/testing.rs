//! Helpers the models' tests share.

use std::path::{Path, PathBuf};

use candle_core::Device;

use crate::models::model::{Answer, Input, Output, Value};

/// The vector of an answer.
pub fn vector_of(answer: &Answer) -> Vec<f32> {
    match answer {
        Answer::Output(Output::Tensor { values, .. }) => values.clone(),
        other => panic!("expected a vector, got {other:?}"),
    }
}

/// A text request with options (a JSON object's text, or empty).
pub fn text_input(text: &str, options: &str) -> Input {
    Input {
        value: Value::Text(text.into()),
        options: options.into(),
    }
}

/// The fetched default models (`scripts/fetch-models`), for tests that need them.
pub fn test_models_dir() -> PathBuf {
    let dir = std::env::var_os("NOMAD_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models"));
    assert!(
        dir.join("all-minilm-l6-v2/model.safetensors").is_file(),
        "the default models are missing from {}: run scripts/fetch-models first",
        dir.display()
    );
    dir
}

/// The device tests run models on: `NOMAD_TEST_DEVICE` (e.g. `cuda:0`), CPU by default.
pub fn test_device() -> Device {
    let spec: crate::device::DeviceSpec = std::env::var("NOMAD_TEST_DEVICE")
        .unwrap_or_else(|_| "cpu".into())
        .parse()
        .expect("NOMAD_TEST_DEVICE");
    spec.open().expect("opening NOMAD_TEST_DEVICE")
}

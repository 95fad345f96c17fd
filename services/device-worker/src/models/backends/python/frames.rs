//! What the frames between the worker and a model host hold (JSON objects; the framing is the
//! codec's). Arguments and outputs pass through as raw JSON: the worker checks that they are
//! JSON and never rebuilds them.

use std::collections::HashMap;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use super::Description;
use crate::models::model::{Answer, Output};

/// A request to the host.
#[derive(Debug, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request<'a> {
    Load {
        entry: &'a str,
        target: &'a str,
        source: Option<String>,
        tool_kwargs: Option<Box<RawValue>>,
        instantiate: bool,
        device: &'a str,
    },
    Batch {
        items: &'a [Box<RawValue>],
        trace: HashMap<String, String>,
    },
    To {
        device: &'a str,
    },
    ClearCache,
}

pub fn encode(request: &Request<'_>) -> Bytes {
    Bytes::from(serde_json::to_vec(request).expect("a request serializes"))
}

/// A factory's keyword arguments, when there are any.
pub fn kwargs(json: &str) -> Option<Box<RawValue>> {
    if json.trim().is_empty() {
        return None;
    }
    // The scheduler checked them when it read its config; a broken one is sent as none.
    serde_json::from_str(json).ok()
}

/// The host's answer: what was asked for, or why it failed.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Reply<T> {
    Ok(T),
    Error(HostFailure),
}

/// An answer as the caller wants it: `Ok(Ok(value))`, `Ok(Err(failure))` (the host reported a
/// failure), or `Err` (the frame was not an answer).
pub type HostReply<T> = Result<T, HostFailure>;

pub fn decode<T: serde::de::DeserializeOwned>(frame: &[u8]) -> Result<HostReply<T>, String> {
    match serde_json::from_slice::<Reply<T>>(frame) {
        Ok(Reply::Ok(value)) => Ok(Ok(value)),
        Ok(Reply::Error(failure)) => Ok(Err(failure)),
        Err(e) => Err(format!("the model host's answer is malformed: {e}")),
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct HostFailure {
    pub kind: FailureKind,
    pub message: String,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    OutOfMemory,
    Failed,
    BadRequest,
}

/// What loading (or describing) a model reports.
#[derive(Debug, Deserialize)]
pub struct Described {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub input_schema: Option<Box<RawValue>>,
    pub output_schema: Option<Box<RawValue>>,
    #[serde(default)]
    pub batch_size: u32,
    #[serde(default)]
    pub bytes: u64,
}

impl Described {
    pub fn into_description(self) -> Description {
        let text =
            |schema: Option<Box<RawValue>>| schema.map(|s| s.get().to_owned()).unwrap_or_default();
        Description {
            description: self.description,
            input_schema: text(self.input_schema),
            output_schema: text(self.output_schema),
            batch_size: self.batch_size,
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct Batch {
    pub results: Vec<ItemReply>,
}

/// One item's outcome.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ItemReply {
    Output(Box<RawValue>),
    /// Its arguments failed the model's validation.
    Invalid(String),
    /// The model raised on it alone.
    Error(String),
}

impl ItemReply {
    pub fn into_answer(self, index: usize) -> Answer {
        match self {
            ItemReply::Output(raw) => Answer::Output(Output::Json(raw.get().to_owned())),
            ItemReply::Invalid(message) => crate::models::batch::invalid(index, message),
            ItemReply::Error(message) => Answer::Failed(format!("request {index}: {message}")),
        }
    }
}

/// An answer with nothing in it.
#[derive(Debug, Deserialize)]
pub struct Empty {}

#[derive(Debug, Deserialize)]
pub struct Released {
    pub released_bytes: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_encode_as_the_host_reads_them() {
        let items: Vec<Box<RawValue>> =
            vec![RawValue::from_string(r#"{"x": [1,2]}"#.into()).unwrap()];
        let frame = encode(&Request::Batch {
            items: &items,
            trace: HashMap::new(),
        });
        assert_eq!(
            std::str::from_utf8(&frame).unwrap(),
            r#"{"op":"batch","items":[{"x": [1,2]}],"trace":{}}"#
        );
        assert_eq!(
            &encode(&Request::ClearCache)[..],
            br#"{"op":"clear_cache"}"#
        );
    }

    #[test]
    fn answers_decode_into_outputs_refusals_and_failures() {
        let batch = decode::<Batch>(
            br#"{"ok":{"results":[{"output":{"y":[2.5]}},{"invalid":"x: required"},{"error":"ValueError: no"}]}}"#,
        )
        .unwrap()
        .unwrap();
        let answers: Vec<Answer> = batch
            .results
            .into_iter()
            .enumerate()
            .map(|(i, r)| r.into_answer(i))
            .collect();
        assert_eq!(
            answers,
            [
                Answer::Output(Output::Json(r#"{"y":[2.5]}"#.into())),
                Answer::Invalid("request 1: x: required".into()),
                Answer::Failed("request 2: ValueError: no".into()),
            ]
        );
        let failure = decode::<Batch>(
            br#"{"error":{"kind":"out_of_memory","message":"CUDA out of memory"}}"#,
        )
        .unwrap()
        .unwrap_err();
        assert_eq!(failure.kind, FailureKind::OutOfMemory);
        assert!(decode::<Batch>(b"[1,2]").unwrap_err().contains("malformed"));
    }
}

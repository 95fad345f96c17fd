//! The bridge between sandboxed code and the gateway: length-prefixed frames (4-byte big-endian
//! length, then the body) over a socketpair the sandbox inherits as a file descriptor. No TCP
//! listener exists for sandboxed code to find.
//!
//! In order: the sandbox's init reports what isolation holds (JSON, [`super::init::Report`]);
//! the gateway sends the run ([`encode_run`]: length-prefixed text fields, so the runner decodes
//! it without importing `json`); the runner says `ready` (once its imports are done) and then
//! sends requests, each with an `id` that its JSON response repeats: `list_servers`,
//! `list_tools {server}`, `call_tool {server, tool, arguments}`. Its last message is
//! `done {result | error}`.

use crate::tool_error::ToolError;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Largest frame either side accepts.
pub const MAX_FRAME: usize = 16 << 20;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FrameError {
    #[error(
        "bridge frame of {len} bytes exceeds the {limit}-byte limit (a tool call may send at \
         most sandbox.max_call_bytes)"
    )]
    TooLarge { len: usize, limit: usize },
    #[error("bridge frame is not JSON: {0}")]
    NotJson(String),
}

/// Encodes one frame.
pub fn encode(value: &impl Serialize) -> Result<Vec<u8>, FrameError> {
    let body = serde_json::to_vec(value).map_err(|e| FrameError::NotJson(e.to_string()))?;
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge {
            len: body.len(),
            limit: MAX_FRAME,
        });
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// The run frame: `mode`, `filename`, `source`, then each environment name and value, every field
/// a 4-byte big-endian length and UTF-8 text.
pub fn encode_run<'a>(fields: impl IntoIterator<Item = &'a str>) -> Result<Vec<u8>, FrameError> {
    let mut frame = vec![0u8; 4];
    for field in fields {
        frame.extend_from_slice(&(field.len() as u32).to_be_bytes());
        frame.extend_from_slice(field.as_bytes());
    }
    let body = frame.len() - 4;
    if body > MAX_FRAME {
        return Err(FrameError::TooLarge {
            len: body,
            limit: MAX_FRAME,
        });
    }
    frame[..4].copy_from_slice(&(body as u32).to_be_bytes());
    Ok(frame)
}

/// Room a decoder keeps between frames.
const KEPT_CAPACITY: usize = 128 << 10;

/// Incremental decoder: feed bytes, take complete frames of at most `limit` bytes.
#[derive(Debug)]
pub struct Decoder {
    buffer: Vec<u8>,
    limit: usize,
}

impl Default for Decoder {
    fn default() -> Self {
        Self::with_limit(MAX_FRAME)
    }
}

impl Decoder {
    /// A decoder that refuses a frame declaring more than `limit` bytes (at most `MAX_FRAME`),
    /// before any of its body is buffered: what one run may make the gateway hold and parse.
    pub fn with_limit(limit: usize) -> Self {
        Self {
            buffer: Vec::new(),
            limit: limit.min(MAX_FRAME),
        }
    }

    pub fn push(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
    }

    /// Bytes held, of frames not yet taken.
    pub fn buffered(&self) -> usize {
        self.buffer.len()
    }

    /// The length of the next frame's body once all of it is buffered (`None` before): what
    /// taking it will cost is known before it is parsed. A length over the limit is an error.
    pub fn ready_len(&self) -> Result<Option<usize>, FrameError> {
        if self.buffer.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_be_bytes(self.buffer[..4].try_into().expect("4 bytes")) as usize;
        if len > self.limit {
            return Err(FrameError::TooLarge {
                len,
                limit: self.limit,
            });
        }
        Ok((self.buffer.len() >= 4 + len).then_some(len))
    }

    /// The next complete message, if one is buffered.
    pub fn next_frame(&mut self) -> Result<Option<Message>, FrameError> {
        self.next_as()
    }

    /// The next complete frame as a `T`, if one is buffered. A length over the limit is an
    /// error before any of its body is buffered, so a hostile peer cannot make the gateway
    /// allocate it.
    pub fn next_as<T: DeserializeOwned>(&mut self) -> Result<Option<T>, FrameError> {
        let Some(len) = self.ready_len()? else {
            return Ok(None);
        };
        // Parsed where it lies: no copy of the body.
        let parsed = serde_json::from_slice(&self.buffer[4..4 + len])
            .map(Some)
            .map_err(|e| FrameError::NotJson(e.to_string()));
        self.buffer.drain(..4 + len);
        // A large frame's room is not kept for the rest of the run.
        if self.buffer.capacity() > KEPT_CAPACITY && self.buffer.len() < self.buffer.capacity() / 4
        {
            self.buffer.shrink_to(self.buffer.len().max(KEPT_CAPACITY));
        }
        parsed
    }
}

/// A message from the runner.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Message {
    #[serde(default)]
    pub id: Option<u64>,
    pub method: String,
    #[serde(default)]
    pub params: Value,
}

/// The gateway's answer to a request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Response {
    pub id: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// Why the request failed: a code (what to do next) and a message (what was wrong), raised
    /// in the run as `ToolError` with `.code` and the message.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ToolError>,
}

impl Response {
    pub fn ok(id: u64, result: Value) -> Self {
        Self {
            id,
            result: Some(result),
            error: None,
        }
    }

    pub fn error(id: u64, error: ToolError) -> Self {
        Self {
            id,
            result: None,
            error: Some(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn frames_round_trip_across_arbitrary_splits() {
        let mut bytes =
            encode(&json!({"id": 1, "method": "call_tool", "params": {"tool": "x"}})).unwrap();
        bytes.extend(encode(&json!({"method": "done", "params": {"result": [1, 2]}})).unwrap());
        for split in 0..bytes.len() {
            let mut d = Decoder::default();
            d.push(&bytes[..split]);
            let mut got = vec![];
            while let Some(m) = d.next_frame().unwrap() {
                got.push(m);
            }
            d.push(&bytes[split..]);
            while let Some(m) = d.next_frame().unwrap() {
                got.push(m);
            }
            assert_eq!(got.len(), 2, "split at {split}");
            assert_eq!(got[0].id, Some(1));
            assert_eq!(got[1].method, "done");
        }
    }

    #[test]
    fn the_run_frame_is_length_prefixed_fields() {
        let frame = encode_run(["code", "<code>", "RESULT = 1", "K", "é"]).unwrap();
        let body = &frame[4..];
        assert_eq!(
            u32::from_be_bytes(frame[..4].try_into().unwrap()) as usize,
            body.len()
        );
        let mut fields = vec![];
        let mut i = 0;
        while i < body.len() {
            let n = u32::from_be_bytes(body[i..i + 4].try_into().unwrap()) as usize;
            fields.push(std::str::from_utf8(&body[i + 4..i + 4 + n]).unwrap());
            i += 4 + n;
        }
        assert_eq!(fields, ["code", "<code>", "RESULT = 1", "K", "é"]);
    }

    #[test]
    fn an_oversized_length_is_refused_before_its_body_arrives() {
        let mut d = Decoder::default();
        d.push(&((MAX_FRAME + 1) as u32).to_be_bytes());
        assert_eq!(
            d.next_frame(),
            Err(FrameError::TooLarge {
                len: MAX_FRAME + 1,
                limit: MAX_FRAME
            })
        );
        // A run's own limit, below the bridge's.
        let mut d = Decoder::with_limit(1000);
        d.push(&1001u32.to_be_bytes());
        assert_eq!(
            d.next_frame(),
            Err(FrameError::TooLarge {
                len: 1001,
                limit: 1000
            })
        );
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut d = Decoder::default();
        d.push(&3u32.to_be_bytes());
        d.push(b"{x}");
        assert!(matches!(d.next_frame(), Err(FrameError::NotJson(_))));
        let mut d = Decoder::default();
        d.push(&2u32.to_be_bytes());
        d.push(b"[]");
        assert!(
            matches!(d.next_frame(), Err(FrameError::NotJson(_))),
            "a frame must be a message object"
        );
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Any bytes, in any chunks: frames, `None` (wait for more) or an error; never a
            /// panic, and an error says what was wrong.
            #[test]
            fn arbitrary_bytes_never_panic(chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..64), 0..8)) {
                let mut d = Decoder::default();
                'feed: for chunk in &chunks {
                    d.push(chunk);
                    loop {
                        match d.next_frame() {
                            Ok(Some(_)) => {}
                            Ok(None) => break,
                            Err(e) => {
                                prop_assert!(e.to_string().starts_with("bridge frame"));
                                break 'feed;
                            }
                        }
                    }
                }
            }

            /// Any message survives encoding and decoding, split anywhere.
            #[test]
            fn messages_round_trip(id in proptest::option::of(any::<u64>()), method in ".{0,12}", text in ".{0,40}", split in 0usize..200) {
                let message = json!({"id": id, "method": method, "params": {"text": text}});
                let bytes = encode(&message).unwrap();
                let split = split.min(bytes.len());
                let mut d = Decoder::default();
                d.push(&bytes[..split]);
                let early = d.next_frame().unwrap();
                d.push(&bytes[split..]);
                let frame = early.or_else(|| d.next_frame().unwrap()).unwrap();
                prop_assert_eq!(frame.id, id);
                prop_assert_eq!(frame.method, method);
                prop_assert_eq!(&frame.params["text"], &json!(text));
            }
        }
    }
}

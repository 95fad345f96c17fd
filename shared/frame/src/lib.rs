//! The one frame format between Nomad's processes, on every socket that frames: a sandbox's
//! bridge, its init's spec and report, the fork server's control socket, and the device worker's
//! model host. A frame is a 4-byte big-endian length, then that many bytes of body (JSON, but for
//! [`encode_fields`]'s frame).
//!
//! Python's side is [`PYTHON`] (`nomad_frame.py` beside this crate), shipped by the gateway beside
//! its runner and by the worker beside its model host. Each protocol declares its limit once, in
//! Rust, and hands it to the Python end in its environment ([`limit_variable`]), so the two ends
//! cannot disagree.

#[cfg(feature = "codec")]
mod codec;

#[cfg(feature = "codec")]
pub use codec::Codec;

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Bytes of a frame's length.
pub const HEADER: usize = 4;

/// The Python module's file name, and its source.
pub const PYTHON_FILE: &str = "nomad_frame.py";
pub const PYTHON: &str = include_str!("../nomad_frame.py");

/// The environment variable that tells a Python end `protocol`'s frame limit, read there with
/// `nomad_frame.limit(protocol)`.
pub fn limit_variable(protocol: &str) -> String {
    format!("NOMAD_{}_MAX_FRAME", protocol.to_ascii_uppercase())
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FrameError {
    #[error("frame of {len} bytes exceeds the {limit}-byte limit")]
    TooLarge { len: usize, limit: usize },
    #[error("frame is not JSON: {0}")]
    NotJson(String),
}

/// The body length a header declares, refused over `limit` before any of the body is read.
pub fn length(header: [u8; HEADER], limit: usize) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(header) as usize;
    if len > limit {
        return Err(FrameError::TooLarge { len, limit });
    }
    Ok(len)
}

/// Whether a body of `len` bytes may be sent under `limit` (and at all: past u32 it cannot be
/// framed whatever the limit).
fn fits(len: usize, limit: usize) -> Result<(), FrameError> {
    if len > limit.min(u32::MAX as usize) {
        return Err(FrameError::TooLarge { len, limit });
    }
    Ok(())
}

/// `body` as one frame.
pub fn frame(body: &[u8], limit: usize) -> Result<Vec<u8>, FrameError> {
    fits(body.len(), limit)?;
    let mut frame = Vec::with_capacity(HEADER + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(body);
    Ok(frame)
}

/// One JSON frame.
pub fn encode(value: &impl Serialize, limit: usize) -> Result<Vec<u8>, FrameError> {
    let body = serde_json::to_vec(value).map_err(|e| FrameError::NotJson(e.to_string()))?;
    frame(&body, limit)
}

/// A frame of text fields, each a 4-byte big-endian length and UTF-8 text: read in Python with
/// `nomad_frame.fields`, which imports nothing (a sandbox run's first frame, read before `json`
/// is imported).
pub fn encode_fields<'a>(
    fields: impl IntoIterator<Item = &'a str>,
    limit: usize,
) -> Result<Vec<u8>, FrameError> {
    let mut body = Vec::new();
    for field in fields {
        body.extend_from_slice(&(field.len() as u32).to_be_bytes());
        body.extend_from_slice(field.as_bytes());
    }
    frame(&body, limit)
}

/// Room a decoder keeps between frames.
const KEPT_CAPACITY: usize = 128 << 10;

/// Incremental decoder: feed bytes, take complete frames of at most its limit.
#[derive(Debug)]
pub struct Decoder {
    buffer: Vec<u8>,
    limit: usize,
}

impl Decoder {
    /// A decoder that refuses a frame declaring more than `limit` bytes before any of its body
    /// is buffered: what one peer may make this side hold and parse.
    pub fn new(limit: usize) -> Self {
        Self {
            buffer: Vec::new(),
            limit,
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
        let Some(header) = self.buffer.first_chunk::<HEADER>() else {
            return Ok(None);
        };
        let len = length(*header, self.limit)?;
        Ok((self.buffer.len() >= HEADER + len).then_some(len))
    }

    /// The next complete frame as a `T`, if one is buffered.
    pub fn next_as<T: DeserializeOwned>(&mut self) -> Result<Option<T>, FrameError> {
        let Some(len) = self.ready_len()? else {
            return Ok(None);
        };
        // Parsed where it lies: no copy of the body.
        let parsed = serde_json::from_slice(&self.buffer[HEADER..HEADER + len])
            .map(Some)
            .map_err(|e| FrameError::NotJson(e.to_string()));
        self.buffer.drain(..HEADER + len);
        // A large frame's room is not kept for the rest of the stream.
        if self.buffer.capacity() > KEPT_CAPACITY && self.buffer.len() < self.buffer.capacity() / 4
        {
            self.buffer.shrink_to(self.buffer.len().max(KEPT_CAPACITY));
        }
        parsed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    const LIMIT: usize = 16 << 20;

    #[test]
    fn frames_round_trip_across_arbitrary_splits() {
        let mut bytes = encode(
            &json!({"id": 1, "method": "call_tool", "params": {"tool": "x"}}),
            LIMIT,
        )
        .unwrap();
        bytes.extend(
            encode(
                &json!({"method": "done", "params": {"result": [1, 2]}}),
                LIMIT,
            )
            .unwrap(),
        );
        for split in 0..bytes.len() {
            let mut d = Decoder::new(LIMIT);
            d.push(&bytes[..split]);
            let mut got: Vec<Value> = vec![];
            while let Some(m) = d.next_as().unwrap() {
                got.push(m);
            }
            d.push(&bytes[split..]);
            while let Some(m) = d.next_as().unwrap() {
                got.push(m);
            }
            assert_eq!(got.len(), 2, "split at {split}");
            assert_eq!(got[0]["id"], 1);
            assert_eq!(got[1]["method"], "done");
        }
    }

    #[test]
    fn a_fields_frame_is_length_prefixed_fields() {
        let frame = encode_fields(["code", "<code>", "RESULT = 1", "K", "é"], LIMIT).unwrap();
        // Read by hand, as the format says, not by this crate's reader.
        let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize;
        let body = &frame[4..];
        assert_eq!(be(&frame), body.len());
        let mut fields = vec![];
        let mut i = 0;
        while i < body.len() {
            let n = be(&body[i..]);
            fields.push(std::str::from_utf8(&body[i + 4..i + 4 + n]).unwrap());
            i += 4 + n;
        }
        assert_eq!(fields, ["code", "<code>", "RESULT = 1", "K", "é"]);
    }

    #[test]
    fn an_oversized_length_is_refused_before_its_body_arrives() {
        let mut d = Decoder::new(1000);
        d.push(&1001u32.to_be_bytes());
        assert_eq!(
            d.next_as::<Value>(),
            Err(FrameError::TooLarge {
                len: 1001,
                limit: 1000
            })
        );
        assert_eq!(
            frame(&[0; 11], 10),
            Err(FrameError::TooLarge { len: 11, limit: 10 })
        );
        assert_eq!(
            FrameError::TooLarge { len: 11, limit: 10 }.to_string(),
            "frame of 11 bytes exceeds the 10-byte limit"
        );
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut d = Decoder::new(LIMIT);
        d.push(&3u32.to_be_bytes());
        d.push(b"{x}");
        assert!(matches!(d.next_as::<Value>(), Err(FrameError::NotJson(_))));
    }

    #[test]
    fn the_limit_variable_is_named_for_its_protocol() {
        assert_eq!(limit_variable("bridge"), "NOMAD_BRIDGE_MAX_FRAME");
        assert_eq!(limit_variable("host"), "NOMAD_HOST_MAX_FRAME");
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Any bytes, in any chunks: frames, `None` (wait for more) or an error; never a
            /// panic, and an error says what was wrong.
            #[test]
            fn arbitrary_bytes_never_panic(chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..64), 0..8)) {
                let mut d = Decoder::new(LIMIT);
                'feed: for chunk in &chunks {
                    d.push(chunk);
                    loop {
                        match d.next_as::<Value>() {
                            Ok(Some(_)) => {}
                            Ok(None) => break,
                            Err(e) => {
                                prop_assert!(e.to_string().starts_with("frame "));
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
                let bytes = encode(&message, LIMIT).unwrap();
                let split = split.min(bytes.len());
                let mut d = Decoder::new(LIMIT);
                d.push(&bytes[..split]);
                let early: Option<Value> = d.next_as().unwrap();
                d.push(&bytes[split..]);
                let frame = early.or_else(|| d.next_as().unwrap()).unwrap();
                prop_assert_eq!(frame, message);
            }
        }
    }
}

//! The one frame format between the gateway and its sandboxes, on every socket (a run's bridge,
//! the fork server's control socket, the init's spec and report): a 4-byte big-endian length,
//! then the body (JSON, but for the run frame; see [`encode_fields`]). The Python side's one
//! reader and writer are in `runner.py`.

use std::os::fd::{AsRawFd as _, BorrowedFd};

use serde::Serialize;
use serde::de::DeserializeOwned;

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

/// Encodes one JSON frame.
pub fn encode(value: &impl Serialize) -> Result<Vec<u8>, FrameError> {
    let body = serde_json::to_vec(value).map_err(|e| FrameError::NotJson(e.to_string()))?;
    with_length(body)
}

/// The run frame: text fields, each a 4-byte big-endian length and UTF-8 text (so the runner
/// decodes it without importing `json`).
pub fn encode_fields<'a>(fields: impl IntoIterator<Item = &'a str>) -> Result<Vec<u8>, FrameError> {
    let mut body = Vec::new();
    for field in fields {
        body.extend_from_slice(&(field.len() as u32).to_be_bytes());
        body.extend_from_slice(field.as_bytes());
    }
    with_length(body)
}

fn with_length(body: Vec<u8>) -> Result<Vec<u8>, FrameError> {
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

/// Reads one frame of at most `limit` bytes from `fd`, exactly (unbuffered: what follows is
/// someone else's); `None` at end of stream before a frame starts.
pub fn read_blocking(fd: BorrowedFd<'_>, limit: usize) -> std::io::Result<Option<Vec<u8>>> {
    let mut length = [0u8; 4];
    if !read_exact(fd, &mut length)? {
        return Ok(None);
    }
    let length = u32::from_be_bytes(length) as usize;
    let limit = limit.min(MAX_FRAME);
    if length > limit {
        return Err(std::io::Error::other(format!(
            "a frame of {length} bytes, more than the {limit} allowed"
        )));
    }
    let mut body = vec![0u8; length];
    if !read_exact(fd, &mut body)? {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some(body))
}

/// Fills `buffer`; `false` at end of stream before the first byte.
fn read_exact(fd: BorrowedFd<'_>, buffer: &mut [u8]) -> std::io::Result<bool> {
    let mut filled = 0;
    while filled < buffer.len() {
        match nix::unistd::read(fd, &mut buffer[filled..]) {
            Ok(0) if filled == 0 => return Ok(false),
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}

/// Writes `frame` to the socket `fd`, with `attached` (if any) passed along as SCM_RIGHTS on its
/// first byte.
pub fn send(
    fd: BorrowedFd<'_>,
    frame: &[u8],
    attached: Option<BorrowedFd<'_>>,
) -> std::io::Result<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
    let rights = attached.map(|a| [a.as_raw_fd()]);
    let mut sent = 0;
    let mut first = true;
    while sent < frame.len() {
        let control: Vec<ControlMessage<'_>> = match (&rights, first) {
            (Some(rights), true) => vec![ControlMessage::ScmRights(rights)],
            _ => Vec::new(),
        };
        match sendmsg::<()>(
            fd.as_raw_fd(),
            &[std::io::IoSlice::new(&frame[sent..])],
            &control,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(n) => {
                sent += n;
                first = false;
            }
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    #[test]
    fn frames_round_trip_across_arbitrary_splits() {
        let mut bytes =
            encode(&json!({"id": 1, "method": "call_tool", "params": {"tool": "x"}})).unwrap();
        bytes.extend(encode(&json!({"method": "done", "params": {"result": [1, 2]}})).unwrap());
        for split in 0..bytes.len() {
            let mut d = Decoder::default();
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
    fn the_run_frame_is_length_prefixed_fields() {
        let frame = encode_fields(["code", "<code>", "RESULT = 1", "K", "é"]).unwrap();
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
            d.next_as::<Value>(),
            Err(FrameError::TooLarge {
                len: MAX_FRAME + 1,
                limit: MAX_FRAME
            })
        );
        // A run's own limit, below the bridge's.
        let mut d = Decoder::with_limit(1000);
        d.push(&1001u32.to_be_bytes());
        assert_eq!(
            d.next_as::<Value>(),
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
        assert!(matches!(d.next_as::<Value>(), Err(FrameError::NotJson(_))));
    }

    #[test]
    fn a_blocking_read_takes_one_frame_exactly_and_a_descriptor_travels_with_a_frame() {
        use std::os::fd::AsFd as _;
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut both = encode(&json!({"first": true})).unwrap();
        both.extend(encode(&json!({"second": true})).unwrap());
        let (keep, _) = std::os::unix::net::UnixStream::pair().unwrap();
        send(a.as_fd(), &both, Some(keep.as_fd())).unwrap();
        let first = read_blocking(b.as_fd(), 1024).unwrap().unwrap();
        assert_eq!(first, br#"{"first":true}"#);
        let second = read_blocking(b.as_fd(), 1024).unwrap().unwrap();
        assert_eq!(second, br#"{"second":true}"#);
        drop(a);
        assert_eq!(read_blocking(b.as_fd(), 1024).unwrap(), None);
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        send(a.as_fd(), &encode(&vec![0u8; 600]).unwrap(), None).unwrap();
        let refused = read_blocking(b.as_fd(), 100).unwrap_err();
        assert!(
            refused.to_string().contains("more than the 100 allowed"),
            "{refused}"
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
                        match d.next_as::<Value>() {
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
                let early: Option<Value> = d.next_as().unwrap();
                d.push(&bytes[split..]);
                let frame = early.or_else(|| d.next_as().unwrap()).unwrap();
                prop_assert_eq!(frame, message);
            }
        }
    }
}

//! The sandbox's framed protocols (`nomad_frame`'s format) and their limits, each declared here
//! once and handed to the Python ends in their environment (see [`environment`]): the bridge (a
//! run and the gateway), the fork server's control socket, and the init's spec and report. Also
//! what the init and a forked run need below tokio: a blocking read of one frame, and a send
//! that carries a descriptor.

use std::os::fd::{AsRawFd as _, BorrowedFd};

pub use nomad_frame::{Decoder, FrameError};
use serde::Serialize;

/// The bridge's limit: the largest frame either side of a run's bridge accepts.
pub const MAX_FRAME: usize = 16 << 20;

/// The fork server's control socket: the run's spec (a few KiB) and requests.
pub const CONTROL_MAX_FRAME: usize = 1 << 20;

/// What the Python ends read their limits from (`nomad_frame.limit("bridge")`, `("control")`).
pub fn environment() -> [String; 2] {
    [
        format!("{}={MAX_FRAME}", nomad_frame::limit_variable("bridge")),
        format!(
            "{}={CONTROL_MAX_FRAME}",
            nomad_frame::limit_variable("control")
        ),
    ]
}

/// One bridge frame of JSON.
pub fn encode(value: &impl Serialize) -> Result<Vec<u8>, FrameError> {
    nomad_frame::encode(value, MAX_FRAME)
}

/// The run frame: text fields, decoded by the runner without importing `json`.
pub fn encode_fields<'a>(fields: impl IntoIterator<Item = &'a str>) -> Result<Vec<u8>, FrameError> {
    nomad_frame::encode_fields(fields, MAX_FRAME)
}

/// A decoder of a run's frames, at most `limit` bytes (never more than the bridge's).
pub fn decoder(limit: usize) -> Decoder {
    Decoder::new(limit.min(MAX_FRAME))
}

/// Reads one frame of at most `limit` bytes from `fd`, exactly (unbuffered: what follows is
/// someone else's); `None` at end of stream before a frame starts.
pub fn read_blocking(fd: BorrowedFd<'_>, limit: usize) -> std::io::Result<Option<Vec<u8>>> {
    let mut header = [0u8; nomad_frame::HEADER];
    if !read_exact(fd, &mut header)? {
        return Ok(None);
    }
    let length = nomad_frame::length(header, limit).map_err(std::io::Error::other)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
            refused.to_string().contains("exceeds the 100-byte limit"),
            "{refused}"
        );
    }

    #[test]
    fn the_python_ends_are_told_each_limit() {
        assert_eq!(
            environment(),
            [
                format!("NOMAD_BRIDGE_MAX_FRAME={}", 16 << 20),
                format!("NOMAD_CONTROL_MAX_FRAME={}", 1 << 20)
            ]
        );
    }
}

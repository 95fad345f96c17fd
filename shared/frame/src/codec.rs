//! The frame format as a tokio-util codec, for a peer an async task drives (`Framed`).

use bytes::{Buf as _, BufMut as _, Bytes, BytesMut};

use crate::{HEADER, fits, length};

/// Frames of at most `limit` bytes each way.
#[derive(Debug, Clone, Copy)]
pub struct Codec {
    limit: usize,
}

impl Codec {
    pub fn new(limit: usize) -> Self {
        Self { limit }
    }
}

impl tokio_util::codec::Decoder for Codec {
    type Item = BytesMut;
    type Error = std::io::Error;

    fn decode(&mut self, src: &mut BytesMut) -> std::io::Result<Option<BytesMut>> {
        let Some(header) = src.first_chunk::<HEADER>() else {
            return Ok(None);
        };
        let len = length(*header, self.limit).map_err(std::io::Error::other)?;
        if src.len() < HEADER + len {
            src.reserve(HEADER + len - src.len());
            return Ok(None);
        }
        src.advance(HEADER);
        Ok(Some(src.split_to(len)))
    }
}

impl tokio_util::codec::Encoder<Bytes> for Codec {
    type Error = std::io::Error;

    fn encode(&mut self, body: Bytes, dst: &mut BytesMut) -> std::io::Result<()> {
        fits(body.len(), self.limit).map_err(std::io::Error::other)?;
        dst.reserve(HEADER + body.len());
        dst.put_u32(body.len() as u32);
        dst.extend_from_slice(&body);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_util::codec::{Decoder as _, Encoder as _};

    #[test]
    fn the_codec_reads_what_the_encoder_writes_in_any_split_and_refuses_past_its_limit() {
        let mut codec = Codec::new(64);
        let mut wire = BytesMut::new();
        codec
            .encode(Bytes::from_static(b"{\"a\":1}"), &mut wire)
            .unwrap();
        codec.encode(Bytes::from_static(b"[]"), &mut wire).unwrap();
        // The format's bytes, written out: a 4-byte big-endian length, then the body.
        assert_eq!(&wire[..], b"\0\0\0\x07{\"a\":1}\0\0\0\x02[]");
        for split in 0..wire.len() {
            let mut src = BytesMut::from(&wire[..split]);
            let mut got = Vec::new();
            while let Some(body) = codec.decode(&mut src).unwrap() {
                got.push(body);
            }
            src.extend_from_slice(&wire[split..]);
            while let Some(body) = codec.decode(&mut src).unwrap() {
                got.push(body);
            }
            assert_eq!(got, [&b"{\"a\":1}"[..], b"[]"], "split at {split}");
        }
        let refused = codec
            .decode(&mut BytesMut::from(&65u32.to_be_bytes()[..]))
            .unwrap_err();
        assert_eq!(
            refused.to_string(),
            "frame of 65 bytes exceeds the 64-byte limit"
        );
        let refused = codec
            .encode(Bytes::from(vec![0; 65]), &mut BytesMut::new())
            .unwrap_err();
        assert_eq!(
            refused.to_string(),
            "frame of 65 bytes exceeds the 64-byte limit"
        );
    }
}

//! The length of a value as JSON, counted as it is written and none of it kept.

use serde_json::Value;

/// Bytes of `value` as JSON, or some number past `stop_past` once it is clear the value is
/// longer (the rest is not written).
pub fn json_len(value: &Value, stop_past: u64) -> u64 {
    struct Count {
        bytes: u64,
        stop_past: u64,
    }
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.bytes += buf.len() as u64;
            if self.bytes > self.stop_past {
                return Err(std::io::Error::other("past the limit"));
            }
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count {
        bytes: 0,
        stop_past,
    };
    let _ = serde_json::to_writer(&mut count, value);
    count.bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_is_measured_as_its_json_and_the_count_stops_past_the_limit() {
        let value = serde_json::json!({"result": "x".repeat(100)});
        let size = value.to_string().len() as u64;
        assert_eq!(json_len(&value, u64::MAX), size);
        assert!(json_len(&value, size - 1) > size - 1);
        assert!(json_len(&value, 0) > 0);
    }
}

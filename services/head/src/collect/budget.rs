//! What `nomad collect` lets its peers write: a bound per request, per second and in all (the
//! run directory's disk budget). A request beyond one is refused whole, naming the bound, so
//! no peer (or anyone holding the token) can fill the disk or the collector's memory.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Why an export request was not written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error(
        "the request expands to {bytes} bytes of lines; at most {limit} a request (send smaller \
         batches)"
    )]
    TooLarge { bytes: u64, limit: u64 },
    #[error(
        "more than {limit} bytes a second are arriving (nomad collect --max-bytes-per-second); \
         retry"
    )]
    TooFast { limit: u64 },
    #[error(
        "this run's telemetry budget of {limit} bytes is spent (nomad collect --max-bytes); \
         nothing more is written"
    )]
    Spent { limit: u64 },
    #[error("the collector's write queue is full ({0} requests); retry")]
    QueueFull(usize),
}

impl Refusal {
    /// The gRPC status an OTLP exporter reads: UNAVAILABLE and RESOURCE_EXHAUSTED for what
    /// passes, so it retries; a spent budget or an oversized request is not worth retrying.
    pub fn grpc(&self) -> tonic::Status {
        let message = self.to_string();
        match self {
            Self::TooLarge { .. } => tonic::Status::invalid_argument(message),
            Self::Spent { .. } => tonic::Status::resource_exhausted(message),
            Self::TooFast { .. } | Self::QueueFull(_) => tonic::Status::unavailable(message),
        }
    }

    /// The HTTP status: 429 and 503 are retried by exporters; 413 and 507 are not.
    pub fn http(&self) -> axum::http::StatusCode {
        use axum::http::StatusCode;
        match self {
            Self::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::TooFast { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::Spent { .. } => StatusCode::INSUFFICIENT_STORAGE,
            Self::QueueFull(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// The bounds, and what has been taken of them.
pub struct Budget {
    per_request: u64,
    per_second: u64,
    total: u64,
    taken: Mutex<Taken>,
}

struct Taken {
    /// The current one-second window and the bytes taken in it.
    window: Instant,
    in_window: u64,
    /// Bytes taken since the collector started.
    total: u64,
    warned: bool,
}

impl Budget {
    pub fn new(per_request: u64, per_second: u64, total: u64, now: Instant) -> Self {
        Self {
            per_request,
            per_second,
            total,
            taken: Mutex::new(Taken {
                window: now,
                in_window: 0,
                total: 0,
                warned: false,
            }),
        }
    }

    /// Takes `bytes` at `now`, or says which bound they would pass (nothing is taken then).
    pub fn take(&self, bytes: u64, now: Instant) -> Result<(), Refusal> {
        if bytes > self.per_request {
            return Err(Refusal::TooLarge {
                bytes,
                limit: self.per_request,
            });
        }
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        if taken.total + bytes > self.total {
            if !std::mem::replace(&mut taken.warned, true) {
                tracing::error!(
                    "the telemetry budget of {} bytes is spent: later exports are refused \
                     (nomad collect --max-bytes)",
                    self.total
                );
            }
            return Err(Refusal::Spent { limit: self.total });
        }
        if now.duration_since(taken.window) >= Duration::from_secs(1) {
            (taken.window, taken.in_window) = (now, 0);
        }
        if taken.in_window + bytes > self.per_second {
            return Err(Refusal::TooFast {
                limit: self.per_second,
            });
        }
        taken.in_window += bytes;
        taken.total += bytes;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_bound_refuses_by_name_and_a_refusal_takes_nothing() {
        let start = Instant::now();
        let budget = Budget::new(100, 150, 400, start);
        assert_eq!(
            budget.take(101, start),
            Err(Refusal::TooLarge {
                bytes: 101,
                limit: 100
            })
        );
        budget.take(100, start).unwrap();
        assert_eq!(budget.take(60, start), Err(Refusal::TooFast { limit: 150 }));
        budget.take(50, start).unwrap();
        // A new second, a new window.
        let later = start + Duration::from_secs(1);
        budget.take(100, later).unwrap();
        budget.take(50, later).unwrap();
        let later = later + Duration::from_secs(1);
        budget.take(100, later).unwrap();
        // 400 in all: the disk budget is spent, whatever the second.
        assert_eq!(
            budget.take(1, later + Duration::from_secs(5)),
            Err(Refusal::Spent { limit: 400 })
        );
        assert_eq!(
            Refusal::Spent { limit: 400 }.grpc().code(),
            tonic::Code::ResourceExhausted
        );
        assert_eq!(Refusal::TooFast { limit: 1 }.http().as_u16(), 429);
    }
}

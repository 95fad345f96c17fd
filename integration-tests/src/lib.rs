//! Harness for Nomad's end-to-end tests: real service binaries on loopback ports, an OTLP
//! receiver speaking the real protocol (gRPC and HTTP/protobuf), and checks over the spans.

pub mod fleet;
pub mod jaeger;
pub mod peers;
pub mod receiver;
pub mod reference;
pub mod spans;
pub mod users;

pub use fleet::{Fleet, FleetOptions, HeadRun, Service};
pub use receiver::OtlpReceiver;
pub use spans::SpanRecord;

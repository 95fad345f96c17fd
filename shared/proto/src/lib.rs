//! Generated gRPC bindings for Nomad's services (`proto/nomad/v1`), plus checked tensor
//! conversions.

pub mod v1 {
    tonic::include_proto!("nomad.v1");
}

/// The slice of Jaeger's api_v3 query API that Nomad uses (`nomad traces --jaeger`).
pub mod jaeger {
    tonic::include_proto!("jaeger.api_v3");
}

pub mod kinds;
mod tensor;

pub use tensor::TensorError;

/// Encoded file descriptor set of every Nomad proto, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("nomad_descriptor");

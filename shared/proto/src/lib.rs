//! Generated gRPC bindings for Nomad's services (`proto/nomad/v1`).

pub mod v1 {
    tonic::include_proto!("nomad.v1");
}

/// Encoded file descriptor set of every Nomad proto, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("nomad_descriptor");

//! Forward passes of model families, built from `kernels` over what `formats` read.

pub mod bert;
pub mod decoder;
pub mod encoder;
pub mod llama;
pub mod prefix_cache;

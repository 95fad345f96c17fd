//! The built-in kinds of the kinds table as models: each takes a batch through `batch`'s loop
//! and runs a family's forward pass.

pub mod cross;
pub mod embed;
pub mod generate;
pub mod length_groups;
pub mod mlp;
pub mod options;

//! Runtimes other than the worker's own passes, behind the same `Model` boundary.

pub mod python;
pub mod sim;

//! The CPU's own compute steps, each the same bits on every path: they import nothing above
//! them.

pub mod attention;
pub mod bert;
pub mod exp;
pub mod host_attention;
pub mod linear;
pub mod swiglu;

//! The models a worker runs, in rooms that import only downwards (`scripts/check-layout` checks
//! the order):
//!
//! - `model`: the boundary every backend implements (`Model`, `Streaming`) and the errors and
//!   limits it speaks in; `batch`: the one loop that splits a batch's valid inputs from the
//!   invalid, runs them and puts the answers back in order;
//! - `kernels`: the CPU's own compute steps (attention, the gated activation, `e^x`, quantized
//!   and encoder matrix products);
//! - `formats`: what model files say (GGUF, safetensors, tokenizers' rows, chat templates,
//!   sentence-transformers and decoder configs);
//! - `families`: forward passes of model families (llama-shaped decoders and their decode loop,
//!   BERT-shaped encoders);
//! - `kinds`: the built-in kinds of the kinds table (`embed`, `rerank`/`classify`, `generate`,
//!   `mlp`) as models, with the per-request options they check;
//! - `backends`: whole other runtimes behind the same boundary (a Python model host, the
//!   simulator);
//! - `load` and `open`: a spec made into a model, exhaustive over the kinds.

pub mod backends;
pub mod batch;
pub mod families;
pub mod formats;
pub mod kernels;
pub mod kinds;
pub mod load;
pub mod model;
pub mod open;
#[cfg(test)]
pub mod testing;

pub use nomad_sources as source;

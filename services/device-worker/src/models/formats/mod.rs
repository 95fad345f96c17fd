//! What a model's files say: read and checked here, so loaders and start-up checks agree.

pub mod architecture;
pub mod chat_template;
pub mod decoder_files;
pub mod gguf;
pub mod rope_scaling;
pub mod row;
pub mod sentence;
pub mod weights;

//! One tokenized sequence, as every encoder pass takes it (the worker's own on the CPU and
//! candle's): its own module, so that the passes and the kinds built on them do not import each
//! other.

/// One tokenized sequence: its ids and their token types (all 0 but for a pair's second text).
#[derive(Debug, Clone, Default)]
pub(crate) struct Row {
    pub ids: Vec<u32>,
    pub types: Vec<u32>,
}

impl Row {
    pub fn of(encoding: &tokenizers::Encoding) -> Self {
        Self {
            ids: encoding.get_ids().to_vec(),
            types: encoding.get_type_ids().to_vec(),
        }
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }
}

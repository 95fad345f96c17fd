//! The models this worker holds: each loaded in host memory, and placed on the device or not.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::Device;
use nomad_proto::v1::LoadedModel;

use crate::models::model::{ExecError, Model};

struct Entry {
    host: Arc<dyn Model>,
    placed: Option<Arc<dyn Model>>,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("tool {0:?} is not loaded on this worker; call Load first")]
    NotLoaded(String),
    #[error("tool {0:?} is loaded but not placed on the device; call Place first")]
    NotPlaced(String),
    #[error(transparent)]
    Exec(#[from] ExecError),
}

pub struct ModelStore {
    device: Device,
    entries: Mutex<HashMap<String, Entry>>,
}

impl ModelStore {
    pub fn new(device: Device) -> Self {
        Self {
            device,
            entries: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // A panic while holding the lock leaves the map consistent (every write is one insert
        // or remove), so a poisoned lock is still safe to use.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn contains(&self, tool: &str) -> bool {
        self.lock().contains_key(tool)
    }

    /// Keeps `model` as `tool`'s host copy unless one is already there (a concurrent Load won).
    /// Returns the bytes held and whether this call inserted it.
    pub fn insert(&self, tool: &str, model: Arc<dyn Model>) -> (u64, bool) {
        let mut entries = self.lock();
        if let Some(existing) = entries.get(tool) {
            return (existing.host.bytes(), false);
        }
        let bytes = model.bytes();
        entries.insert(
            tool.to_owned(),
            Entry {
                host: model,
                placed: None,
            },
        );
        (bytes, true)
    }

    /// Copies `tool` onto the device (no-op when already there).
    pub fn place(&self, tool: &str) -> Result<(), StoreError> {
        let host = {
            let entries = self.lock();
            let entry = entries
                .get(tool)
                .ok_or_else(|| StoreError::NotLoaded(tool.to_owned()))?;
            if entry.placed.is_some() {
                return Ok(());
            }
            entry.host.clone()
        };
        let placed = if self.device.is_cpu() {
            host
        } else {
            host.to_device(&self.device)?
        };
        if let Some(entry) = self.lock().get_mut(tool) {
            entry.placed.get_or_insert(placed);
        }
        Ok(())
    }

    /// Drops the device copy, keeping the host copy (a model in another process moves its
    /// weights back to host memory there first). Blocks while it does.
    pub fn offload(&self, tool: &str) -> Result<(), StoreError> {
        let placed = {
            let mut entries = self.lock();
            let entry = entries
                .get_mut(tool)
                .ok_or_else(|| StoreError::NotLoaded(tool.to_owned()))?;
            entry.placed.take()
        };
        if let Some(placed) = placed {
            placed.offload()?;
        }
        Ok(())
    }

    /// Asks every model to release the device memory its own allocator caches; the bytes
    /// released, when any model knows them. Blocks while they do.
    pub fn clear_caches(&self) -> Option<u64> {
        let models: Vec<Arc<dyn Model>> = self.lock().values().map(|e| e.host.clone()).collect();
        models
            .iter()
            .filter_map(|m| m.clear_cache())
            .reduce(|a, b| a + b)
    }

    /// Drops the model entirely; true when it was held.
    pub fn unload(&self, tool: &str) -> bool {
        self.lock().remove(tool).is_some()
    }

    /// The device copy to run a batch on.
    pub fn placed(&self, tool: &str) -> Result<Arc<dyn Model>, StoreError> {
        let entries = self.lock();
        let entry = entries
            .get(tool)
            .ok_or_else(|| StoreError::NotLoaded(tool.to_owned()))?;
        entry
            .placed
            .clone()
            .ok_or_else(|| StoreError::NotPlaced(tool.to_owned()))
    }

    pub fn models(&self) -> Vec<LoadedModel> {
        let mut models: Vec<_> = self
            .lock()
            .iter()
            .map(|(tool, e)| LoadedModel {
                tool: tool.clone(),
                on_device: e.placed.is_some(),
                bytes: e.host.bytes(),
            })
            .collect();
        models.sort_by(|a, b| a.tool.cmp(&b.tool));
        models
    }
}

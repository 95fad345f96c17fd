//! A read-only view of the manager's state for the observable gauges.

use super::{Core, SlotId, SlotState};

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolSnapshot {
    pub name: String,
    pub queue_length: usize,
    pub inflight: u32,
    pub batch_size: u32,
    /// Has a host copy on some worker.
    pub resident: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SlotSnapshot {
    pub slot: SlotId,
    pub busy: bool,
    /// Tool on the device, by name.
    pub on_device: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub tools: Vec<ToolSnapshot>,
    pub slots: Vec<SlotSnapshot>,
    /// Tools with requests waiting for dispatch.
    pub pending_tools: usize,
}

impl Core {
    pub fn snapshot(&self) -> Snapshot {
        let tools: Vec<ToolSnapshot> = self
            .tools
            .iter()
            .enumerate()
            .map(|(id, t)| ToolSnapshot {
                name: t.spec.name.clone(),
                queue_length: t.queue.len(),
                inflight: t.inflight,
                batch_size: t.effective_batch() as u32,
                resident: self.slots.values().any(|s| s.resident.contains(&id)),
            })
            .collect();
        let mut slots: Vec<SlotSnapshot> = self
            .slots
            .iter()
            .map(|(id, s)| SlotSnapshot {
                slot: *id,
                busy: s.state != SlotState::Idle,
                on_device: s.on_device.map(|t| self.tools[t].spec.name.clone()),
            })
            .collect();
        slots.sort_by_key(|s| s.slot);
        Snapshot {
            pending_tools: tools.iter().filter(|t| t.queue_length > 0).count(),
            tools,
            slots,
        }
    }
}

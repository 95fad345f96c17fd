//! The rules: which slot a tool takes, when a batch is ready, eviction, unloading and cache
//! clearing. Called from the events in the crate root.

use std::time::Instant;

use super::{
    Action, Batch, Core, LoadKind, RequestId, RequestState, SizeChange, Slot, SlotId, SlotState,
    ToolId,
};

impl Core {
    pub(crate) fn slots_holding(&self, tool: ToolId) -> usize {
        self.slots
            .values()
            .filter(|s| s.on_device == Some(tool) || s.state == SlotState::Preparing(tool))
            .count()
    }

    /// Assigns free slots to waiting tools and dispatches ready batches.
    pub(crate) fn schedule(&mut self, now: Instant) {
        for s in self.slots.values_mut() {
            for b in s.backoff.values_mut() {
                b.pending &= b.until > now;
            }
        }
        // Oldest waiting request first, across tools.
        let mut waiting: Vec<(Instant, ToolId)> = self
            .tools
            .iter()
            .enumerate()
            .filter_map(|(id, t)| t.queue.front().map(|r| (self.requests[r].enqueued_at, id)))
            .collect();
        waiting.sort();
        for (_, tool) in waiting {
            // Dispatch on every free slot that already holds the tool.
            while !self.tools[tool].queue.is_empty() {
                let Some(slot) = self.free_slot_holding(tool) else {
                    break;
                };
                if !self.batch_ready(tool, now) {
                    break;
                }
                self.dispatch(tool, slot, now);
            }
            if self.tools[tool].queue.is_empty() {
                continue;
            }
            if let Some(slot) = self.slot_to_take(tool, now) {
                let s = self.slots.get_mut(&slot).expect("slot exists");
                let offload = s.on_device.filter(|&held| held != tool);
                let load = (!s.resident.contains(&tool)).then(|| {
                    if self.slots.values().any(|o| o.resident.contains(&tool)) {
                        LoadKind::Replica
                    } else {
                        LoadKind::Resident
                    }
                });
                let s = self.slots.get_mut(&slot).expect("slot exists");
                if offload.is_some() {
                    s.on_device = None;
                }
                // Counted as resident from now on, so a second load elsewhere is a replica.
                s.resident.insert(tool);
                s.state = SlotState::Preparing(tool);
                self.actions.push(Action::Prepare {
                    slot,
                    tool,
                    offload,
                    load,
                });
            }
        }
    }

    fn batch_ready(&self, tool: ToolId, now: Instant) -> bool {
        let t = &self.tools[tool];
        match t.queue.front() {
            None => false,
            // A request that runs alone is a whole batch by itself.
            Some(front) => {
                let front = &self.requests[front];
                t.spec.continuous
                    || front.solo()
                    || t.queue.len() >= t.effective_batch()
                    || self.fills_budget(tool)
                    || now >= front.enqueued_at + self.timing.max_batch_delay
            }
        }
    }

    /// Whether the queue holds more than one batch's byte or token budget within its first
    /// batch-size requests: the batch is as full as it can be.
    fn fills_budget(&self, tool: ToolId) -> bool {
        let t = &self.tools[tool];
        let (mut bytes, mut tokens) = (0u64, 0u64);
        t.queue.iter().take(t.effective_batch()).any(|id| {
            let cost = self.requests[id].cost;
            bytes += cost.bytes;
            tokens += cost.tokens;
            bytes > t.spec.max_batch_bytes
                || (t.spec.max_batch_tokens > 0 && tokens > t.spec.max_batch_tokens)
        })
    }

    /// A slot holding `tool` that can run a batch now: an idle one, or for a continuous tool
    /// one running fewer than its bound (the least loaded).
    fn free_slot_holding(&self, tool: ToolId) -> Option<SlotId> {
        let t = &self.tools[tool];
        self.slots
            .iter()
            .filter(|(_, s)| s.on_device == Some(tool))
            .filter(|(_, s)| {
                s.state == SlotState::Idle
                    || (t.spec.continuous
                        && s.state == SlotState::Executing
                        && s.batches.len() < t.effective_batch())
            })
            .min_by_key(|(id, s)| (s.batches.len(), s.last_used, **id))
            .map(|(id, _)| *id)
    }

    /// Whether a slot other than `failed` holds `tool`, or may take it once free (it has not
    /// failed to prepare it lately).
    pub(crate) fn servable_elsewhere(&self, tool: ToolId, failed: SlotId, now: Instant) -> bool {
        self.slots.iter().any(|(id, s)| {
            *id != failed
                && (s.on_device == Some(tool)
                    || s.state == SlotState::Preparing(tool)
                    || s.backoff.get(&tool).is_none_or(|b| b.until <= now))
        })
    }

    /// A slot `tool` may take: a new one only below `max_devices`; not one where preparing it
    /// failed lately (backoff); an empty slot before one holding another tool (least recently
    /// used first); and never the last free slots that waiting tools holding none need
    /// (fairness).
    fn slot_to_take(&self, tool: ToolId, now: Instant) -> Option<SlotId> {
        let held = self.slots_holding(tool);
        if held >= self.tools[tool].spec.max_devices as usize {
            return None;
        }
        let free: Vec<(&SlotId, &Slot)> = self
            .slots
            .iter()
            .filter(|(_, s)| s.state == SlotState::Idle)
            .filter(|(_, s)| s.backoff.get(&tool).is_none_or(|b| b.until <= now))
            // Another lane of the same worker already holds the tool: that lane serves it.
            .filter(|(id, s)| {
                !self.slots.iter().any(|(o, other)| {
                    o != *id && other.group == s.group && other.resident.contains(&tool)
                })
            })
            .collect();
        if free.is_empty() {
            return None;
        }
        if held > 0 {
            let starving = self
                .tools
                .iter()
                .enumerate()
                .filter(|(id, t)| {
                    *id != tool && !t.queue.is_empty() && self.slots_holding(*id) == 0
                })
                .count();
            if free.len() <= starving {
                return None;
            }
        }
        free.into_iter()
            .filter(|(_, s)| match s.on_device {
                None => true,
                // A slot whose tool still has work waiting is not taken from it.
                Some(other) => self.tools[other].queue.is_empty(),
            })
            .min_by_key(|(id, s)| (s.on_device.is_some(), s.last_used, **id))
            .map(|(id, _)| *id)
    }

    fn dispatch(&mut self, tool: ToolId, slot: SlotId, now: Instant) {
        let requests = if self.tools[tool].spec.continuous {
            self.tools[tool].queue.pop_front().into_iter().collect()
        } else {
            self.next_batch_of(tool)
        };
        let t = &mut self.tools[tool];
        t.inflight += requests.len() as u32;
        let batch = self.next_batch;
        self.next_batch += 1;
        let mut queue_waits = Vec::with_capacity(requests.len());
        for r in &requests {
            if let Some(req) = self.requests.get_mut(r) {
                req.state = RequestState::Executing(batch);
                queue_waits.push(now.saturating_duration_since(req.enqueued_at));
            }
        }
        let s = self.slots.get_mut(&slot).expect("slot exists");
        s.state = SlotState::Executing;
        s.batches.insert(batch);
        let running = if self.tools[tool].spec.continuous {
            s.batches.len() as u32
        } else {
            requests.len() as u32
        };
        self.batches.insert(
            batch,
            Batch {
                tool,
                slot,
                requests: requests.clone(),
                running,
            },
        );
        self.actions.push(Action::Dispatch {
            batch,
            slot,
            tool,
            requests,
            queue_waits,
            running,
        });
    }

    /// Takes the next batch off `tool`'s queue: up to the batch size and within the byte and
    /// token budgets, in queue order. The front request always goes (alone if it exceeds a
    /// budget by itself, or if it runs alone since its worker was lost). A request that runs
    /// alone ends a batch rather than joining it. When the model pads to the longest input
    /// and several batches' worth is queued, the front request's batch is filled with the
    /// queued ones closest to it in size (among the next few batches' worth), so a long input
    /// does not pad many short ones.
    fn next_batch_of(&mut self, tool: ToolId) -> Vec<RequestId> {
        let t = &self.tools[tool];
        let size = t.effective_batch();
        let (max_bytes, max_tokens) = (t.spec.max_batch_bytes, t.spec.max_batch_tokens);
        let Some(&front) = t.queue.front() else {
            return Vec::new();
        };
        let request = |id: &RequestId| &self.requests[id];
        let mut chosen = vec![0usize];
        if !request(&front).solo() {
            // Candidates: queue positions up to the next request that runs alone.
            let window = if t.spec.group_by_size && t.queue.len() >= 2 * size {
                4 * size
            } else {
                size
            };
            let mut candidates: Vec<usize> = (1..t.queue.len().min(window))
                .take_while(|&i| !request(&t.queue[i]).solo())
                .collect();
            if t.spec.group_by_size && t.queue.len() >= 2 * size {
                let like = request(&front).cost.tokens;
                candidates.sort_by_key(|&i| (request(&t.queue[i]).cost.tokens.abs_diff(like), i));
            }
            let (mut bytes, mut tokens) = (request(&front).cost.bytes, request(&front).cost.tokens);
            for i in candidates {
                if chosen.len() >= size {
                    break;
                }
                let cost = request(&t.queue[i]).cost;
                let over_bytes = bytes + cost.bytes > max_bytes;
                let over_tokens = max_tokens > 0 && tokens + cost.tokens > max_tokens;
                if over_bytes || over_tokens {
                    // In queue order, the batch ends here; grouping may still pick a smaller one.
                    if t.spec.group_by_size && t.queue.len() >= 2 * size {
                        continue;
                    }
                    break;
                }
                bytes += cost.bytes;
                tokens += cost.tokens;
                chosen.push(i);
            }
        }
        chosen.sort_unstable();
        let queue = &mut self.tools[tool].queue;
        let batch: Vec<RequestId> = chosen.iter().map(|&i| queue[i]).collect();
        for &i in chosen.iter().rev() {
            queue.remove(i);
        }
        batch
    }

    /// A good batch at a reduced size: after `oom_regrow_after` of them the size doubles back
    /// toward the configured one, a step at a time.
    pub(crate) fn regrow(&mut self, tool: ToolId) {
        let t = &mut self.tools[tool];
        let configured = t.spec.batch_size.max(1);
        if t.batch_size >= configured {
            return;
        }
        t.good_batches += 1;
        if t.good_batches < t.spec.oom_regrow_after.max(1) {
            return;
        }
        let old = t.batch_size;
        t.batch_size = (old * 2).min(configured);
        t.good_batches = 0;
        self.actions.push(Action::BatchSizeChanged {
            tool,
            old,
            new: t.batch_size,
            cause: SizeChange::Regrown,
        });
    }

    /// Idle eviction: slots unused for `idle`, least recently used first.
    pub(crate) fn evict_idle(&mut self, now: Instant) {
        let mut due: Vec<(Instant, SlotId, ToolId)> = self
            .slots
            .iter()
            .filter(|(_, s)| s.state == SlotState::Idle)
            .filter_map(|(id, s)| s.on_device.map(|t| (s.last_used, *id, t)))
            .filter(|(used, _, _)| now.duration_since(*used) >= self.timing.idle)
            .collect();
        due.sort();
        for (_, slot, tool) in due {
            let s = self.slots.get_mut(&slot).expect("slot exists");
            s.on_device = None;
            s.state = SlotState::Maintenance;
            self.actions.push(Action::Evict { slot, tool });
        }
    }

    /// No slot, nothing queued, nothing in flight: the tool may leave host memory.
    pub(crate) fn unloadable(&self, tool: ToolId) -> bool {
        let t = &self.tools[tool];
        t.queue.is_empty()
            && t.inflight == 0
            && self.slots_holding(tool) == 0
            && self.slots.values().any(|s| s.resident.contains(&tool))
    }

    pub(crate) fn unload_idle(&mut self, now: Instant) {
        for tool in 0..self.tools.len() {
            if !self.unloadable(tool)
                || now.duration_since(self.tools[tool].last_used) < self.timing.disk_idle
            {
                continue;
            }
            let mut ids: Vec<SlotId> = self
                .slots
                .iter()
                .filter(|(_, s)| s.state == SlotState::Idle && s.resident.contains(&tool))
                .map(|(id, _)| *id)
                .collect();
            ids.sort();
            for slot in ids {
                let s = self.slots.get_mut(&slot).expect("slot exists");
                s.resident.remove(&tool);
                s.state = SlotState::Maintenance;
                self.actions.push(Action::Unload { slot, tool });
            }
        }
    }

    /// Whole-server idleness: nothing open, every slot idle, `gc_idle` since the last activity.
    pub(crate) fn clear_caches(&mut self, now: Instant) {
        if !self.requests.is_empty()
            || now.duration_since(self.last_activity) < self.timing.gc_idle
            || self.slots.values().any(|s| s.state != SlotState::Idle)
        {
            return;
        }
        let mut ids: Vec<SlotId> = self
            .slots
            .iter()
            .filter(|(_, s)| s.dirty)
            .map(|(id, _)| *id)
            .collect();
        ids.sort();
        for slot in ids {
            let s = self.slots.get_mut(&slot).expect("slot exists");
            s.dirty = false;
            s.state = SlotState::Maintenance;
            self.actions.push(Action::ClearCache { slot });
        }
    }
}

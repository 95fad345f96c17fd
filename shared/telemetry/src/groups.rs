//! Span groups: which kinds of spans a process records.
//!
//! `span_groups` is a comma list of group names and presets, case-insensitive. Turning a group
//! off removes its spans only; trace context still propagates through every hop.

use std::fmt;

use SpanGroup::{
    Batch, Client, Device, Gateway, Job, Rollout, Sandbox, Server, Startup, Tool, Upstream, Verify,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum SpanGroup {
    /// `nomad.job`, once per run.
    Job,
    /// `nomad.rollout`, the root of each rollout's trace.
    Rollout,
    /// `nomad.verify`.
    Verify,
    /// gRPC server spans.
    Server,
    /// gRPC client spans.
    Client,
    /// `nomad.gateway.execute_mcp_code` / `execute_mcp_script`.
    Gateway,
    /// `nomad.gateway.sandbox.run`.
    Sandbox,
    /// `nomad.gateway.upstream_tool`.
    Upstream,
    /// `nomad.tool.request`.
    Tool,
    /// `nomad.tool.batch`.
    Batch,
    /// Device operations: load, offload, evict, unload, cache clear.
    Device,
    /// Start-up: `nomad.startup` in the head, `nomad.server.startup` in each server.
    Startup,
}

impl SpanGroup {
    pub const ALL: [SpanGroup; 12] = [
        Job, Rollout, Verify, Server, Client, Gateway, Sandbox, Upstream, Tool, Batch, Device,
        Startup,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SpanGroup::Job => "job",
            SpanGroup::Rollout => "rollout",
            SpanGroup::Verify => "verify",
            SpanGroup::Server => "server",
            SpanGroup::Client => "client",
            SpanGroup::Gateway => "gateway",
            SpanGroup::Sandbox => "sandbox",
            SpanGroup::Upstream => "upstream",
            SpanGroup::Tool => "tool",
            SpanGroup::Batch => "batch",
            SpanGroup::Device => "device",
            SpanGroup::Startup => "startup",
        }
    }

    fn bit(self) -> u32 {
        1 << (self as u8)
    }
}

/// A set of span groups.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct SpanGroups(u32);

/// Presets, in the order the docs list them.
pub const PRESETS: [(&str, &[SpanGroup]); 4] = [
    // Everything but gRPC client spans, which mostly repeat the server span at the other end.
    (
        "default",
        &[
            Job, Rollout, Verify, Server, Gateway, Sandbox, Upstream, Tool, Batch, Device, Startup,
        ],
    ),
    // One span per rollout step and no per-request fan-out: for very large runs.
    ("per_rollout", &[Job, Rollout, Verify, Gateway]),
    ("all", &SpanGroup::ALL),
    ("none", &[]),
];

impl SpanGroups {
    pub const NONE: SpanGroups = SpanGroups(0);

    pub fn all() -> Self {
        Self::from_groups(&SpanGroup::ALL)
    }

    pub fn default_preset() -> Self {
        Self::from_groups(PRESETS[0].1)
    }

    pub fn from_groups(groups: &[SpanGroup]) -> Self {
        SpanGroups(groups.iter().fold(0, |bits, g| bits | g.bit()))
    }

    pub fn contains(self, group: SpanGroup) -> bool {
        self.0 & group.bit() != 0
    }

    pub fn bits(self) -> u32 {
        self.0
    }

    pub fn from_bits(bits: u32) -> Self {
        SpanGroups(bits)
    }

    /// Parses a comma list of group names and presets (case-insensitive, blanks ignored).
    pub fn parse(list: &str) -> Result<Self, String> {
        let mut bits = 0;
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let item = item.to_ascii_lowercase();
            if let Some((_, groups)) = PRESETS.iter().find(|(name, _)| *name == item) {
                bits |= Self::from_groups(groups).0;
            } else if let Some(group) = SpanGroup::ALL.iter().find(|g| g.name() == item) {
                bits |= group.bit();
            } else {
                let presets: Vec<_> = PRESETS.iter().map(|(n, _)| *n).collect();
                let groups: Vec<_> = SpanGroup::ALL.iter().map(|g| g.name()).collect();
                return Err(format!(
                    "unknown span group {item:?}; presets: {}; groups: {}",
                    presets.join(", "),
                    groups.join(", ")
                ));
            }
        }
        Ok(SpanGroups(bits))
    }
}

impl fmt::Debug for SpanGroups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<_> = SpanGroup::ALL
            .iter()
            .filter(|g| self.contains(**g))
            .map(|g| g.name())
            .collect();
        write!(f, "SpanGroups({})", names.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_and_names_combine_case_insensitively() {
        let g = SpanGroups::parse("Per_Rollout, CLIENT").unwrap();
        assert!(g.contains(SpanGroup::Rollout) && g.contains(SpanGroup::Client));
        assert!(!g.contains(SpanGroup::Batch));
        assert_eq!(SpanGroups::parse("all").unwrap(), SpanGroups::all());
        assert_eq!(SpanGroups::parse("").unwrap(), SpanGroups::NONE);
        assert_eq!(SpanGroups::parse("none").unwrap(), SpanGroups::NONE);
    }

    #[test]
    fn default_preset_leaves_out_client_spans_only() {
        let d = SpanGroups::parse("default").unwrap();
        for g in SpanGroup::ALL {
            assert_eq!(d.contains(g), g != SpanGroup::Client, "{g:?}");
        }
    }

    #[test]
    fn unknown_group_is_named_with_the_valid_choices() {
        let err = SpanGroups::parse("default,batches").unwrap_err();
        assert!(
            err.contains("\"batches\"") && err.contains("batch"),
            "{err}"
        );
    }
}

//! `docs/metrics.md`, generated from the metric table (`metrics/mod.rs`), so the docs and the
//! instruments cannot disagree.

use crate::metrics::{MetricDef, TABLES};

/// A markdown table of `defs` in the original's column layout.
pub fn markdown_table(defs: &[MetricDef]) -> String {
    let mut out = String::from("| Metric | Type | Unit | Description |\n|---|---|---|---|\n");
    for d in defs {
        out.push_str(&format!(
            "| `{}` | {} | `{}` | {} |\n",
            d.name,
            d.kind.doc_name(),
            d.unit,
            d.description
        ));
    }
    out
}

/// The whole of `docs/metrics.md`.
pub fn docs_markdown() -> String {
    let mut out = String::from(
        "# Metrics\n\n<!-- Generated from shared/telemetry/src/metrics/mod.rs; do not edit. \
         Regenerate with: NOMAD_BLESS=1 cargo test -p nomad-telemetry docs_ -->\n",
    );
    for (heading, intro, defs) in TABLES {
        out.push_str(&format!("\n## {heading}\n\n{intro}\n\n"));
        out.push_str(&markdown_table(defs));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docs_metrics_md_matches_the_definition_table() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/metrics.md");
        let expected = docs_markdown();
        if std::env::var_os("NOMAD_BLESS").is_some() {
            std::fs::write(&path, &expected).unwrap();
        }
        let actual = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            actual == expected,
            "docs/metrics.md is out of date with shared/telemetry/src/metrics/mod.rs; \
             regenerate it with: NOMAD_BLESS=1 cargo test -p nomad-telemetry docs_"
        );
    }
}

//! What `nomad export` writes beside the config: each model's card (cards/<tool>.md) and a
//! README that reports what was exported, where to, how big, by which digest, with which
//! environment.

use std::fmt::Write as _;
use std::path::Path;

use super::Exported;

/// The card files a model directory may carry, first found wins.
const CARD_FILES: [&str; 3] = ["README.md", "MODEL_CARD.md", "model_card.md"];

pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KB", "MB", "GB", "TB"];
    if bytes < 1000 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = "B";
    for next in UNITS {
        if value < 1000.0 {
            break;
        }
        value /= 1000.0;
        unit = next;
    }
    format!("{value:.1} {unit}")
}

/// The model's own card when its files carry one, else one written from what is known of it.
pub fn card(
    tool: &str,
    path: &Path,
    original: &str,
    written: &str,
    digest: Option<&str>,
) -> String {
    let dir = if path.is_file() {
        path.parent().unwrap_or(path)
    } else {
        path
    };
    let own = CARD_FILES
        .iter()
        .find_map(|name| std::fs::read_to_string(dir.join(name)).ok());
    let mut text = own.unwrap_or_else(|| format!("# {tool}\n\nThe model's files carry no card.\n"));
    let _ = write!(
        text,
        "\n\n---\n\nExported by `nomad export`: from `{original}` to `{written}`{}.\n",
        digest
            .map(|d| format!(" (manifest {d})"))
            .unwrap_or_default()
    );
    text
}

/// Writes cards/<tool>.md for each model and README.md.
pub fn write(
    out: &Path,
    config: &Path,
    exported: &[Exported],
    modules: &[String],
) -> anyhow::Result<()> {
    let cards = out.join("cards");
    std::fs::create_dir_all(&cards)?;
    let mut readme = String::from("# Nomad export\n\n");
    let _ = writeln!(
        readme,
        "From `{}`; start it with `nomad up nomad.yml` (or `nomad serve nomad.yml`) in this \
         directory.\n",
        config.display()
    );
    readme.push_str("| Tool | Section | From | To | Files | Size | Digest |\n");
    readme.push_str("|---|---|---|---|---|---|---|\n");
    let total: u64 = exported.iter().map(|e| e.bytes).sum();
    for e in exported {
        let card_name = format!("{}.md", e.tool.replace(['/', '\\'], "-"));
        std::fs::write(cards.join(&card_name), &e.card)?;
        let from = if e.pinned == e.original {
            format!("`{}`", e.original)
        } else {
            format!("`{}` (`{}`)", e.original, e.pinned)
        };
        let _ = writeln!(
            readme,
            "| [{}](cards/{card_name}) | {} | {from} | `{}` | {} | {} | {} |",
            e.tool,
            e.section,
            e.written,
            e.files,
            human_bytes(e.bytes),
            e.digest
                .as_deref()
                .map_or("-".to_owned(), |d| format!("`{d}`"))
        );
    }
    let _ = writeln!(
        readme,
        "\n{} models, {} in all.",
        exported.len(),
        human_bytes(total)
    );
    let with_env: Vec<_> = exported
        .iter()
        .filter(|e| !e.requirements.is_empty())
        .collect();
    if !with_env.is_empty() {
        readme.push_str("\n## Environments\n\nRead from each entry's requirements file and written into the config as its `env` list:\n\n");
        for e in with_env {
            let _ = writeln!(readme, "- {}: `{}`", e.tool, e.requirements.join("`, `"));
        }
    }
    if !modules.is_empty() {
        let _ = writeln!(
            readme,
            "\n## Python modules\n\nCopied from beside the config (the model host imports \
             from the config's directory): {}.",
            modules.join(", ")
        );
    }
    std::fs::write(out.join("README.md"), readme)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(super::human_bytes(999), "999 B");
        assert_eq!(super::human_bytes(90_870_000), "90.9 MB");
        assert_eq!(super::human_bytes(5_000_000_000), "5.0 GB");
    }
}

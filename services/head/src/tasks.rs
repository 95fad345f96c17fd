//! Tasks: one JSON object per line of a tasks JSONL file.

use serde::Deserialize;
use serde_json::Value;

/// One task: call `tool` on upstream `server` with `arguments`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Task {
    pub id: String,
    /// Upstream server (default: `nomad`, the scheduler's tools).
    #[serde(default = "default_server")]
    pub server: String,
    pub tool: String,
    #[serde(default = "empty_object")]
    pub arguments: Value,
}

fn default_server() -> String {
    "nomad".to_owned()
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

/// Parses and checks one task given as JSON.
pub fn parse_task(json: &str) -> Result<Task, String> {
    let task: Task = serde_json::from_str(json).map_err(|e| e.to_string())?;
    if task.id.is_empty() {
        return Err("`id` is empty".into());
    }
    if task.tool.is_empty() {
        return Err("`tool` is empty".into());
    }
    if !task.arguments.is_object() {
        return Err("`arguments` must be a JSON object".into());
    }
    Ok(task)
}

/// Parses labelled task texts; on failure lists every bad one (label and reason), not just the
/// first. Duplicate ids are refused: results are keyed by task id.
pub fn parse_all<'a>(
    items: impl IntoIterator<Item = (String, &'a str)>,
) -> Result<Vec<Task>, String> {
    let mut tasks = Vec::new();
    let mut errors = Vec::new();
    let mut ids = std::collections::HashSet::new();
    for (label, json) in items {
        match parse_task(json) {
            Ok(task) if !ids.insert(task.id.clone()) => {
                errors.push(format!("{label}: task id {:?} appears twice", task.id))
            }
            Ok(task) => tasks.push(task),
            Err(e) => errors.push(format!("{label}: {e}")),
        }
    }
    if !errors.is_empty() {
        return Err(errors.join("\n"));
    }
    if tasks.is_empty() {
        return Err("no tasks (expected one JSON object per line)".into());
    }
    Ok(tasks)
}

/// Parses a tasks JSONL text; `source` names the file in errors (`file:line: reason`).
pub fn parse(text: &str, source: &str) -> Result<Vec<Task>, String> {
    parse_all(
        text.lines()
            .enumerate()
            .filter(|(_, line)| !line.trim().is_empty())
            .map(|(i, line)| (format!("{source}:{}", i + 1), line)),
    )
    .map_err(|e| {
        if e.starts_with("no tasks") {
            format!("{source}: {e}")
        } else {
            e
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tasks_with_defaults() {
        let tasks = parse(
            "{\"id\":\"a\",\"tool\":\"mlp\",\"arguments\":{\"input\":[1]}}\n\n{\"id\":\"b\",\"tool\":\"x\"}\n",
            "t.jsonl",
        )
        .unwrap();
        assert_eq!(tasks.len(), 2);
        assert_eq!(tasks[1].server, "nomad");
        assert!(tasks[1].arguments.as_object().unwrap().is_empty());
    }

    #[test]
    fn every_bad_line_is_reported_with_its_number() {
        let text = "{\"id\":\"a\",\"tool\":\"m\"}\nnot json\n{\"id\":\"a\",\"tool\":\"m\"}\n{\"id\":\"c\",\"tool\":\"m\",\"argz\":{}}\n{\"id\":\"d\",\"tool\":\"m\",\"arguments\":[1]}\n";
        let err = parse(text, "t.jsonl").unwrap_err();
        assert!(err.contains("t.jsonl:2:"), "{err}");
        assert!(
            err.contains("t.jsonl:3: task id \"a\" appears twice"),
            "{err}"
        );
        assert!(err.contains("t.jsonl:4:") && err.contains("argz"), "{err}");
        assert!(
            err.contains("t.jsonl:5: `arguments` must be a JSON object"),
            "{err}"
        );
        assert!(parse("\n\n", "e.jsonl").unwrap_err().contains("no tasks"));
    }
}

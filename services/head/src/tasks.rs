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

/// Parses every line; on failure lists each bad line (number and reason), not just the first.
pub fn parse(text: &str, source: &str) -> Result<Vec<Task>, String> {
    let mut tasks = Vec::new();
    let mut errors = Vec::new();
    let mut ids = std::collections::HashSet::new();
    for (index, line) in text.lines().enumerate() {
        let line_no = index + 1;
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Task>(line) {
            Ok(task) if task.id.is_empty() => {
                errors.push(format!("{source}:{line_no}: `id` is empty"))
            }
            Ok(task) if task.tool.is_empty() => {
                errors.push(format!("{source}:{line_no}: `tool` is empty"))
            }
            Ok(task) if !task.arguments.is_object() => errors.push(format!(
                "{source}:{line_no}: `arguments` must be a JSON object"
            )),
            Ok(task) if !ids.insert(task.id.clone()) => errors.push(format!(
                "{source}:{line_no}: task id {:?} appears twice",
                task.id
            )),
            Ok(task) => tasks.push(task),
            Err(e) => errors.push(format!("{source}:{line_no}: {e}")),
        }
    }
    if !errors.is_empty() {
        return Err(errors.join("\n"));
    }
    if tasks.is_empty() {
        return Err(format!(
            "{source}: no tasks (expected one JSON object per line)"
        ));
    }
    Ok(tasks)
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

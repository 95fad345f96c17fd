//! Tasks: one JSON object per line of a tasks JSONL file.
//!
//! A task's agent step is one of: `code` (Python the gateway runs in its sandbox), `inputs` (fed
//! to the `--template` script as `TASK`), or `tool` + `arguments` (one direct tool call). An
//! `expected` value and a `verify` kind make the rollout's reward.

/// The tasks file's format, as `nomad run --help` and `nomad up --help` show it.
pub const FORMAT: &str = "\
Tasks file (--tasks): one JSON object per line, each with a unique \"id\" and one step:
  {\"id\": \"a\", \"code\": \"RESULT = 6 * 7\"}                     Python run in the sandbox; RESULT is the output
  {\"id\": \"b\", \"inputs\": {...}}                              given as TASK to the --template script
  {\"id\": \"c\", \"tool\": \"embed\", \"arguments\": {\"text\": \"hi\"}}  one direct tool call (\"server\" defaults to nomad)
For a reward add \"expected\" and \"verify\": \"exact\" (the default), {\"kind\": \"numeric\", \"tolerance\": 0.001}
or {\"kind\": \"similarity\", \"threshold\": 0.8}. Every bad line is named before anything runs.
Results: one JSON line per task (status ok, error or cancelled). More in docs/fleet.md.";

use serde::Deserialize;
use serde_json::Value;

use crate::verify::Verify;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RawTask {
    pub id: String,
    #[serde(default)]
    pub code: Option<String>,
    #[serde(default)]
    pub inputs: Option<Value>,
    #[serde(default)]
    pub tool: Option<String>,
    /// Upstream server for `tool` (default: `nomad`, the scheduler's tools).
    #[serde(default)]
    pub server: Option<String>,
    #[serde(default)]
    pub arguments: Option<Value>,
    #[serde(default)]
    pub expected: Option<Value>,
    #[serde(default)]
    pub verify: Option<Verify>,
}

/// What the agent step does.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    Code(String),
    Tool {
        server: String,
        tool: String,
        arguments: Value,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    pub id: String,
    pub step: Step,
    pub expected: Option<Value>,
    pub verify: Verify,
}

/// Turns a raw task into a runnable one; `template` is the `--template` script, if any.
pub fn resolve(raw: RawTask, template: Option<&str>) -> Result<Task, String> {
    if raw.id.is_empty() {
        return Err("`id` is empty".into());
    }
    if raw.arguments.is_some() && raw.tool.is_none() {
        return Err("`arguments` goes with `tool`".into());
    }
    let step = match (raw.code, raw.inputs, raw.tool) {
        (Some(code), None, None) => {
            if code.trim().is_empty() {
                return Err("`code` is empty".into());
            }
            Step::Code(code)
        }
        (None, Some(inputs), None) => {
            let template = template.ok_or("`inputs` needs a template: pass --template FILE")?;
            // The template reads its inputs from TASK; no text is substituted into code.
            Step::Code(format!("TASK = {}\n{template}", python_literal(&inputs)))
        }
        (None, None, Some(tool)) => {
            if tool.is_empty() {
                return Err("`tool` is empty".into());
            }
            let arguments = raw
                .arguments
                .unwrap_or_else(|| Value::Object(Default::default()));
            if !arguments.is_object() {
                return Err("`arguments` must be a JSON object".into());
            }
            Step::Tool {
                server: raw.server.unwrap_or_else(|| "nomad".into()),
                tool,
                arguments,
            }
        }
        (None, None, None) => {
            return Err("a task needs `code`, `inputs` (with --template) or `tool`".into());
        }
        _ => return Err("give only one of `code`, `inputs` and `tool`".into()),
    };
    let verify = match raw.verify {
        Some(v) => v,
        None if raw.expected.is_some() => Verify::Exact,
        None => Verify::None,
    };
    if verify != Verify::None && raw.expected.is_none() {
        return Err("`verify` needs an `expected` value".into());
    }
    Ok(Task {
        id: raw.id,
        step,
        expected: raw.expected,
        verify,
    })
}

/// JSON as a Python expression: the JSON text as a JSON string literal (also a valid Python
/// one), decoded by `json.loads`.
fn python_literal(value: &Value) -> String {
    let text = serde_json::to_string(&value.to_string()).expect("a string serializes");
    format!("__import__('json').loads({text})")
}

/// A task's JSON error without serde's "at line 1": the label already names the file's line, so
/// only the column is worth adding.
fn json_error(error: &serde_json::Error) -> String {
    let text = error.to_string();
    let location = format!(" at line {} column {}", error.line(), error.column());
    match text.strip_suffix(&location) {
        Some(reason) => format!("{reason} (column {})", error.column()),
        None => text,
    }
}

/// Parses labelled task texts; on failure lists every bad one (label and reason), not just the
/// first. Duplicate ids are refused: results are keyed by task id.
pub fn parse_all<'a>(
    items: impl IntoIterator<Item = (String, &'a str)>,
    template: Option<&str>,
) -> Result<Vec<Task>, String> {
    let mut tasks = Vec::new();
    let mut errors = Vec::new();
    let mut ids = std::collections::HashSet::new();
    for (label, json) in items {
        let parsed = serde_json::from_str::<RawTask>(json)
            .map_err(|e| json_error(&e))
            .and_then(|raw| resolve(raw, template));
        match parsed {
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
pub fn parse(text: &str, source: &str, template: Option<&str>) -> Result<Vec<Task>, String> {
    parse_all(
        text.lines()
            .enumerate()
            .filter(|(_, line)| !line.trim().is_empty())
            .map(|(i, line)| (format!("{source}:{}", i + 1), line)),
        template,
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
    fn inputs_reach_python_exactly_whatever_their_characters() {
        let value = serde_json::json!({
            "emoji": "😀 ü", "quotes": "'\"", "backslash": "a\\b", "control": "\u{1}\t\n",
            "separator": "\u{2028}", "nested": [1, 2.5, null, true, {"k": "v"}]
        });
        let code = format!(
            "import json, sys\nTASK = {}\nsys.stdout.write(json.dumps(TASK, sort_keys=True))",
            python_literal(&value)
        );
        let out = std::process::Command::new("python3")
            .args(["-c", &code])
            .output()
            .expect("python3 runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let back: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(back, value);
    }

    #[test]
    fn the_three_kinds_of_agent_step() {
        let tasks = parse(
            concat!(
                r#"{"id":"a","tool":"mlp","arguments":{"input":[1]}}"#, "\n",
                r#"{"id":"b","code":"RESULT = 1","expected":1}"#, "\n",
                r#"{"id":"c","inputs":{"x":2},"expected":4,"verify":{"kind":"numeric","tolerance":0.5}}"#, "\n",
            ),
            "t.jsonl",
            Some("RESULT = TASK['x'] ** 2"),
        )
        .unwrap();
        assert!(matches!(&tasks[0].step, Step::Tool { server, .. } if server == "nomad"));
        assert_eq!(tasks[0].verify, Verify::None);
        assert_eq!(tasks[1].verify, Verify::Exact, "expected alone means exact");
        let Step::Code(code) = &tasks[2].step else {
            panic!()
        };
        assert!(
            code.starts_with("TASK = __import__('json').loads(\"{\\\"x\\\":2}\")\n"),
            "{code}"
        );
        assert!(code.ends_with("RESULT = TASK['x'] ** 2"));
    }

    #[test]
    fn every_bad_line_is_reported_with_its_number() {
        let text = concat!(
            r#"{"id":"a","tool":"m"}"#,
            "\n",
            "not json\n",
            r#"{"id":"a","tool":"m"}"#,
            "\n",
            r#"{"id":"c","tool":"m","argz":{}}"#,
            "\n",
            r#"{"id":"d","tool":"m","arguments":[1]}"#,
            "\n",
            r#"{"id":"e","code":"x","tool":"m"}"#,
            "\n",
            r#"{"id":"f","inputs":{}}"#,
            "\n",
            r#"{"id":"g","code":"x","verify":"exact"}"#,
            "\n",
            r#"{"id":"h"}"#,
            "\n",
        );
        let err = parse(text, "t.jsonl", None).unwrap_err();
        for expected in [
            "t.jsonl:2:",
            "t.jsonl:3: task id \"a\" appears twice",
            "t.jsonl:4:",
            "t.jsonl:5: `arguments` must be a JSON object",
            "t.jsonl:6: give only one of",
            "t.jsonl:7: `inputs` needs a template",
            "t.jsonl:8: `verify` needs an `expected` value",
            "t.jsonl:9: a task needs",
        ] {
            assert!(err.contains(expected), "missing {expected:?} in:\n{err}");
        }
        // A line's own JSON error names the column, not serde's "line 1" inside the file's line.
        assert!(
            err.contains("t.jsonl:2: expected ident (column 2)"),
            "{err}"
        );
        assert!(!err.contains("at line 1"), "{err}");
        assert!(
            parse("\n\n", "e.jsonl", None)
                .unwrap_err()
                .contains("no tasks")
        );
    }
}

//! The built-in `nomad` upstream: the scheduler's tools, called with JSON arguments.
//!
//! Arguments: `{"text": "..."}` for text tools, or `{"input": [numbers], "shape": [dims]}` for
//! tensor tools (`shape` defaults to `[len(input)]`); any other key is a tool option (e.g.
//! `max_tokens`). Results: `{"text": "..."}` (a generation's with `prompt_tokens`,
//! `cached_prompt_tokens`, `completion_tokens` and `finish_reason`) or
//! `{"output": [numbers], "shape": [dims]}`.

use nomad_proto::kinds::{InputType, KindSpec};
use nomad_proto::v1::{GenerationStats, Tensor, ToolInput, ToolOutput, tool_input, tool_output};
use serde_json::{Value, json};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ArgumentError {
    #[error("arguments must be a JSON object, got {0}")]
    NotObject(&'static str),
    #[error("give either `text` or `input`, not both")]
    Both,
    #[error("arguments need {0}")]
    Missing(&'static str),
    #[error("{kind} takes {takes}, not `{given}`")]
    WrongInput {
        kind: &'static str,
        takes: &'static str,
        given: &'static str,
    },
    #[error("`text` must be a string")]
    TextNotString,
    #[error("`input[{0}]` is not a number")]
    NotNumber(usize),
    #[error("`input` must be an array of numbers")]
    InputNotArray,
    #[error("`shape` must be an array of non-negative integers")]
    BadShape,
    #[error("`shape` {shape:?} holds {expected} elements but `input` has {actual}")]
    ShapeMismatch {
        shape: Vec<u64>,
        expected: u64,
        actual: usize,
    },
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// What a kind's arguments must hold, in words.
fn needs(kind: Option<&KindSpec>) -> &'static str {
    match kind {
        Some(k) if k.input == InputType::Tensor => "`input` (an array of numbers)",
        Some(k) if k.option("messages").is_some() => {
            "`text` (a string) or `messages` (a list of {\"role\", \"content\"})"
        }
        Some(_) => "`text` (a string)",
        None => "`text` (a string) or `input` (an array of numbers)",
    }
}

/// Converts JSON arguments to the scheduler's `ToolInput`, for a tool of `kind` when it is known
/// (its messages then name what that kind takes).
pub fn input_from_value(
    value: &Value,
    kind: Option<&KindSpec>,
) -> Result<ToolInput, ArgumentError> {
    let Value::Object(object) = value else {
        return Err(ArgumentError::NotObject(type_name(value)));
    };
    let mut object = object.clone();
    let text = object.remove("text");
    let input = object.remove("input");
    let shape = object.remove("shape");
    if let Some(k) = kind {
        let given = match (&text, &input) {
            (Some(_), None) if k.input == InputType::Tensor => Some("text"),
            (None, Some(_)) if k.input == InputType::Text => Some("input"),
            _ => None,
        };
        if let Some(given) = given {
            return Err(ArgumentError::WrongInput {
                kind: k.name,
                takes: needs(kind),
                given,
            });
        }
    }
    let value = match (text, input) {
        (Some(_), Some(_)) => return Err(ArgumentError::Both),
        // A conversation in `messages` stands for the text (generation).
        (None, None) if object.contains_key("messages") => tool_input::Value::Text(String::new()),
        (None, None) => return Err(ArgumentError::Missing(needs(kind))),
        (Some(Value::String(text)), None) => tool_input::Value::Text(text),
        (Some(_), None) => return Err(ArgumentError::TextNotString),
        (None, Some(Value::Array(items))) => {
            let values = items
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_f64()
                        .map(|f| f as f32)
                        .ok_or(ArgumentError::NotNumber(i))
                })
                .collect::<Result<Vec<f32>, _>>()?;
            let shape = match shape {
                None => vec![values.len() as u64],
                Some(Value::Array(dims)) => dims
                    .iter()
                    .map(|d| d.as_u64().ok_or(ArgumentError::BadShape))
                    .collect::<Result<Vec<_>, _>>()?,
                Some(_) => return Err(ArgumentError::BadShape),
            };
            let expected = shape
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or(ArgumentError::BadShape)?;
            if expected != values.len() as u64 {
                return Err(ArgumentError::ShapeMismatch {
                    shape,
                    expected,
                    actual: values.len(),
                });
            }
            tool_input::Value::Tensor(Tensor::from_f32(&values, shape))
        }
        (None, Some(_)) => return Err(ArgumentError::InputNotArray),
    };
    let options_json = if object.is_empty() {
        String::new()
    } else {
        Value::Object(object).to_string()
    };
    Ok(ToolInput {
        value: Some(value),
        options_json,
    })
}

/// A Python model's input: its arguments as they are, one JSON object (its own schema checks
/// them in its host).
pub fn arguments_input(value: &Value) -> Result<ToolInput, ArgumentError> {
    if !value.is_object() {
        return Err(ArgumentError::NotObject(type_name(value)));
    }
    Ok(ToolInput {
        value: Some(tool_input::Value::Json(value.to_string())),
        options_json: String::new(),
    })
}

/// Converts a tool's output to its JSON result; a generation's text comes with its token counts
/// and why it ended; a Python model's output is its JSON.
pub fn output_to_json(
    output: &ToolOutput,
    generation: Option<&GenerationStats>,
) -> Result<Value, String> {
    match &output.value {
        Some(tool_output::Value::Text(text)) => Ok(match generation {
            None => json!({ "text": text }),
            Some(g) => json!({
                "text": text,
                "prompt_tokens": g.prompt_tokens,
                "cached_prompt_tokens": g.cached_prompt_tokens,
                "completion_tokens": g.completion_tokens,
                "finish_reason": g.finish_reason,
            }),
        }),
        Some(tool_output::Value::Tensor(t)) => {
            let values = t.to_f32_vec().map_err(|e| e.to_string())?;
            Ok(json!({ "output": values, "shape": t.shape }))
        }
        Some(tool_output::Value::Json(text)) => {
            serde_json::from_str(text).map_err(|e| format!("the tool's output is not JSON: {e}"))
        }
        None => Err("the tool returned an empty output".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ToolInput, ArgumentError> {
        input_from_value(&serde_json::from_str(text).unwrap(), None)
    }

    #[test]
    fn a_kinds_own_inputs_are_named_when_one_is_missing_or_wrong() {
        let with = |kind: &str, text: &str| {
            input_from_value(
                &serde_json::from_str(text).unwrap(),
                nomad_proto::kinds::kind(kind),
            )
            .unwrap_err()
            .to_string()
        };
        assert_eq!(
            with("generate", r#"{"max_tokens": 4}"#),
            r#"arguments need `text` (a string) or `messages` (a list of {"role", "content"})"#
        );
        assert_eq!(with("embed", "{}"), "arguments need `text` (a string)");
        assert_eq!(
            with("mlp", r#"{"text": "x"}"#),
            "mlp takes `input` (an array of numbers), not `text`"
        );
        assert_eq!(
            with("embed", r#"{"input": [1]}"#),
            "embed takes `text` (a string), not `input`"
        );
    }

    #[test]
    fn text_and_tensor_arguments_convert_and_extra_keys_become_options() {
        let t = parse(r#"{"text":"hi","max_tokens":4}"#).unwrap();
        assert_eq!(t.value, Some(tool_input::Value::Text("hi".into())));
        assert_eq!(t.options_json, r#"{"max_tokens":4}"#);
        let t = parse(r#"{"input":[1,2.5,3,4],"shape":[2,2]}"#).unwrap();
        match t.value {
            Some(tool_input::Value::Tensor(t)) => {
                assert_eq!(t.shape, vec![2, 2]);
                assert_eq!(t.to_f32_vec().unwrap(), vec![1.0, 2.5, 3.0, 4.0]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bad_arguments_name_the_field() {
        let cases = [
            ("[1]", "got an array"),
            (r#"{"text":1}"#, "`text` must be a string"),
            (r#"{"input":[1,"x"]}"#, "`input[1]`"),
            (
                r#"{"input":[1,2],"shape":[3]}"#,
                "holds 3 elements but `input` has 2",
            ),
            (r#"{"input":[1],"text":"a"}"#, "not both"),
            ("{}", "need `text` (a string) or `input`"),
            (r#"{"input":[1],"shape":[-1]}"#, "`shape`"),
        ];
        for (args, expected) in cases {
            let msg = parse(args).unwrap_err().to_string();
            assert!(msg.contains(expected), "{args}: {msg}");
        }
    }

    #[test]
    fn tensor_output_round_trips_to_json() {
        let out = ToolOutput {
            value: Some(tool_output::Value::Tensor(Tensor::from_f32(
                &[0.5, -1.0],
                vec![2],
            ))),
        };
        assert_eq!(
            output_to_json(&out, None).unwrap(),
            json!({"output": [0.5, -1.0], "shape": [2]})
        );
    }

    #[test]
    fn a_generation_answers_with_its_token_counts_and_finish_reason() {
        let out = ToolOutput {
            value: Some(tool_output::Value::Text("Paris".into())),
        };
        let stats = GenerationStats {
            prompt_tokens: 30,
            cached_prompt_tokens: 24,
            completion_tokens: 2,
            finish_reason: "stop".into(),
            ..Default::default()
        };
        assert_eq!(
            output_to_json(&out, Some(&stats)).unwrap(),
            json!({"text": "Paris", "prompt_tokens": 30, "cached_prompt_tokens": 24,
                   "completion_tokens": 2, "finish_reason": "stop"})
        );
        assert_eq!(
            output_to_json(&out, None).unwrap(),
            json!({"text": "Paris"})
        );
    }
}

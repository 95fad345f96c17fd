//! Per-request tool options (`Input::options`): a JSON object whose keys, types and
//! ranges the kind's table (`nomad_proto::kinds`) gives. Every value is checked once, here.

use std::collections::HashMap;

use nomad_proto::kinds::{self, KindSpec, OptionSpec, OptionType};
use serde_json::Value;

use crate::models::batch::invalid;
use crate::models::formats::chat_template::Message;
use crate::models::model::Answer;

/// A request's options, checked against its kind: each known option's value, or its default.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    values: HashMap<&'static str, Checked>,
    /// The options the request set (the rest hold the kind's defaults).
    given: Vec<&'static str>,
}

/// A checked value; whole numbers stay exact (a seed may exceed f64's integers).
#[derive(Debug, Clone, PartialEq)]
enum Checked {
    Flag(bool),
    Integer(u64),
    Number(f64),
    Strings(Vec<String>),
    Messages(Vec<Message>),
    Text(Option<String>),
    Texts(Vec<String>),
}

impl Checked {
    fn default_of(spec: &OptionSpec) -> Self {
        match spec.ty {
            OptionType::Bool => Checked::Flag(spec.default != 0.0),
            OptionType::Integer => Checked::Integer(spec.default as u64),
            OptionType::Number => Checked::Number(spec.default),
            OptionType::Strings => Checked::Strings(Vec::new()),
            OptionType::Messages => Checked::Messages(Vec::new()),
            OptionType::Text => Checked::Text(None),
            OptionType::Texts => Checked::Texts(Vec::new()),
        }
    }
}

/// A list of at most `max` `what` (a plural noun), each item read by `item` with its index.
fn list<T>(
    key: &str,
    value: &Value,
    max: usize,
    what: &str,
    item: impl Fn(usize, &Value) -> Result<T, String>,
) -> Result<Vec<T>, String> {
    let items = value
        .as_array()
        .ok_or_else(|| format!("option {key:?} must be a list of {what}"))?;
    if items.len() > max {
        return Err(format!(
            "option {key:?} has {} {what}; at most {max}",
            items.len()
        ));
    }
    items.iter().enumerate().map(|(i, v)| item(i, v)).collect()
}

/// A `Strings` value: a list of short non-empty strings.
fn strings(key: &str, value: &Value, max: usize) -> Result<Vec<String>, String> {
    list(key, value, max, "strings", |_, item| match item.as_str() {
        Some(s) if !s.is_empty() && s.len() <= kinds::MAX_STRING_BYTES => Ok(s.to_owned()),
        Some(_) => Err(format!(
            "option {key:?}: each string must be 1 to {} bytes",
            kinds::MAX_STRING_BYTES
        )),
        None => Err(format!("option {key:?} must be a list of strings")),
    })
}

/// A `Texts` value: a list of non-empty texts of bounded size.
fn texts(key: &str, value: &Value, max: usize) -> Result<Vec<String>, String> {
    list(key, value, max, "texts", |i, item| match item.as_str() {
        Some(s) if !s.trim().is_empty() && s.len() <= kinds::MAX_TEXT_BYTES => Ok(s.to_owned()),
        Some(s) if s.trim().is_empty() => Err(format!("option {key:?}: text {i} is empty")),
        Some(_) => Err(format!(
            "option {key:?}: text {i} is over {} bytes",
            kinds::MAX_TEXT_BYTES
        )),
        None => Err(format!("option {key:?}: item {i} is not a string")),
    })
}

/// A `Messages` value: `{"role", "content"}` objects with a known role.
fn messages(key: &str, value: &Value, max: usize) -> Result<Vec<Message>, String> {
    list(key, value, max, "messages", |i, item| {
        let role = item.get("role").and_then(Value::as_str);
        let content = item.get("content").and_then(Value::as_str);
        let extra = item
            .as_object()
            .is_some_and(|o| o.keys().any(|k| k != "role" && k != "content"));
        match (role, content) {
            (Some(role), Some(content)) if !extra => {
                let role = kinds::ROLES.iter().find(|r| **r == role).ok_or_else(|| {
                    format!(
                        "option {key:?}: message {i} has role {role:?}; roles are {}",
                        kinds::ROLES.join(", ")
                    )
                })?;
                Ok(Message {
                    role,
                    content: content.to_owned(),
                })
            }
            _ => Err(format!(
                "option {key:?}: message {i} must be {{\"role\": \"...\", \"content\": \"...\"}}"
            )),
        }
    })
}

impl Options {
    /// The options of request `index`, refusing unknown keys and values of the wrong type or
    /// out of range (naming the option and its range).
    pub fn parse(index: usize, json: &str, kind: &KindSpec) -> Result<Self, Answer> {
        let mut values: HashMap<&'static str, Checked> = kind
            .options
            .iter()
            .map(|o| (o.name, Checked::default_of(o)))
            .collect();
        let mut given = Vec::new();
        if json.trim().is_empty() {
            return Ok(Self { values, given });
        }
        let value: Value = serde_json::from_str(json)
            .map_err(|e| invalid(index, format!("options are not valid JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(invalid(index, "options must be a JSON object"));
        };
        for (key, value) in &map {
            let Some(spec) = kind.option(key) else {
                let known = kind.option_names();
                return Err(invalid(
                    index,
                    if known.is_empty() {
                        format!("unknown option {key:?}; {} takes none", kind.name)
                    } else {
                        format!(
                            "unknown option {key:?}; this tool takes: {}",
                            known.join(", ")
                        )
                    },
                ));
            };
            let max_items = spec.max as usize;
            let (checked, number) = match (spec.ty, value) {
                (OptionType::Strings, v) => {
                    let list = strings(key, v, max_items).map_err(|m| invalid(index, m))?;
                    (Checked::Strings(list), spec.min)
                }
                (OptionType::Messages, v) => {
                    let list = messages(key, v, max_items).map_err(|m| invalid(index, m))?;
                    (Checked::Messages(list), spec.min)
                }
                (OptionType::Texts, v) => {
                    let list = texts(key, v, max_items).map_err(|m| invalid(index, m))?;
                    (Checked::Texts(list), spec.min)
                }
                (OptionType::Text, Value::String(t))
                    if !t.is_empty() && t.len() <= kinds::MAX_STRING_BYTES =>
                {
                    (Checked::Text(Some(t.clone())), spec.min)
                }
                (OptionType::Text, _) => {
                    return Err(invalid(
                        index,
                        format!(
                            "option {key:?} must be a string of 1 to {} bytes",
                            kinds::MAX_STRING_BYTES
                        ),
                    ));
                }
                (OptionType::Bool, Value::Bool(b)) => (Checked::Flag(*b), f64::from(u8::from(*b))),
                (OptionType::Bool, _) => {
                    return Err(invalid(
                        index,
                        format!("option {key:?} must be true or false"),
                    ));
                }
                (OptionType::Integer, v) => {
                    let n = v.as_u64().ok_or_else(|| {
                        invalid(index, format!("option {key:?} must be a whole number"))
                    })?;
                    (Checked::Integer(n), n as f64)
                }
                (OptionType::Number, v) => {
                    let x = v.as_f64().ok_or_else(|| {
                        invalid(index, format!("option {key:?} must be a number"))
                    })?;
                    (Checked::Number(x), x)
                }
            };
            if !(spec.min..=spec.max).contains(&number) {
                return Err(invalid(
                    index,
                    format!(
                        "option {key:?} is {value}; it must be between {} and {}",
                        spec.min, spec.max
                    ),
                ));
            }
            values.insert(spec.name, checked);
            given.push(spec.name);
        }
        Ok(Self { values, given })
    }

    /// Whether the request set `name` itself (else it holds the kind's default).
    pub fn given(&self, name: &str) -> bool {
        self.given.contains(&name)
    }

    pub fn flag(&self, name: &str) -> bool {
        matches!(self.values.get(name), Some(Checked::Flag(true)))
    }

    pub fn integer(&self, name: &str) -> u64 {
        match self.values.get(name) {
            Some(Checked::Integer(n)) => *n,
            _ => 0,
        }
    }

    pub fn number(&self, name: &str) -> f64 {
        match self.values.get(name) {
            Some(Checked::Number(x)) => *x,
            _ => 0.0,
        }
    }

    pub fn strings(&self, name: &str) -> &[String] {
        match self.values.get(name) {
            Some(Checked::Strings(list)) => list,
            _ => &[],
        }
    }

    pub fn messages(&self, name: &str) -> &[Message] {
        match self.values.get(name) {
            Some(Checked::Messages(list)) => list,
            _ => &[],
        }
    }

    pub fn texts(&self, name: &str) -> &[String] {
        match self.values.get(name) {
            Some(Checked::Texts(list)) => list,
            _ => &[],
        }
    }

    /// A `Text` option's value, when the request gave one.
    pub fn text(&self, name: &str) -> Option<&str> {
        match self.values.get(name) {
            Some(Checked::Text(text)) => text.as_deref(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nomad_proto::kinds::{EMBED, GENERATE, MLP};

    fn refusal(result: Result<Options, Answer>) -> String {
        match result.unwrap_err() {
            Answer::Invalid(m) => m,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn defaults_values_and_refusals_come_from_the_table() {
        let none = Options::parse(0, "", &GENERATE).unwrap();
        assert_eq!(none.integer("max_tokens"), 64);
        assert!(none.flag("chat"));
        let some = Options::parse(
            0,
            r#"{"max_tokens": 8, "temperature": 0.5, "chat": false}"#,
            &GENERATE,
        )
        .unwrap();
        assert_eq!(
            (some.integer("max_tokens"), some.number("temperature")),
            (8, 0.5)
        );
        assert!(!some.flag("chat"));
        // What the request set is told apart from a default.
        assert!(some.given("temperature") && !some.given("top_p"));
        assert!(!none.given("max_tokens"));
        for (json, expected) in [
            (r#"{"max_tokens": 0}"#, "between 1 and 2048"),
            (r#"{"max_tokens": 1.5}"#, "whole number"),
            (r#"{"temperature": 9}"#, "between 0 and 2"),
            (r#"{"chat": "yes"}"#, "true or false"),
            (r#"{"top_q": 1}"#, "this tool takes: max_tokens"),
            ("[1]", "JSON object"),
            ("{", "not valid JSON"),
        ] {
            let message = refusal(Options::parse(3, json, &GENERATE));
            assert!(message.contains(expected), "{json}: {message}");
        }
        assert!(refusal(Options::parse(0, r#"{"x": 1}"#, &MLP)).contains("mlp takes none"));
        assert!(
            Options::parse(0, r#"{"truncate": true}"#, &EMBED)
                .unwrap()
                .flag("truncate")
        );
        let seed = Options::parse(0, r#"{"seed": 18446744073709551615}"#, &GENERATE).unwrap();
        assert_eq!(seed.integer("seed"), u64::MAX);
    }

    #[test]
    fn every_sampling_option_is_checked_naming_it_and_its_range() {
        let all = Options::parse(
            0,
            r#"{"top_p": 0.9, "top_k": 40, "repeat_penalty": 1.1, "stop": ["\n\n", "END"],
                "messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"}]}"#,
            &GENERATE,
        )
        .unwrap();
        assert_eq!(all.number("top_p"), 0.9);
        assert_eq!(all.integer("top_k"), 40);
        assert_eq!(all.number("repeat_penalty"), 1.1);
        assert_eq!(all.strings("stop"), ["\n\n", "END"]);
        assert_eq!(all.messages("messages")[1].role, "user");
        let defaults = Options::parse(0, "", &GENERATE).unwrap();
        assert_eq!(
            (defaults.number("top_p"), defaults.integer("top_k")),
            (1.0, 0)
        );
        assert_eq!(defaults.number("repeat_penalty"), 1.0);
        assert!(defaults.strings("stop").is_empty() && defaults.messages("messages").is_empty());
        let long = format!(r#"{{"stop": ["{}"]}}"#, "x".repeat(65));
        for (json, expected) in [
            (
                r#"{"top_p": 0}"#,
                r#"option "top_p" is 0; it must be between 0.01 and 1"#,
            ),
            (r#"{"top_p": 1.5}"#, "between 0.01 and 1"),
            (
                r#"{"top_k": -1}"#,
                r#"option "top_k" must be a whole number"#,
            ),
            (r#"{"top_k": 5000}"#, "between 0 and 1000"),
            (
                r#"{"repeat_penalty": 3}"#,
                r#""repeat_penalty" is 3; it must be between 0.5 and 2"#,
            ),
            (
                r#"{"stop": "END"}"#,
                r#"option "stop" must be a list of strings"#,
            ),
            (r#"{"stop": ["a", "b", "c", "d", "e"]}"#, "at most 4"),
            (r#"{"stop": [""]}"#, "1 to 64 bytes"),
            (long.as_str(), "1 to 64 bytes"),
            (
                r#"{"messages": [{"role": "robot", "content": "x"}]}"#,
                "roles are system, user, assistant",
            ),
            (r#"{"messages": [{"role": "user"}]}"#, "message 0 must be"),
            (r#"{"messages": "hi"}"#, "must be a list of messages"),
        ] {
            let message = refusal(Options::parse(0, json, &GENERATE));
            assert!(message.contains(expected), "{json}: {message}");
        }
    }
}

//! Per-request tool options (`ToolInput.options_json`): a JSON object whose keys, types and
//! ranges the kind's table (`nomad_proto::kinds`) gives. Every value is checked once, here.

use std::collections::HashMap;

use nomad_proto::kinds::{KindSpec, OptionSpec, OptionType};
use nomad_proto::v1::ItemResult;
use serde_json::Value;

use super::invalid;

/// A request's options, checked against its kind: each known option's value, or its default.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    values: HashMap<&'static str, Checked>,
}

/// A checked value; whole numbers stay exact (a seed may exceed f64's integers).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Checked {
    Flag(bool),
    Integer(u64),
    Number(f64),
}

impl Checked {
    fn default_of(spec: &OptionSpec) -> Self {
        match spec.ty {
            OptionType::Bool => Checked::Flag(spec.default != 0.0),
            OptionType::Integer => Checked::Integer(spec.default as u64),
            OptionType::Number => Checked::Number(spec.default),
        }
    }
}

impl Options {
    /// The options of request `index`, refusing unknown keys and values of the wrong type or
    /// out of range (naming the option and its range).
    pub fn parse(index: usize, json: &str, kind: &KindSpec) -> Result<Self, ItemResult> {
        let mut values: HashMap<&'static str, Checked> = kind
            .options
            .iter()
            .map(|o| (o.name, Checked::default_of(o)))
            .collect();
        if json.trim().is_empty() {
            return Ok(Self { values });
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
            let (checked, number) = match (spec.ty, value) {
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
        }
        Ok(Self { values })
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use nomad_proto::kinds::{EMBED, GENERATE, MLP};
    use nomad_proto::v1::item_result;

    fn refusal(result: Result<Options, ItemResult>) -> String {
        match result.unwrap_err().result {
            Some(item_result::Result::InvalidInput(m)) => m,
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
}

//! Per-request tool options (`ToolInput.options_json`): a JSON object of known keys.

use nomad_proto::v1::ItemResult;
use serde_json::{Map, Value};

use super::invalid;

/// The options of request `index`, refusing keys not in `allowed` (naming them).
pub fn parse(index: usize, json: &str, allowed: &[&str]) -> Result<Map<String, Value>, ItemResult> {
    if json.trim().is_empty() {
        return Ok(Map::new());
    }
    let value: Value = serde_json::from_str(json)
        .map_err(|e| invalid(index, format!("options are not valid JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(invalid(index, "options must be a JSON object"));
    };
    if let Some(unknown) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(invalid(
            index,
            format!(
                "unknown option {unknown:?}; this tool takes: {}",
                allowed.join(", ")
            ),
        ));
    }
    Ok(map)
}

pub fn bool_option(
    index: usize,
    map: &Map<String, Value>,
    key: &str,
    default: bool,
) -> Result<bool, ItemResult> {
    match map.get(key) {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(invalid(
            index,
            format!("option {key:?} must be true or false"),
        )),
    }
}

pub fn u64_option(
    index: usize,
    map: &Map<String, Value>,
    key: &str,
    default: u64,
    range: std::ops::RangeInclusive<u64>,
) -> Result<u64, ItemResult> {
    let value = match map.get(key) {
        None => return Ok(default),
        Some(v) => v
            .as_u64()
            .ok_or_else(|| invalid(index, format!("option {key:?} must be a whole number")))?,
    };
    if range.contains(&value) {
        Ok(value)
    } else {
        Err(invalid(
            index,
            format!(
                "option {key:?} is {value}; it must be between {} and {}",
                range.start(),
                range.end()
            ),
        ))
    }
}

pub fn f64_option(
    index: usize,
    map: &Map<String, Value>,
    key: &str,
    default: f64,
    range: std::ops::RangeInclusive<f64>,
) -> Result<f64, ItemResult> {
    let value = match map.get(key) {
        None => return Ok(default),
        Some(v) => v
            .as_f64()
            .ok_or_else(|| invalid(index, format!("option {key:?} must be a number")))?,
    };
    if range.contains(&value) {
        Ok(value)
    } else {
        Err(invalid(
            index,
            format!(
                "option {key:?} is {value}; it must be between {} and {}",
                range.start(),
                range.end()
            ),
        ))
    }
}

//! How sandboxed code calls a tool: a Python signature generated from the tool's JSON Schema.
//! Total over any JSON: odd or hostile schemas give a looser signature, never a panic.

use serde_json::Value;

/// A Python identifier for `name` (the runner uses the same rule).
pub fn identifier(name: &str) -> String {
    let mut ident: String = name
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    const KEYWORDS: &[&str] = &[
        "False", "None", "True", "and", "as", "assert", "async", "await", "break", "class",
        "continue", "def", "del", "elif", "else", "except", "finally", "for", "from", "global",
        "if", "import", "in", "is", "lambda", "nonlocal", "not", "or", "pass", "raise", "return",
        "try", "while", "with", "yield",
    ];
    if ident.is_empty()
        || ident.starts_with(|c: char| c.is_ascii_digit())
        || KEYWORDS.contains(&ident.as_str())
    {
        ident.insert(0, '_');
    }
    ident
}

fn is_identifier(name: &str) -> bool {
    identifier(name) == name
}

/// The Python type for a JSON Schema fragment.
fn python_type(schema: &Value, depth: usize) -> String {
    if depth > 8 {
        return "Any".into();
    }
    let single = |t: &str| -> String {
        match t {
            "string" => "str".into(),
            "integer" => "int".into(),
            "number" => "float".into(),
            "boolean" => "bool".into(),
            "null" => "None".into(),
            "object" => "dict".into(),
            "array" => match schema.get("items") {
                Some(items) if items.is_object() => {
                    format!("list[{}]", python_type(items, depth + 1))
                }
                _ => "list".into(),
            },
            _ => "Any".into(),
        }
    };
    match schema.get("type") {
        Some(Value::String(t)) => single(t),
        Some(Value::Array(types)) => {
            let names: Vec<String> = types.iter().filter_map(Value::as_str).map(single).collect();
            if names.is_empty() {
                "Any".into()
            } else {
                names.join(" | ")
            }
        }
        _ => match schema.get("anyOf").or_else(|| schema.get("oneOf")) {
            Some(Value::Array(options)) if !options.is_empty() => options
                .iter()
                .map(|o| python_type(o, depth + 1))
                .collect::<Vec<_>>()
                .join(" | "),
            _ => "Any".into(),
        },
    }
}

fn python_literal(value: &Value) -> String {
    match value {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

/// `name(required: type, optional: type = default, ...) -> Any`, parameters in the order the
/// runner accepts them positionally: required ones in schema order, then the optional ones by
/// name (both sides see the schema as the gateway serialises it).
pub fn python_signature(tool: &str, schema: &Value) -> String {
    let properties = schema.get("properties").and_then(Value::as_object);
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut params = Vec::new();
    let mut extra = false;
    if let Some(properties) = properties {
        let ordered = required
            .iter()
            .filter(|r| properties.contains_key(**r))
            .copied()
            .chain(
                properties
                    .keys()
                    .map(String::as_str)
                    .filter(|k| !required.contains(k)),
            );
        for name in ordered {
            if !is_identifier(name) {
                extra = true;
                continue;
            }
            let prop = &properties[name];
            let ty = python_type(prop, 0);
            if required.contains(&name) {
                params.push(format!("{name}: {ty}"));
            } else {
                let default = prop.get("default").map_or("None".into(), python_literal);
                params.push(format!("{name}: {ty} = {default}"));
            }
        }
    }
    if extra || properties.is_none() {
        params.push("**arguments".into());
    }
    format!("{}({}) -> Any", identifier(tool), params.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn required_first_then_optional_by_name_with_python_defaults() {
        let schema = json!({
            "type": "object",
            "properties": {
                "truncate": {"type": "boolean", "default": false},
                "text": {"type": "string"},
                "ids": {"type": "array", "items": {"type": "integer"}},
                "mode": {"type": ["string", "null"], "default": "fast"}
            },
            "required": ["text"]
        });
        assert_eq!(
            python_signature("embed", &schema),
            r#"embed(text: str, ids: list[int] = None, mode: str | None = "fast", truncate: bool = False) -> Any"#
        );
    }

    #[test]
    fn odd_names_and_schemas_never_panic() {
        assert_eq!(
            python_signature("do-thing", &json!({})),
            "do_thing(**arguments) -> Any"
        );
        assert_eq!(identifier("class"), "_class");
        assert_eq!(identifier("3d"), "_3d");
        assert_eq!(identifier(""), "_");
        let weird =
            json!({"properties": {"a b": {}, "ok": {"type": 7}}, "required": [1, "ok", "missing"]});
        assert_eq!(
            python_signature("t", &weird),
            "t(ok: Any, **arguments) -> Any"
        );
        let mut deep = json!({"type": "string"});
        for _ in 0..50 {
            deep = json!({"type": "array", "items": deep});
        }
        assert!(python_signature("t", &json!({"properties": {"x": deep}})).contains("list[list["));
        for odd in [
            json!(null),
            json!(1),
            json!("s"),
            json!([1, 2]),
            json!({"properties": 3}),
        ] {
            python_signature("t", &odd);
        }
    }
}

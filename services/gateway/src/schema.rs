//! How sandboxed code calls a tool: a Python signature generated from the tool's JSON Schema.
//! Total over any JSON: odd or hostile schemas give a looser signature, never a panic.

use serde_json::Value;

/// A Python identifier for `name` (the runner uses the same rule).
pub fn identifier(name: &str) -> String {
    let mut ident: String = name
        .chars()
        .map(|c| {
            // ASCII only: Python refuses some characters Rust calls alphanumeric (`²`).
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    const KEYWORDS: &[&str] = &[
        "False",
        "None",
        "True",
        "and",
        "as",
        "assert",
        "async",
        "await",
        "break",
        "class",
        "continue",
        "def",
        "del",
        "elif",
        "else",
        "except",
        "finally",
        "for",
        "from",
        "global",
        "if",
        "import",
        "in",
        "is",
        "lambda",
        "nonlocal",
        "not",
        "or",
        "pass",
        "raise",
        "return",
        "try",
        "while",
        "with",
        "yield",
        "__debug__",
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
    // A JSON string literal is a valid Python one: its escapes are a subset of Python's.
    let string = |s: &str| serde_json::to_string(s).expect("a string serializes");
    match value {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => string(s),
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(python_literal).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Object(map) => {
            let items: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{}: {}", string(k), python_literal(v)))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
    }
}

/// The names in a schema's `required` list, in order, without repeats.
fn required_names(schema: &Value) -> Vec<&str> {
    let mut names: Vec<&str> = Vec::new();
    for name in schema
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
    {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// The main inputs a schema offers as alternatives (`anyOf`/`oneOf` of `required` lists, as
/// `generate`'s `text` or `messages`), in order: optional, but first among the optional ones.
fn alternative_names(schema: &Value) -> Vec<&str> {
    let mut names: Vec<&str> = Vec::new();
    for branch in ["anyOf", "oneOf"]
        .iter()
        .filter_map(|k| schema.get(*k).and_then(Value::as_array))
        .flatten()
    {
        for name in required_names(branch) {
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    names
}

/// `name(required: type, optional: type = default, ...) -> Any`, parameters in the order the
/// runner accepts them positionally: required ones in schema order, then the alternatives of an
/// `anyOf` (a prompt before the options), then the other optional ones by name (both sides see
/// the schema as the gateway serialises it).
pub fn python_signature(tool: &str, schema: &Value) -> String {
    let properties = schema.get("properties").and_then(Value::as_object);
    let required = required_names(schema);
    let alternatives: Vec<&str> = alternative_names(schema)
        .into_iter()
        .filter(|n| !required.contains(n))
        .collect();
    let mut params = Vec::new();
    let mut extra = false;
    if let Some(properties) = properties {
        let ordered = required
            .iter()
            .chain(&alternatives)
            .filter(|r| properties.contains_key(**r))
            .copied()
            .chain(
                properties
                    .keys()
                    .map(String::as_str)
                    .filter(|k| !required.contains(k) && !alternatives.contains(k)),
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
        // The catch-all must not take a parameter's name.
        let mut rest = "arguments".to_owned();
        while properties.is_some_and(|p| p.contains_key(&rest)) {
            rest.insert(0, '_');
        }
        params.push(format!("**{rest}"));
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
    fn a_main_input_among_alternatives_comes_before_the_options() {
        let schema = json!({
            "type": "object",
            "properties": {
                "chat": {"type": "boolean", "default": true},
                "max_tokens": {"type": "integer", "default": 64},
                "messages": {"type": "array"},
                "text": {"type": "string"}
            },
            "anyOf": [{"required": ["text"]}, {"required": ["messages"]}]
        });
        assert_eq!(
            python_signature("generate", &schema),
            "generate(text: str = None, messages: list = None, chat: bool = True, max_tokens: int = 64) -> Any"
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

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn json() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::Bool),
                any::<i64>().prop_map(|n| json!(n)),
                any::<f64>()
                    .prop_filter("finite", |f| f.is_finite())
                    .prop_map(|f| json!(f)),
                ".{0,8}".prop_map(Value::String),
                // What a Python literal must escape.
                "[\\x00-\\x1f\\x7f'\"\\\\\u{200b}\u{1F600}a]{1,4}".prop_map(Value::String),
                prop_oneof![
                    Just("string"),
                    Just("integer"),
                    Just("number"),
                    Just("boolean"),
                    Just("array"),
                    Just("object"),
                    Just("null"),
                    Just("arguments"),
                    Just("class"),
                    Just("x²"),
                ]
                .prop_map(|s| Value::String(s.into())),
            ];
            leaf.prop_recursive(4, 48, 6, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                    prop::collection::btree_map(
                        prop_oneof![
                            Just("type".to_owned()),
                            Just("properties".to_owned()),
                            Just("required".to_owned()),
                            Just("items".to_owned()),
                            Just("default".to_owned()),
                            Just("arguments".to_owned()),
                            "[a-z_]{1,6}",
                            ".{0,4}",
                        ],
                        inner,
                        0..5
                    )
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
                ]
            })
        }

        /// Properties as tools declare them: names, types and defaults.
        fn properties() -> impl Strategy<Value = Value> {
            let property = (
                prop::sample::select(vec!["string", "integer", "array", "object", "boolean"]),
                proptest::option::of(json()),
            )
                .prop_map(|(ty, default)| {
                    let mut p = json!({"type": ty});
                    if let Some(d) = default {
                        p["default"] = d;
                    }
                    p
                });
            prop::collection::btree_map(
                prop_oneof![
                    "[a-z_][a-z0-9_]{0,5}",
                    Just("arguments".to_owned()),
                    Just("class".to_owned()),
                    Just("x²".to_owned())
                ],
                property,
                0..5,
            )
            .prop_map(|m| Value::Object(m.into_iter().collect()))
        }

        /// Whether Python parses `def <signature>: pass`.
        fn python_parses(signature: &str) -> Result<(), String> {
            use std::io::Write as _;
            let mut child = std::process::Command::new("python3")
                .args(["-c", "import ast, sys; ast.parse(sys.stdin.read())"])
                .stdin(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .map_err(|e| e.to_string())?;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(format!("def {signature}: pass\n").as_bytes())
                .unwrap();
            let out = child.wait_with_output().unwrap();
            if out.status.success() {
                Ok(())
            } else {
                Err(String::from_utf8_lossy(&out.stderr).into_owned())
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(96))]

            /// Any schema and tool name give a signature Python parses.
            #[test]
            fn every_signature_is_valid_python(tool in ".{0,10}", properties in prop_oneof![properties(), json()], required in json()) {
                let schema = json!({"type": "object", "properties": properties, "required": required});
                let signature = python_signature(&tool, &schema);
                prop_assert!(python_parses(&signature).is_ok(), "{signature}: {:?}", python_parses(&signature));
            }
        }
    }
}

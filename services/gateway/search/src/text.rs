//! Text of a tool as the rankers see it: identifiers split into words, the arguments as one text,
//! and how well a query matches a tool's name.

use serde_json::Value;

/// `text` with identifiers opened into words: `snake_case`, `camelCase`, `dotted.names`,
/// `kebab-case` and `HTTPServer` become space-separated words; everything else is kept.
pub fn split_identifiers(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len() + 8);
    for (i, &c) in chars.iter().enumerate() {
        if matches!(c, '_' | '.' | '-' | '/' | ':') {
            out.push(' ');
            continue;
        }
        if c.is_uppercase() && i > 0 {
            let prev = chars[i - 1];
            let next_lower = chars.get(i + 1).is_some_and(|n| n.is_lowercase());
            // fooBar -> foo Bar; HTTPServer -> HTTP Server; a digit run ends a word too.
            if prev.is_lowercase() || prev.is_ascii_digit() || (prev.is_uppercase() && next_lower) {
                out.push(' ');
            }
        }
        out.push(c);
    }
    out
}

/// The words of `text` as one lowercase `snake_case` key, for comparing a query with a name.
pub fn name_key(text: &str) -> String {
    split_identifiers(text)
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect::<Vec<_>>()
        .join("_")
}

/// The name-match tier of `name` for `query` (the original's bonus): the query's words as the
/// whole name 12, its start 8, its end 4, inside it 2, else 0.
pub fn name_tier(query_key: &str, name: &str) -> f64 {
    if query_key.is_empty() {
        return 0.0;
    }
    let name = name_key(name);
    if name == query_key {
        12.0
    } else if name.starts_with(query_key) {
        8.0
    } else if name.ends_with(query_key) {
        4.0
    } else if name.contains(query_key) {
        2.0
    } else {
        0.0
    }
}

/// Argument names and descriptions of a JSON Schema's top-level properties, as one text.
pub fn arguments_text(input_schema: &Value) -> String {
    let Some(properties) = input_schema.get("properties").and_then(Value::as_object) else {
        return String::new();
    };
    let mut parts = Vec::with_capacity(properties.len());
    for (name, schema) in properties {
        parts.push(split_identifiers(name));
        if let Some(description) = schema.get("description").and_then(Value::as_str) {
            parts.push(description.to_owned());
        }
    }
    parts.join(". ")
}

/// At most `max` bytes of `text`, cut at a character boundary.
pub fn clip(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn identifiers_open_into_words() {
        assert_eq!(split_identifiers("get_current_time"), "get current time");
        assert_eq!(split_identifiers("readRange"), "read Range");
        assert_eq!(
            split_identifiers("mcp_tools.excel.read_range"),
            "mcp tools excel read range"
        );
        assert_eq!(split_identifiers("HTTPServer"), "HTTP Server");
        assert_eq!(split_identifiers("utf8Decode"), "utf8 Decode");
        assert_eq!(split_identifiers("plain words stay"), "plain words stay");
    }

    #[test]
    fn name_tiers_follow_the_original() {
        let q = name_key("git status");
        assert_eq!(q, "git_status");
        assert_eq!(name_tier(&q, "git_status"), 12.0);
        assert_eq!(name_tier(&name_key("gitStatus"), "git_status"), 12.0);
        assert_eq!(name_tier(&name_key("git_diff"), "git_diff_staged"), 8.0);
        assert_eq!(name_tier(&name_key("diff staged"), "git_diff_staged"), 4.0);
        assert_eq!(name_tier(&name_key("diff"), "git_diff_staged"), 2.0);
        assert_eq!(name_tier(&name_key("commit"), "git_diff_staged"), 0.0);
        assert_eq!(name_tier("", "git_status"), 0.0);
    }

    #[test]
    fn arguments_text_names_each_property_with_its_description() {
        let schema = json!({"type": "object", "properties": {
            "repo_path": {"type": "string", "description": "Where the repository is"},
            "maxCount": {"type": "integer"}}});
        let text = arguments_text(&schema);
        assert!(
            text.contains("repo path. Where the repository is"),
            "{text}"
        );
        assert!(text.contains("max Count"), "{text}");
        assert_eq!(arguments_text(&json!({"type": "object"})), "");
    }

    #[test]
    fn clip_keeps_whole_characters() {
        assert_eq!(clip("héllo", 2), "h");
        assert_eq!(clip("hello", 10), "hello");
    }
}

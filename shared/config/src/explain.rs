//! A config error in a user's words: the key path written as it appears in the file
//! (`tools[0].batch_sise`), an unknown key with the nearest known one, and no nested quoting.

use figment::error::Kind;

/// `error` as one line: where, then what is wrong (`at` is where the value being read sits).
pub fn explain(error: &figment::Error, at: &str) -> String {
    let mut keys: Vec<&str> = error.path.iter().map(String::as_str).collect();
    // figment appends the key `extract_inner` read, which `at` already names.
    let root = at.split(['.', '[']).next().unwrap_or_default();
    if !root.is_empty() && keys.last() == Some(&root) {
        keys.pop();
    }
    // An unknown key's path ends with the key itself, which the message names.
    if let Kind::UnknownField(field, _) = &error.kind
        && keys.last() == Some(&field.as_str())
    {
        keys.pop();
    }
    let mut path = at.to_owned();
    for key in keys {
        match key.parse::<usize>() {
            Ok(index) => path.push_str(&format!("[{index}]")),
            Err(_) if path.is_empty() => path.push_str(key),
            Err(_) => {
                path.push('.');
                path.push_str(key);
            }
        }
    }
    let what = match &error.kind {
        Kind::UnknownField(field, expected) => {
            let hint = match suggest(field, expected) {
                Some(near) => format!(" (did you mean `{near}`?)"),
                None => String::new(),
            };
            return format!(
                "{path}: unknown key `{field}`{hint}; the keys here are: {}",
                expected.join(", ")
            );
        }
        Kind::MissingField(field) => format!("`{field}` is required"),
        other => other.to_string(),
    };
    if path.is_empty() {
        what
    } else {
        format!("{path}: {what}")
    }
}

/// The known name nearest to `given`, when it is near enough to be a typo of it.
pub fn suggest<'a>(given: &str, known: &[&'a str]) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (distance(given, k), *k))
        .filter(|(d, k)| *d <= (k.len() / 3).max(1))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// Edits between two strings: insertions, deletions, substitutions and swaps of neighbours.
fn distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            d[i][j] = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                d[i][j] = d[i][j].min(d[i - 2][j - 2] + 1);
            }
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typos_find_their_key_and_strangers_do_not() {
        let keys = ["batch_size", "tool_name", "name_or_path", "env"];
        assert_eq!(suggest("batch_sise", &keys), Some("batch_size"));
        assert_eq!(suggest("toolname", &keys), Some("tool_name"));
        assert_eq!(suggest("evn", &keys), Some("env"));
        assert_eq!(suggest("weights", &keys), None);
    }

    #[test]
    fn an_unknown_key_is_named_once_with_its_path() {
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Entry {
            batch_size: u32,
        }
        let file = crate::ConfigFile::from_yaml_str("tools:\n  - batch_sise: 3\n");
        let error = file
            .figment
            .extract_inner::<Vec<Entry>>("tools")
            .unwrap_err();
        let text = explain(&error, "tools");
        assert_eq!(
            text,
            "tools[0]: unknown key `batch_sise` (did you mean `batch_size`?); the keys here are: batch_size"
        );
    }
}

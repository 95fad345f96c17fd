//! `${VAR}` and `${VAR:DEFAULT}` in a config's strings, replaced from the environment as the
//! original Nomad's config loader does: a variable that is set wins, else the default; one that
//! is neither is an error naming it and where it was.

use figment::value::{Dict, Value};

use crate::Env;

/// `tree` with every string expanded; on an unset variable without a default, `Err((where,
/// variable))`.
pub fn expand(tree: Dict, env: &(impl Env + ?Sized)) -> Result<Dict, (String, String)> {
    tree.into_iter()
        .map(|(key, value)| Ok((key.clone(), expand_value(value, env, &key)?)))
        .collect()
}

fn expand_value(
    value: Value,
    env: &(impl Env + ?Sized),
    at: &str,
) -> Result<Value, (String, String)> {
    Ok(match value {
        Value::String(tag, text) => Value::String(tag, expand_text(&text, env, at)?),
        Value::Dict(tag, dict) => Value::Dict(
            tag,
            dict.into_iter()
                .map(|(k, v)| {
                    let here = format!("{at}.{k}");
                    expand_value(v, env, &here).map(|v| (k, v))
                })
                .collect::<Result<_, _>>()?,
        ),
        Value::Array(tag, items) => Value::Array(
            tag,
            items
                .into_iter()
                .enumerate()
                .map(|(i, v)| expand_value(v, env, &format!("{at}[{i}]")))
                .collect::<Result<_, _>>()?,
        ),
        other => other,
    })
}

/// One string: each `${NAME}` or `${NAME:default}` (NAME of letters, digits and `_`) replaced;
/// anything else, `$` included, kept as written.
fn expand_text(
    text: &str,
    env: &(impl Env + ?Sized),
    at: &str,
) -> Result<String, (String, String)> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else {
            out.push_str(&rest[start..]);
            return Ok(out);
        };
        let inner = &after[..end];
        let (name, default) = match inner.split_once(':') {
            Some((name, default)) => (name, Some(default)),
            None => (inner, None),
        };
        let is_name = !name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || c == '_');
        if !is_name {
            out.push_str("${");
            rest = after;
            continue;
        }
        match (env.var(name), default) {
            (Some(value), _) => out.push_str(&value),
            (None, Some(default)) => out.push_str(default),
            (None, None) => return Err((at.to_owned(), name.to_owned())),
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(text: &str) -> Result<String, (String, String)> {
        let env: &[(&str, &str)] = &[("HOME", "/home/ada"), ("EMPTY", "")];
        expand_text(text, env, "tools[0].source")
    }

    #[test]
    fn set_variables_win_then_defaults_and_the_rest_stays() {
        assert_eq!(run("${HOME}/models").unwrap(), "/home/ada/models");
        assert_eq!(run("${HOME:/srv}/m").unwrap(), "/home/ada/m");
        assert_eq!(run("${MODELS:/srv/models}/a").unwrap(), "/srv/models/a");
        assert_eq!(run("${EMPTY:x}").unwrap(), "", "set but empty is set");
        assert_eq!(run("cost $5 ${").unwrap(), "cost $5 ${");
        assert_eq!(run("${not a name}").unwrap(), "${not a name}");
        assert_eq!(run("${A:x}-${B:y}").unwrap(), "x-y");
    }

    #[test]
    fn an_unset_variable_without_default_names_itself_and_where() {
        assert_eq!(
            run("${WEIGHTS}/a").unwrap_err(),
            ("tools[0].source".to_owned(), "WEIGHTS".to_owned())
        );
    }

    #[test]
    fn every_string_of_a_tree_is_expanded() {
        let file = crate::ConfigFile::from_yaml_str("a:\n  - b: ${HOME}\n");
        let tree: Dict = file.figment.extract().unwrap();
        let env: &[(&str, &str)] = &[("HOME", "/h")];
        let out = expand(tree.clone(), env).unwrap();
        assert_eq!(
            out["a"].clone().into_array().unwrap()[0]
                .clone()
                .into_dict()
                .unwrap()["b"]
                .as_str(),
            Some("/h")
        );
        let err = expand(tree, &[] as &[(&str, &str)]).unwrap_err();
        assert_eq!(err, ("a[0].b".to_owned(), "HOME".to_owned()));
    }
}

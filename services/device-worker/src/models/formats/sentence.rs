//! What a sentence-transformers directory asks of its embeddings, read from its own files:
//! `modules.json` (the modules in order: a Transformer, a Pooling, optionally a Normalize),
//! the pooling module's `config.json` (which token vectors make the sentence vector: the
//! `pooling_mode` of sentence-transformers 5 and later, or the older `pooling_mode_*` flags),
//! the longest input (`sentence_bert_config.json`'s `max_seq_length`, else the tokenizer's
//! `model_max_length`), and `config_sentence_transformers.json` (named prompts and the default
//! one). A module or pooling mode Nomad does not compute is refused, naming it, rather than
//! served differently.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

/// How token vectors become the sentence vector; several are concatenated in this order, as
/// sentence-transformers concatenates them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The first token's vector (`[CLS]`).
    Cls,
    /// The largest value of each dimension over the real tokens.
    Max,
    /// The mean over the real tokens.
    Mean,
    /// The sum over the real tokens divided by the square root of their number.
    MeanSqrtLen,
    /// The last real token's vector.
    LastToken,
}

impl Pooling {
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Cls => "cls",
            Pooling::Max => "max",
            Pooling::Mean => "mean",
            Pooling::MeanSqrtLen => "mean_sqrt_len",
            Pooling::LastToken => "lasttoken",
        }
    }
}

/// The directory's settings for embedding.
#[derive(Debug, Clone, PartialEq)]
pub struct SentenceConfig {
    pub pooling: Vec<Pooling>,
    /// A `Normalize` module follows the pooling: unit-length vectors.
    pub normalize: bool,
    pub max_seq_length: Option<usize>,
    pub do_lower_case: bool,
    /// Named prompts prepended to a text (`query: `, ...), and the one used when a request
    /// names none.
    pub prompts: BTreeMap<String, String>,
    pub default_prompt: Option<String>,
    /// Whether the settings came from sentence-transformers files (else the defaults below).
    pub from_files: bool,
}

#[derive(Deserialize)]
struct Module {
    #[serde(default)]
    path: String,
    #[serde(rename = "type")]
    kind: String,
}

/// `pooling_mode`: one mode or a list, in the order they are concatenated.
#[derive(Deserialize)]
#[serde(untagged)]
enum Modes {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Default)]
struct PoolingFile {
    pooling_mode: Option<Modes>,
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
    #[serde(default)]
    pooling_mode_weightedmean_tokens: bool,
    #[serde(default)]
    pooling_mode_lasttoken: bool,
    #[serde(default = "yes")]
    include_prompt: bool,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize, Default)]
struct SentenceBertFile {
    max_seq_length: Option<usize>,
    #[serde(default)]
    do_lower_case: bool,
}

#[derive(Deserialize, Default)]
struct TokenizerConfigFile {
    model_max_length: Option<f64>,
}

#[derive(Deserialize, Default)]
struct PromptsFile {
    #[serde(default)]
    prompts: BTreeMap<String, String>,
    default_prompt_name: Option<String>,
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Option<T>, String> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// A module by its class name (`sentence_transformers.models.Pooling` and, from version 5,
/// `sentence_transformers.sentence_transformer.modules.pooling.Pooling`).
fn class(kind: &str) -> &str {
    kind.rsplit('.').next().unwrap_or(kind)
}

/// A pooling mode by its name in `pooling_mode`.
fn mode(name: &str, file: &Path) -> Result<Pooling, String> {
    Ok(match name {
        "cls" => Pooling::Cls,
        "max" => Pooling::Max,
        "mean" => Pooling::Mean,
        "mean_sqrt_len_tokens" => Pooling::MeanSqrtLen,
        "lasttoken" => Pooling::LastToken,
        "weightedmean" => {
            return Err(format!(
                "{}: weighted-mean pooling is not supported (supported: cls, mean, max, \
                 mean_sqrt_len_tokens, lasttoken)",
                file.display()
            ));
        }
        other => {
            return Err(format!(
                "{}: unknown pooling mode {other:?}",
                file.display()
            ));
        }
    })
}

impl SentenceConfig {
    /// Reads `dir`'s settings. Without `modules.json` (a plain transformers directory) the
    /// sentence vector is the mean over the real tokens, not normalised, as sentence-transformers
    /// wraps such a model.
    pub fn read(dir: &Path) -> Result<Self, String> {
        let modules: Option<Vec<Module>> = read_json(&dir.join("modules.json"))?;
        let (pooling_dir, normalize) = match &modules {
            None => (None, false),
            Some(modules) => {
                let mut pooling_dir = None;
                let mut normalize = false;
                for (i, m) in modules.iter().enumerate() {
                    match class(&m.kind) {
                        "Transformer" if i == 0 => {}
                        "Pooling" if pooling_dir.is_none() => pooling_dir = Some(m.path.clone()),
                        "Normalize" if pooling_dir.is_some() => normalize = true,
                        _ => {
                            let other = &m.kind;
                            return Err(format!(
                                "modules.json: module {i} is {other}, which Nomad does not \
                                 compute (it serves a Transformer, then Pooling, then an \
                                 optional Normalize)"
                            ));
                        }
                    }
                }
                (pooling_dir, normalize)
            }
        };
        let pooling = match &pooling_dir {
            Some(path) => {
                let file = dir.join(path).join("config.json");
                let p: PoolingFile = read_json(&file)?.ok_or_else(|| {
                    format!("{}: missing (modules.json names it)", file.display())
                })?;
                if !p.include_prompt {
                    return Err(format!(
                        "{}: include_prompt: false (pooling without the prompt's tokens) is not \
                         supported",
                        file.display()
                    ));
                }
                let names: Vec<String> = match p.pooling_mode {
                    Some(Modes::One(m)) => vec![m],
                    Some(Modes::Many(ms)) => ms,
                    // The older flags, in the order sentence-transformers concatenates them.
                    None => [
                        (p.pooling_mode_cls_token, "cls"),
                        (p.pooling_mode_max_tokens, "max"),
                        (p.pooling_mode_mean_tokens, "mean"),
                        (p.pooling_mode_mean_sqrt_len_tokens, "mean_sqrt_len_tokens"),
                        (p.pooling_mode_weightedmean_tokens, "weightedmean"),
                        (p.pooling_mode_lasttoken, "lasttoken"),
                    ]
                    .into_iter()
                    .filter(|(on, _)| *on)
                    .map(|(_, name)| name.to_owned())
                    .collect(),
                };
                let modes = names
                    .iter()
                    .map(|n| mode(n, &file))
                    .collect::<Result<Vec<_>, _>>()?;
                if modes.is_empty() {
                    return Err(format!("{}: no pooling mode is on", file.display()));
                }
                modes
            }
            None => vec![Pooling::Mean],
        };
        let bert: SentenceBertFile =
            read_json(&dir.join("sentence_bert_config.json"))?.unwrap_or_default();
        let tokenizer: TokenizerConfigFile =
            read_json(&dir.join("tokenizer_config.json"))?.unwrap_or_default();
        // transformers writes a huge sentinel when the tokenizer has no limit of its own.
        let tokenizer_max = tokenizer
            .model_max_length
            .filter(|n| *n >= 1.0 && *n < 1e7)
            .map(|n| n as usize);
        let prompts: PromptsFile =
            read_json(&dir.join("config_sentence_transformers.json"))?.unwrap_or_default();
        if let Some(name) = &prompts.default_prompt_name
            && !prompts.prompts.contains_key(name)
        {
            return Err(format!(
                "config_sentence_transformers.json: default_prompt_name {name:?} is not among its \
                 prompts ({})",
                prompts
                    .prompts
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        Ok(Self {
            pooling,
            normalize,
            max_seq_length: bert.max_seq_length.or(tokenizer_max),
            do_lower_case: bert.do_lower_case,
            prompts: prompts.prompts,
            default_prompt: prompts.default_prompt_name,
            from_files: modules.is_some(),
        })
    }

    /// The prompt a request asked for by name (or the default one), refused when the model has
    /// no prompt of that name.
    pub fn prompt(&self, name: Option<&str>) -> Result<Option<&str>, String> {
        match name.or(self.default_prompt.as_deref()) {
            None => Ok(None),
            Some(name) => self
                .prompts
                .get(name)
                .map(|p| Some(p.as_str()))
                .ok_or_else(|| {
                    if self.prompts.is_empty() {
                        format!("prompt {name:?}: this model has no named prompts")
                    } else {
                        format!(
                            "prompt {name:?}: this model's prompts are {}",
                            self.prompts.keys().cloned().collect::<Vec<_>>().join(", ")
                        )
                    }
                }),
        }
    }

    /// The pooling in words, for the start-up log.
    pub fn describe(&self) -> String {
        let modes: Vec<&str> = self.pooling.iter().map(|p| p.name()).collect();
        format!(
            "pooling {}{}",
            modes.join("+"),
            if self.normalize { ", normalized" } else { "" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(files: &[(&str, &str)]) -> std::path::PathBuf {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("nomad-st-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (name, text) in files {
            let path = dir.join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    const MODULES: &str = r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
        {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"},
        {"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.models.Normalize"}]"#;

    #[test]
    fn the_directory_says_its_pooling_normalization_length_and_prompts() {
        let dir = dir_with(&[
            ("modules.json", MODULES),
            (
                "1_Pooling/config.json",
                r#"{"pooling_mode_cls_token": true}"#,
            ),
            (
                "sentence_bert_config.json",
                r#"{"max_seq_length": 512, "do_lower_case": false}"#,
            ),
            (
                "config_sentence_transformers.json",
                r#"{"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": null}"#,
            ),
        ]);
        let c = SentenceConfig::read(&dir).unwrap();
        assert_eq!(c.pooling, [Pooling::Cls]);
        assert!(c.normalize && c.from_files);
        assert_eq!(c.max_seq_length, Some(512));
        assert_eq!(c.prompt(Some("query")).unwrap(), Some("query: "));
        assert_eq!(c.prompt(None).unwrap(), None);
        assert_eq!(
            c.prompt(Some("doc")).unwrap_err(),
            "prompt \"doc\": this model's prompts are passage, query"
        );
        assert_eq!(c.describe(), "pooling cls, normalized");
    }

    #[test]
    fn several_modes_concatenate_in_sentence_transformers_order_and_no_normalize_means_none() {
        let modules = r#"[{"path":"","type":"sentence_transformers.models.Transformer"},
            {"path":"pool","type":"sentence_transformers.models.Pooling"}]"#;
        let dir = dir_with(&[
            ("modules.json", modules),
            (
                "pool/config.json",
                r#"{"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": true, "pooling_mode_max_tokens": true}"#,
            ),
        ]);
        let c = SentenceConfig::read(&dir).unwrap();
        assert_eq!(c.pooling, [Pooling::Cls, Pooling::Max, Pooling::Mean]);
        assert!(!c.normalize);
    }

    #[test]
    fn the_format_of_sentence_transformers_5_reads_the_same() {
        let modules = r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.base.modules.transformer.Transformer"},
            {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.sentence_transformer.modules.pooling.Pooling"},
            {"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.base.modules.normalize.Normalize"}]"#;
        let dir = dir_with(&[
            ("modules.json", modules),
            (
                "1_Pooling/config.json",
                r#"{"embedding_dimension": 32, "pooling_mode": ["mean_sqrt_len_tokens", "lasttoken"], "include_prompt": true}"#,
            ),
            (
                "sentence_bert_config.json",
                r#"{"transformer_task": "feature-extraction"}"#,
            ),
            ("tokenizer_config.json", r#"{"model_max_length": 96}"#),
        ]);
        let c = SentenceConfig::read(&dir).unwrap();
        assert_eq!(c.pooling, [Pooling::MeanSqrtLen, Pooling::LastToken]);
        assert!(c.normalize);
        assert_eq!(c.max_seq_length, Some(96));
        let sentinel = dir_with(&[(
            "tokenizer_config.json",
            r#"{"model_max_length": 1000000000000000019884624838656}"#,
        )]);
        assert_eq!(
            SentenceConfig::read(&sentinel).unwrap().max_seq_length,
            None
        );
    }

    #[test]
    fn a_plain_transformers_directory_is_mean_pooled_without_normalization() {
        let dir = dir_with(&[("config.json", "{}")]);
        let c = SentenceConfig::read(&dir).unwrap();
        assert_eq!(
            (c.pooling.as_slice(), c.normalize, c.from_files),
            (&[Pooling::Mean][..], false, false)
        );
    }

    #[test]
    fn what_is_not_computed_is_refused_by_name() {
        let dense = r#"[{"path":"","type":"sentence_transformers.models.Transformer"},
            {"path":"1_Pooling","type":"sentence_transformers.models.Pooling"},
            {"path":"2_Dense","type":"sentence_transformers.models.Dense"}]"#;
        let cases: [(&[(&str, &str)], &str); 4] = [
            (
                &[
                    ("modules.json", dense),
                    (
                        "1_Pooling/config.json",
                        r#"{"pooling_mode_mean_tokens": true}"#,
                    ),
                ],
                "module 2 is sentence_transformers.models.Dense",
            ),
            (
                &[
                    ("modules.json", MODULES),
                    (
                        "1_Pooling/config.json",
                        r#"{"pooling_mode_weightedmean_tokens": true}"#,
                    ),
                ],
                "weighted-mean pooling is not supported",
            ),
            (
                &[
                    ("modules.json", MODULES),
                    (
                        "1_Pooling/config.json",
                        r#"{"pooling_mode_mean_tokens": true, "include_prompt": false}"#,
                    ),
                ],
                "include_prompt: false",
            ),
            (
                &[
                    ("modules.json", MODULES),
                    (
                        "1_Pooling/config.json",
                        r#"{"pooling_mode_mean_tokens": true}"#,
                    ),
                    (
                        "config_sentence_transformers.json",
                        r#"{"prompts": {"query": "q: "}, "default_prompt_name": "doc"}"#,
                    ),
                ],
                "default_prompt_name \"doc\" is not among its prompts (query)",
            ),
        ];
        for (files, expected) in cases {
            let message = SentenceConfig::read(&dir_with(files)).unwrap_err();
            assert!(message.contains(expected), "{message}");
        }
    }
}

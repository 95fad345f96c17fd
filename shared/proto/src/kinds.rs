//! The model kinds device workers run, and the options each takes. One table: the scheduler
//! accepts only these kinds, the worker checks every request's options against it, and the
//! gateway turns it into the JSON Schema agents see.

/// What an option holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptionType {
    Bool,
    /// A whole number in `min..=max`.
    Integer,
    /// A number in `min..=max`.
    Number,
    /// A list of at most `max` strings, each of 1 to [`MAX_STRING_BYTES`] bytes.
    Strings,
    /// A chat: at most `max` `{"role": "system"|"user"|"assistant", "content": "..."}` objects.
    Messages,
    /// One string of 1 to [`MAX_STRING_BYTES`] bytes (a name).
    Text,
    /// A list of at most `max` texts, each of 1 to [`MAX_TEXT_BYTES`] bytes (documents).
    Texts,
}

/// The longest string a `Strings` option holds (a stop string).
pub const MAX_STRING_BYTES: usize = 64;

/// The longest text a `Texts` option holds (one document).
pub const MAX_TEXT_BYTES: usize = 1 << 20;

/// The roles a `Messages` option accepts.
pub const ROLES: &[&str] = &["system", "user", "assistant"];

/// One option of a kind (a key of `ToolInput.options_json`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptionSpec {
    pub name: &'static str,
    pub ty: OptionType,
    /// The value when the request does not give one (`0` or `1` for a bool).
    pub default: f64,
    pub min: f64,
    pub max: f64,
    pub description: &'static str,
}

/// What a kind takes as its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputType {
    Text,
    Tensor,
    /// A JSON object of arguments, checked by the model's own schema (a Python model's
    /// `args_schema`, reported when the model is described).
    Json,
}

/// What a kind answers with, as the gateway's JSON shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputType {
    /// `{"output": [numbers], "shape": [dimensions]}`.
    Tensor,
    /// `{"text", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "finish_reason"}`.
    Text,
    /// `[{"index", "score"}]`: the documents, best first.
    Ranking,
    /// `{"label", "scores": [{"label", "score"}]}`: the labels, best first.
    Labels,
    /// The model's own (its `output_schema`, reported when the model is described).
    Json,
}

/// The form a request's input came in (which of `ToolInput.value`'s fields it set).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputForm {
    Text,
    Tensor,
    Json,
    /// No value (a generation may give its conversation as the `messages` option alone).
    Missing,
}

impl InputForm {
    fn name(self) -> &'static str {
        match self {
            InputForm::Text => "text",
            InputForm::Tensor => "a tensor",
            InputForm::Json => "JSON arguments",
            InputForm::Missing => "nothing",
        }
    }
}

impl crate::v1::ToolInput {
    /// The form its value came in.
    pub fn form(&self) -> InputForm {
        use crate::v1::tool_input::Value;
        match &self.value {
            Some(Value::Text(_)) => InputForm::Text,
            Some(Value::Tensor(_)) => InputForm::Tensor,
            Some(Value::Json(_)) => InputForm::Json,
            None => InputForm::Missing,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KindSpec {
    pub name: &'static str,
    pub input: InputType,
    pub output: OutputType,
    /// The model pads a batch to its longest input (so batching inputs of similar length wastes
    /// less).
    pub pads: bool,
    /// Served by a decode loop on the worker: requests join while others run (continuous
    /// batching), bounded by the tool's `max_running`, and may stream their output.
    pub continuous: bool,
    /// A call reads its input and the model's weights and nothing else: it changes nothing and
    /// reaches no outside world (MCP's read-only, idempotent, closed-world hints). A Python
    /// tool's code may do anything, so it makes no such claim.
    pub pure: bool,
    /// How the input is described to agents.
    pub input_description: &'static str,
    pub options: &'static [OptionSpec],
}

impl KindSpec {
    pub fn option(&self, name: &str) -> Option<&'static OptionSpec> {
        self.options.iter().find(|o| o.name == name)
    }

    /// Why an input of `form` cannot be this kind's, naming what it takes: the one rule the
    /// worker applies before it runs an input, and the scheduler before it queues one bound for
    /// the wrong side (JSON arguments to a model host, the rest to the worker's own passes). An
    /// empty input is the kind's own to refuse (it knows whether an option stands for it).
    pub fn input_refusal(&self, form: InputForm) -> Option<String> {
        let takes = match (self.input, form) {
            (_, InputForm::Missing)
            | (InputType::Text, InputForm::Text)
            | (InputType::Tensor, InputForm::Tensor)
            | (InputType::Json, InputForm::Json) => return None,
            (InputType::Text, _) => "a text input",
            (InputType::Tensor, _) => "a tensor input",
            (InputType::Json, _) => {
                "a JSON object of arguments (`json`), as its input schema describes"
            }
        };
        // A Python model is the user's own: named as that, not by the kind's name.
        let subject = match self.input {
            InputType::Json => "a Python model",
            _ => self.name,
        };
        Some(format!("{subject} takes {takes}, got {}", form.name()))
    }

    /// The option names, for messages.
    pub fn option_names(&self) -> Vec<&'static str> {
        self.options.iter().map(|o| o.name).collect()
    }
}

const fn flag(name: &'static str, default: bool, description: &'static str) -> OptionSpec {
    let default = if default { 1.0 } else { 0.0 };
    ranged(name, OptionType::Bool, [default, 0.0, 1.0], description)
}

const fn integer(name: &'static str, range: [f64; 3], description: &'static str) -> OptionSpec {
    ranged(name, OptionType::Integer, range, description)
}

/// A list option: `max` is the most items it may hold.
const fn list(
    name: &'static str,
    ty: OptionType,
    max: f64,
    description: &'static str,
) -> OptionSpec {
    ranged(name, ty, [0.0, 0.0, max], description)
}

const fn number(name: &'static str, range: [f64; 3], description: &'static str) -> OptionSpec {
    ranged(name, OptionType::Number, range, description)
}

/// An option of type `ty` with its `[default, min, max]`.
const fn ranged(
    name: &'static str,
    ty: OptionType,
    [default, min, max]: [f64; 3],
    description: &'static str,
) -> OptionSpec {
    OptionSpec {
        name,
        ty,
        default,
        min,
        max,
        description,
    }
}

pub const EMBED: KindSpec = KindSpec {
    name: "embed",
    input: InputType::Text,
    output: OutputType::Tensor,
    pads: true,
    continuous: false,
    pure: true,
    input_description: "Text to embed.",
    options: &[
        flag(
            "truncate",
            false,
            "Cut a text longer than the model's limit instead of refusing it.",
        ),
        list(
            "prompt",
            OptionType::Text,
            0.0,
            "The name of one of the model's prompts to put before the text (e.g. `query`), \
             from its config_sentence_transformers.json.",
        ),
    ],
};

pub const GENERATE: KindSpec = KindSpec {
    name: "generate",
    input: InputType::Text,
    output: OutputType::Text,
    pads: true,
    continuous: true,
    pure: true,
    input_description: "The prompt (a user message unless chat is false); empty when `messages` \
                        gives the conversation.",
    options: &[
        integer(
            "max_tokens",
            [64.0, 1.0, 2048.0],
            "Tokens to generate at most.",
        ),
        number(
            "temperature",
            [0.0, 0.0, 2.0],
            "Sampling temperature; 0 is greedy.",
        ),
        number(
            "top_p",
            [1.0, 0.01, 1.0],
            "Sample from the smallest set of tokens whose probability reaches this (1: all).",
        ),
        integer(
            "top_k",
            [0.0, 0.0, 1000.0],
            "Sample from this many most likely tokens (0: all).",
        ),
        number(
            "repeat_penalty",
            [1.0, 0.5, 2.0],
            "Divide the logits of tokens among the last 64 by this (1: none).",
        ),
        integer(
            "seed",
            [0.0, 0.0, u64::MAX as f64],
            "Seed of the sampler (with a temperature above 0).",
        ),
        list(
            "stop",
            OptionType::Strings,
            4.0,
            "Strings that end the generation (left out of the answer).",
        ),
        flag(
            "chat",
            true,
            "Wrap the text in the model's chat template as a user message.",
        ),
        list(
            "messages",
            OptionType::Messages,
            64.0,
            "The conversation so far, in the model's chat template, instead of `text`.",
        ),
    ],
};

pub const MLP: KindSpec = KindSpec {
    name: "mlp",
    input: InputType::Tensor,
    output: OutputType::Tensor,
    pads: false,
    continuous: false,
    pure: true,
    input_description: "Tensor values, row-major.",
    options: &[],
};

pub const RERANK: KindSpec = KindSpec {
    name: "rerank",
    input: InputType::Text,
    output: OutputType::Ranking,
    pads: true,
    continuous: false,
    pure: true,
    input_description: "The query the documents are scored against.",
    options: &[
        list(
            "documents",
            OptionType::Texts,
            1024.0,
            "The texts to score against the query (1 to 1024); each pair is cut at the model's \
             max_seq_length, as a cross-encoder reads it.",
        ),
        integer(
            "top_n",
            [0.0, 0.0, 1024.0],
            "Return only the best this many (0: every document).",
        ),
        flag(
            "raw_scores",
            false,
            "Scores as the model's logits instead of their sigmoid (0 to 1).",
        ),
    ],
};

pub const CLASSIFY: KindSpec = KindSpec {
    name: "classify",
    input: InputType::Text,
    output: OutputType::Labels,
    pads: true,
    continuous: false,
    pure: true,
    input_description: "Text to classify.",
    options: &[
        flag(
            "truncate",
            false,
            "Cut a text longer than the model's limit instead of refusing it.",
        ),
        flag(
            "raw_scores",
            false,
            "Scores as the model's logits instead of probabilities (softmax, or sigmoid for a \
             multi-label model).",
        ),
    ],
};

/// A Python model served by a model host in its own environment: the original Nomad's
/// `fmod_models` (a TorchModuleTool-like class) and callable `tools`. Its arguments, output and
/// description are the model's own.
pub const PYTHON: KindSpec = KindSpec {
    name: "python",
    input: InputType::Json,
    output: OutputType::Json,
    pads: false,
    continuous: false,
    pure: false,
    input_description: "The arguments, as the model's `args_schema` describes them.",
    options: &[],
};

/// The kinds as a closed set: code that treats each kind its own way matches on this, so a kind
/// added here does not compile until every such place has its arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Embed,
    Rerank,
    Classify,
    Generate,
    Mlp,
    Python,
}

impl Kind {
    /// Every kind, in the table's order.
    pub const ALL: [Kind; 6] = [
        Kind::Embed,
        Kind::Rerank,
        Kind::Classify,
        Kind::Generate,
        Kind::Mlp,
        Kind::Python,
    ];

    pub const fn spec(self) -> &'static KindSpec {
        match self {
            Kind::Embed => &EMBED,
            Kind::Rerank => &RERANK,
            Kind::Classify => &CLASSIFY,
            Kind::Generate => &GENERATE,
            Kind::Mlp => &MLP,
            Kind::Python => &PYTHON,
        }
    }

    pub const fn name(self) -> &'static str {
        self.spec().name
    }

    /// The kind called `name`.
    pub fn named(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Every kind's spec, in `Kind::ALL`'s order.
pub const KINDS: &[KindSpec] = &[EMBED, RERANK, CLASSIFY, GENERATE, MLP, PYTHON];

/// The kind called `name`.
pub fn kind(name: &str) -> Option<&'static KindSpec> {
    Kind::named(name).map(Kind::spec)
}

/// The kind names, for messages.
pub fn names() -> Vec<&'static str> {
    KINDS.iter().map(|k| k.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/models.md names the built-in kinds in its opening line and gives each a row of its
    /// table: exactly the kinds of this table (Python aside, docs/python-models.md's), so a kind
    /// added here and not documented, or documented and gone, fails.
    #[test]
    fn the_models_page_documents_exactly_the_built_in_kinds() {
        let page = include_str!("../../../docs/models.md");
        let built_in: std::collections::BTreeSet<&str> = KINDS
            .iter()
            .filter(|k| k.name != PYTHON.name)
            .map(|k| k.name)
            .collect();
        let rows: std::collections::BTreeSet<&str> = page
            .lines()
            .filter_map(|line| line.strip_prefix("| `"))
            .filter_map(|rest| rest.split_once("` |").map(|(name, _)| name))
            .filter(|name| name.chars().all(|c| c.is_ascii_lowercase()))
            .collect();
        assert_eq!(rows, built_in, "docs/models.md's kinds table");
        let opening = page
            .lines()
            .find(|l| l.contains("built-in model kinds"))
            .unwrap();
        for kind in &built_in {
            assert!(opening.contains(&format!("`{kind}`")), "{kind}: {opening}");
        }
    }

    #[test]
    fn each_kind_takes_its_own_input_form_and_names_it_otherwise() {
        for kind in KINDS {
            let own = match kind.input {
                InputType::Text => InputForm::Text,
                InputType::Tensor => InputForm::Tensor,
                InputType::Json => InputForm::Json,
            };
            assert_eq!(kind.input_refusal(own), None, "{}", kind.name);
            assert_eq!(
                kind.input_refusal(InputForm::Missing),
                None,
                "{}",
                kind.name
            );
        }
        assert_eq!(
            EMBED.input_refusal(InputForm::Tensor).unwrap(),
            "embed takes a text input, got a tensor"
        );
        assert_eq!(
            MLP.input_refusal(InputForm::Json).unwrap(),
            "mlp takes a tensor input, got JSON arguments"
        );
        assert!(
            PYTHON
                .input_refusal(InputForm::Text)
                .unwrap()
                .starts_with("a Python model takes a JSON object of arguments")
        );
    }

    #[test]
    fn the_enum_and_the_table_list_the_same_kinds_in_one_order() {
        let from_enum: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
        assert_eq!(from_enum, names());
        assert_eq!(Kind::named("rerank"), Some(Kind::Rerank));
        assert_eq!(Kind::named("Rerank"), None);
    }

    #[test]
    fn every_default_lies_in_its_range_and_names_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for kind in KINDS {
            assert!(seen.insert(kind.name));
            let mut options = std::collections::HashSet::new();
            for o in kind.options {
                assert!(options.insert(o.name), "{}.{}", kind.name, o.name);
                assert!(
                    o.min <= o.default && o.default <= o.max,
                    "{}.{}",
                    kind.name,
                    o.name
                );
            }
        }
        assert_eq!(
            kind("generate").unwrap().option("max_tokens").unwrap().max,
            2048.0
        );
        assert!(kind("nope").is_none());
    }
}

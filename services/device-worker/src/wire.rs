//! Protobuf and the worker's own types, converted here once: requests into `Input`s as a batch
//! arrives, answers into `ItemResult`s as it leaves. Nothing below the gRPC layer sees protobuf.

use std::time::Duration;

use nomad_proto::kinds::Kind;
use nomad_proto::v1::{
    BatchResults, GenerationStats, ItemResult, ModelSpec, OutOfMemory, Tensor, ToolDescription,
    ToolInput, ToolOutput, execute_batch_response::Outcome, item_result, python_model, tool_input,
    tool_output,
};

use crate::models::model::{
    Answer, ExecError, Input, LoadError, Output, PythonEntry, PythonSpec, Spec, Value,
};
use crate::models::open::Described;

/// A load or describe request's model: its kind one of the kinds table's, and a Python model's
/// own part there, with a target.
pub fn spec(spec: ModelSpec) -> Result<Spec, LoadError> {
    let kind = Kind::named(&spec.kind).ok_or_else(|| LoadError::UnknownKind(spec.kind.clone()))?;
    let refused = |reason: &str| LoadError::Invalid {
        path: spec.source.clone().into(),
        reason: reason.into(),
    };
    let python = match (kind, spec.python) {
        (Kind::Python, None) => return Err(refused("a python tool's spec has no `python` part")),
        (Kind::Python, Some(p)) if p.target.is_empty() => {
            return Err(refused("the dotted path of the class or callable is empty"));
        }
        (Kind::Python, Some(p)) => Some(PythonSpec {
            entry: match p.entry() {
                python_model::Entry::Callable => PythonEntry::Callable,
                python_model::Entry::ModelClass | python_model::Entry::Unspecified => {
                    PythonEntry::ModelClass
                }
            },
            target: p.target,
            tool_kwargs_json: p.tool_kwargs_json,
            requirements: p.requirements,
            python: (!p.python.is_empty()).then_some(p.python),
            import_paths: p.import_paths,
            batch_timeout: (p.batch_timeout_ms > 0)
                .then(|| Duration::from_millis(p.batch_timeout_ms)),
        }),
        (_, _) => None,
    };
    Ok(Spec {
        tool: spec.tool,
        kind,
        source: spec.source,
        base_dir: spec.base_dir,
        max_running: (spec.max_running > 0).then_some(spec.max_running as usize),
        kv_budget_bytes: (spec.kv_budget_bytes > 0).then_some(spec.kv_budget_bytes),
        dense_prefill: spec.dense_prefill,
        python,
        registries: spec
            .registries
            .into_iter()
            .map(|(registry, login)| {
                (
                    registry,
                    nomad_config::registries::RegistryLogin {
                        username_env: login.username_env,
                        password_env: login.password_env,
                    },
                )
            })
            .collect(),
    })
}

/// What describing a tool found, as Describe answers it.
pub fn description(described: Described) -> ToolDescription {
    ToolDescription {
        description: described.own.description,
        input_schema_json: described.own.input_schema,
        output_schema_json: described.own.output_schema,
        batch_size: described.own.batch_size,
        model_card: described.model_card,
        pinned_source: described.pinned_source,
    }
}

/// A request as the models read it; a tensor whose bytes do not fit its type and shape is kept
/// as `Unreadable`, refused with its own answer like any other bad input.
pub fn input(input: ToolInput) -> Input {
    let value = match input.value {
        Some(tool_input::Value::Text(t)) => Value::Text(t),
        Some(tool_input::Value::Json(j)) => Value::Json(j),
        Some(tool_input::Value::Tensor(t)) => match t.to_f32_vec() {
            Ok(values) => Value::Tensor {
                values,
                shape: t.shape,
            },
            Err(e) => Value::Unreadable(e.to_string()),
        },
        None => Value::Missing,
    };
    Input {
        value,
        options: input.options_json,
    }
}

/// An answer as ExecuteBatch returns it.
pub fn item_result(answer: Answer) -> ItemResult {
    let output = |value| {
        Some(item_result::Result::Output(ToolOutput {
            value: Some(value),
        }))
    };
    match answer {
        Answer::Output(Output::Tensor { values, shape }) => ItemResult {
            result: output(tool_output::Value::Tensor(Tensor::from_f32(&values, shape))),
            generation: None,
        },
        Answer::Output(Output::Text(text)) => ItemResult {
            result: output(tool_output::Value::Text(text)),
            generation: None,
        },
        Answer::Output(Output::Json(json)) => ItemResult {
            result: output(tool_output::Value::Json(json)),
            generation: None,
        },
        Answer::Output(Output::Generated(done)) => ItemResult {
            generation: Some(GenerationStats {
                prompt_tokens: done.prompt_tokens as u32,
                cached_prompt_tokens: done.cached_prompt_tokens as u32,
                finish_reason: done.finish_reason.as_str().to_owned(),
                completion_tokens: done.completion_tokens as u32,
                time_to_first_token_seconds: done.time_to_first_token.as_secs_f64(),
                decode_seconds: done.decode.as_secs_f64(),
            }),
            result: output(tool_output::Value::Text(done.text)),
        },
        Answer::Invalid(message) => ItemResult {
            result: Some(item_result::Result::InvalidInput(message)),
            generation: None,
        },
        Answer::Failed(message) => ItemResult {
            result: Some(item_result::Result::Error(message)),
            generation: None,
        },
    }
}

/// A batch's outcome as ExecuteBatch answers it (its results, or out of memory so the scheduler
/// halves it); a failure of the whole batch is the error, its message.
pub fn outcome(executed: Result<Vec<Answer>, ExecError>) -> Result<Outcome, String> {
    match executed {
        Ok(answers) => Ok(Outcome::Results(BatchResults {
            items: answers.into_iter().map(item_result).collect(),
        })),
        Err(ExecError::OutOfMemory(detail)) => Ok(Outcome::OutOfMemory(OutOfMemory { detail })),
        Err(ExecError::Failed(message)) => Err(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::model::{FinishReason, Finished};

    #[test]
    fn a_spec_names_a_known_kind_and_a_python_one_has_its_target() {
        let with = |kind: &str, python: Option<nomad_proto::v1::PythonModel>| ModelSpec {
            tool: "t".into(),
            kind: kind.into(),
            python,
            ..Default::default()
        };
        assert!(matches!(spec(with("nope", None)), Err(LoadError::UnknownKind(k)) if k == "nope"));
        let missing = spec(with("python", None)).unwrap_err().to_string();
        assert!(missing.contains("no `python` part"), "{missing}");
        let empty = spec(with("python", Some(Default::default())))
            .unwrap_err()
            .to_string();
        assert!(empty.contains("dotted path"), "{empty}");
        let python = spec(with(
            "python",
            Some(nomad_proto::v1::PythonModel {
                target: "m:Tool".into(),
                entry: python_model::Entry::Callable as i32,
                batch_timeout_ms: 1500,
                ..Default::default()
            }),
        ))
        .unwrap()
        .python
        .unwrap();
        assert_eq!(python.entry, PythonEntry::Callable);
        assert_eq!(python.batch_timeout, Some(Duration::from_millis(1500)));
        assert_eq!(python.python, None);
        let embed = spec(with("embed", None)).unwrap();
        assert_eq!((embed.kind, embed.max_running), (Kind::Embed, None));
    }

    #[test]
    fn a_tensor_arrives_as_f32_and_one_that_does_not_fit_its_shape_is_unreadable() {
        let read = input(ToolInput {
            value: Some(tool_input::Value::Tensor(Tensor::from_f32(
                &[1.0, 2.0],
                vec![1, 2],
            ))),
            options_json: r#"{"a": 1}"#.into(),
        });
        assert_eq!(
            read,
            Input {
                value: Value::Tensor {
                    values: vec![1.0, 2.0],
                    shape: vec![1, 2]
                },
                options: r#"{"a": 1}"#.into()
            }
        );
        let mut short = Tensor::from_f32(&[1.0, 2.0], vec![3]);
        short.data.truncate(6);
        assert!(matches!(
            input(ToolInput {
                value: Some(tool_input::Value::Tensor(short)),
                options_json: String::new(),
            })
            .value,
            Value::Unreadable(_)
        ));
        assert_eq!(input(ToolInput::default()).value, Value::Missing);
    }

    #[test]
    fn a_generation_carries_its_stats_and_a_failure_is_the_batchs_error() {
        let done = Finished {
            text: "hi".into(),
            finish_reason: FinishReason::Length,
            prompt_tokens: 5,
            cached_prompt_tokens: 2,
            completion_tokens: 1,
            time_to_first_token: Duration::from_millis(250),
            decode: Duration::ZERO,
        };
        let result = item_result(Answer::Output(Output::Generated(done)));
        let stats = result.generation.unwrap();
        assert_eq!(
            (
                stats.prompt_tokens,
                stats.cached_prompt_tokens,
                stats.completion_tokens
            ),
            (5, 2, 1)
        );
        assert_eq!(stats.finish_reason, "length");
        assert_eq!(stats.time_to_first_token_seconds, 0.25);
        assert_eq!(
            outcome(Err(ExecError::Failed("boom".into()))).unwrap_err(),
            "boom"
        );
        assert!(matches!(
            outcome(Err(ExecError::OutOfMemory("big".into()))),
            Ok(Outcome::OutOfMemory(_))
        ));
    }
}

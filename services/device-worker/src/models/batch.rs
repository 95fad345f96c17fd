//! The one batch loop: each input is prepared (its tokens, its checked options) or refused with
//! its own `invalid_input` result; the prepared run together; their answers go back to their
//! places, so the results stand in input order whatever was refused.

use nomad_proto::kinds::KindSpec;

use crate::models::model::{Answer, ExecError, Input, Output, Value};

/// Runs `inputs` as one batch: `prepare` turns input `index` into what the model runs (or its
/// refusal; an unreadable input is refused before it), and `run` gets the prepared in order,
/// with their indices, and answers each.
pub fn run<P>(
    inputs: &[Input],
    prepare: impl FnMut(usize, &Input) -> Result<P, Answer>,
    run: impl FnOnce(Vec<P>, &[usize]) -> Result<Vec<Answer>, ExecError>,
) -> Result<Vec<Answer>, ExecError> {
    let (prepared, places) = split(inputs, prepare);
    if prepared.is_empty() {
        return places.join(Vec::new());
    }
    let answers = run(prepared, places.positions())?;
    places.join(answers)
}

/// `run`'s two halves, for a model that awaits its pass (a model host): the prepared inputs in
/// order, and where their answers go among the refusals already made.
pub fn split<P>(
    inputs: &[Input],
    mut prepare: impl FnMut(usize, &Input) -> Result<P, Answer>,
) -> (Vec<P>, Places) {
    let mut answers: Vec<Option<Answer>> = vec![None; inputs.len()];
    let mut prepared = Vec::with_capacity(inputs.len());
    let mut positions = Vec::with_capacity(inputs.len());
    for (index, input) in inputs.iter().enumerate() {
        let prepared_one = match &input.value {
            Value::Unreadable(why) => Err(invalid(index, why)),
            _ => prepare(index, input),
        };
        match prepared_one {
            Ok(item) => {
                prepared.push(item);
                positions.push(index);
            }
            Err(refused) => answers[index] = Some(refused),
        }
    }
    (prepared, Places { answers, positions })
}

/// Where the answers of a batch's prepared inputs go (`split`).
#[derive(Debug)]
pub struct Places {
    answers: Vec<Option<Answer>>,
    positions: Vec<usize>,
}

impl Places {
    /// The input index of each prepared input, in order.
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }

    /// Every input's answer in input order: `answers` holds one per prepared input.
    pub fn join(mut self, answers: Vec<Answer>) -> Result<Vec<Answer>, ExecError> {
        if answers.len() != self.positions.len() {
            return Err(ExecError::Failed(format!(
                "the model answered {} results for {} inputs",
                answers.len(),
                self.positions.len()
            )));
        }
        for (position, answer) in self.positions.into_iter().zip(answers) {
            self.answers[position] = Some(answer);
        }
        Ok(self.answers.into_iter().flatten().collect())
    }
}

/// Input `index` refused: the message names the request and what was wrong.
pub fn invalid(index: usize, message: impl std::fmt::Display) -> Answer {
    Answer::Invalid(format!("request {index}: {message}"))
}

/// Request `index` refused when its input is of a form `kind` does not take (the kinds table's
/// rule, the scheduler's too).
pub fn check_form(index: usize, input: &Input, kind: &KindSpec) -> Result<(), Answer> {
    match kind.input_refusal(input.value.form()) {
        Some(refusal) => Err(invalid(index, refusal)),
        None => Ok(()),
    }
}

/// The non-empty text of request `index`, or its refusal naming what `kind` takes.
pub fn text<'a>(index: usize, input: &'a Input, kind: &KindSpec) -> Result<&'a str, Answer> {
    check_form(index, input, kind)?;
    match &input.value {
        Value::Text(t) if !t.trim().is_empty() => Ok(t),
        _ => Err(invalid(
            index,
            format!("empty text; {} takes a non-empty text", kind.name),
        )),
    }
}

/// A vector answer (an embedding, an MLP's last layer).
pub fn vector(values: Vec<f32>) -> Answer {
    let shape = vec![values.len() as u64];
    Answer::Output(Output::Tensor { values, shape })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(t: &str) -> Input {
        Input {
            value: Value::Text(t.into()),
            options: String::new(),
        }
    }

    fn text_of(answer: &Answer) -> &str {
        match answer {
            Answer::Output(Output::Text(t)) | Answer::Invalid(t) => t,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn refused_inputs_keep_their_places_and_the_rest_run_together_in_order() {
        let mut inputs = vec![text("a"), text(""), text("c"), text("")];
        inputs[3].value = Value::Unreadable("4 bytes for 2 f32 values".into());
        let mut batches = 0;
        let answers = run(
            &inputs,
            |index, input| match &input.value {
                Value::Text(t) if !t.is_empty() => Ok(t.to_uppercase()),
                _ => Err(invalid(index, "empty")),
            },
            |prepared, positions| {
                batches += 1;
                assert_eq!(positions, [0, 2]);
                Ok(prepared
                    .into_iter()
                    .map(|t| Answer::Output(Output::Text(t)))
                    .collect())
            },
        )
        .unwrap();
        assert_eq!(batches, 1);
        let texts: Vec<&str> = answers.iter().map(text_of).collect();
        assert_eq!(
            texts,
            [
                "A",
                "request 1: empty",
                "C",
                "request 3: 4 bytes for 2 f32 values"
            ]
        );
    }

    #[test]
    fn an_all_refused_batch_runs_nothing_and_a_short_answer_fails() {
        let inputs = [text(""), text("")];
        let answers = run(
            &inputs,
            |index, _| Err::<(), _>(invalid(index, "no")),
            |_, _| panic!("nothing to run"),
        )
        .unwrap();
        assert_eq!(answers.len(), 2);
        let short = run(
            &[text("a"), text("b")],
            |_, _| Ok(()),
            |_, _| Ok(Vec::new()),
        );
        assert!(
            matches!(&short, Err(ExecError::Failed(m)) if m.contains("0 results for 2 inputs")),
            "{short:?}"
        );
    }
}

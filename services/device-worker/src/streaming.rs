//! Serving models with a decode loop (generation): each input joins the loop and is answered
//! when it ends, as a batch item or as a stream of text. Dropping the call drops the receivers,
//! which frees the sequences' places at the loop's next step.

use std::pin::Pin;

use futures::Stream;
use nomad_proto::v1::{
    BatchResults, ExecuteBatchResponse, ExecuteStreamEvent, ItemResult, OutOfMemory, ToolInput,
    execute_batch_response, execute_stream_event,
};
use tonic::Status;

use crate::models::decoder::Event;
use crate::models::generate::answer;
use crate::models::{ExecError, ExecLimits, StartError, Streaming};

pub type EventStream = Pin<Box<dyn Stream<Item = Result<ExecuteStreamEvent, Status>> + Send>>;

/// Starts every input at once and waits for all of them: the batch's outcome.
pub async fn run_batch(
    model: &dyn Streaming,
    inputs: &[ToolInput],
    limits: &ExecLimits,
) -> Result<Vec<ItemResult>, ExecError> {
    let started: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(i, input)| model.start(i, input, limits))
        .collect();
    let mut items = Vec::with_capacity(inputs.len());
    for start in started {
        match start {
            Err(StartError::Invalid(refused)) => items.push(refused),
            Err(StartError::Exec(e)) => return Err(e),
            Ok(mut events) => items.push(answer(finish(&mut events, |_| {}).await?)),
        }
    }
    Ok(items)
}

/// Reads events until the end, handing text to `on_text`.
async fn finish(
    events: &mut tokio::sync::mpsc::Receiver<Event>,
    mut on_text: impl FnMut(String),
) -> Result<crate::models::decoder::Finished, ExecError> {
    loop {
        match events.recv().await {
            Some(Event::Text(text)) => on_text(text),
            Some(Event::Done(done)) => return done,
            None => return Err(ExecError::Failed("the decode loop stopped".into())),
        }
    }
}

/// The outcome ExecuteBatch gives for one item, as the stream's last event.
fn done(outcome: Result<ItemResult, ExecError>) -> Result<ExecuteStreamEvent, Status> {
    let outcome = match outcome {
        Ok(item) => execute_batch_response::Outcome::Results(BatchResults { items: vec![item] }),
        Err(ExecError::OutOfMemory(detail)) => {
            execute_batch_response::Outcome::OutOfMemory(OutOfMemory { detail })
        }
        Err(ExecError::Failed(message)) => return Err(Status::internal(message)),
    };
    Ok(ExecuteStreamEvent {
        event: Some(execute_stream_event::Event::Done(ExecuteBatchResponse {
            outcome: Some(outcome),
        })),
    })
}

/// One input as a stream: its text as it is made, then its outcome. `on_end` runs when the
/// stream ends or is dropped (it closes the request's span).
pub fn run_stream(
    model: &dyn Streaming,
    input: &ToolInput,
    limits: &ExecLimits,
    on_end: impl FnOnce(Option<&str>) + Send + 'static,
) -> EventStream {
    let events = match model.start(0, input, limits) {
        Ok(events) => events,
        Err(StartError::Invalid(refused)) => {
            on_end(None);
            return Box::pin(futures::stream::once(async move { done(Ok(refused)) }));
        }
        Err(StartError::Exec(e)) => {
            on_end(Some(&e.to_string()));
            return Box::pin(futures::stream::once(async move { done(Err(e)) }));
        }
    };
    struct State<F: FnOnce(Option<&str>)> {
        events: tokio::sync::mpsc::Receiver<Event>,
        on_end: Option<F>,
    }
    let state = State {
        events,
        on_end: Some(on_end),
    };
    Box::pin(futures::stream::unfold(Some(state), |state| async move {
        let mut state = state?;
        let (item, next) = match state.events.recv().await {
            Some(Event::Text(text)) => (
                Ok(ExecuteStreamEvent {
                    event: Some(execute_stream_event::Event::Text(text)),
                }),
                true,
            ),
            Some(Event::Done(outcome)) => {
                let error = outcome.as_ref().err().map(ToString::to_string);
                if let Some(end) = state.on_end.take() {
                    end(error.as_deref());
                }
                (done(outcome.map(answer)), false)
            }
            None => (Err(Status::internal("the decode loop stopped")), false),
        };
        Some((item, next.then_some(state)))
    }))
}

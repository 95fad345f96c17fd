//! Streaming a model with a decode loop (generation): an input joins the loop, its text is sent
//! as it is made, then its outcome (a whole batch is `models::generate::run_batch`). Dropping
//! the call drops the receiver, which frees the sequence's place at the loop's next step.

use std::pin::Pin;

use futures::Stream;
use nomad_proto::v1::{ExecuteBatchResponse, ExecuteStreamEvent, execute_stream_event};
use tonic::Status;

use crate::models::kinds::generate::answer;
use crate::models::model::{Answer, Event, ExecError, ExecLimits, Input, StartError, Streaming};
use crate::wire;

pub type EventStream = Pin<Box<dyn Stream<Item = Result<ExecuteStreamEvent, Status>> + Send>>;

/// The outcome ExecuteBatch gives for one item, as the stream's last event.
fn done(outcome: Result<Answer, ExecError>) -> Result<ExecuteStreamEvent, Status> {
    let outcome = wire::outcome(outcome.map(|answer| vec![answer])).map_err(Status::internal)?;
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
    input: &Input,
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

//! The decode loop against the real SmolLM2 weights.

use super::*;
use crate::models::kinds::generate::{DecodeConfig, Generator};
use crate::models::model::{Answer, ExecLimits, Input, Model, Output, StartError, Streaming};

fn model(max_running: usize) -> Generator {
    model_with(max_running, false)
}

fn model_with(max_running: usize, dense_prefill: bool) -> Generator {
    configured(DecodeConfig {
        max_running,
        kv_budget_bytes: None,
        dense_prefill,
    })
}

/// Eight places and a KV budget of `bytes`.
fn model_with_budget(bytes: u64) -> Generator {
    configured(DecodeConfig {
        max_running: 8,
        kv_budget_bytes: Some(bytes),
        dense_prefill: false,
    })
}

fn configured(config: DecodeConfig) -> Generator {
    Generator::load_configured(
        &crate::models::testing::test_models_dir().join("smollm2-135m-instruct"),
        &crate::models::testing::test_device(),
        crate::models::kinds::generate::requantize_q4_1(),
        config,
    )
    .unwrap()
}

use crate::models::testing::text_input as input;

fn start(m: &Generator, text: &str, options: &str) -> tokio::sync::mpsc::Receiver<Event> {
    match m.start(0, &input(text, options), &ExecLimits::default()) {
        Ok(events) => events,
        Err(StartError::Invalid(r)) => panic!("refused: {r:?}"),
        Err(StartError::Exec(e)) => panic!("{e}"),
    }
}

/// The streamed text and the answer.
fn finish(events: &mut tokio::sync::mpsc::Receiver<Event>) -> (String, Finished) {
    let mut streamed = String::new();
    loop {
        match events.blocking_recv().expect("the loop answers") {
            Event::Text(t) => streamed.push_str(&t),
            Event::Done(done) => return (streamed, done.unwrap()),
        }
    }
}

fn texts(results: &[Answer]) -> Vec<String> {
    results
        .iter()
        .map(|r| match r {
            Answer::Output(Output::Generated(done)) => done.text.clone(),
            other => panic!("{other:?}"),
        })
        .collect()
}

const PROMPTS: [&str; 8] = [
    "Name a colour.",
    "What is 2 + 2?",
    "Write one word about the sea.",
    "Say hello in French.",
    "List three fruits.",
    "What day comes after Monday?",
    "Give me a short greeting.",
    // Over two prefill chunks: fed across steps beside the others' decoding.
    "Here is a long request that goes on for a while so that its prompt takes more than one \
     chunk of sixty-four tokens to feed into the model, which means the decode loop has to \
     split it across several steps while the other sequences keep decoding beside it; \
     please answer it with a single short sentence about why the sky looks blue.",
];

#[test]
fn greedy_answers_are_the_same_alone_and_beside_seven_others() {
    same_alone_and_together(&model(8));
}

/// Dense prefill too: a prompt row takes the f32 path whatever shares its step.
#[test]
fn greedy_answers_are_the_same_alone_and_together_with_dense_prefill() {
    let dense = model_with(8, true);
    same_alone_and_together(&dense);
    assert!(
        dense.bytes() > model(8).bytes() * 2,
        "the f32 copies are not counted"
    );
}

fn same_alone_and_together(m: &Generator) {
    let options = r#"{"max_tokens": 12}"#;
    let limits = ExecLimits::default();
    let alone: Vec<String> = PROMPTS
        .iter()
        .flat_map(|p| texts(&m.execute(&[input(p, options)], &limits).unwrap()))
        .collect();
    let inputs: Vec<Input> = PROMPTS.iter().map(|p| input(p, options)).collect();
    let together = texts(&m.execute(&inputs, &limits).unwrap());
    assert_eq!(together, alone);
    assert!(alone.iter().all(|t| !t.is_empty()), "{alone:?}");
}

#[test]
fn a_short_request_submitted_after_a_long_one_finishes_first() {
    let m = model(8);
    let mut long = start(&m, PROMPTS[0], r#"{"max_tokens": 48, "stop": ["\u0001"]}"#);
    let mut short = start(&m, PROMPTS[1], r#"{"max_tokens": 3}"#);
    let (_, done) = finish(&mut short);
    assert!(done.completion_tokens <= 3);
    // The long one is still running: no end among what it has sent so far.
    while let Ok(event) = long.try_recv() {
        assert!(
            matches!(event, Event::Text(_)),
            "the long one ended first: {event:?}"
        );
    }
    let (_, long_done) = finish(&mut long);
    assert!(long_done.completion_tokens > 3, "{long_done:?}");
}

#[test]
fn cancelling_one_of_eight_running_frees_its_place_and_the_others_finish_unchanged() {
    let options = r#"{"max_tokens": 10}"#;
    let alone: Vec<String> = {
        let m = model(1);
        PROMPTS[..7]
            .iter()
            .map(|p| finish(&mut start(&m, p, options)).1.text)
            .collect()
    };
    let m = model(8);
    let mut running: Vec<_> = PROMPTS.iter().map(|p| start(&m, p, options)).collect();
    let mut queued = start(&m, "Count to three.", options);
    // The cancelled one has started: it sent text.
    let mut cancelled = running.remove(7);
    if let Event::Done(d) = cancelled.blocking_recv().unwrap() {
        panic!("ended before it could be cancelled: {d:?}");
    }
    assert!(
        queued.try_recv().is_err(),
        "the ninth started with eight running"
    );
    drop(cancelled);
    let (_, ninth) = finish(&mut queued);
    assert!(!ninth.text.is_empty());
    let others: Vec<String> = running.iter_mut().map(|e| finish(e).1.text).collect();
    assert_eq!(others, alone);
}

#[test]
fn the_stream_adds_up_to_the_answer_and_a_stop_string_ends_it() {
    let m = model(8);
    let (streamed, full) = finish(&mut start(&m, PROMPTS[4], r#"{"max_tokens": 24}"#));
    assert_eq!(streamed, full.text);
    // Stop at a word in the middle of that answer: the answer ends just before it.
    let word = full
        .text
        .split_whitespace()
        .nth(2)
        .expect("an answer of three words or more");
    let at = full.text.find(word).unwrap();
    let options = serde_json::json!({"max_tokens": 24, "stop": [word]}).to_string();
    let (streamed, stopped) = finish(&mut start(&m, PROMPTS[4], &options));
    assert_eq!(stopped.text, full.text[..at]);
    assert_eq!(streamed, stopped.text);
}

#[test]
fn sampling_follows_its_seed_and_a_chat_in_messages_is_a_prompt() {
    let m = model(8);
    let sampled = |seed: u64| {
        let options = serde_json::json!({"max_tokens": 16, "temperature": 0.9, "top_k": 40,
                                         "top_p": 0.95, "repeat_penalty": 1.1, "seed": seed});
        finish(&mut start(&m, PROMPTS[2], &options.to_string()))
            .1
            .text
    };
    assert_eq!(sampled(7), sampled(7), "one seed, one answer");
    assert!(
        (8..12).any(|seed| sampled(seed) != sampled(7)),
        "five seeds gave one answer"
    );
    // The same user turn as text or as messages is the same prompt.
    let as_text = finish(&mut start(&m, PROMPTS[1], r#"{"max_tokens": 8}"#)).1;
    let messages = serde_json::json!({"max_tokens": 8,
        "messages": [{"role": "user", "content": PROMPTS[1]}]});
    let as_messages = finish(&mut start(&m, "", &messages.to_string())).1;
    assert_eq!(as_messages.with_times_of(&as_text), as_text);
    let both = m.start(
        0,
        &input("hi", &messages.to_string()),
        &ExecLimits::default(),
    );
    assert!(matches!(both, Err(StartError::Invalid(_))));
}

#[test]
fn a_request_whose_kv_cache_cannot_fit_is_out_of_memory_naming_the_budget() {
    let m = model_with_budget(1 << 20);
    let mut events = start(&m, PROMPTS[0], r#"{"max_tokens": 64}"#);
    match events.blocking_recv() {
        Some(Event::Done(Err(ExecError::OutOfMemory(m)))) => {
            assert!(m.contains("kv_budget_bytes is 1048576"), "{m}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_prompt_that_starts_like_a_finished_one_copies_the_shared_tokens_and_answers_the_same() {
    let options = r#"{"max_tokens": 16}"#;
    let warm = model(8);
    let first = finish(&mut start(&warm, PROMPTS[0], options)).1;
    assert_eq!(first.cached_prompt_tokens, 0, "nothing was kept before it");
    // Another user turn after the same system prompt: the template's start is copied.
    let second = finish(&mut start(&warm, PROMPTS[1], options)).1;
    assert!(
        second.cached_prompt_tokens > 10 && second.cached_prompt_tokens < second.prompt_tokens,
        "{second:?}"
    );
    // The next turn of the first chat: its first turn and the answer's tokens too.
    let chat = serde_json::json!({"max_tokens": 16, "messages": [
        {"role": "user", "content": PROMPTS[0]},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Another one, please."}]})
    .to_string();
    let next = finish(&mut start(&warm, "", &chat)).1;
    assert!(
        next.cached_prompt_tokens > first.prompt_tokens,
        "{next:?} after {first:?}"
    );
    // Each answers as it does computed from the first token.
    for (text, options, kept) in [(PROMPTS[1], options, &second), ("", chat.as_str(), &next)] {
        let cold = finish(&mut start(&model(8), text, options)).1;
        assert_eq!(cold.cached_prompt_tokens, 0);
        assert_eq!(
            (&kept.text, kept.completion_tokens, kept.finish_reason),
            (&cold.text, cold.completion_tokens, cold.finish_reason)
        );
    }
}

#[test]
fn kept_caches_give_way_to_a_request_that_needs_their_memory() {
    let options = r#"{"max_tokens": 8}"#;
    let probe = finish(&mut start(&model(8), PROMPTS[1], options)).1;
    // SmolLM2-135M: 30 layers, keys and values, 3 KV heads of 64 f32.
    let per_token = 30 * 2 * 3 * 64 * 4;
    let one_request = (probe.prompt_tokens + 8) as u64 * per_token;
    let tight = model_with_budget(one_request);
    let first = finish(&mut start(&tight, PROMPTS[1], options)).1;
    // The same prompt again: the kept cache would give all but its last token, but the
    // budget holds one request and no more, so it went to make room.
    let again = finish(&mut start(&tight, PROMPTS[1], options)).1;
    assert_eq!(again.cached_prompt_tokens, 0, "{again:?}");
    assert_eq!(again.text, first.text);
    let roomy = model(8);
    finish(&mut start(&roomy, PROMPTS[1], options));
    let kept = finish(&mut start(&roomy, PROMPTS[1], options)).1;
    assert_eq!(kept.cached_prompt_tokens, kept.prompt_tokens - 1);
    assert_eq!(kept.text, first.text);
}

#[test]
fn an_answer_says_whether_it_stopped_or_ran_out_of_tokens() {
    let m = model(8);
    let long = finish(&mut start(&m, PROMPTS[4], r#"{"max_tokens": 4}"#)).1;
    assert_eq!(
        (long.finish_reason, long.completion_tokens),
        (FinishReason::Length, 4)
    );
    let word = long.text.split_whitespace().last().expect("some words");
    let options = serde_json::json!({"max_tokens": 4, "stop": [word]}).to_string();
    let stopped = finish(&mut start(&m, PROMPTS[4], &options)).1;
    assert_eq!(stopped.finish_reason, FinishReason::Stop, "{stopped:?}");
}

impl Finished {
    /// `self` with `other`'s timings and cache use, to compare answers.
    fn with_times_of(self, other: &Finished) -> Finished {
        Finished {
            time_to_first_token: other.time_to_first_token,
            decode: other.decode,
            cached_prompt_tokens: other.cached_prompt_tokens,
            ..self
        }
    }
}

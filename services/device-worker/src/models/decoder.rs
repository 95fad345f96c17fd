//! The decode loop of a generation model: continuous batching. One thread per placed model
//! advances every running sequence by one token per step, in one forward pass; newcomers'
//! prompts are fed between steps in chunks of [`PREFILL_CHUNK`] tokens (at most
//! [`PREFILL_PER_STEP`] per step), so a long prompt does not stall running sequences. A sequence
//! leaves at its end (end of turn, a stop string or `max_tokens`) and is answered at once; one
//! whose caller went away is dropped at the next step, freeing its place and KV cache.
//!
//! A sequence is chunked the same way whatever runs beside it, and every row of a step is
//! computed as it would be alone (see `llama.rs`), so batching never changes an answer.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError};
use std::time::{Duration, Instant};

use candle_core::{IndexOp, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use tokenizers::Tokenizer;

use super::ExecError;
use super::llama::{Cache, Llama, Step};

/// Prompt tokens one sequence feeds per step.
pub const PREFILL_CHUNK: usize = 64;
/// Prompt tokens all newcomers together feed per step.
pub const PREFILL_PER_STEP: usize = 128;
/// Tokens back the repeat penalty looks.
const REPEAT_LAST_N: usize = 64;

/// How one request samples and when it stops.
#[derive(Debug, Clone)]
pub struct Params {
    pub max_tokens: usize,
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: usize,
    pub repeat_penalty: f32,
    pub seed: u64,
    pub stop: Vec<String>,
}

/// What a running request reports, in order: text as it is made, then its end.
#[derive(Debug)]
pub enum Event {
    Text(String),
    Done(Result<Finished, ExecError>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub text: String,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// From submission to the first generated token (queueing and prefill).
    pub time_to_first_token: Duration,
    /// From the first generated token to the end.
    pub decode: Duration,
}

/// The bounds of one loop.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Sequences advancing together at most.
    pub max_running: usize,
    /// KV cache all running sequences may reserve (each reserves its prompt plus `max_tokens`).
    pub kv_budget_bytes: u64,
    pub kv_bytes_per_token: u64,
}

struct Job {
    prompt: Vec<u32>,
    params: Params,
    events: tokio::sync::mpsc::Sender<Event>,
    submitted: Instant,
}

/// The model and tokenizer a loop runs.
pub struct Engine {
    pub model: Arc<Llama>,
    pub tokenizer: Tokenizer,
    /// Token ids that end a generation.
    pub end: Vec<u32>,
}

/// A handle on a running loop; dropping it lets the loop finish what runs, then end.
pub struct Decoder {
    jobs: SyncSender<Job>,
    bounds: Bounds,
}

impl Decoder {
    pub fn start(engine: Engine, bounds: Bounds) -> Self {
        let bounds = Bounds {
            max_running: bounds.max_running.max(1),
            ..bounds
        };
        // Room for a full set running plus a full set waiting: the scheduler sends at most
        // max_running, and a cancelled sequence may hold its place until the next step.
        let (jobs, intake) = std::sync::mpsc::sync_channel(2 * bounds.max_running);
        std::thread::Builder::new()
            .name("nomad-decode".into())
            .spawn(move || run(engine, bounds, intake))
            .expect("spawning the decode thread");
        Self { jobs, bounds }
    }

    /// Queues one request; its events arrive on the returned receiver.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        params: Params,
    ) -> Result<tokio::sync::mpsc::Receiver<Event>, ExecError> {
        // Every token is one event, plus the final flush and the end: never full.
        let (events, receiver) = tokio::sync::mpsc::channel(params.max_tokens + 2);
        let job = Job {
            prompt,
            params,
            events,
            submitted: Instant::now(),
        };
        match self.jobs.try_send(job) {
            Ok(()) => Ok(receiver),
            Err(TrySendError::Full(_)) => Err(ExecError::OutOfMemory(format!(
                "the decode loop already holds {} sequences (twice max_running)",
                2 * self.bounds.max_running
            ))),
            Err(TrySendError::Disconnected(_)) => {
                Err(ExecError::Failed("the decode loop has stopped".into()))
            }
        }
    }
}

struct Sequence {
    job: Job,
    cache: Cache,
    /// Prompt tokens fed so far.
    fed: usize,
    generated: Vec<u32>,
    sampler: LogitsProcessor,
    /// Bytes of the text already sent.
    sent: usize,
    first_token: Option<Instant>,
    kv_bytes: u64,
}

impl Sequence {
    fn prefilling(&self) -> bool {
        self.fed < self.job.prompt.len()
    }
}

fn sampling(p: &Params) -> Sampling {
    if p.temperature <= 0.0 {
        return Sampling::ArgMax;
    }
    let temperature = p.temperature;
    match (p.top_k > 0, p.top_p < 1.0) {
        (false, false) => Sampling::All { temperature },
        (true, false) => Sampling::TopK {
            k: p.top_k,
            temperature,
        },
        (false, true) => Sampling::TopP {
            p: p.top_p,
            temperature,
        },
        (true, true) => Sampling::TopKThenTopP {
            k: p.top_k,
            p: p.top_p,
            temperature,
        },
    }
}

fn run(engine: Engine, bounds: Bounds, intake: Receiver<Job>) {
    let mut waiting: VecDeque<Job> = VecDeque::new();
    let mut running: Vec<Sequence> = Vec::new();
    let mut open = true;
    loop {
        if running.is_empty() && waiting.is_empty() {
            if !open {
                return;
            }
            match intake.recv() {
                Ok(job) => waiting.push_back(job),
                Err(_) => return,
            }
        }
        while open && waiting.len() < 2 * bounds.max_running {
            match intake.try_recv() {
                Ok(job) => waiting.push_back(job),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => open = false,
            }
        }
        // Callers that went away: their place and cache are freed now.
        running.retain(|s| !s.job.events.is_closed());
        waiting.retain(|j| !j.events.is_closed());
        admit(&engine, bounds, &mut waiting, &mut running);
        if running.is_empty() {
            continue;
        }
        if let Err(e) = step(&engine, &mut running) {
            // The pass failed for every sequence in it.
            let message = ExecError::from(e);
            for s in running.drain(..) {
                let _ = s.job.events.try_send(Event::Done(Err(message.clone())));
            }
        }
    }
}

/// Starts waiting requests while places and KV budget allow; one that could never fit is
/// answered out of memory.
fn admit(
    engine: &Engine,
    bounds: Bounds,
    waiting: &mut VecDeque<Job>,
    running: &mut Vec<Sequence>,
) {
    let mut reserved: u64 = running.iter().map(|s| s.kv_bytes).sum();
    while running.len() < bounds.max_running {
        let Some(job) = waiting.front() else { break };
        let tokens = job.prompt.len() + job.params.max_tokens;
        let need = tokens as u64 * bounds.kv_bytes_per_token;
        if need > bounds.kv_budget_bytes {
            let job = waiting.pop_front().expect("front exists");
            let _ = job
                .events
                .try_send(Event::Done(Err(ExecError::OutOfMemory(format!(
                    "its prompt and max_tokens need {need} bytes of KV cache; the tool's \
                 kv_budget_bytes is {}",
                    bounds.kv_budget_bytes
                )))));
            continue;
        }
        if reserved + need > bounds.kv_budget_bytes {
            break;
        }
        let job = waiting.pop_front().expect("front exists");
        reserved += need;
        running.push(Sequence {
            cache: engine.model.cache(tokens),
            fed: 0,
            generated: Vec::with_capacity(job.params.max_tokens),
            sampler: LogitsProcessor::from_sampling(job.params.seed, sampling(&job.params)),
            sent: 0,
            first_token: None,
            kv_bytes: need,
            job,
        });
    }
}

/// One forward pass over every running sequence that has work this step, then sampling.
fn step(engine: &Engine, running: &mut Vec<Sequence>) -> candle_core::Result<()> {
    // (index into `running`, range of its prompt to feed, or None for a decode step)
    let mut plan: Vec<(usize, Option<std::ops::Range<usize>>)> = Vec::new();
    let mut prefill_left = PREFILL_PER_STEP;
    for (i, s) in running.iter().enumerate() {
        if s.prefilling() {
            let chunk = PREFILL_CHUNK.min(s.job.prompt.len() - s.fed);
            if chunk > prefill_left {
                continue; // next step; its chunks stay the same
            }
            prefill_left -= chunk;
            plan.push((i, Some(s.fed..s.fed + chunk)));
        } else {
            plan.push((i, None));
        }
    }
    let last_tokens: Vec<[u32; 1]> = plan
        .iter()
        .map(|(i, _)| [running[*i].generated.last().copied().unwrap_or(0)])
        .collect();
    let logits = {
        let mut picked: Vec<Option<&mut Sequence>> = running.iter_mut().map(Some).collect();
        let mut steps = Vec::with_capacity(plan.len());
        for ((i, range), last) in plan.iter().zip(&last_tokens) {
            let s = picked[*i].take().expect("each sequence once");
            let tokens: &[u32] = match range {
                Some(r) => &s.job.prompt[r.clone()],
                None => last,
            };
            steps.push(Step {
                tokens,
                cache: &mut s.cache,
            });
        }
        engine.model.forward(&mut steps)?
    };
    let mut finished = Vec::new();
    for (row, (i, range)) in plan.iter().enumerate() {
        let s = &mut running[*i];
        if let Some(r) = range {
            s.fed = r.end;
            if s.prefilling() {
                continue; // mid-prompt: nothing to sample yet
            }
        }
        let logits = logits.i(row)?;
        if let Some(done) = advance(engine, s, &logits)? {
            finished.push((*i, done));
        }
    }
    // Highest index first, so the others keep their places while removing.
    finished.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
    for (i, text) in finished {
        let s = running.remove(i);
        let first = s.first_token.unwrap_or_else(Instant::now);
        let done = Finished {
            prompt_tokens: s.job.prompt.len(),
            completion_tokens: s.generated.len(),
            time_to_first_token: first.saturating_duration_since(s.job.submitted),
            decode: first.elapsed(),
            text,
        };
        let _ = s.job.events.try_send(Event::Done(Ok(done)));
    }
    Ok(())
}

/// Samples the next token of `s`; sends the text it completes. Returns the whole answer when
/// the sequence has ended.
fn advance(
    engine: &Engine,
    s: &mut Sequence,
    logits: &Tensor,
) -> candle_core::Result<Option<String>> {
    let logits = if s.job.params.repeat_penalty != 1.0 {
        let context: Vec<u32> = s.job.prompt.iter().chain(&s.generated).copied().collect();
        let from = context.len().saturating_sub(REPEAT_LAST_N);
        candle_transformers::utils::apply_repeat_penalty(
            logits,
            s.job.params.repeat_penalty,
            &context[from..],
        )?
    } else {
        logits.clone()
    };
    let next = s.sampler.sample(&logits)?;
    if s.first_token.is_none() {
        s.first_token = Some(Instant::now());
    }
    let ended = engine.end.contains(&next);
    if !ended {
        s.generated.push(next);
    }
    let text = engine
        .tokenizer
        .decode(&s.generated, true)
        .map_err(|e| candle_core::Error::Msg(format!("decoding: {e}")))?;
    if let Some(at) = s.job.params.stop.iter().filter_map(|x| text.find(x)).min() {
        flush(s, &text[..at]);
        return Ok(Some(text[..at].to_owned()));
    }
    if ended || s.generated.len() >= s.job.params.max_tokens {
        flush(s, &text);
        return Ok(Some(text));
    }
    // Hold back an unfinished character and anything a stop string may still start with.
    let complete = text.trim_end_matches('\u{FFFD}');
    let hold = s
        .job
        .params
        .stop
        .iter()
        .flat_map(|x| {
            (1..x.len())
                .filter(|&k| x.is_char_boundary(k))
                .map(move |k| &x[..k])
        })
        .filter(|prefix| complete.ends_with(prefix))
        .map(str::len)
        .max()
        .unwrap_or(0);
    flush(s, &complete[..complete.len() - hold]);
    Ok(None)
}

/// Sends what of `text` the caller has not had yet.
fn flush(s: &mut Sequence, text: &str) {
    if text.len() > s.sent && text.is_char_boundary(s.sent) {
        let _ = s
            .job
            .events
            .try_send(Event::Text(text[s.sent..].to_owned()));
        s.sent = text.len();
    }
}

#[cfg(test)]
mod tests {
    use super::super::generate::{DecodeConfig, Generator};
    use super::super::{ExecLimits, Model, StartError, Streaming};
    use super::*;
    use nomad_proto::v1::{ToolInput, item_result, tool_input, tool_output};

    fn model(max_running: usize) -> Generator {
        model_with(max_running, false)
    }

    fn model_with(max_running: usize, dense_prefill: bool) -> Generator {
        Generator::load_configured(
            &super::super::test_models_dir().join("smollm2-135m-instruct"),
            &super::super::test_device(),
            true,
            DecodeConfig {
                max_running,
                kv_budget_bytes: None,
                dense_prefill,
            },
        )
        .unwrap()
    }

    fn input(text: &str, options: &str) -> ToolInput {
        ToolInput {
            value: Some(tool_input::Value::Text(text.to_owned())),
            options_json: options.to_owned(),
        }
    }

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

    fn texts(results: &[nomad_proto::v1::ItemResult]) -> Vec<String> {
        results
            .iter()
            .map(|r| match &r.result {
                Some(item_result::Result::Output(o)) => match &o.value {
                    Some(tool_output::Value::Text(t)) => t.clone(),
                    other => panic!("{other:?}"),
                },
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
        let inputs: Vec<ToolInput> = PROMPTS.iter().map(|p| input(p, options)).collect();
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
        let m = Generator::load_configured(
            &super::super::test_models_dir().join("smollm2-135m-instruct"),
            &super::super::test_device(),
            true,
            DecodeConfig {
                max_running: 8,
                kv_budget_bytes: Some(1 << 20),
                dense_prefill: false,
            },
        )
        .unwrap();
        let mut events = start(&m, PROMPTS[0], r#"{"max_tokens": 64}"#);
        match events.blocking_recv() {
            Some(Event::Done(Err(ExecError::OutOfMemory(m)))) => {
                assert!(m.contains("kv_budget_bytes is 1048576"), "{m}")
            }
            other => panic!("{other:?}"),
        }
    }

    impl Finished {
        /// `self` with `other`'s timings, to compare answers.
        fn with_times_of(self, other: &Finished) -> Finished {
            Finished {
                time_to_first_token: other.time_to_first_token,
                decode: other.decode,
                ..self
            }
        }
    }
}

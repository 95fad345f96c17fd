//! The decode loop of a generation model: continuous batching. One thread per placed model
//! advances every running sequence by one token per step, in one forward pass; newcomers'
//! prompts are fed between steps in chunks of [`PREFILL_CHUNK`] tokens (at most
//! [`PREFILL_PER_STEP`] per step), so a long prompt does not stall running sequences. A sequence
//! leaves at its end (end of turn, a stop string or `max_tokens`) and is answered at once; one
//! whose caller went away is dropped at the next step, freeing its place and KV cache.
//!
//! A newcomer whose prompt starts like a finished sequence's tokens (a shared system prompt,
//! the earlier turns of a chat) copies those tokens' keys and values from the
//! [`PrefixCache`] and feeds only the rest.
//!
//! A sequence is chunked the same way whatever runs beside it, and every row of a step is
//! computed as it would be alone (see `llama.rs`), so batching never changes an answer.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError};
use std::time::Instant;

use candle_core::{IndexOp, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use tokenizers::Tokenizer;

use crate::models::families::llama::{Cache, Llama, Step};
use crate::models::families::prefix_cache::PrefixCache;
use crate::models::model::{Event, ExecError, FinishReason, Finished};

/// Prompt tokens one sequence feeds per step.
pub const PREFILL_CHUNK: usize = 64;
/// Prompt tokens all newcomers together feed per step.
pub const PREFILL_PER_STEP: usize = 128;
/// Tokens back the repeat penalty looks.
const REPEAT_LAST_N: usize = 64;
/// Finished sequences' caches kept per running place (within the KV budget).
const KEPT_PER_PLACE: usize = 4;

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
    /// Prompt tokens fed so far (or copied from a kept cache).
    fed: usize,
    /// Prompt tokens copied from a kept cache.
    cached: usize,
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
    // Only where a copied prefix gives the same bits as a computed one (see `llama.rs`).
    let kept_entries = if engine.model.split_exact() {
        KEPT_PER_PLACE * bounds.max_running
    } else {
        0
    };
    let mut kept = PrefixCache::new(kept_entries);
    // Caches of sequences gone, whose memory serves the next ones.
    let mut spare: Vec<Cache> = Vec::with_capacity(bounds.max_running);
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
        for gone in running.extract_if(.., |s| s.job.events.is_closed()) {
            recycle(&mut spare, gone.cache, bounds);
        }
        waiting.retain(|j| !j.events.is_closed());
        admit(
            &engine,
            bounds,
            &mut waiting,
            &mut running,
            &mut kept,
            &mut spare,
        );
        if running.is_empty() {
            continue;
        }
        if let Err(e) = step(&engine, bounds, &mut running, &mut kept, &mut spare) {
            // The pass failed for every sequence in it.
            let message = ExecError::from(e);
            for s in running.drain(..) {
                let _ = s.job.events.try_send(Event::Done(Err(message.clone())));
            }
        }
    }
}

/// Starts waiting requests while places and KV budget allow (spare and kept caches give way
/// to them); one that could never fit is answered out of memory.
fn admit(
    engine: &Engine,
    bounds: Bounds,
    waiting: &mut VecDeque<Job>,
    running: &mut Vec<Sequence>,
    kept: &mut PrefixCache<Cache>,
    spare: &mut Vec<Cache>,
) {
    let held = |spare: &Vec<Cache>| -> u64 {
        spare
            .iter()
            .map(|c| c.capacity() as u64 * bounds.kv_bytes_per_token)
            .sum()
    };
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
        // A spare cache's memory serves this request (counted in `need` from here on).
        let memory = spare.pop();
        while reserved + kept.bytes() + held(spare) + need > bounds.kv_budget_bytes
            && (spare.pop().is_some() || kept.evict().is_some())
        {}
        let job = waiting.pop_front().expect("front exists");
        reserved += need;
        let (cache, cached) = start_cache(engine, kept, &job.prompt, tokens, memory);
        running.push(Sequence {
            cache,
            fed: cached,
            cached,
            generated: Vec::with_capacity(job.params.max_tokens),
            sampler: LogitsProcessor::from_sampling(job.params.seed, sampling(&job.params)),
            sent: 0,
            first_token: None,
            kv_bytes: need,
            job,
        });
    }
}

/// A cache of `capacity` tokens for `prompt`, holding what a kept cache shares with it (all but
/// the prompt's last token at most: its logits give the first new token), and how many
/// tokens that is; in `memory` where there is one (a gone sequence's cache), so that a new
/// sequence allocates nothing.
fn start_cache(
    engine: &Engine,
    kept: &mut PrefixCache<Cache>,
    prompt: &[u32],
    capacity: usize,
    mut memory: Option<Cache>,
) -> (Cache, usize) {
    if let Some((cache, shared)) = kept.longest(prompt) {
        let len = shared.min(prompt.len().saturating_sub(1));
        if len > 0 {
            let copy = match memory.take() {
                Some(mut into) => into.reuse(cache, len, capacity).map(|()| into),
                None => cache.prefix(len, capacity),
            };
            if let Ok(copy) = copy {
                return (copy, len);
            }
        }
    }
    match memory {
        Some(mut cache) => {
            cache.reset(capacity);
            (cache, 0)
        }
        None => (engine.model.cache(capacity), 0),
    }
}

/// A gone sequence's cache kept for its memory, up to one per running place.
fn recycle(spare: &mut Vec<Cache>, cache: Cache, bounds: Bounds) {
    if spare.len() < bounds.max_running {
        spare.push(cache);
    }
}

/// Keeps the cache of a finished sequence for prompts that start the same way (moved, not
/// copied: counted at the room it holds); what the kept caches no longer hold is recycled.
fn keep(s: Sequence, kept: &mut PrefixCache<Cache>, spare: &mut Vec<Cache>, bounds: Bounds) {
    let len = s.cache.len();
    let tokens: Vec<u32> = s
        .job
        .prompt
        .iter()
        .chain(&s.generated)
        .take(len)
        .copied()
        .collect();
    let no_longer_kept = if tokens.len() == len {
        let bytes = s.cache.capacity() as u64 * bounds.kv_bytes_per_token;
        kept.insert(tokens, s.cache, bytes)
    } else {
        vec![s.cache]
    };
    for cache in no_longer_kept {
        recycle(spare, cache, bounds);
    }
}

/// One forward pass over every running sequence that has work this step, then sampling.
fn step(
    engine: &Engine,
    bounds: Bounds,
    running: &mut Vec<Sequence>,
    kept: &mut PrefixCache<Cache>,
    spare: &mut Vec<Cache>,
) -> candle_core::Result<()> {
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
    for (i, (text, finish_reason)) in finished {
        let s = running.remove(i);
        let first = s.first_token.unwrap_or_else(Instant::now);
        let done = Finished {
            prompt_tokens: s.job.prompt.len(),
            cached_prompt_tokens: s.cached,
            completion_tokens: s.generated.len(),
            time_to_first_token: first.saturating_duration_since(s.job.submitted),
            decode: first.elapsed(),
            text,
            finish_reason,
        };
        let _ = s.job.events.try_send(Event::Done(Ok(done)));
        keep(s, kept, spare, bounds);
    }
    Ok(())
}

/// Samples the next token of `s`; sends the text it completes. Returns the whole answer and
/// why it ended when the sequence has ended.
fn advance(
    engine: &Engine,
    s: &mut Sequence,
    logits: &Tensor,
) -> candle_core::Result<Option<(String, FinishReason)>> {
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
        return Ok(Some((text[..at].to_owned(), FinishReason::Stop)));
    }
    if ended || s.generated.len() >= s.job.params.max_tokens {
        flush(s, &text);
        let reason = if ended {
            FinishReason::Stop
        } else {
            FinishReason::Length
        };
        return Ok(Some((text, reason)));
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
mod tests;

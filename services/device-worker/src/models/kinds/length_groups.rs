//! Splitting a batch of sequences so that little compute goes to padding: an encoder pads every
//! sequence of a forward pass to the longest, so one 200-token input beside thirty 8-token ones
//! costs as much as thirty-one 200-token inputs.

/// A new group starts when a sequence is longer than this multiple of the group's shortest
/// (plus [`SLACK`] tokens, so short sequences of nearly equal length stay together).
const RATIO: usize = 2;
const SLACK: usize = 8;

/// Plans the forward passes of sequences of `lens` tokens on `parts` workers: for each worker,
/// its passes, each a list of indices into `lens`. Sequences are grouped by length (sorted, a
/// group ends where lengths more than double); each group is shared evenly among the workers,
/// and a group smaller than the worker count goes to the least loaded ones. Every index appears
/// exactly once.
pub fn plan(lens: &[usize], parts: usize) -> Vec<Vec<Vec<usize>>> {
    let parts = parts.max(1);
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| (lens[i], i));
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for i in order {
        match groups.last_mut() {
            Some(group) if lens[i] <= RATIO * lens[group[0]] + SLACK => group.push(i),
            _ => groups.push(vec![i]),
        }
    }
    let mut plan: Vec<Vec<Vec<usize>>> = vec![Vec::new(); parts];
    // Padded tokens each worker has been given so far.
    let mut load = vec![0usize; parts];
    // Longest groups first, so the small ones even out the load.
    for group in groups.into_iter().rev() {
        let len = group.last().map_or(0, |&i| lens[i]).max(1);
        let share = group.len().div_ceil(parts);
        let mut chunks: Vec<Vec<usize>> = group.chunks(share).map(<[usize]>::to_vec).collect();
        // The biggest chunk to the least loaded worker.
        chunks.sort_by_key(|c| std::cmp::Reverse(c.len()));
        let mut workers: Vec<usize> = (0..parts).collect();
        workers.sort_by_key(|&w| (load[w], w));
        for (chunk, w) in chunks.into_iter().zip(workers) {
            load[w] += chunk.len() * len;
            plan[w].push(chunk);
        }
    }
    plan
}

/// The CPU threads an encoder's passes run on: one single-threaded pool per core, each running
/// whole passes (encoders' matmuls at these sizes scale poorly across threads; whole sequences
/// scale well), and one pool of every core for a batch that is a single pass (one long text,
/// or a query and one document), so that it does not leave all but one core idle. None on an
/// accelerator.
pub struct Pools {
    each: Vec<rayon::ThreadPool>,
    all: Option<rayon::ThreadPool>,
}

impl Pools {
    /// Pools for `cores` cores (0 on an accelerator), their threads named after `name`.
    pub fn new(cores: usize, name: &str) -> Result<Self, rayon::ThreadPoolBuildError> {
        let pool = |threads: usize, label: String| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(move |i| format!("{label}-{i}"))
                .build()
        };
        let each = (0..cores)
            .map(|i| pool(1, format!("{name}-{i}")))
            .collect::<Result<Vec<_>, _>>()?;
        let all = if cores > 1 {
            Some(pool(cores, format!("{name}-all"))?)
        } else {
            None
        };
        Ok(Self { each, all })
    }
}

/// Runs `forward` over `rows` in passes of similar length, one worker's passes on each of the
/// single-threaded pools (a lone pass on the pool of every core; everything on the calling
/// thread on an accelerator), and returns its results in the rows' order.
pub fn run_passes<R: Clone + Sync, T: Send + Default + Clone>(
    rows: &[R],
    lens: &[usize],
    pools: &Pools,
    forward: impl Fn(&[R]) -> Result<Vec<T>, crate::models::model::ExecError> + Sync,
) -> Result<Vec<T>, crate::models::model::ExecError> {
    type Part<T> = Result<Vec<(usize, T)>, crate::models::model::ExecError>;
    let plan = plan(lens, pools.each.len().max(1));
    let run = |passes: &[Vec<usize>]| -> Part<T> {
        let mut out = Vec::new();
        for pass in passes {
            let part: Vec<R> = pass.iter().map(|&i| rows[i].clone()).collect();
            out.extend(pass.iter().copied().zip(forward(&part)?));
        }
        Ok(out)
    };
    let busy: Vec<(&Vec<Vec<usize>>, &rayon::ThreadPool)> = plan
        .iter()
        .zip(&pools.each)
        .filter(|(passes, _)| !passes.is_empty())
        .collect();
    let lone = busy.len() == 1 && busy[0].0.len() == 1;
    let parts: Vec<Part<T>> = match (&pools.all, lone) {
        _ if pools.each.is_empty() => plan.iter().map(|passes| run(passes)).collect(),
        (Some(all), true) => vec![all.install(|| run(busy[0].0))],
        _ => std::thread::scope(|scope| {
            let handles: Vec<_> = busy
                .iter()
                .map(|&(passes, pool)| scope.spawn(|| pool.install(|| run(passes))))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(crate::models::model::ExecError::Failed(
                            "a forward pass panicked".into(),
                        ))
                    })
                })
                .collect()
        }),
    };
    let mut out = vec![T::default(); rows.len()];
    for part in parts {
        for (i, value) in part? {
            out[i] = value;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flatten(plan: &[Vec<Vec<usize>>]) -> Vec<usize> {
        let mut all: Vec<usize> = plan.iter().flatten().flatten().copied().collect();
        all.sort_unstable();
        all
    }

    #[test]
    fn long_sequences_are_not_padded_with_short_ones() {
        let mut lens = vec![8; 29];
        lens.extend([200, 210, 190]);
        let plan = plan(&lens, 2);
        assert_eq!(flatten(&plan), (0..32).collect::<Vec<_>>());
        for pass in plan.iter().flatten() {
            let (min, max) = pass.iter().fold((usize::MAX, 0), |(lo, hi), &i| {
                (lo.min(lens[i]), hi.max(lens[i]))
            });
            assert!(
                max <= 2 * min + SLACK,
                "a pass mixes {min} and {max} tokens"
            );
        }
    }

    #[test]
    fn similar_lengths_stay_one_pass_per_worker_split_evenly() {
        let lens: Vec<usize> = (0..32).map(|i| 25 + i % 16).collect();
        let plan = plan(&lens, 2);
        assert_eq!(flatten(&plan), (0..32).collect::<Vec<_>>());
        assert!(plan.iter().all(|passes| passes.len() == 1), "{plan:?}");
        assert_eq!(plan[0][0].len(), 16);
        assert_eq!(plan[1][0].len(), 16);
    }

    #[test]
    fn small_groups_balance_the_load_and_one_worker_takes_everything() {
        let lens = [300, 10, 10, 10];
        let two = plan(&lens, 2);
        assert_eq!(flatten(&two), vec![0, 1, 2, 3]);
        // The long one alone on one worker; the short ones share the other... or both: the
        // short group is split, its bigger half going to the worker without the long one.
        let with_long = two
            .iter()
            .position(|p| p.iter().any(|pass| pass.contains(&0)))
            .unwrap();
        let other: usize = two[1 - with_long].iter().map(Vec::len).sum();
        assert!(other >= 2, "{two:?}");
        let one = plan(&lens, 1);
        assert_eq!(one.len(), 1);
        assert_eq!(flatten(&one), vec![0, 1, 2, 3]);
        assert!(plan(&[], 2).iter().all(Vec::is_empty));
    }
}

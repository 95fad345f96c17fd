//! The keys and values of finished sequences, kept for new prompts that start the same way (a
//! shared system prompt, the earlier turns of a chat): a newcomer copies the tokens it shares
//! with the best entry instead of computing them again. Bounded by entries and, through the
//! decode loop's KV budget, by bytes; the least recently used entry goes first.

use std::collections::VecDeque;

/// Kept caches of type `C` (a sequence's KV cache; anything in tests).
pub struct PrefixCache<C> {
    /// Least recently used first.
    entries: VecDeque<Entry<C>>,
    max_entries: usize,
    bytes: u64,
}

struct Entry<C> {
    /// The tokens whose keys and values `cache` holds, in order.
    tokens: Vec<u32>,
    cache: C,
    bytes: u64,
}

/// How many tokens `a` and `b` start with in common.
pub fn shared(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<C> PrefixCache<C> {
    pub fn new(max_entries: usize) -> Self {
        Self {
            entries: VecDeque::new(),
            max_entries,
            bytes: 0,
        }
    }

    /// Bytes the kept caches hold.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The entry that starts with the most of `prompt` (the most recent among equals) and how
    /// many tokens it shares; it becomes the most recently used. `None` when none shares any.
    pub fn longest(&mut self, prompt: &[u32]) -> Option<(&C, usize)> {
        let (at, len) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, shared(&e.tokens, prompt)))
            .filter(|&(_, len)| len > 0)
            .max_by_key(|&(i, len)| (len, i))?;
        let entry = self.entries.remove(at).expect("index from the scan");
        self.entries.push_back(entry);
        let entry = self.entries.back().expect("just pushed");
        Some((&entry.cache, len))
    }

    /// Keeps `cache`, which holds `tokens`. An entry whose tokens all start `tokens` is replaced
    /// (the new one covers it); if an entry already covers `tokens`, that one is kept instead.
    /// Beyond `max_entries`, the least recently used go. Returns the caches no longer kept
    /// (`cache` itself where it is not), for their memory to serve again.
    pub fn insert(&mut self, tokens: Vec<u32>, cache: C, bytes: u64) -> Vec<C> {
        if self.max_entries == 0 || tokens.is_empty() {
            return vec![cache];
        }
        if let Some(at) = self
            .entries
            .iter()
            .position(|e| e.tokens.starts_with(&tokens))
        {
            let entry = self.entries.remove(at).expect("index from the scan");
            self.entries.push_back(entry);
            return vec![cache];
        }
        let mut gone = Vec::new();
        let mut i = 0;
        while i < self.entries.len() {
            if tokens.starts_with(&self.entries[i].tokens) {
                let replaced = self.entries.remove(i).expect("in range");
                self.bytes -= replaced.bytes;
                gone.push(replaced.cache);
            } else {
                i += 1;
            }
        }
        self.bytes += bytes;
        self.entries.push_back(Entry {
            tokens,
            cache,
            bytes,
        });
        while self.entries.len() > self.max_entries {
            gone.extend(self.evict());
        }
        gone
    }

    /// Takes out the least recently used entry's cache; None when none is left.
    pub fn evict(&mut self) -> Option<C> {
        let gone = self.entries.pop_front()?;
        self.bytes -= gone.bytes;
        Some(gone.cache)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_shared_start_wins_and_sharing_nothing_finds_nothing() {
        let mut kept = PrefixCache::new(4);
        kept.insert(vec![1, 2, 3], "a", 30);
        kept.insert(vec![1, 2, 9, 9], "b", 40);
        kept.insert(vec![7], "c", 10);
        assert_eq!(kept.longest(&[1, 2, 9, 5]), Some((&"b", 3)));
        assert_eq!(kept.longest(&[1, 2, 3, 4, 5]), Some((&"a", 3)));
        // Equal shares: the most recently used ("a", just found).
        assert_eq!(kept.longest(&[1, 2]), Some((&"a", 2)));
        assert_eq!(kept.longest(&[5, 1, 2]), None);
        assert_eq!(kept.longest(&[]), None);
        assert_eq!(kept.bytes(), 80);
    }

    #[test]
    fn a_covering_entry_replaces_what_it_covers_and_is_not_duplicated() {
        let mut kept = PrefixCache::new(4);
        kept.insert(vec![1, 2], "short", 20);
        assert_eq!(kept.insert(vec![1, 2, 3, 4], "long", 40), ["short"]);
        assert_eq!((kept.len(), kept.bytes()), (1, 40));
        // Covered by "long": nothing new is kept, and the new cache comes back.
        assert_eq!(kept.insert(vec![1, 2, 3], "covered", 30), ["covered"]);
        assert_eq!((kept.len(), kept.bytes()), (1, 40));
        assert_eq!(kept.longest(&[1, 2, 3, 4, 5]), Some((&"long", 4)));
    }

    #[test]
    fn the_least_recently_used_go_first_beyond_the_entry_bound() {
        let mut kept = PrefixCache::new(2);
        kept.insert(vec![1], "one", 1);
        kept.insert(vec![2], "two", 2);
        assert!(kept.longest(&[1]).is_some()); // "one" is now the most recent
        assert_eq!(kept.insert(vec![3], "three", 3), ["two"]);
        assert_eq!(kept.longest(&[2]), None, "the least recently used went");
        assert_eq!((kept.len(), kept.bytes()), (2, 4));
        assert_eq!(kept.evict(), Some("one"));
        assert_eq!(kept.evict(), Some("three"));
        assert_eq!(kept.evict(), None);
        assert_eq!(kept.bytes(), 0);
        let mut none = PrefixCache::new(0);
        assert_eq!(none.insert(vec![1], "kept nowhere", 1), ["kept nowhere"]);
        assert_eq!(none.len(), 0);
    }
}

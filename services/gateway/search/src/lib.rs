//! Ranking a catalog of tools for a query, with no network: the gateway lists the upstreams'
//! tools and embeds their texts, this crate ranks.
//!
//! - **Lexical**: BM25 (tantivy) over weighted fields — name 3.0, import path 2.0, title 1.5,
//!   description 1.0, arguments 1.25 — with the query's words OR-ed and identifiers split into
//!   words, 50 candidates; then the name-match tier (exact 12, prefix 8, suffix 4, substring 2)
//!   is added to the score and non-positive scores are dropped.
//! - **Hybrid**: the lexical candidates fused with the tools nearest to the query's embedding
//!   (cosine similarity) by a weighted sum, 0.1 × BM25 / best BM25 + 0.9 × similarity (chosen
//!   over reciprocal rank fusion by `nomad-search-bench`); the name tier still orders first, so
//!   a query that names a tool finds it.
//! - An empty query lists every tool, by server and name.

mod lexical;
pub mod text;

use serde_json::Value;

/// Candidates each ranker contributes before fusion (the original's 50).
pub const CANDIDATES: usize = 50;

/// Below this cosine similarity a tool is not a semantic candidate: unrelated texts score about
/// 0 to 0.15 with sentence embeddings, so this keeps nonsense queries from listing everything.
pub const MIN_SIMILARITY: f32 = 0.2;

/// Bytes of a description that go into the text embedded for a tool (the model reads about 256
/// tokens; the start of a description says what the tool is for).
const EMBEDDED_DESCRIPTION_BYTES: usize = 600;

/// One tool as the rankers see it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDoc {
    pub server: String,
    pub name: String,
    /// `mcp_tools.<server>.<tool>`: the words of the path sandboxed code imports it from.
    pub import_path: String,
    pub title: String,
    pub description: String,
    /// Argument names and descriptions as one text.
    pub arguments: String,
}

impl ToolDoc {
    pub fn new(
        server: &str,
        name: &str,
        title: &str,
        description: &str,
        input_schema: &Value,
    ) -> Self {
        Self {
            server: server.to_owned(),
            name: name.to_owned(),
            import_path: format!("mcp_tools.{server}.{name}"),
            title: title.to_owned(),
            description: description.to_owned(),
            arguments: text::arguments_text(input_schema),
        }
    }

    /// The text whose embedding stands for the tool: its name in words, title, the start of its
    /// description and its argument names.
    pub fn embedding_text(&self) -> String {
        let mut text = text::split_identifiers(&self.name);
        for part in [&self.title, &self.description] {
            let part = text::clip(part.trim(), EMBEDDED_DESCRIPTION_BYTES);
            if !part.is_empty() {
                text.push_str(". ");
                text.push_str(part);
            }
        }
        text
    }
}

/// How lexical and semantic ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fusion {
    /// Σ 1 / (k + rank) over the lists a tool is in.
    ReciprocalRank { k: f64 },
    /// `lexical` × BM25 / best BM25 + (1 − `lexical`) × cosine similarity.
    Weighted { lexical: f64 },
}

/// The fusion the gateway uses: on plain-language requests BM25 mostly adds noise (words such
/// as "cells" or "sheet" match many tools), so it weighs little; see BENCHMARKS.md, "Tool
/// search", for the fusions measured.
pub const DEFAULT_FUSION: Fusion = Fusion::Weighted { lexical: 0.1 };

/// Which rankers produced a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ranking {
    Lexical,
    Hybrid,
}

impl Ranking {
    pub fn as_str(self) -> &'static str {
        match self {
            Ranking::Lexical => "lexical",
            Ranking::Hybrid => "hybrid",
        }
    }
}

pub struct Query<'a> {
    pub text: &'a str,
    /// The query's embedding, from the same model as the tools'; `None` ranks lexically.
    pub embedding: Option<&'a [f32]>,
    /// Only tools of this server.
    pub server: Option<&'a str>,
    pub limit: usize,
    pub fusion: Fusion,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hit {
    /// Position of the tool in [`Index::docs`].
    pub doc: usize,
    pub score: f64,
}

/// A catalog ready to search: its tools, their BM25 index and, once embedded, their vectors.
pub struct Index {
    docs: Vec<ToolDoc>,
    lexical: lexical::Lexical,
    vectors: Option<Vec<Vec<f32>>>,
}

impl Index {
    pub fn build(docs: Vec<ToolDoc>) -> Result<Self, String> {
        let lexical =
            lexical::Lexical::build(&docs).map_err(|e| format!("building the tool index: {e}"))?;
        Ok(Self {
            docs,
            lexical,
            vectors: None,
        })
    }

    pub fn docs(&self) -> &[ToolDoc] {
        &self.docs
    }

    /// Gives every tool its embedding, in the order of [`Index::docs`]; vectors are normalised.
    pub fn set_embeddings(&mut self, vectors: Vec<Vec<f32>>) -> Result<(), String> {
        if vectors.len() != self.docs.len() {
            return Err(format!(
                "{} embeddings for {} tools",
                vectors.len(),
                self.docs.len()
            ));
        }
        if let Some(dims) = vectors.first().map(Vec::len)
            && vectors.iter().any(|v| v.len() != dims || dims == 0)
        {
            return Err("tool embeddings differ in length".into());
        }
        self.vectors = Some(vectors.into_iter().map(normalized).collect());
        Ok(())
    }

    pub fn has_embeddings(&self) -> bool {
        self.vectors.is_some()
    }

    /// The tools for `query`, best first, and which rankers ranked them. Hybrid when the query
    /// has an embedding of the tools' length and the tools are embedded; else lexical.
    pub fn search(&self, query: &Query<'_>) -> Result<(Vec<Hit>, Ranking), String> {
        let in_scope = |i: usize| query.server.is_none_or(|s| self.docs[i].server == s);
        if query.text.trim().is_empty() {
            let mut all: Vec<usize> = (0..self.docs.len()).filter(|&i| in_scope(i)).collect();
            all.sort_by(|&a, &b| {
                let (a, b) = (&self.docs[a], &self.docs[b]);
                (&a.server, &a.name).cmp(&(&b.server, &b.name))
            });
            let hits = all.into_iter().take(query.limit);
            return Ok((
                hits.map(|doc| Hit { doc, score: 0.0 }).collect(),
                Ranking::Lexical,
            ));
        }
        let key = text::name_key(query.text);
        let tier = |i: usize| text::name_tier(&key, &self.docs[i].name);
        let lexical = self
            .lexical
            .search(query.text, query.server, CANDIDATES)
            .map_err(|e| format!("searching the tool index: {e}"))?;
        // The original's order: BM25 plus the name tier, non-positive scores dropped.
        let mut lexical: Vec<Hit> = lexical
            .into_iter()
            .map(|(doc, score)| Hit {
                doc,
                score: f64::from(score) + tier(doc),
            })
            .filter(|h| h.score > 0.0)
            .collect();
        sort_best_first(&mut lexical);

        let semantic = match (query.embedding, &self.vectors) {
            (Some(q), Some(vectors)) if vectors.first().is_some_and(|v| v.len() == q.len()) => {
                let q = normalized(q.to_vec());
                let mut near: Vec<Hit> = (0..self.docs.len())
                    .filter(|&i| in_scope(i))
                    .map(|i| Hit {
                        doc: i,
                        score: f64::from(dot(&q, &vectors[i])),
                    })
                    .filter(|h| h.score >= f64::from(MIN_SIMILARITY))
                    .collect();
                sort_best_first(&mut near);
                near.truncate(CANDIDATES);
                Some(near)
            }
            _ => None,
        };
        let Some(semantic) = semantic else {
            lexical.truncate(query.limit);
            return Ok((lexical, Ranking::Lexical));
        };
        let mut fused = fuse(&lexical, &semantic, query.fusion);
        // A query that names a tool finds it first, whatever the fusion says.
        fused.sort_by(|a, b| {
            tier(b.doc)
                .total_cmp(&tier(a.doc))
                .then(b.score.total_cmp(&a.score))
                .then(a.doc.cmp(&b.doc))
        });
        fused.truncate(query.limit);
        Ok((fused, Ranking::Hybrid))
    }
}

/// Both lists combined by `fusion`; each list is best first.
fn fuse(lexical: &[Hit], semantic: &[Hit], fusion: Fusion) -> Vec<Hit> {
    let mut scores: std::collections::BTreeMap<usize, f64> = Default::default();
    match fusion {
        Fusion::ReciprocalRank { k } => {
            for list in [lexical, semantic] {
                for (rank, hit) in list.iter().enumerate() {
                    *scores.entry(hit.doc).or_default() += 1.0 / (k + rank as f64 + 1.0);
                }
            }
        }
        Fusion::Weighted { lexical: w } => {
            let best = lexical.iter().map(|h| h.score).fold(0.0, f64::max);
            for hit in lexical {
                *scores.entry(hit.doc).or_default() += w * hit.score / best;
            }
            for hit in semantic {
                *scores.entry(hit.doc).or_default() += (1.0 - w) * hit.score;
            }
        }
    }
    scores
        .into_iter()
        .map(|(doc, score)| Hit { doc, score })
        .collect()
}

fn sort_best_first(hits: &mut [Hit]) {
    hits.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.doc.cmp(&b.doc)));
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn normalized(mut v: Vec<f32>) -> Vec<f32> {
    let norm = dot(&v, &v).sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    }
    v
}

#[cfg(test)]
mod tests;

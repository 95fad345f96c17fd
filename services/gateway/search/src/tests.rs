//! Ranking behaviour on small catalogs with hand-made embeddings.

use super::*;
use serde_json::json;

fn catalog() -> Vec<ToolDoc> {
    let doc = |server: &str, name: &str, description: &str| {
        ToolDoc::new(server, name, "", description, &json!({}))
    };
    vec![
        doc("git", "git_log", "Shows the commit logs"),
        doc("git", "git_status", "Shows the working tree status"),
        doc("time", "convert_time", "Convert time between timezones"),
        doc(
            "nomad",
            "embed",
            "Sentence embedding (all-MiniLM-L6-v2, 384 dimensions)",
        ),
        doc("excel", "read_range", "Read cell values as rows"),
    ]
}

/// Unit vectors along axis `i` of 5, so each tool has its own direction.
fn axis(i: usize) -> Vec<f32> {
    let mut v = vec![0.0; 5];
    v[i] = 1.0;
    v
}

fn embedded() -> Index {
    let mut index = Index::build(catalog()).unwrap();
    index.set_embeddings((0..5).map(axis).collect()).unwrap();
    index
}

fn names(index: &Index, hits: &[Hit]) -> Vec<String> {
    hits.iter()
        .map(|h| index.docs()[h.doc].name.clone())
        .collect()
}

fn query<'a>(text: &'a str, embedding: Option<&'a [f32]>) -> Query<'a> {
    Query {
        text,
        embedding,
        server: None,
        limit: 10,
        fusion: DEFAULT_FUSION,
    }
}

#[test]
fn an_empty_query_lists_every_tool_by_server_and_name() {
    let index = embedded();
    let (hits, ranking) = index.search(&query("  ", None)).unwrap();
    assert_eq!(ranking, Ranking::Lexical);
    assert_eq!(
        names(&index, &hits),
        [
            "read_range",
            "git_log",
            "git_status",
            "embed",
            "convert_time"
        ]
    );
    let mut only_git = query("", None);
    only_git.server = Some("git");
    let (hits, _) = index.search(&only_git).unwrap();
    assert_eq!(names(&index, &hits), ["git_log", "git_status"]);
}

#[test]
fn a_query_with_no_matching_word_and_no_embedding_finds_nothing() {
    let index = embedded();
    let (hits, ranking) = index.search(&query("xylophone", None)).unwrap();
    assert_eq!((hits.len(), ranking), (0, Ranking::Lexical));
}

#[test]
fn meaning_finds_a_tool_that_shares_no_word_with_the_query() {
    let index = embedded();
    // "turn text into vectors" shares no word with `embed`'s texts; its embedding points at it.
    let near_embed = [0.1, 0.0, 0.05, 0.9, 0.0];
    let (hits, ranking) = index
        .search(&query("turn text into vectors", Some(&near_embed)))
        .unwrap();
    assert_eq!(ranking, Ranking::Hybrid);
    assert_eq!(names(&index, &hits)[0], "embed");
    // Lexically it finds nothing.
    let (lexical, _) = index
        .search(&query("turn text into vectors", None))
        .unwrap();
    assert!(lexical.is_empty());
}

#[test]
fn a_query_naming_a_tool_puts_it_first_even_when_meaning_points_elsewhere() {
    let index = embedded();
    let (hits, _) = index.search(&query("git status", Some(&axis(0)))).unwrap();
    assert_eq!(names(&index, &hits)[0], "git_status");
}

#[test]
fn both_rankers_agreeing_beats_either_alone() {
    let index = embedded();
    // Lexically "logs" finds git_log; the embedding leans to git_log too but also to status.
    let e = [0.8, 0.6, 0.0, 0.0, 0.0];
    for fusion in [
        Fusion::ReciprocalRank { k: 10.0 },
        Fusion::Weighted { lexical: 0.5 },
    ] {
        let mut q = query("commit logs", Some(&e));
        q.fusion = fusion;
        let (hits, _) = index.search(&q).unwrap();
        assert_eq!(
            names(&index, &hits)[..2],
            ["git_log", "git_status"],
            "{fusion:?}"
        );
    }
}

#[test]
fn the_server_filter_holds_for_both_rankers() {
    let index = embedded();
    let near_time = axis(2);
    let mut q = query("time", Some(&near_time));
    q.server = Some("git");
    let (hits, _) = index.search(&q).unwrap();
    assert!(
        hits.iter().all(|h| index.docs()[h.doc].server == "git"),
        "{hits:?}"
    );
}

#[test]
fn a_query_embedding_of_another_length_ranks_lexically() {
    let index = embedded();
    let (hits, ranking) = index
        .search(&query("timezones", Some(&[1.0, 0.0])))
        .unwrap();
    assert_eq!(ranking, Ranking::Lexical);
    assert_eq!(names(&index, &hits), ["convert_time"]);
}

#[test]
fn embeddings_must_match_the_catalog() {
    let mut index = Index::build(catalog()).unwrap();
    assert!(
        index
            .set_embeddings(vec![axis(0)])
            .unwrap_err()
            .contains("1 embeddings for 5 tools")
    );
    let mut ragged: Vec<Vec<f32>> = (0..5).map(axis).collect();
    ragged[3] = vec![1.0];
    assert!(index.set_embeddings(ragged).is_err());
    assert!(!index.has_embeddings());
}

#[test]
fn the_limit_bounds_the_answer() {
    let index = embedded();
    let mut q = query("shows", None);
    q.limit = 1;
    let (hits, _) = index.search(&q).unwrap();
    assert_eq!(hits.len(), 1);
}

#[test]
fn embedding_text_names_the_tool_in_words_and_clips_the_description() {
    let long = "x".repeat(5000);
    let doc = ToolDoc::new("s", "read_range", "Read", &long, &json!({}));
    let text = doc.embedding_text();
    assert!(text.starts_with("read range. Read. xxx"), "{}", &text[..30]);
    assert!(text.len() < 700);
}

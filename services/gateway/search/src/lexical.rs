//! BM25 over a tool's weighted fields (tantivy, in memory): name 3.0, import path 2.0, title 1.5,
//! description 1.0, arguments 1.25; the query's words OR-ed.

use tantivy::collector::TopDocs;
use tantivy::query::{BooleanQuery, BoostQuery, Occur, Query, TermQuery};
use tantivy::schema::{
    Field, IndexRecordOption, STORED, STRING, Schema, TextFieldIndexing, TextOptions, Value as _,
};
use tantivy::tokenizer::{
    Language, LowerCaser, RemoveLongFilter, SimpleTokenizer, Stemmer, StopWordFilter, TextAnalyzer,
};
use tantivy::{IndexReader, TantivyDocument, Term};

use crate::ToolDoc;
use crate::text::split_identifiers;

const TOKENIZER: &str = "tool_words";

/// Each searched field and its weight.
const WEIGHTS: [(&str, f32); 5] = [
    ("name", 3.0),
    ("import", 2.0),
    ("title", 1.5),
    ("description", 1.0),
    ("arguments", 1.25),
];

fn analyzer() -> TextAnalyzer {
    TextAnalyzer::builder(SimpleTokenizer::default())
        .filter(RemoveLongFilter::limit(40))
        .filter(LowerCaser)
        .filter(StopWordFilter::new(Language::English).expect("tantivy ships English stop words"))
        .filter(Stemmer::new(Language::English))
        .build()
}

pub struct Lexical {
    reader: IndexReader,
    fields: [Field; 5],
    server: Field,
    id: Field,
}

impl Lexical {
    pub fn build(docs: &[ToolDoc]) -> tantivy::Result<Self> {
        let mut schema = Schema::builder();
        let words = TextOptions::default().set_indexing_options(
            TextFieldIndexing::default()
                .set_tokenizer(TOKENIZER)
                .set_index_option(IndexRecordOption::WithFreqs),
        );
        let fields = WEIGHTS.map(|(name, _)| schema.add_text_field(name, words.clone()));
        let server = schema.add_text_field("server", STRING);
        let id = schema.add_u64_field("id", STORED);
        let index = tantivy::Index::create_in_ram(schema.build());
        index.tokenizers().register(TOKENIZER, analyzer());
        // One thread and the smallest arena tantivy takes: a catalog is small.
        let mut writer = index.writer_with_num_threads(1, 15_000_000)?;
        for (i, doc) in docs.iter().enumerate() {
            let mut d = TantivyDocument::new();
            let texts = [
                &doc.name,
                &doc.import_path,
                &doc.title,
                &doc.description,
                &doc.arguments,
            ];
            for (field, text) in fields.iter().zip(texts) {
                d.add_text(*field, split_identifiers(text));
            }
            d.add_text(server, &doc.server);
            d.add_u64(id, i as u64);
            writer.add_document(d)?;
        }
        writer.commit()?;
        Ok(Self {
            reader: index.reader()?,
            fields,
            server,
            id,
        })
    }

    /// Up to `candidates` documents with a positive score for `query`, best first, as
    /// (document number, BM25 score).
    pub fn search(
        &self,
        query: &str,
        server: Option<&str>,
        candidates: usize,
    ) -> tantivy::Result<Vec<(usize, f32)>> {
        let words = terms(query);
        if words.is_empty() || candidates == 0 {
            return Ok(Vec::new());
        }
        let mut should: Vec<(Occur, Box<dyn Query>)> = Vec::new();
        for (field, (_, weight)) in self.fields.iter().zip(WEIGHTS) {
            for word in &words {
                let term = TermQuery::new(
                    Term::from_field_text(*field, word),
                    IndexRecordOption::WithFreqs,
                );
                should.push((
                    Occur::Should,
                    Box::new(BoostQuery::new(Box::new(term), weight)),
                ));
            }
        }
        let mut query: Box<dyn Query> = Box::new(BooleanQuery::new(should));
        if let Some(server) = server {
            let only = TermQuery::new(
                Term::from_field_text(self.server, server),
                IndexRecordOption::Basic,
            );
            query = Box::new(BooleanQuery::new(vec![
                (Occur::Must, query),
                (Occur::Must, Box::new(BoostQuery::new(Box::new(only), 0.0))),
            ]));
        }
        let searcher = self.reader.searcher();
        let top = searcher.search(&query, &TopDocs::with_limit(candidates).order_by_score())?;
        let mut found = Vec::with_capacity(top.len());
        for (score, address) in top {
            let doc: TantivyDocument = searcher.doc(address)?;
            if let Some(id) = doc.get_first(self.id).and_then(|v| v.as_u64())
                && score > 0.0
            {
                found.push((id as usize, score));
            }
        }
        Ok(found)
    }
}

/// The distinct analysed words of `query`, as the index holds them.
fn terms(query: &str) -> Vec<String> {
    let mut analyzer = analyzer();
    let opened = split_identifiers(query);
    let mut stream = analyzer.token_stream(&opened);
    let mut words: Vec<String> = Vec::new();
    while stream.advance() {
        let word = &stream.token().text;
        if !words.contains(word) {
            words.push(word.clone());
        }
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(server: &str, name: &str, description: &str) -> ToolDoc {
        ToolDoc::new(server, name, "", description, &serde_json::json!({}))
    }

    #[test]
    fn query_words_are_stemmed_split_and_stripped_of_stop_words() {
        assert_eq!(terms("Reading the commitLogs"), ["read", "commit", "log"]);
        assert_eq!(terms("the of a"), Vec::<String>::new());
    }

    #[test]
    fn a_name_word_outweighs_the_same_word_in_a_description() {
        let docs = [
            doc("s", "describe_things", "Commits nothing at all."),
            doc("s", "git_commit", "Records changes to the repository."),
        ];
        let index = Lexical::build(&docs).unwrap();
        let found = index.search("commit", None, 50).unwrap();
        assert_eq!(found.iter().map(|f| f.0).collect::<Vec<_>>(), [1, 0]);
        assert!(found[0].1 > found[1].1);
    }

    #[test]
    fn words_are_or_ed_and_unmatched_documents_are_left_out() {
        let docs = [
            doc("a", "convert_time", "Convert time between timezones"),
            doc("b", "fetch", "Fetches a URL"),
            doc("a", "git_log", "Shows the commit logs"),
        ];
        let index = Lexical::build(&docs).unwrap();
        let found: Vec<usize> = index
            .search("timezone url", None, 50)
            .unwrap()
            .into_iter()
            .map(|f| f.0)
            .collect();
        assert_eq!(found.len(), 2);
        assert!(found.contains(&0) && found.contains(&1));
        let only_a: Vec<usize> = index
            .search("timezone url", Some("a"), 50)
            .unwrap()
            .into_iter()
            .map(|f| f.0)
            .collect();
        assert_eq!(only_a, [0]);
    }
}

//! Large results as resource links: a result over `gateway.tasks.link_results_over_bytes` is
//! kept in the task store (for its owner, for the tasks' TTL) and answered as a
//! `resource_link` the client reads with `resources/read`, so the model's context holds a link
//! rather than a tensor. A tool that declares an output schema keeps its result inline: the
//! protocol requires its structured result to be there.

use std::sync::Arc;

use rmcp::ErrorData as McpError;
use rmcp::model::{CallToolResult, ContentBlock, ReadResourceResult, Resource, ResourceContents};

use super::{Caller, Tasks, now_ms};

/// Where linked results live.
const SCHEME: &str = "nomad://results/";

impl Tasks {
    /// `result` as it is, or, when it is over the size, as a link to it kept for `caller`.
    pub async fn link_large(
        self: &Arc<Self>,
        caller: &Caller,
        tool: &str,
        result: CallToolResult,
        has_output_schema: bool,
    ) -> CallToolResult {
        let Some(limit) = self.config.link_results_over_bytes.filter(|l| *l > 0) else {
            return result;
        };
        if has_output_schema {
            return result;
        }
        // Measured without making the text for a result that stays inline (most of them).
        let over = match &result.structured_content {
            Some(value) => crate::json_len::json_len(value, limit) > limit,
            None => {
                result
                    .content
                    .iter()
                    .filter_map(|c| c.as_text().map(|t| t.text.len() as u64))
                    .sum::<u64>()
                    > limit
            }
        };
        if !over {
            return result;
        }
        let (mime, body) = match &result.structured_content {
            Some(value) => ("application/json", value.to_string()),
            None => {
                // Only text can be kept as text; an image or audio block stays inline.
                let texts: Option<Vec<&str>> = result
                    .content
                    .iter()
                    .map(|c| c.as_text().map(|t| t.text.as_str()))
                    .collect();
                match texts {
                    Some(texts) => ("text/plain", texts.concat()),
                    None => return result,
                }
            }
        };
        let uri = format!("{SCHEME}{}", uuid::Uuid::new_v4().simple());
        let size = body.len() as u64;
        let (owner, kept_uri) = (caller.owner().to_owned(), uri.clone());
        let kept = self
            .with_store(move |s| s.put_result(&kept_uri, &owner, mime, &body, now_ms()))
            .await;
        match kept {
            Ok(removed) => self.instruments.removed(removed),
            Err(e) => {
                // Nothing is lost: the result goes inline, as it would without links.
                tracing::warn!(tool, "a large result is answered inline: {e}");
                return result;
            }
        }
        let mut link = Resource::new(uri, format!("{tool} result"));
        link.description = Some(format!(
            "The result of {tool}: {size} bytes of {mime}, over gateway.tasks.\
             link_results_over_bytes ({limit}); read it with resources/read within \
             gateway.tasks.ttl_seconds."
        ));
        link.mime_type = Some(mime.to_owned());
        link.size = Some(size);
        let mut linked = if result.is_error == Some(true) {
            CallToolResult::error(vec![ContentBlock::resource_link(link)])
        } else {
            CallToolResult::success(vec![ContentBlock::resource_link(link)])
        };
        linked.meta = result.meta;
        linked
    }

    /// `resources/read` of a linked result, for the caller that made it.
    pub async fn read(
        self: &Arc<Self>,
        caller: &Caller,
        uri: String,
    ) -> Result<ReadResourceResult, McpError> {
        let owner = caller.owner().to_owned();
        let key = uri.clone();
        let found = self
            .with_store(move |s| s.result(&key, &owner, now_ms()))
            .await
            .map_err(|e| super::refusal(&e))?;
        let Some((mime, body)) = found else {
            return Err(McpError::resource_not_found(
                format!(
                    "no result at {uri}: results are kept gateway.tasks.ttl_seconds, for the \
                     credential that made them"
                ),
                None,
            ));
        };
        let contents = ResourceContents::TextResourceContents {
            uri,
            mime_type: Some(mime),
            text: body,
            meta: None,
        };
        Ok(ReadResourceResult::new(vec![contents]))
    }
}

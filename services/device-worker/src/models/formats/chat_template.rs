//! A model's own chat template (`tokenizer.chat_template`, Jinja), rendered as transformers'
//! `apply_chat_template` renders it: blocks trimmed and left-stripped, loop controls, Python's
//! string and dict methods, `raise_exception` and `strftime_now`, the model's `bos_token` and
//! `eos_token`, and `add_generation_prompt` set so the prompt ends where the assistant begins.

use minijinja::{Environment, Error, ErrorKind, context};

const NAME: &str = "chat_template";

/// One message of a chat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: &'static str,
    pub content: String,
}

/// Why a conversation could not be made into a prompt.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("the model's chat template does not compile: {0}")]
    Compile(String),
    /// The template itself refused the conversation (its `raise_exception`), e.g. roles that
    /// do not alternate.
    #[error("the model's chat template refuses this conversation: {0}")]
    Refused(String),
    #[error("the model's chat template failed: {0}")]
    Render(String),
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<(), Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message).with_source(Raised))
        });
        env.add_function("strftime_now", |format: String| -> Result<String, Error> {
            use std::fmt::Write as _;
            let mut out = String::new();
            write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: {format:?} is not a time format"),
                )
            })?;
            Ok(out)
        });
        env.add_template_owned(NAME, source.to_owned())
            .map_err(|e| TemplateError::Compile(describe(&e)))?;
        Ok(Self {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// The conversation as the model was trained to read it, ready for the assistant's turn.
    pub fn render(&self, messages: &[Message]) -> Result<String, TemplateError> {
        let messages: Vec<_> = messages
            .iter()
            .map(|m| context! { role => m.role, content => m.content })
            .collect();
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| TemplateError::Compile(describe(&e)))?;
        template
            .render(context! {
                messages,
                add_generation_prompt => true,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| {
                if std::error::Error::source(&e).is_some_and(|s| s.is::<Raised>()) {
                    TemplateError::Refused(e.detail().unwrap_or_default().to_owned())
                } else {
                    TemplateError::Render(describe(&e))
                }
            })
    }
}

/// Marks an error the template raised itself (`raise_exception`).
#[derive(Debug, thiserror::Error)]
#[error("raised by the template")]
struct Raised;

/// An error with its line, without minijinja's debug dump of the template.
fn describe(e: &Error) -> String {
    match e.line() {
        Some(line) => format!(
            "{} (line {line})",
            e.detail().unwrap_or(&e.kind().to_string())
        ),
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(pairs: &[(&'static str, &str)]) -> Vec<Message> {
        pairs
            .iter()
            .map(|(role, content)| Message {
                role,
                content: (*content).to_owned(),
            })
            .collect()
    }

    /// Llama 3's template as Meta ships it (a Jinja feature set: `set`, `loop.index0`, `trim`,
    /// string concatenation, `bos_token`).
    const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

    #[test]
    fn renders_the_models_own_template() {
        let t = ChatTemplate::new(LLAMA3, "<|begin_of_text|>", "<|eot_id|>").unwrap();
        let prompt = t
            .render(&messages(&[("system", "Be brief."), ("user", "  Hi  ")]))
            .unwrap();
        assert_eq!(
            prompt,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    /// Blocks trimmed as transformers trims them, Python methods, loop controls.
    #[test]
    fn python_methods_trimmed_blocks_and_loop_controls() {
        let source = "{% for m in messages %}\n  {% if m.role == 'system' %}{% continue %}{% endif %}\n{{ m.content.strip().upper() }}|\n{% endfor %}";
        let t = ChatTemplate::new(source, "", "").unwrap();
        let prompt = t
            .render(&messages(&[
                ("system", "x"),
                ("user", " a "),
                ("assistant", "b"),
            ]))
            .unwrap();
        assert_eq!(prompt, "A|\nB|\n");
    }

    #[test]
    fn a_refusal_and_a_broken_template_are_named() {
        let source = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user message') }}{% endif %}ok";
        let t = ChatTemplate::new(source, "", "").unwrap();
        let err = t
            .render(&messages(&[("assistant", "hi")]))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "the model's chat template refuses this conversation: Conversations must start \
             with a user message"
        );
        let err = ChatTemplate::new("{% for m in messages %}", "", "")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("the model's chat template does not compile:"),
            "{err}"
        );
        assert!(err.contains("line 1"), "{err}");
    }
}

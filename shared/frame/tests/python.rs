//! The two ends of the format against each other: frames Rust writes, read by `nomad_frame.py`
//! in a real interpreter, and the frames it writes back read by Rust; the same refusals on both
//! sides; a limit handed over in the environment as the services hand it.

use std::io::Write as _;
use std::process::{Command, Stdio};

use nomad_frame::{Decoder, FrameError, encode, encode_fields, frame, limit_variable};
use serde_json::{Value, json};

/// Reads frames on stdin with `nomad_frame`, answers each with a frame of its own on stdout:
/// a fields frame's fields as JSON, a JSON frame echoed with `"seen": true`, and a refusal's
/// message when a frame is over the limit.
const ECHO: &str = r#"
import json, os, sys
sys.path.insert(0, sys.argv[1])
import nomad_frame

limit = nomad_frame.limit("test")
stdin = sys.stdin.buffer

def read_exact(n):
    data = stdin.read(n)
    if len(data) < n:
        raise EOFError
    return data

def reply(value):
    sys.stdout.buffer.write(nomad_frame.pack(json.dumps(value).encode(), limit))

reply({"fields": nomad_frame.fields(nomad_frame.read(read_exact, limit))})
message = json.loads(nomad_frame.read(read_exact, limit))
message["seen"] = True
reply(message)
try:
    nomad_frame.read(read_exact, limit)
except nomad_frame.FrameTooLarge as e:
    reply({"refused": str(e)})
try:
    nomad_frame.pack(b"x" * (limit + 1), limit)
except nomad_frame.FrameTooLarge as e:
    reply({"refused": str(e)})
"#;

fn python() -> String {
    std::env::var("NOMAD_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

#[test]
fn rust_and_python_read_each_others_frames_and_refuse_alike() {
    const LIMIT: usize = 4096;
    let mut input = encode_fields(["run", "<code>", "RESULT = 'é'", "1,2,3"], LIMIT).unwrap();
    input.extend(encode(&json!({"id": 7, "method": "call_tool"}), LIMIT).unwrap());
    // A header over the limit: refused before its body is read.
    input.extend(((LIMIT + 1) as u32).to_be_bytes());

    let mut child = Command::new(python())
        .args(["-I", "-c", ECHO, env!("CARGO_MANIFEST_DIR")])
        .env(limit_variable("test"), LIMIT.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    child.stdin.take().unwrap().write_all(&input).unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );

    let mut decoder = Decoder::new(LIMIT);
    decoder.push(&output.stdout);
    let mut replies: Vec<Value> = Vec::new();
    while let Some(reply) = decoder.next_as().unwrap() {
        replies.push(reply);
    }
    assert_eq!(decoder.buffered(), 0, "Python wrote whole frames only");
    let rust_refusal = |len| FrameError::TooLarge { len, limit: LIMIT }.to_string();
    assert_eq!(
        replies,
        [
            json!({"fields": ["run", "<code>", "RESULT = 'é'", "1,2,3"]}),
            json!({"id": 7, "method": "call_tool", "seen": true}),
            json!({"refused": rust_refusal(LIMIT + 1)}),
            json!({"refused": rust_refusal(LIMIT + 1)}),
        ]
    );
    assert_eq!(
        frame(&[0; LIMIT + 1], LIMIT).unwrap_err().to_string(),
        rust_refusal(LIMIT + 1)
    );
}

#[test]
fn a_python_end_without_its_limit_says_what_sets_it() {
    let output = Command::new(python())
        .args([
            "-I",
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); import nomad_frame; nomad_frame.limit('bridge')",
            env!("CARGO_MANIFEST_DIR"),
        ])
        .env_remove(limit_variable("bridge"))
        .output()
        .expect("python3 runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("NOMAD_BRIDGE_MAX_FRAME is '', not a number of bytes"),
        "{stderr}"
    );
}

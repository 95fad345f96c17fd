//! The frame limits each side of a pipe must agree on are declared in Rust; the Python that
//! reads the other end states them again (it runs before it can be told). These tests make a
//! change on one side alone fail here rather than at run time.

use super::{RUNNER, ZYGOTE};

/// `NAME = A << B` (or `NAME = N`) in `source`, evaluated.
fn python_constant(source: &str, name: &str) -> usize {
    let line = source
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} = ")))
        .unwrap_or_else(|| panic!("no `{name} = ...` line"));
    match line.split_once("<<") {
        Some((a, b)) => a.trim().parse::<usize>().unwrap() << b.trim().parse::<u32>().unwrap(),
        None => line.trim().parse().unwrap(),
    }
}

#[test]
fn the_runner_and_zygote_read_the_frames_the_gateway_writes() {
    assert_eq!(
        python_constant(RUNNER, "MAX_FRAME"),
        super::bridge::MAX_FRAME,
        "runner.py's MAX_FRAME and nomad_jail::frame::MAX_FRAME"
    );
    assert_eq!(
        python_constant(ZYGOTE, "MAX_CONTROL_FRAME"),
        super::fork_server::CONTROL_FRAME,
        "zygote.py's MAX_CONTROL_FRAME and fork_server::CONTROL_FRAME"
    );
}

#[test]
fn the_docs_state_the_bridges_frame_limit() {
    let docs = include_str!("../../../../docs/gateway.md");
    let stated = format!("{} MiB frames", super::bridge::MAX_FRAME >> 20);
    assert!(
        docs.contains(&stated),
        "docs/gateway.md should say \"{stated}\" of the bridge"
    );
}

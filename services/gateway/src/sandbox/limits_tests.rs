//! The frame limits are declared once, in Rust (`nomad_jail::frame`), and reach the runner and
//! the zygote in their environment. These tests hold the protocol names each side uses to one
//! another, and the docs to the bridge's limit, so a change on one side alone fails here rather
//! than at run time.

use super::{RUNNER, ZYGOTE};

#[test]
fn the_runner_and_zygote_read_the_limits_the_jail_sets() {
    let set = nomad_jail::frame::environment();
    for (source, protocol) in [(RUNNER, "bridge"), (ZYGOTE, "control")] {
        assert!(
            source.contains(&format!("limit(\"{protocol}\")")),
            "the Python end should read the {protocol} limit"
        );
        let variable = nomad_frame::limit_variable(protocol);
        assert!(
            set.iter().any(|v| v.starts_with(&format!("{variable}="))),
            "the jail should set {variable}: {set:?}"
        );
    }
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

//! Starting `nomad-gateway sandbox-init`, the first process of every sandboxed run and of the
//! fork server: the gateway's own binary in that mode, a fresh single-threaded process that
//! takes the isolation steps of `nomad_jail` (one sequence, shared with forked runs) and then
//! starts Python. Its spec travels as the bridge's first frame, never on the command line, which
//! `ps` shows every user.

use std::io::Write as _;

pub use nomad_jail::{Entry, INIT_ARG as ARG, Limits, RUNTIME_DIR, Report, SETUP_FAILED, Spec};

/// The command that starts the init for `spec` (with no environment), and the gateway's end of
/// the bridge, whose other end is the command's standard input and already holds the spec (a
/// few KiB into an empty socket buffer: the write completes before the init reads). Standard
/// output and error are the caller's to set.
pub fn command(
    spec: &Spec,
) -> std::io::Result<(std::os::unix::net::UnixStream, tokio::process::Command)> {
    let (mut ours, theirs) = std::os::unix::net::UnixStream::pair()?;
    let frame = nomad_jail::frame::encode(spec).map_err(std::io::Error::other)?;
    ours.write_all(&frame)?;
    let mut command = tokio::process::Command::new("/proc/self/exe");
    command
        .arg(ARG)
        .env_clear()
        .stdin(std::process::Stdio::from(std::os::fd::OwnedFd::from(
            theirs,
        )))
        .kill_on_drop(true);
    Ok((ours, command))
}

/// Runs the init; never returns.
pub fn main() -> ! {
    nomad_jail::init_main()
}

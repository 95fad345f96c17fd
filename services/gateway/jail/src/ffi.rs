//! The C interface the fork server's interpreter calls through `ctypes` (see `zygote.py`):
//! prepare once, then one call in each child it forks.

use std::ffi::c_int;
use std::io::Write as _;

use crate::error::Step as _;
use crate::{Failed, Jail, SETUP_FAILED, Spec, descriptors};

/// Parses `spec` (`len` bytes of a [`Spec`] as JSON) and prepares it; null on failure, said on
/// standard error.
///
/// # Safety
/// `spec` points to `len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nomad_jail_prepare(spec: *const u8, len: usize) -> *mut Jail {
    // SAFETY: the caller's promise.
    let bytes = unsafe { std::slice::from_raw_parts(spec, len) };
    let prepared = serde_json::from_slice::<Spec>(bytes)
        .step("reading the spec")
        .and_then(Jail::new);
    match prepared {
        Ok(jail) => Box::into_raw(Box::new(jail)),
        Err(Failed(message)) => {
            let _ = writeln!(std::io::stderr(), "nomad sandbox fork server: {message}");
            std::ptr::null_mut()
        }
    }
}

/// In a child the fork server has just forked (one thread): places `bridge`, `stdout` and
/// `stderr`, starts a new session, then takes the run's steps. Returns 0 in the run's first
/// process, isolated, its report sent; the waiter it leaves outside never returns. A failure is
/// said on standard error and ends the child with [`SETUP_FAILED`].
///
/// # Safety
/// `jail` is what [`nomad_jail_prepare`] returned, and the caller is a freshly forked child with
/// no other thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nomad_jail_enter_run(
    jail: *const Jail,
    bridge: c_int,
    stdout: c_int,
    stderr: c_int,
) -> c_int {
    // SAFETY: the caller's promise.
    let jail = unsafe { &*jail };
    let entered = descriptors::arrange(bridge, stdout, stderr)
        .and_then(|()| nix::unistd::setsid().step("setsid"))
        .and_then(|_| jail.enter_run());
    match entered {
        Ok(_) => 0,
        Err(Failed(message)) => {
            let _ = writeln!(std::io::stderr(), "nomad sandbox-init: {message}");
            // SAFETY: ends the child without running the interpreter's exit handlers.
            unsafe { libc::_exit(SETUP_FAILED) }
        }
    }
}

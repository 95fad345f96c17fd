//! A mutex's guard even when a holder panicked: what the gateway keeps behind its mutexes (maps
//! of sessions, connections, forks and tasks) stays usable, so one panic does not take down the
//! rest.

use std::sync::{Mutex, MutexGuard};

pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

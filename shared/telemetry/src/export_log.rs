//! Export failures are logged once per kind, not once per batch: during a collector outage the
//! SDK reports every failed export, which would bury the process's own log. How many were left
//! out is logged at shutdown. (Span drops need nothing: the SDK logs the first and, at shutdown,
//! the count.)

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use tracing::Metadata;
use tracing::subscriber::Interest;
use tracing_subscriber::layer::{Context, Filter};

static SEEN: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
static SUPPRESSED: AtomicU64 = AtomicU64::new(0);

fn is_export_error(meta: &Metadata<'_>) -> bool {
    meta.target().starts_with("opentelemetry") && meta.name().ends_with("ExportError")
}

/// Lets the first export error of each kind through and counts the rest.
pub(crate) struct ExportErrorsOnce;

impl<S> Filter<S> for ExportErrorsOnce {
    fn enabled(&self, meta: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        if !is_export_error(meta) {
            return true;
        }
        let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
        let first = seen.get_or_insert_with(HashSet::new).insert(meta.name());
        if !first {
            SUPPRESSED.fetch_add(1, Ordering::Relaxed);
        }
        first
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        // Export errors are decided per event; everything else once per callsite.
        if is_export_error(meta) {
            Interest::sometimes()
        } else {
            Interest::always()
        }
    }
}

/// Export failures not logged since the first of their kind.
pub(crate) fn suppressed() -> u64 {
    SUPPRESSED.load(Ordering::Relaxed)
}

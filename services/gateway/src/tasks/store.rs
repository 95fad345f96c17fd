//! The task store: one SQLite database (WAL, synchronous writes) holding every task's state and
//! outcome, bounded by a count, a byte budget and a time to live. Plain and synchronous, its
//! clock passed in, so that every rule is tested without a network or a wait.
//!
//! A task is `working` until it ends `completed` (its `CallToolResult`), `failed` (a JSON-RPC
//! error) or `cancelled`; its outcome is kept `ttl` after it ends, then removed. A task still
//! `working` when the store is opened again was cut off by a stop: it is `failed`, saying so.

use std::path::{Path, PathBuf};

use rusqlite::{Connection, OptionalExtension as _, params};

/// The schema's version (`PRAGMA user_version`); a store written by another version is refused.
const SCHEMA_VERSION: i64 = 1;

/// What every task costs the byte budget beside its outcome (its id, owner, tool and times).
pub const ROW_BYTES: u64 = 256;

/// The message of a task cut off by a stop.
pub const STOPPED: &str =
    "the gateway stopped while this task was working; call the tool again for its result";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// How long a finished task's outcome is kept (ms).
    pub ttl_ms: u64,
    /// Tasks held at once, working or finished.
    pub max_tasks: u64,
    /// Bytes of outcomes held at once (each task counts [`ROW_BYTES`] more).
    pub max_bytes: u64,
}

/// A task's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr, strum::EnumString)]
#[strum(serialize_all = "snake_case")]
pub enum Status {
    Working,
    Completed,
    Failed,
    Cancelled,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    fn parse(text: &str) -> Result<Self, StoreError> {
        text.parse()
            .map_err(|_| StoreError::Corrupt(format!("a task's status is {text:?}")))
    }
}

/// How a task ended: its result or error as JSON (the wire's `result` / `error` objects).
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Completed(String),
    Failed { error: String, message: String },
}

/// One task as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub id: String,
    pub tool: String,
    pub status: Status,
    pub message: Option<String>,
    /// The result (completed) or error (failed), as JSON.
    pub payload: Option<String>,
    pub created_ms: u64,
    pub updated_ms: u64,
    /// When the task may be removed: `None` while it works.
    pub expires_ms: Option<u64>,
}

impl Record {
    /// Its time to live counted from its creation, as the wire states it: while it works, the
    /// configured TTL; once it ended, up to the moment it will be removed.
    pub fn ttl_ms(&self, limits: &Limits) -> u64 {
        match self.expires_ms {
            Some(expires) => expires.saturating_sub(self.created_ms),
            None => limits.ttl_ms,
        }
    }
}

/// Tasks removed by one operation, by reason (`reason` on `nomad.gateway.tasks.removed`):
/// expired (their time ran out) or evicted (room was made for a newer task or outcome).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Removed {
    pub expired: u64,
    pub evicted: u64,
}

/// What `tasks/cancel` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancelled {
    /// It was working and is now `cancelled`.
    Now,
    /// It had already ended (cancelling it changes nothing).
    AlreadyEnded(Status),
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the task store {path} could not be opened: {source}")]
    Open {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error("the task store's directory {path} could not be made: {source}")]
    Directory {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the task store {path} is in use by another gateway: give each gateway its own \
         gateway.tasks.path"
    )]
    InUse { path: PathBuf },
    #[error(
        "the task store {path} was written by another version of Nomad (schema {found}, this \
         one reads {SCHEMA_VERSION}): move it away or set gateway.tasks.path to a new file"
    )]
    Version { path: PathBuf, found: i64 },
    #[error(
        "the task store is full: {held} tasks are working (gateway.tasks.max_tasks is {max}); \
         wait for one to end, or call the tool without the tasks extension"
    )]
    TooManyTasks { held: u64, max: u64 },
    #[error(
        "the task store is full: working tasks and their outcomes hold {held} bytes \
         (gateway.tasks.max_bytes is {max}); wait for a task to end, or raise the budget"
    )]
    TooManyBytes { held: u64, max: u64 },
    #[error("the task store is corrupt: {0}")]
    Corrupt(String),
    #[error("the task store failed: {0}")]
    Sqlite(#[from] rusqlite::Error),
}

impl StoreError {
    /// A refusal for want of room (the client may try again later), not a failure.
    pub fn is_full(&self) -> bool {
        matches!(
            self,
            StoreError::TooManyTasks { .. } | StoreError::TooManyBytes { .. }
        )
    }
}

pub struct Store {
    db: Connection,
    limits: Limits,
}

impl Store {
    /// Opens (or creates) the store at `path` (`None`: in memory, gone at a stop) and fails
    /// every task a stop cut off. Returns it and how many tasks that failed.
    pub fn open(
        path: Option<&Path>,
        limits: Limits,
        now_ms: u64,
    ) -> Result<(Self, u64), StoreError> {
        let shown = || path.map_or_else(|| PathBuf::from(":memory:"), Path::to_path_buf);
        let open_error = |source| StoreError::Open {
            path: shown(),
            source,
        };
        let db = match path {
            Some(path) => {
                if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir).map_err(|source| StoreError::Directory {
                        path: dir.to_path_buf(),
                        source,
                    })?;
                }
                Connection::open(path).map_err(open_error)?
            }
            None => Connection::open_in_memory().map_err(open_error)?,
        };
        db.busy_timeout(std::time::Duration::from_millis(500))?;
        // One gateway owns a store: the first write takes an exclusive lock held until the
        // gateway stops (or dies: the lock goes with the process). A handle is returned only
        // once its row is on disk (synchronous FULL).
        db.execute_batch(
            "PRAGMA locking_mode = EXCLUSIVE;
             PRAGMA journal_mode = WAL;
             PRAGMA synchronous = FULL;",
        )
        .map_err(|e| busy_or(e, shown(), open_error))?;
        let found: i64 = db
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(|e| busy_or(e, shown(), open_error))?;
        if found != 0 && found != SCHEMA_VERSION {
            return Err(StoreError::Version {
                path: shown(),
                found,
            });
        }
        db.execute_batch(&format!(
            "CREATE TABLE IF NOT EXISTS tasks (
                 id TEXT PRIMARY KEY,
                 owner TEXT NOT NULL,
                 tool TEXT NOT NULL,
                 status TEXT NOT NULL,
                 message TEXT,
                 payload TEXT,
                 bytes INTEGER NOT NULL,
                 created_ms INTEGER NOT NULL,
                 updated_ms INTEGER NOT NULL,
                 expires_ms INTEGER
             );
             CREATE INDEX IF NOT EXISTS tasks_expiry ON tasks (expires_ms);
             CREATE TABLE IF NOT EXISTS results (
                 uri TEXT PRIMARY KEY,
                 owner TEXT NOT NULL,
                 mime TEXT NOT NULL,
                 body TEXT NOT NULL,
                 bytes INTEGER NOT NULL,
                 created_ms INTEGER NOT NULL,
                 expires_ms INTEGER NOT NULL
             );
             PRAGMA user_version = {SCHEMA_VERSION};"
        ))
        .map_err(|e| busy_or(e, shown(), open_error))?;
        let mut store = Store { db, limits };
        let cut_off = store.fail_working(now_ms)?;
        store.sweep(now_ms)?;
        Ok((store, cut_off))
    }

    /// Fails every working task, saying the gateway stopped (at a stop, and at the next open
    /// for tasks a crash cut off); how many.
    pub fn fail_working(&mut self, now_ms: u64) -> Result<u64, StoreError> {
        let error = stopped_error();
        Ok(self.db.execute(
            "UPDATE tasks SET status = 'failed', message = ?1, payload = ?2, bytes = ?3,
                 updated_ms = ?4, expires_ms = ?5
             WHERE status = 'working'",
            params![
                STOPPED,
                error,
                (ROW_BYTES + error.len() as u64) as i64,
                now_ms as i64,
                now_ms.saturating_add(self.limits.ttl_ms) as i64
            ],
        )? as u64)
    }

    /// A new `working` task for `owner`, once there is room for it: expired tasks are removed,
    /// then finished ones oldest first while the store is over a bound. Refused by name when
    /// working tasks alone fill it.
    pub fn create(
        &mut self,
        id: &str,
        owner: &str,
        tool: &str,
        now_ms: u64,
    ) -> Result<(Record, Removed), StoreError> {
        let tx = self.db.transaction()?;
        let mut removed = Removed {
            expired: expire(&tx, now_ms)?,
            evicted: 0,
        };
        removed.evicted = make_room(&tx, &self.limits, 1, ROW_BYTES)?;
        tx.execute(
            "INSERT INTO tasks (id, owner, tool, status, bytes, created_ms, updated_ms)
             VALUES (?1, ?2, ?3, 'working', ?4, ?5, ?5)",
            params![id, owner, tool, ROW_BYTES as i64, now_ms as i64],
        )?;
        tx.commit()?;
        let record = Record {
            id: id.to_owned(),
            tool: tool.to_owned(),
            status: Status::Working,
            message: None,
            payload: None,
            created_ms: now_ms,
            updated_ms: now_ms,
            expires_ms: None,
        };
        Ok((record, removed))
    }

    /// Records how a working task ended (a cancelled one keeps `cancelled`). An outcome that
    /// would not fit the budget even with every other finished task gone is kept as a failure
    /// saying so. Returns whether the task was still working.
    pub fn finish(
        &mut self,
        id: &str,
        outcome: Outcome,
        now_ms: u64,
    ) -> Result<(bool, Removed), StoreError> {
        let tx = self.db.transaction()?;
        let working: bool = tx
            .query_row(
                "SELECT status = 'working' FROM tasks WHERE id = ?1",
                [id],
                |r| r.get(0),
            )
            .optional()?
            .unwrap_or(false);
        if !working {
            return Ok((false, Removed::default()));
        }
        // This task's own row is counted already: only what the outcome adds must fit.
        let (mut status, mut message, mut payload) = match outcome {
            Outcome::Completed(result) => (Status::Completed, None, result),
            Outcome::Failed { error, message } => (Status::Failed, Some(message), error),
        };
        let mut removed = Removed::default();
        // An outcome that cannot fit even with every finished task gone evicts none of them.
        let working: i64 = tx.query_row(
            "SELECT COALESCE(SUM(bytes), 0) FROM tasks WHERE status = 'working'",
            [],
            |r| r.get(0),
        )?;
        let room = if working as u64 + payload.len() as u64 > self.limits.max_bytes {
            Err(StoreError::TooManyBytes {
                held: working as u64,
                max: self.limits.max_bytes,
            })
        } else {
            make_room(&tx, &self.limits, 0, payload.len() as u64)
        };
        match room {
            Ok(evicted) => removed.evicted = evicted,
            Err(StoreError::TooManyBytes { .. }) => {
                let why = format!(
                    "the result is {} bytes, more than the task store keeps (gateway.tasks.max_bytes \
                     is {}); call the tool without the tasks extension, or raise the budget",
                    payload.len(),
                    self.limits.max_bytes
                );
                payload = serde_json::json!({"code": -32603, "message": why}).to_string();
                status = Status::Failed;
                message = Some(why);
            }
            Err(e) => return Err(e),
        }
        tx.execute(
            "UPDATE tasks SET status = ?2, message = ?3, payload = ?4, bytes = ?5,
                 updated_ms = ?6, expires_ms = ?7
             WHERE id = ?1",
            params![
                id,
                status.as_str(),
                message,
                payload,
                (ROW_BYTES + payload.len() as u64) as i64,
                now_ms as i64,
                now_ms.saturating_add(self.limits.ttl_ms) as i64
            ],
        )?;
        tx.commit()?;
        Ok((true, removed))
    }

    /// `owner`'s task `id`, unless it expired; another owner's is not found, as if it did not
    /// exist.
    pub fn get(&self, id: &str, owner: &str, now_ms: u64) -> Result<Option<Record>, StoreError> {
        let record = self
            .db
            .query_row(
                "SELECT id, tool, status, message, payload, created_ms, updated_ms, expires_ms
                 FROM tasks WHERE id = ?1 AND owner = ?2
                     AND (expires_ms IS NULL OR expires_ms > ?3)",
                params![id, owner, now_ms as i64],
                |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, String>(2)?,
                        r.get::<_, Option<String>>(3)?,
                        r.get::<_, Option<String>>(4)?,
                        r.get::<_, i64>(5)?,
                        r.get::<_, i64>(6)?,
                        r.get::<_, Option<i64>>(7)?,
                    ))
                },
            )
            .optional()?;
        let Some((id, tool, status, message, payload, created, updated, expires)) = record else {
            return Ok(None);
        };
        Ok(Some(Record {
            id,
            tool,
            status: Status::parse(&status)?,
            message,
            payload,
            created_ms: created as u64,
            updated_ms: updated as u64,
            expires_ms: expires.map(|e| e as u64),
        }))
    }

    /// Marks `owner`'s working task `id` cancelled; `None` when there is no such task.
    pub fn cancel(
        &mut self,
        id: &str,
        owner: &str,
        now_ms: u64,
    ) -> Result<Option<Cancelled>, StoreError> {
        let Some(record) = self.get(id, owner, now_ms)? else {
            return Ok(None);
        };
        if record.status != Status::Working {
            return Ok(Some(Cancelled::AlreadyEnded(record.status)));
        }
        self.db.execute(
            "UPDATE tasks SET status = 'cancelled', message = 'cancelled by the client',
                 updated_ms = ?2, expires_ms = ?3
             WHERE id = ?1 AND status = 'working'",
            params![
                id,
                now_ms as i64,
                now_ms.saturating_add(self.limits.ttl_ms) as i64
            ],
        )?;
        Ok(Some(Cancelled::Now))
    }

    /// Keeps a large result for `owner` to read at `uri` until the TTL runs out, making room as
    /// a new task does.
    pub fn put_result(
        &mut self,
        uri: &str,
        owner: &str,
        mime: &str,
        body: &str,
        now_ms: u64,
    ) -> Result<Removed, StoreError> {
        let tx = self.db.transaction()?;
        let mut removed = Removed {
            expired: expire(&tx, now_ms)?,
            evicted: 0,
        };
        let bytes = ROW_BYTES + body.len() as u64;
        removed.evicted = make_room(&tx, &self.limits, 1, bytes)?;
        tx.execute(
            "INSERT INTO results (uri, owner, mime, body, bytes, created_ms, expires_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![
                uri,
                owner,
                mime,
                body,
                bytes as i64,
                now_ms as i64,
                now_ms.saturating_add(self.limits.ttl_ms) as i64
            ],
        )?;
        tx.commit()?;
        Ok(removed)
    }

    /// `owner`'s result at `uri` (its media type and text), unless it expired.
    pub fn result(
        &self,
        uri: &str,
        owner: &str,
        now_ms: u64,
    ) -> Result<Option<(String, String)>, StoreError> {
        Ok(self
            .db
            .query_row(
                "SELECT mime, body FROM results
                 WHERE uri = ?1 AND owner = ?2 AND expires_ms > ?3",
                params![uri, owner, now_ms as i64],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?)
    }

    /// Removes every task whose time ran out; how many.
    pub fn sweep(&mut self, now_ms: u64) -> Result<u64, StoreError> {
        Ok(expire(&self.db, now_ms)?)
    }

    /// Tasks held and the bytes they count.
    #[cfg(test)]
    pub fn held(&self) -> Result<(u64, u64), StoreError> {
        Ok(held(&self.db)?)
    }
}

/// The error a task cut off by a stop reads as (a JSON-RPC internal error).
fn stopped_error() -> String {
    serde_json::json!({"code": -32603, "message": STOPPED}).to_string()
}

/// SQLite's "busy" at open means another process holds the store.
fn busy_or(
    e: rusqlite::Error,
    path: PathBuf,
    otherwise: impl FnOnce(rusqlite::Error) -> StoreError,
) -> StoreError {
    match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => {
            StoreError::InUse { path }
        }
        _ => otherwise(e),
    }
}

fn expire(db: &Connection, now_ms: u64) -> rusqlite::Result<u64> {
    let tasks = db.execute(
        "DELETE FROM tasks WHERE expires_ms IS NOT NULL AND expires_ms <= ?1",
        [now_ms as i64],
    )?;
    let results = db.execute(
        "DELETE FROM results WHERE expires_ms <= ?1",
        [now_ms as i64],
    )?;
    Ok((tasks + results) as u64)
}

/// Tasks and linked results held, and the bytes they count.
fn held(db: &Connection) -> rusqlite::Result<(u64, u64)> {
    db.query_row(
        "SELECT (SELECT COUNT(*) FROM tasks) + (SELECT COUNT(*) FROM results),
                (SELECT COALESCE(SUM(bytes), 0) FROM tasks)
                    + (SELECT COALESCE(SUM(bytes), 0) FROM results)",
        [],
        |r| Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64)),
    )
}

/// Removes finished tasks, oldest ending first, until `tasks` more tasks and `bytes` more bytes
/// fit; refuses by name when the working ones alone leave no room. Returns how many it removed.
fn make_room(db: &Connection, limits: &Limits, tasks: u64, bytes: u64) -> Result<u64, StoreError> {
    let (mut count, mut size) = held(db)?;
    let mut evicted = 0;
    while count + tasks > limits.max_tasks || size + bytes > limits.max_bytes {
        // Finished tasks and linked results, whichever ended first.
        let oldest: Option<(String, bool, u64)> = db
            .query_row(
                "SELECT id, is_task, bytes FROM (
                     SELECT id, updated_ms AS at, 1 AS is_task, bytes FROM tasks
                         WHERE status != 'working'
                     UNION ALL
                     SELECT uri, created_ms, 0, bytes FROM results)
                 ORDER BY at, id LIMIT 1",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get::<_, i64>(2)? as u64)),
            )
            .optional()?;
        let Some((id, is_task, freed)) = oldest else {
            return Err(if count + tasks > limits.max_tasks {
                StoreError::TooManyTasks {
                    held: count,
                    max: limits.max_tasks,
                }
            } else {
                StoreError::TooManyBytes {
                    held: size,
                    max: limits.max_bytes,
                }
            });
        };
        if is_task {
            db.execute("DELETE FROM tasks WHERE id = ?1", [&id])?;
        } else {
            db.execute("DELETE FROM results WHERE uri = ?1", [&id])?;
        }
        evicted += 1;
        count -= 1;
        size = size.saturating_sub(freed);
    }
    Ok(evicted)
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;

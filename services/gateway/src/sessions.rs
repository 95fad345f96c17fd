//! MCP sessions, bounded: at most `max_sessions` at once across the gateway's MCP endpoints
//! (one fleet has one credential, so this is also the bound per token), each ended after
//! `idle` without a request. When full, a new session takes the place of the one idle longest
//! (none of its streams open); with every session busy, it is refused, saying so.

use crate::lock::lock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt as _};
use rmcp::model::{ClientJsonRpcMessage, ServerJsonRpcMessage};
use rmcp::transport::common::server_side_http::{ServerSseMessage, SessionId};
use rmcp::transport::streamable_http_server::session::SessionManager;
use rmcp::transport::streamable_http_server::session::local::{
    LocalSessionManager, LocalSessionManagerError,
};

/// Sessions of every endpoint, against their one bound.
pub struct Sessions {
    max: usize,
    open: Mutex<HashMap<(usize, SessionId), Activity>>,
    /// One manager per endpoint, by index.
    managers: Mutex<Vec<Arc<LocalSessionManager>>>,
}

struct Activity {
    last: Instant,
    /// Response streams of the session still open (a call in progress is not idleness).
    streams: Arc<AtomicUsize>,
}

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(
        "the gateway holds as many MCP sessions as it allows ({max}, gateway.http.max_sessions), \
         every one of them busy; close sessions you no longer use (an HTTP DELETE with their \
         Mcp-Session-Id) or retry shortly"
    )]
    Full { max: usize },
    #[error(transparent)]
    Session(#[from] LocalSessionManagerError),
}

impl Sessions {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max,
            open: Mutex::default(),
            managers: Mutex::default(),
        })
    }

    /// A session manager for one endpoint, whose sessions end after `idle` without a request.
    pub fn endpoint(self: &Arc<Self>, idle: Duration) -> Arc<Bounded> {
        let mut inner = LocalSessionManager::default();
        inner.session_config.keep_alive = Some(idle);
        let inner = Arc::new(inner);
        let mut managers = lock(&self.managers);
        managers.push(inner.clone());
        Arc::new(Bounded {
            inner,
            sessions: self.clone(),
            endpoint: managers.len() - 1,
        })
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Whether a new session would be refused now.
    pub fn full(&self) -> bool {
        let open = lock(&self.open);
        open.len() >= self.max
            && !open
                .values()
                .any(|a| a.streams.load(Ordering::Relaxed) == 0)
    }

    /// Makes room for one more session: the one idle longest is closed, if it must.
    async fn make_room(&self) -> Result<(), SessionError> {
        let evicted = {
            let mut open = lock(&self.open);
            if open.len() < self.max {
                return Ok(());
            }
            let idle = open
                .iter()
                .filter(|(_, a)| a.streams.load(Ordering::Relaxed) == 0)
                .min_by_key(|(_, a)| a.last)
                .map(|(key, _)| key.clone())
                .ok_or(SessionError::Full { max: self.max })?;
            open.remove(&idle);
            idle
        };
        let (endpoint, id) = evicted;
        let manager = lock(&self.managers).get(endpoint).cloned();
        if let Some(manager) = manager {
            tracing::info!(
                max_sessions = self.max,
                "MCP session {id} closed for a new one: the gateway holds as many as it allows, \
                 and it was idle longest"
            );
            let _ = manager.close_session(&id).await;
        }
        Ok(())
    }

    fn touch(&self, key: &(usize, SessionId)) -> Option<Arc<AtomicUsize>> {
        let mut open = lock(&self.open);
        let activity = open.get_mut(key)?;
        activity.last = Instant::now();
        Some(activity.streams.clone())
    }
}

/// One endpoint's sessions, counted against the gateway's bound.
pub struct Bounded {
    inner: Arc<LocalSessionManager>,
    sessions: Arc<Sessions>,
    endpoint: usize,
}

impl Bounded {
    fn key(&self, id: &SessionId) -> (usize, SessionId) {
        (self.endpoint, id.clone())
    }

    /// Notes a request on session `id`; the stream it answers on counts as open until dropped.
    fn counted<S: Stream<Item = ServerSseMessage> + Send + Sync + 'static>(
        &self,
        id: &SessionId,
        stream: S,
    ) -> impl Stream<Item = ServerSseMessage> + Send + Sync + 'static {
        let open = self.sessions.touch(&self.key(id)).map(OpenStream::new);
        stream.map(move |message| {
            let _ = &open;
            message
        })
    }
}

/// One open response stream of a session.
struct OpenStream(Arc<AtomicUsize>);

impl OpenStream {
    fn new(streams: Arc<AtomicUsize>) -> Self {
        streams.fetch_add(1, Ordering::Relaxed);
        Self(streams)
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl SessionManager for Bounded {
    type Error = SessionError;
    type Transport = <LocalSessionManager as SessionManager>::Transport;

    async fn create_session(&self) -> Result<(SessionId, Self::Transport), Self::Error> {
        self.sessions.make_room().await?;
        let (id, transport) = self.inner.create_session().await?;
        lock(&self.sessions.open).insert(
            self.key(&id),
            Activity {
                last: Instant::now(),
                streams: Arc::default(),
            },
        );
        Ok((id, transport))
    }

    async fn initialize_session(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<ServerJsonRpcMessage, Self::Error> {
        self.sessions.touch(&self.key(id));
        Ok(self.inner.initialize_session(id, message).await?)
    }

    async fn has_session(&self, id: &SessionId) -> Result<bool, Self::Error> {
        Ok(self.inner.has_session(id).await?)
    }

    async fn close_session(&self, id: &SessionId) -> Result<(), Self::Error> {
        lock(&self.sessions.open).remove(&self.key(id));
        Ok(self.inner.close_session(id).await?)
    }

    async fn create_stream(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        let stream = self.inner.create_stream(id, message).await?;
        Ok(self.counted(id, stream))
    }

    async fn accept_message(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<(), Self::Error> {
        self.sessions.touch(&self.key(id));
        Ok(self.inner.accept_message(id, message).await?)
    }

    async fn create_standalone_stream(
        &self,
        id: &SessionId,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        let stream = self.inner.create_standalone_stream(id).await?;
        Ok(self.counted(id, stream))
    }

    async fn resume(
        &self,
        id: &SessionId,
        last_event_id: String,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        let stream = self.inner.resume(id, last_event_id).await?;
        Ok(self.counted(id, stream))
    }
}

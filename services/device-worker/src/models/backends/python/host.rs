//! One model host process and the frames it speaks: a task owns the process and its end of the
//! socket, and callers send it requests over a channel (one request at a time on the socket, as
//! the host serves them). The host's stdout and stderr go to this worker's log, never into the
//! protocol, which runs on a socket of its own (`NOMAD_HOST_FD`).

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use command_fds::{CommandFdExt as _, FdMapping};
use futures::{SinkExt as _, StreamExt as _};
use nomad_frame::Codec;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _};
use tokio::sync::{mpsc, oneshot};
use tokio_util::codec::Framed;

/// The descriptor the host reads its socket from.
const HOST_FD: i32 = 3;
/// The largest frame either side sends (the worker hop's message limit), declared here once: the
/// host is told it in its environment (`nomad_frame.limit("host")`).
pub const MAX_FRAME: usize = 64 << 20;
/// How long a host may take to exit when asked before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(5);
/// The longest line of the host's output copied to the log.
const MAX_LOG_LINE: usize = 8 << 10;

/// How a host call failed (as opposed to an error the host reported).
#[derive(Debug, Clone, thiserror::Error)]
pub enum HostError {
    #[error("the model host exited ({0})")]
    Exited(String),
    #[error("the model host gave no answer within {} s and was stopped", .0.as_secs_f64())]
    Timeout(Duration),
    #[error("the model host broke the protocol: {0}")]
    Protocol(String),
    #[error("cannot start the model host: {0}")]
    Spawn(String),
}

/// What starts a host: the interpreter, the host file and its environment.
#[derive(Debug, Clone)]
pub struct Launch {
    pub tool: String,
    pub python: PathBuf,
    pub host_file: PathBuf,
    /// Directories first on the host's import path.
    pub import_paths: Vec<PathBuf>,
    /// `CUDA_VISIBLE_DEVICES` for the host: its worker's GPU only, or none on a CPU worker.
    pub visible_devices: String,
    /// `service.name` of the spans the host exports itself.
    pub service_name: String,
}

struct Call {
    frame: Bytes,
    timeout: Duration,
    reply: oneshot::Sender<Result<Bytes, HostError>>,
}

/// A running host. Dropping it asks the process to exit (and kills it after a grace period).
pub struct Host {
    calls: mpsc::Sender<Call>,
    pub pid: u32,
}

impl Host {
    pub fn start(launch: &Launch) -> Result<Self, HostError> {
        let spawn = |e: std::io::Error| HostError::Spawn(e.to_string());
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(spawn)?;
        ours.set_nonblocking(true).map_err(spawn)?;
        let mut child = {
            let mut command = tokio::process::Command::new(&launch.python);
            command
                .arg("-u")
                .arg(&launch.host_file)
                .env("NOMAD_HOST_FD", HOST_FD.to_string())
                .env(nomad_frame::limit_variable("host"), MAX_FRAME.to_string())
                .env("NOMAD_HOST_SERVICE_NAME", &launch.service_name)
                .env("CUDA_VISIBLE_DEVICES", &launch.visible_devices)
                .env(
                    "NOMAD_HOST_PATH",
                    std::env::join_paths(&launch.import_paths).map_err(|e| {
                        HostError::Spawn(format!("an import path holds a separator: {e}"))
                    })?,
                )
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                // A Ctrl-C at the terminal reaches the worker, which stops its hosts itself.
                .process_group(0)
                .kill_on_drop(true);
            // The fleet's credential is the services', not the model's.
            for name in fleet_credentials(
                std::env::vars_os(),
                nomad_rpc::auth::installed().token.as_deref(),
            ) {
                command.env_remove(name);
            }
            command
                .fd_mappings(vec![FdMapping {
                    parent_fd: OwnedFd::from(theirs),
                    child_fd: HOST_FD,
                }])
                .map_err(|e| HostError::Spawn(e.to_string()))?;
            // The command holds the host's end until it is dropped here, so that the host's exit
            // closes the socket.
            command
                .spawn()
                .map_err(|e| HostError::Spawn(format!("{}: {e}", launch.python.display())))?
        };
        let pid = child.id().unwrap_or(0);
        for (stream, name) in [
            (child.stdout.take().map(Output::Out), "stdout"),
            (child.stderr.take().map(Output::Err), "stderr"),
        ] {
            if let Some(stream) = stream {
                tokio::spawn(copy_to_log(stream, launch.tool.clone(), name));
            }
        }
        let socket = tokio::net::UnixStream::from_std(ours).map_err(spawn)?;
        let framed = Framed::new(socket, Codec::new(MAX_FRAME));
        let (calls, rx) = mpsc::channel(1);
        tokio::spawn(serve(child, framed, rx));
        Ok(Self { calls, pid })
    }

    /// Sends `frame` and waits for the host's answer, at most `timeout`.
    pub async fn call(&self, frame: Bytes, timeout: Duration) -> Result<Bytes, HostError> {
        let (reply, answer) = oneshot::channel();
        let call = Call {
            frame,
            timeout,
            reply,
        };
        if self.calls.send(call).await.is_err() {
            return Err(HostError::Exited("it had already stopped".into()));
        }
        answer
            .await
            .unwrap_or_else(|_| Err(HostError::Exited("it stopped".into())))
    }
}

enum Output {
    Out(tokio::process::ChildStdout),
    Err(tokio::process::ChildStderr),
}

/// Copies the host's output to the log line by line (long lines cut).
async fn copy_to_log(stream: Output, tool: String, name: &'static str) {
    let reader: Box<dyn tokio::io::AsyncRead + Unpin + Send> = match stream {
        Output::Out(s) => Box::new(s),
        Output::Err(s) => Box::new(s),
    };
    let mut reader = tokio::io::BufReader::new(reader);
    let mut line = Vec::new();
    loop {
        line.clear();
        // Read at most one bounded line; the rest of an overlong line is skipped.
        let read = (&mut reader)
            .take(MAX_LOG_LINE as u64)
            .read_until(b'\n', &mut line)
            .await;
        match read {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if line.last() != Some(&b'\n') && line.len() == MAX_LOG_LINE {
            let mut rest = Vec::new();
            let _ = reader.read_until(b'\n', &mut rest).await;
        }
        let text = String::from_utf8_lossy(&line);
        tracing::info!(target: "nomad_model_host", %tool, stream = name, "{}", text.trim_end());
    }
}

/// Owns the process and the socket: one request on the wire at a time, and every caller
/// answered, also when the process dies under its request.
async fn serve(
    mut child: tokio::process::Child,
    mut framed: Framed<tokio::net::UnixStream, Codec>,
    mut calls: mpsc::Receiver<Call>,
) {
    let exited = |status: std::io::Result<std::process::ExitStatus>| match status {
        Ok(s) => HostError::Exited(describe_exit(s)),
        Err(e) => HostError::Exited(e.to_string()),
    };
    loop {
        let call = tokio::select! {
            call = calls.recv() => call,
            status = child.wait() => {
                let error = exited(status);
                tracing::warn!("{error}");
                calls.close();
                while let Some(call) = calls.recv().await {
                    let _ = call.reply.send(Err(error.clone()));
                }
                return;
            }
        };
        let Some(call) = call else {
            // Every handle is gone: ask the host to exit, then make sure it did.
            let _ = framed.send(Bytes::from_static(br#"{"op":"exit"}"#)).await;
            if tokio::time::timeout(EXIT_GRACE, child.wait())
                .await
                .is_err()
            {
                let _ = child.kill().await;
            }
            return;
        };
        let answer = tokio::time::timeout(call.timeout, async {
            framed
                .send(call.frame)
                .await
                .map_err(|e| HostError::Protocol(format!("sending: {e}")))?;
            tokio::select! {
                frame = framed.next() => match frame {
                    Some(Ok(frame)) => Ok(frame.freeze()),
                    Some(Err(e)) => Err(HostError::Protocol(format!("receiving: {e}"))),
                    // The socket closed: the process is ending; its status says how.
                    None => Err(exited(child.wait().await)),
                },
                status = child.wait() => Err(exited(status)),
            }
        })
        .await
        .unwrap_or(Err(HostError::Timeout(call.timeout)));
        let fatal = answer.is_err();
        if let Err(error) = &answer
            && !matches!(error, HostError::Exited(_))
        {
            // A host that hangs or garbles the protocol cannot be trusted with the next call.
            let _ = child.kill().await;
        }
        let _ = call.reply.send(answer);
        if fatal {
            calls.close();
            while let Some(call) = calls.recv().await {
                let _ = call
                    .reply
                    .send(Err(HostError::Exited("it was stopped".into())));
            }
            return;
        }
    }
}

/// An exit status in words: the code, or the signal by name.
pub fn describe_exit(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    if let Some(code) = status.code() {
        return format!("exit code {code}");
    }
    match status.signal() {
        Some(signal) => {
            let name = match signal {
                libc::SIGKILL => " (SIGKILL: killed, e.g. by the out-of-memory killer)",
                libc::SIGSEGV => " (SIGSEGV: a crash in native code)",
                libc::SIGABRT => " (SIGABRT: aborted)",
                libc::SIGTERM => " (SIGTERM)",
                libc::SIGBUS => " (SIGBUS)",
                _ => "",
            };
            format!("signal {signal}{name}")
        }
        None => status.to_string(),
    }
}

/// Variables of the worker's environment `vars` the model host must not inherit: Nomad's own
/// credential variables, and any other whose value holds the fleet's `token` (as is, or
/// percent-encoded as in an OTLP headers variable: a Slurm job's collector headers carry it).
fn fleet_credentials(
    vars: impl Iterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
    token: Option<&str>,
) -> Vec<std::ffi::OsString> {
    let mut names: Vec<std::ffi::OsString> = ["NOMAD_AUTH_TOKEN", "NOMAD_OTEL_OTLP_HEADERS"]
        .map(Into::into)
        .into();
    if let Some(token) = token.filter(|t| !t.is_empty()) {
        let encoded: String = token
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        names.extend(vars.filter_map(|(name, value)| {
            let value = value.to_string_lossy();
            (value.contains(token) || value.contains(&encoded)).then_some(name)
        }));
    }
    names
}

#[cfg(test)]
mod credential_tests {
    use super::fleet_credentials;
    use std::ffi::OsString;

    #[test]
    fn every_variable_holding_the_fleet_token_is_withheld() {
        let token = "s3cret/token+x";
        let vars = [
            ("PATH", "/usr/bin".to_owned()),
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "authorization=Bearer%20s3cret%2Ftoken%2Bx".to_owned(),
            ),
            ("SOME_TOOL_KEY", format!("x-{token}")),
            ("OTHER_HEADERS", "authorization=Bearer other".to_owned()),
        ]
        .map(|(k, v)| (OsString::from(k), OsString::from(v)));
        let withheld = fleet_credentials(vars.into_iter(), Some(token));
        let names: Vec<&str> = withheld.iter().map(|n| n.to_str().unwrap()).collect();
        assert_eq!(
            names,
            [
                "NOMAD_AUTH_TOKEN",
                "NOMAD_OTEL_OTLP_HEADERS",
                "OTEL_EXPORTER_OTLP_HEADERS",
                "SOME_TOOL_KEY"
            ]
        );
        // Without a token only Nomad's own names go.
        assert_eq!(fleet_credentials(std::iter::empty(), None).len(), 2);
    }
}

#[cfg(test)]
mod limit_tests {
    #[test]
    fn the_docs_state_the_hosts_frame_limit() {
        let docs = include_str!("../../../../../../docs/python-models.md");
        let stated = format!("frames of at most {} MiB", super::MAX_FRAME >> 20);
        assert!(
            docs.contains(&stated),
            "docs/python-models.md should say {stated:?}"
        );
    }
}

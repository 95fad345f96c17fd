//! `nomad top`: a live view of a fleet, refreshed every second: each tool's queue, in-flight
//! requests, batch sizes, rate and latency, each worker's device, memory, utilization and
//! loaded tools (the scheduler's `Snapshot`), the gateway's sandbox (`Status`) and the run's
//! rollouts (its results file).

mod view;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use nomad_proto::v1::gateway_client::GatewayClient;
use nomad_proto::v1::scheduler_client::SchedulerClient;
use nomad_proto::v1::{GatewayStatusRequest, SchedulerSnapshotRequest};

use self::view::{Rollouts, View};
use crate::up::fleet_file::FleetFile;

#[derive(clap::Args)]
pub struct TopArgs {
    /// A fleet that `nomad up` started: its scheduler, gateway, token and results.
    #[arg(long, conflicts_with = "scheduler")]
    pub fleet: Option<PathBuf>,
    /// The scheduler to watch (without --fleet).
    #[arg(long)]
    pub scheduler: Option<String>,
    /// The gateway to watch too (without --fleet).
    #[arg(long)]
    pub gateway: Option<String>,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0)]
    pub interval: f64,
    /// Print one frame as text and exit (for scripts).
    #[arg(long)]
    pub once: bool,
}

/// Where the figures come from.
struct Sources {
    scheduler_address: String,
    scheduler: SchedulerClient<nomad_rpc::Channel>,
    gateway: Option<GatewayClient<nomad_rpc::Channel>>,
    results: Option<PathBuf>,
    run_id: Option<String>,
    /// The previous poll's rollouts and when: the rate is their difference.
    last: Option<(Instant, usize)>,
}

/// How long one answer may take before the frame shows the server as not answering.
const ANSWER_WITHIN: Duration = Duration::from_secs(2);

impl Sources {
    async fn open(args: &TopArgs) -> anyhow::Result<Self> {
        let fleet = match args.fleet.as_deref() {
            Some(path) => Some(FleetFile::read_running(path).await?),
            None => None,
        };
        let scheduler_address = match (&fleet, &args.scheduler) {
            (Some(f), _) => f.scheduler.clone(),
            (None, Some(s)) => s.clone(),
            (None, None) => {
                anyhow::bail!("give --fleet runs/<run id>/fleet.json or --scheduler ADDRESS")
            }
        };
        let gateway = fleet
            .as_ref()
            .map(|f| f.gateway.clone())
            .or_else(|| args.gateway.clone());
        // The fleet's token, unless NOMAD_AUTH_TOKEN gives one.
        let mut auth = nomad_rpc::auth::Auth::resolve(
            &nomad_config::ConfigFile::default(),
            &nomad_config::ProcessEnv,
        )?;
        if auth.token.is_none() {
            auth.token = fleet.as_ref().and_then(|f| f.token.clone()).map(Into::into);
        }
        nomad_rpc::auth::install(auth)?;
        Ok(Self {
            scheduler: SchedulerClient::new(nomad_rpc::channel(&scheduler_address)?),
            scheduler_address,
            gateway: gateway
                .map(|g| nomad_rpc::channel(&g).map(GatewayClient::new))
                .transpose()?,
            results: fleet
                .as_ref()
                .and_then(|f| f.run_dir.as_ref().map(|d| d.join("results.jsonl"))),
            run_id: fleet.map(|f| f.run_id),
            last: None,
        })
    }

    fn rollouts(&mut self) -> Option<Rollouts> {
        let results = self.results.as_ref()?;
        if !results.is_file() {
            return None;
        }
        let lines = crate::rollouts::read_jsonl(results);
        let failed = lines.iter().filter(|r| r["status"] != "ok").count();
        let now = Instant::now();
        let rate = match self.last {
            Some((then, done)) => {
                lines.len().saturating_sub(done) as f64
                    / now.duration_since(then).as_secs_f64().max(1e-3)
            }
            None => 0.0,
        };
        self.last = Some((now, lines.len()));
        Some(Rollouts {
            done: lines.len(),
            failed,
            rate,
        })
    }

    async fn poll(&mut self) -> View {
        let scheduler = tokio::time::timeout(
            ANSWER_WITHIN,
            self.scheduler.snapshot(SchedulerSnapshotRequest {}),
        )
        .await
        .map_err(|_| format!("no answer within {ANSWER_WITHIN:?}"))
        .and_then(|r| {
            r.map(|r| r.into_inner())
                .map_err(|s| s.message().to_owned())
        });
        let gateway = match &mut self.gateway {
            Some(client) => Some(
                tokio::time::timeout(ANSWER_WITHIN, client.status(GatewayStatusRequest {}))
                    .await
                    .map_err(|_| format!("no answer within {ANSWER_WITHIN:?}"))
                    .and_then(|r| {
                        r.map(|r| r.into_inner())
                            .map_err(|s| s.message().to_owned())
                    }),
            ),
            None => None,
        };
        View {
            scheduler_address: self.scheduler_address.clone(),
            scheduler,
            gateway,
            rollouts: self.rollouts(),
            restarts: self
                .results
                .as_ref()
                .and_then(|r| r.parent())
                .and_then(crate::supervisor::restarts_line),
            run_id: self.run_id.clone(),
        }
    }
}

/// One frame as plain text, `width` columns wide.
fn text_frame(view: &View, width: u16) -> anyhow::Result<String> {
    let backend = ratatui::backend::TestBackend::new(width, 30);
    let mut terminal = ratatui::Terminal::new(backend)?;
    terminal.draw(|f| view::draw(f, view))?;
    let buffer = terminal.backend().buffer();
    let mut out = String::new();
    for y in 0..buffer.area.height {
        let line: String = (0..buffer.area.width)
            .map(|x| buffer[(x, y)].symbol())
            .collect();
        out.push_str(line.trim_end());
        out.push('\n');
    }
    Ok(out)
}

/// Key presses, read on their own thread (crossterm's reads block); `q`, Esc or Ctrl-C quit.
fn quit_keys() -> tokio::sync::mpsc::Receiver<()> {
    use ratatui::crossterm::event::{self, Event, KeyCode, KeyModifiers};
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    std::thread::spawn(move || {
        loop {
            match event::read() {
                Ok(Event::Key(key))
                    if matches!(key.code, KeyCode::Char('q') | KeyCode::Esc)
                        || (key.code == KeyCode::Char('c')
                            && key.modifiers.contains(KeyModifiers::CONTROL)) =>
                {
                    let _ = tx.blocking_send(());
                    return;
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    });
    rx
}

pub async fn top(args: TopArgs) -> anyhow::Result<bool> {
    let interval =
        nomad_config::seconds("--interval", args.interval).map_err(anyhow::Error::msg)?;
    let mut sources = Sources::open(&args).await?;
    if args.once {
        let view = sources.poll().await;
        print!("{}", text_frame(&view, 120)?);
        return Ok(view.scheduler.is_ok());
    }
    let mut terminal = ratatui::init();
    let mut quit = quit_keys();
    let result = async {
        loop {
            let view = sources.poll().await;
            terminal.draw(|f| view::draw(f, &view))?;
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                _ = quit.recv() => return anyhow::Ok(()),
                () = nomad_rpc::shutdown_signal() => return Ok(()),
            }
        }
    }
    .await;
    ratatui::restore();
    result.map(|()| true)
}

//! What makes each process a service: `--version` with the commit it was built from,
//! `--log-format`, `--admin-listen` (metrics, readiness and liveness over HTTP), and
//! the man page generated from its command line.

use std::time::Duration;

use eventplane::admin::{AdminConfig, AdminServer, Routes};
use eventplane::metrics::Exporter;
use tokio_util::sync::CancellationToken;

/// `0.1.0 (1a2b3c4d5e6f)`: the crate's version and the commit built (`unknown`
/// outside a git checkout).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("EVENTPLANE_GIT_COMMIT"),
    ")"
);

/// How often the admin endpoint's metrics are sampled from the components' stats.
pub const METRICS_INTERVAL: Duration = Duration::from_secs(1);

/// How log lines are written to stderr.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, target, message, fields), for a
    /// log pipeline.
    Json,
}

/// The flags every service takes.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ServiceArgs {
    /// Serve GET /metrics (Prometheus text format), /readyz (200 once ready, 503 with
    /// the reason before) and /livez on ADDR (host:port, e.g. 0.0.0.0:9464). At most
    /// 8 connections at once, one request each, request heads up to 4 KiB.
    #[arg(long = "admin-listen", value_name = "ADDR", value_parser = listen_address)]
    pub admin_listen: Option<String>,
    /// Log lines as text or as one JSON object per line; RUST_LOG sets what is
    /// logged.
    #[arg(long = "log-format", value_enum, value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
}

/// An admin address: `ip:port`.
pub fn listen_address(text: &str) -> Result<String, String> {
    text.parse::<std::net::SocketAddr>()
        .map(|_| text.to_owned())
        .map_err(|e| format!("{e} (ip:port, e.g. 0.0.0.0:9464)"))
}

/// Logs to stderr in `format`, filtered by `RUST_LOG` (`default_spec` when unset).
pub fn init_logging(format: LogFormat, default_spec: &str) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = crate::common::log_filter(default_spec);
    let registry = tracing_subscriber::registry().with(filter);
    let _ = match format {
        LogFormat::Text => registry
            .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
            .try_init(),
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_current_span(false)
                    .with_writer(std::io::stderr),
            )
            .try_init(),
    };
}

/// Prints the man page of `command` (roff) and exits when the process was run with
/// the hidden `--print-man-page` as its only argument (how `services/man/` is made
/// and checked); returns otherwise.
pub fn print_man_page_if_asked(command: clap::Command) {
    let mut args = std::env::args_os().skip(1);
    if args.next().as_deref() != Some(std::ffi::OsStr::new("--print-man-page"))
        || args.next().is_some()
    {
        return;
    }
    // The crate's version without the commit: the checked-in pages stay current
    // from one commit to the next.
    let command = command.version(env!("CARGO_PKG_VERSION"));
    let mut out = Vec::new();
    let code = match clap_mangen::Man::new(command).render(&mut out) {
        Ok(()) => {
            use std::io::Write;
            let _ = std::io::stdout().write_all(&out);
            0
        }
        Err(e) => {
            eprintln!("cannot render the man page: {e}");
            1
        }
    };
    std::process::exit(code);
}

/// A running admin endpoint and the sampler feeding its metrics.
#[derive(Debug)]
pub struct Admin {
    server: AdminServer,
    stop: CancellationToken,
    sampling: tokio::task::JoinHandle<()>,
}

/// What a service does first once its arguments are parsed: logging as `args` say
/// (`default_spec` when `RUST_LOG` is unset), then the metrics recorder when it
/// serves an admin endpoint. `Err` is the exit code after saying why.
pub fn start(
    args: &ServiceArgs,
    default_spec: &str,
) -> Result<Option<Recorder>, std::process::ExitCode> {
    init_logging(args.log_format.unwrap_or_default(), default_spec);
    Recorder::install_if(args.admin_listen.is_some()).map_err(|e| {
        eprintln!("{e}");
        std::process::ExitCode::from(2)
    })
}

/// The process's Prometheus recorder, installed: a component's series bind to the
/// recorder installed when they are first sampled, so this comes before anything is
/// spawned.
#[derive(Debug, Clone)]
pub struct Recorder(metrics_exporter_prometheus::PrometheusHandle);

impl Recorder {
    /// Installs the recorder when `wanted`.
    pub fn install_if(wanted: bool) -> Result<Option<Recorder>, String> {
        if !wanted {
            return Ok(None);
        }
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::set_global_recorder(recorder)
            .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
        eventplane::metrics::describe();
        Ok(Some(Recorder(handle)))
    }
}

impl Admin {
    /// Samples `exporter`'s components into `recorder` every [`METRICS_INTERVAL`], and
    /// serves them on `listen` with `ready` as the readiness check.
    pub async fn start(
        listen: &str,
        recorder: &Recorder,
        exporter: Exporter,
        ready: impl Fn() -> Result<(), String> + Send + Sync + 'static,
    ) -> Result<Admin, String> {
        let handle = recorder.0.clone();
        let routes = Routes::new(ready).metrics(move || handle.render());
        let server = AdminServer::bind(listen, AdminConfig::default(), routes)
            .await
            .map_err(|e| crate::common::chain(&e))?;
        let admin = server.handle();
        let exporter = exporter.source(move || admin.stats());
        let stop = CancellationToken::new();
        let sampling = tokio::spawn(exporter.run(METRICS_INTERVAL, stop.clone()));
        eprintln!("admin endpoint on http://{}", server.local_addr());
        Ok(Admin {
            server,
            stop,
            sampling,
        })
    }

    /// The address it serves on.
    pub fn local_addr(&self) -> std::net::SocketAddr {
        self.server.local_addr()
    }

    /// Stops serving and sampling.
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.sampling.await;
        self.server.shutdown().await;
    }
}

//! The command-line conventions of eventplane's tools, shared by the library's
//! examples and the services (`event-broker`, `kv-relay`, `kv-router`), so that every
//! process reads its flags, logs, stops and reports failures the same way: tracing to
//! stderr filtered by `RUST_LOG`, SIGTERM and Ctrl-C, the engine-side flags, exit
//! codes (2 for a refused argument, 3 for what cannot be reached).
//!
//! Not a stable API: it changes with the tools.
#![allow(missing_docs)]

use eventplane::zmtp::Message;

/// Each frame in lower-case hex (an empty frame as `-`), frames separated by a space.
pub fn hex_line(m: &Message) -> String {
    let mut line = String::with_capacity(m.byte_len() * 2 + m.len());
    for (i, frame) in m.parts().enumerate() {
        if i > 0 {
            line.push(' ');
        }
        if frame.is_empty() {
            line.push('-');
        }
        for b in frame.iter() {
            line.push_str(&format!("{b:02x}"));
        }
    }
    line
}

/// Logs to stderr through `tracing`, filtered by `RUST_LOG` (`warn` when unset):
/// a level (`debug`), or `target=level` pairs (`eventplane::subscriber=debug,warn`).
/// The library only emits events; installing a subscriber is the application's job,
/// as here. A `RUST_LOG` that does not parse is reported and the default used.
pub fn init_tracing() {
    init_tracing_or("warn");
}

/// Raises this process's soft limit on open files to its hard limit, as a daemon that
/// follows thousands of publishers must (one descriptor each; the soft limit is often
/// 1,024). Returns the limit now in force, `None` if it cannot be read. The library
/// never changes process limits: that is the application's call, made here.
pub fn raise_fd_limit() -> Option<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        limit.current = limit.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, limit) {
            tracing::warn!(error = %e, "could not raise the open-file limit");
        }
    }
    getrlimit(Resource::Nofile).current
}

/// [`init_tracing`] with another default than `warn` when `RUST_LOG` is unset (a
/// `target=level` list, like `RUST_LOG`).
pub fn init_tracing_or(default_spec: &str) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let _ = tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with(log_filter(default_spec))
        .try_init();
}

/// What `RUST_LOG` asks to log, `default_spec` when it is unset; a `RUST_LOG` that
/// does not parse is reported and the default used.
pub fn log_filter(default_spec: &str) -> tracing_subscriber::filter::Targets {
    use tracing_subscriber::filter::Targets;
    let default = || {
        default_spec
            .parse::<Targets>()
            .unwrap_or_else(|_| Targets::new().with_default(tracing::Level::WARN))
    };
    match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => spec.parse().unwrap_or_else(|e| {
            eprintln!("ignoring RUST_LOG={spec:?} ({e}); logging warnings");
            default()
        }),
        _ => default(),
    }
}

/// An error and its sources, `: `-separated.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// SIGTERM and Ctrl-C, to be awaited more than once (a first signal drains, a second
/// stops at once). Installed when created.
pub struct Signals {
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    int: Option<tokio::signal::unix::Signal>,
}

/// Installs the handlers now (see [`stop_signal`] for why early matters).
pub fn signals() -> Signals {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        Signals {
            term: signal(SignalKind::terminate()).ok(),
            int: signal(SignalKind::interrupt()).ok(),
        }
    }
    #[cfg(not(unix))]
    {
        Signals {}
    }
}

impl Signals {
    /// The next SIGTERM or Ctrl-C.
    pub async fn recv(&mut self) {
        #[cfg(unix)]
        {
            async fn next(s: &mut Option<tokio::signal::unix::Signal>) {
                match s {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending().await,
                }
            }
            tokio::select! {
                () = next(&mut self.term) => {}
                () = next(&mut self.int) => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Completes on Ctrl-C or (on Unix) SIGTERM. The handlers are installed when this is
/// called, not when it is first awaited: call it early, and a signal that arrives
/// while the process is still starting up is not lost (nor the process killed by the
/// default action before it could clean up).
pub fn stop_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let term = signal(SignalKind::terminate()).ok();
        let int = signal(SignalKind::interrupt()).ok();
        async move {
            match (term, int) {
                (Some(mut term), Some(mut int)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = int.recv() => {}
                    }
                }
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Completes after `ms` milliseconds, or never when `None`.
pub async fn optional_timeout(ms: Option<u64>) {
    match ms {
        Some(ms) => tokio::time::sleep(std::time::Duration::from_millis(ms)).await,
        None => std::future::pending().await,
    }
}

/// What `kv_listen --help` and `kv-relay --help` say of their input.
pub const ENGINE_INPUT_HELP: &str = "\
Input: the engine's ZMQ PUB (--connect), messages of three frames [topic, seq, batch]: \
seq a big-endian u64 counted per batch, batch msgpack [ts, events, dp_rank] (or a map \
with those names). Events as vLLM sends them, tagged arrays [\"BlockStored\", \
block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...], \
[\"BlockRemoved\", block_hashes, medium], [\"AllBlocksCleared\"], or as maps with a \
\"type\" key (vLLM >= 0.24, SGLang). token_ids holds --block-size tokens per stored \
hash. Every field, with types and what is ignored: the `eventplane::kv` docs, \
\"The engine's format\" (cargo doc --open). An engine to copy: examples/engine.py.\n\n\
When the engine's sequence skips (its PUB dropped batches), starts again (a new \
engine) or its connection ends, the worker no longer knows what the engine holds: it \
emits a `cleared` router event for each data-parallel rank it forwarded events for, \
so routers drop those blocks (counted in listener.stale_clears). With \
--engine-replay it first asks the engine's replay buffer for what it missed (on every \
gap and every connection, the first included) and clears only when the buffer cannot \
cover the loss (listener.replay counts replays, repairs and fallbacks by cause).";

/// What `kv_listen --help`, `kv-router --help` say a router event looks like.
pub const ROUTER_EVENT_HELP: &str = "\
A router event as JSON: {\"worker_id\":W,\"tier\":\"device\"|\"host_pinned\"|\"disk\"|\
\"external\",\"event\":{\"id\":N,\"dp_rank\":R,\"data\":D}} with D one of \
{\"stored\":{\"parent_hash\":H|null,\"blocks\":[{\"block_hash\":H,\"tokens_hash\":T}]}}, \
{\"removed\":{\"block_hashes\":[H]}}, \"cleared\" (the rank holds nothing, in any tier). \
Ids count from 1, one more per event.";

/// The engine side shared by `kv_listen` and `kv-relay`.
#[derive(clap::Args, Debug)]
pub struct EngineArgs {
    /// The engine's ZMQ PUB endpoint.
    #[arg(long)]
    pub connect: String,
    /// The engine's topic.
    #[arg(long)]
    pub topic: String,
    /// Tokens per KV block in the engine.
    #[arg(long = "block-size")]
    pub block_size: usize,
    /// This worker's id.
    #[arg(long = "worker-id")]
    pub worker_id: u64,
    /// Batch across engine lists for up to this long (max 15 000).
    #[arg(long = "batch-timeout-ms")]
    pub batch_timeout_ms: Option<u64>,
    /// The engine's replay endpoint (its ROUTER, vLLM's and SGLang's
    /// `replay_endpoint`): losses are repaired from the engine's buffer instead of
    /// cleared.
    #[arg(long = "engine-replay")]
    pub engine_replay: Option<String>,
    /// The engine's data-parallel rank: the ports of --connect and --engine-replay are
    /// moved up by it, as the engine moves its own.
    #[arg(long = "engine-dp-rank", default_value_t = 0)]
    pub engine_dp_rank: u32,
}

impl EngineArgs {
    /// Checks the engine-side arguments (before anything is started or registered).
    pub fn processor_config(&self) -> Result<eventplane::kv::pipeline::ProcessorConfig, String> {
        let refused = |e: eventplane::ConfigError| match flag(e.field()) {
            Some(flag) => format!("invalid {flag}: {e}"),
            None => format!("invalid setting: {e}"),
        };
        self.listener_config().validate().map_err(refused)?;
        let config = eventplane::kv::pipeline::ProcessorConfig::default()
            .batch_timeout(self.batch_timeout_ms.map(std::time::Duration::from_millis));
        config.validate().map_err(refused)?;
        Ok(config)
    }

    /// The engine side of a [`eventplane::kv::pipeline::Worker`].
    pub fn listener_config(&self) -> eventplane::kv::engine::EngineListenerConfig {
        let mut config = eventplane::kv::engine::EngineListenerConfig::new(
            &self.connect,
            self.topic.clone(),
            eventplane::kv::WorkerId(self.worker_id),
            self.block_size,
        );
        if let Some(replay) = &self.engine_replay {
            config = config.engine_replay(replay);
        }
        config.engine_dp_rank(self.engine_dp_rank)
    }

    /// Starts a worker (`EngineListener → Processor → sink`) from these arguments;
    /// `builder` picks the sink (`Worker::builder` or `Worker::with_sink`).
    pub fn start(
        &self,
        builder: impl FnOnce(
            eventplane::kv::engine::EngineListenerConfig,
        ) -> eventplane::kv::pipeline::WorkerBuilder,
    ) -> Result<eventplane::kv::pipeline::Worker, String> {
        let config = self.processor_config()?;
        builder(self.listener_config())
            .processor(config)
            .spawn()
            .map_err(|e| e.to_string())
    }
}

/// A `StaticDiscovery` of `endpoints` under `namespace/{component or "static"}/topic`,
/// for the examples' `--static` flag.
pub fn static_discovery(
    namespace: &str,
    component: Option<&str>,
    topic: &str,
    endpoints: &[String],
) -> Result<std::sync::Arc<dyn eventplane::discovery::Discovery>, String> {
    eventplane::discovery::StaticDiscovery::from_endpoints(
        namespace,
        component.unwrap_or("static"),
        topic,
        endpoints.iter(),
    )
    .map(|d| std::sync::Arc::new(d) as std::sync::Arc<dyn eventplane::discovery::Discovery>)
    .map_err(|e| chain(&e))
}

/// The command-line flag behind a config field, where there is one.
fn flag(field: &str) -> Option<&'static str> {
    match field {
        "endpoint" => Some("--connect"),
        "engine_replay" => Some("--engine-replay"),
        "block_size" => Some("--block-size"),
        "batch_timeout" => Some("--batch-timeout-ms"),
        _ => None,
    }
}

/// Why a CLI could not start: a bad argument (exit 2), or discovery or another
/// resource it could not have (exit 3).
#[allow(dead_code)] // not every example reaches a service
pub enum StartError {
    /// An argument was refused.
    Args(String),
    /// Discovery did not answer.
    Unreachable(String),
    /// Something else the process needs could not be had (a port to listen on): the
    /// message says what.
    Unavailable(String),
}

#[allow(dead_code)]
impl StartError {
    /// Prints the reason on stderr and returns the exit code.
    pub fn report(self) -> std::process::ExitCode {
        match self {
            StartError::Args(e) => {
                eprintln!("{e}");
                std::process::ExitCode::from(2)
            }
            StartError::Unreachable(e) => {
                eprintln!("cannot reach discovery: {e}");
                std::process::ExitCode::from(3)
            }
            StartError::Unavailable(e) => {
                eprintln!("{e}");
                std::process::ExitCode::from(3)
            }
        }
    }

    /// A failed etcd connect: settings the backend refused are argument errors.
    pub fn etcd(e: &eventplane::discovery::DiscoveryError) -> StartError {
        StartError::discovery("--etcd", e)
    }

    /// A failed discovery connect (`flag` names it): settings the backend refused are
    /// argument errors, the rest unreachable.
    pub fn discovery(flag: &str, e: &eventplane::discovery::DiscoveryError) -> StartError {
        match e {
            eventplane::discovery::DiscoveryError::InvalidConfig(c) => {
                StartError::Args(format!("invalid {flag} setting: {c}"))
            }
            other => StartError::Unreachable(chain(other)),
        }
    }
}

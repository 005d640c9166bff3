//! `event-broker`: the in-cluster end of the tunnel. It dials out to a router's event
//! bus over HTTP/2 + TLS and relays the publishers the router subscribes to (DESIGN §7).
//!
//! ```text
//! event-broker --config FILE [--check-config | --check-bus | --print-token-sha256]
//! ```
//! The configuration is TOML; unknown fields are refused:
//! ```toml
//! bus_url = "https://router.example:8443"   # https only
//! client_id = "broker-a"                    # one session per id
//! ca_file = "/etc/eventplane/bus-ca.pem"    # the CA the bus certificate chains to
//! token_file = "/etc/eventplane/bus.token"  # or token_env = "EVENTPLANE_BUS_TOKEN";
//!                                           # "${CREDENTIALS_DIRECTORY}/token" reads a
//!                                           # systemd credential (LoadCredential=)
//! allowed_cidrs = ["10.0.0.0/8"]            # optional: only these networks are dialled
//!                                           # (loopback, link-local and metadata addresses
//!                                           # are refused unless a CIDR inside them is
//!                                           # listed, e.g. "127.0.0.0/8")
//! drain_deadline_ms = 30000                 # optional: streams' grace on SIGTERM
//! max_stream_buffer_bytes = 1048576         # optional: 16 KiB ..= 1 MiB per stream
//! max_session_buffer_bytes = 67108864       # optional: ..= 64 MiB per session
//!
//! [timeouts]                                # optional, each stage's deadline
//! dns_ms = 5000
//! connect_ms = 10000                        # all resolved addresses together
//! connect_attempt_ms = 5000                 # one address
//! stream_slot_ms = 5000
//! response_ms = 10000
//! bus_connect_ms = 10000
//!
//! [backoff]                                 # optional: reconnects to the bus
//! min_ms = 1000                             # never sooner; jittered up to 2 × min,
//! max_ms = 60000                            # the window doubling up to max
//!
//! [discovery]
//! namespaces = ["prod"]
//! etcd = ["http://etcd:2379"]               # needs feature etcd; or:
//! static_endpoints = ["tcp://10.1.2.3:5557"]  # or (feature kube, Dynamo's resources):
//! # kubernetes = { namespaces = ["dynamo-system"] }
//! record_format = "eventplane"              # or "dynamo" (etcd only)
//! ```
//! Logs one line per session change (welcomed, ended, reconnecting) on stderr
//! (`RUST_LOG` adjusts). On SIGTERM or Ctrl-C it says `draining`, refuses new streams,
//! lets open ones run until `drain_deadline_ms`, prints its stats as one JSON object
//! (the last stderr line) and exits 0; a second signal exits at once with 1.
//! `--check-config` checks the configuration, the credential and the CA bundle, and
//! that discovery answers, then exits without contacting the bus (a wrong token or CA
//! passes it); `--check-bus`
//! also opens one session with the bus (as `CLIENT_ID.check`, so a running broker is
//! not superseded, and a router with per-broker credentials admits it) and exits 0
//! once welcomed, 3 if the bus refuses, denies or cannot be reached.
//! `--print-token-sha256` prints the digest of the token for the router's
//! `--bus-clients` file. Exit codes: 0 after a drain (or a good check); 1 on
//! a second signal; 2 on a refused configuration; 3 when discovery or (with
//! `--check-bus`) the bus cannot be reached.

use eventplane_services::common;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{CommandFactory, Parser};
use common::chain;
use eventplane::discovery::{
    Backend, ChannelId, Discovery, DiscoveryError, Instance, Query, StaticDiscovery, Transport,
};
use eventplane::metrics::Exporter;
use eventplane::net::AddrFilter;
use eventplane::tunnel::{Broker, BrokerConfig, Deadlines, Secret, TokenDigest, client_tls};
use eventplane::wire::Dialect;
use eventplane_services::service::{self, ServiceArgs};

#[derive(Parser, Debug)]
#[command(
    name = "event-broker",
    version = service::VERSION,
    about = "Relay publishers inside a cluster to a router's event bus outside it",
    after_help = "Exit codes, logs and every key of the configuration file: --help, or man event-broker.",
    after_long_help = LONG_HELP
)]
struct Args {
    /// The TOML configuration file.
    #[arg(long)]
    config: std::path::PathBuf,
    /// Check that the configuration parses and is valid, that the credential and the
    /// CA bundle can be read, and that discovery answers, then exit. The bus is not
    /// contacted: a token it does not accept, or a CA that did not sign its
    /// certificate, shows only with --check-bus.
    #[arg(long = "check-config")]
    check_config: bool,
    /// Check the configuration, then open one session with the bus (TLS with the CA
    /// bundle, the token, the hello) and exit: 0 once the bus welcomes it, 3 if the bus
    /// refuses or cannot be reached (the warning before says why: a wrong token, an
    /// unknown CA, a closed port) or no session completes within the session's
    /// deadlines (two bus_connect_ms, one response_ms) plus 5 s. The session uses the
    /// client id CLIENT_ID.check, so a broker running as CLIENT_ID is not superseded.
    #[arg(long = "check-bus", conflicts_with = "check_config")]
    check_bus: bool,
    /// Print the SHA-256 of this configuration's token, as the router's
    /// `--bus-clients` file wants it (`token_sha256`), and exit. The token itself is
    /// never printed.
    #[arg(long = "print-token-sha256", conflicts_with_all = ["check_config", "check_bus"])]
    print_token_sha256: bool,
    #[command(flatten)]
    service: ServiceArgs,
}

/// Exit codes, logs and the whole configuration file, one key a line: `--help` and the
/// man page show it; `every_key_is_in_the_reference` holds it to the structs below.
const LONG_HELP: &str = "\
Exit codes: 0 after a drain (or a good --check-config / --check-bus); 1 on a second signal \
(or a signal during --check-bus); 2 on a refused configuration; 3 when discovery cannot be \
reached, or with --check-bus when the bus refuses or cannot be reached.

Logs: session changes go to stderr; RUST_LOG sets the level (off, debug, or target=level \
pairs such as eventplane=debug).

Configuration file (TOML; an unknown key is refused, exit 2). Every key, with its default \
or an example, and what it sets:

  bus_url = \"https://router:8443\"     required; https only
  client_id = \"broker-a\"              required; the credential's id
  ca_file = \"/etc/eventplane/ca.pem\"  required; the bus's CA bundle
  token_file = \"PATH\"                 the bus credential, or:
  token_env = \"EVENTPLANE_BUS_TOKEN\"  the variable holding it
  allowed_cidrs = []                  the only networks dialled
  drain_deadline_ms = 30000           grace on SIGTERM (<= 1 h)
  max_stream_buffer_bytes = 1048576   per stream (16 KiB..1 MiB)
  max_session_buffer_bytes = 67108864  per session (<= 64 MiB)
  admin_listen = \"IP:PORT\"            /metrics, /readyz, /livez

  [timeouts]                          milliseconds per stage
  dns_ms = 5000
  connect_ms = 10000                  all addresses together
  connect_attempt_ms = 5000           one address
  stream_slot_ms = 5000               a free stream slot
  response_ms = 10000                 the bus's answer
  bus_connect_ms = 10000              reaching the bus

  [backoff]                           reconnects to the bus
  min_ms = 1000                       jittered from min to 2 x min,
  max_ms = 60000                      doubling up to max

  [discovery]                         required; one source of:
  namespaces = [\"prod\"]               required; relayed namespaces
  etcd = [\"http://etcd:2379\"]         etcd endpoints
  static_endpoints = [\"tcp://h:5557\"]  fixed publishers
  kubernetes = { namespaces = [], mode = \"pod\" }
                                      Dynamo's resources (feature kube)
  record_format = \"eventplane\"        etcd records: ours or \"dynamo\"

token_file may name a systemd credential (\"${CREDENTIALS_DIRECTORY}/token\"); one of \
token_file and token_env is required. Without allowed_cidrs any network is dialled but \
loopback, link-local and metadata addresses, which are refused unless a listed CIDR holds \
them. An empty kubernetes namespace list follows the pod's namespace (or kubeconfig's); \
its mode is where readiness comes from, as the workers' DYN_KUBE_DISCOVERY_MODE: \"pod\" \
(EndpointSlices) or \"container\" (Pods).";

#[derive(serde::Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    bus_url: String,
    client_id: String,
    ca_file: std::path::PathBuf,
    token_file: Option<std::path::PathBuf>,
    token_env: Option<String>,
    #[serde(default)]
    allowed_cidrs: Vec<String>,
    drain_deadline_ms: Option<u64>,
    max_stream_buffer_bytes: Option<usize>,
    max_session_buffer_bytes: Option<usize>,
    /// The admin endpoint's address (`--admin-listen` overrides it).
    admin_listen: Option<String>,
    #[serde(default)]
    timeouts: TimeoutsConfig,
    #[serde(default)]
    backoff: BackoffConfig,
    discovery: DiscoveryConfig,
}

/// Per-stage deadlines in milliseconds; absent ones keep their defaults.
#[derive(serde::Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct TimeoutsConfig {
    dns_ms: Option<u64>,
    connect_ms: Option<u64>,
    connect_attempt_ms: Option<u64>,
    stream_slot_ms: Option<u64>,
    response_ms: Option<u64>,
    bus_connect_ms: Option<u64>,
}

#[derive(serde::Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct BackoffConfig {
    min_ms: Option<u64>,
    max_ms: Option<u64>,
}

#[derive(serde::Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct DiscoveryConfig {
    namespaces: Vec<String>,
    #[serde(default)]
    etcd: Vec<String>,
    #[serde(default)]
    static_endpoints: Vec<String>,
    /// Dynamo's `DynamoWorkerMetadata` resources in these Kubernetes namespaces
    /// (empty: the client's default namespace).
    kubernetes: Option<KubernetesConfig>,
    record_format: Option<String>,
}

#[derive(serde::Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct KubernetesConfig {
    #[serde(default)]
    namespaces: Vec<String>,
    /// Where readiness comes from: "pod" (EndpointSlices) or "container" (Pods), as
    /// the workers' DYN_KUBE_DISCOVERY_MODE says.
    mode: Option<String>,
}

/// A refused configuration (exit 2) or unreachable discovery (exit 3).
enum Refusal {
    Config(String),
    // Only etcd and Kubernetes can be unreachable.
    #[cfg_attr(not(any(feature = "etcd", feature = "kube")), allow(dead_code))]
    Discovery(String),
}

/// The token the Debian package's broker.token ships with.
const PLACEHOLDER_TOKEN: &str = "replace-with-the-routers-token";

/// Whether a credential is still the shipped placeholder (compared by digest: a
/// secret's text is never exposed).
fn is_placeholder(token: &Secret) -> bool {
    Secret::new(PLACEHOLDER_TOKEN).is_ok_and(|p| TokenDigest::of(&p) == TokenDigest::of(token))
}

/// `token_file` with a leading `${CREDENTIALS_DIRECTORY}` replaced by that variable
/// (where systemd puts a unit's `LoadCredential=` files), refused when it is not set.
fn credentials_path(file: &std::path::Path) -> Result<std::path::PathBuf, String> {
    let Some(rest) = file
        .to_str()
        .and_then(|f| f.strip_prefix("${CREDENTIALS_DIRECTORY}"))
    else {
        return Ok(file.to_owned());
    };
    match std::env::var_os("CREDENTIALS_DIRECTORY") {
        Some(dir) => Ok(std::path::PathBuf::from(dir).join(rest.trim_start_matches('/'))),
        None => Err(format!(
            "token_file: {} needs CREDENTIALS_DIRECTORY (set by systemd for a unit with \
             LoadCredential=)",
            file.display()
        )),
    }
}

fn load(args: &Args) -> Result<(FileConfig, Secret, AddrFilter), Refusal> {
    let c = |e: String| Refusal::Config(e);
    let text = std::fs::read_to_string(&args.config)
        .map_err(|e| c(format!("cannot read {}: {e}", args.config.display())))?;
    let config: FileConfig =
        toml::from_str(&text).map_err(|e| c(format!("{}: {e}", args.config.display())))?;
    let token = match (&config.token_file, &config.token_env) {
        (Some(file), None) => {
            let file = credentials_path(file).map_err(c)?;
            Secret::from_file(&file).map_err(|e| c(chain(&e)))?
        }
        (None, Some(var)) => {
            let value =
                std::env::var(var).map_err(|_| c(format!("token_env: {var} is not set")))?;
            Secret::new(value).map_err(|e| c(chain(&e)))?
        }
        _ => return Err(c("exactly one of token_file and token_env is needed".into())),
    };
    // The shipped broker.token's placeholder is no credential: refused before any dial.
    if is_placeholder(&token) {
        return Err(c(format!(
            "the token is still the placeholder {PLACEHOLDER_TOKEN:?} of the shipped \
             broker.token: give the router's"
        )));
    }
    if let Some(listen) = &config.admin_listen {
        service::listen_address(listen).map_err(|e| c(format!("admin_listen: {listen:?}: {e}")))?;
    }
    // Strict: the broker runs next to admin ports only loopback reaches.
    let mut filter = AddrFilter::strict();
    for cidr in &config.allowed_cidrs {
        let parsed = cidr
            .parse()
            .map_err(|e| c(format!("allowed_cidrs: {cidr:?}: {e}")))?;
        filter = filter.allow_cidr(parsed);
    }
    let d = &config.discovery;
    let sources = [
        !d.etcd.is_empty(),
        !d.static_endpoints.is_empty(),
        d.kubernetes.is_some(),
    ];
    if sources.iter().filter(|s| **s).count() != 1 {
        return Err(c(
            "discovery: exactly one of etcd, static_endpoints and kubernetes is needed".into(),
        ));
    }
    if d.kubernetes.is_some() && d.record_format.is_some() {
        return Err(c(
            "discovery.record_format: Kubernetes holds Dynamo's records only (leave it out)".into(),
        ));
    }
    if !matches!(
        d.record_format.as_deref(),
        None | Some("eventplane" | "dynamo")
    ) {
        return Err(c("discovery.record_format: eventplane or dynamo".into()));
    }
    Ok((config, token, filter))
}

async fn discovery(config: &DiscoveryConfig) -> Result<Arc<dyn Discovery>, Refusal> {
    if !config.static_endpoints.is_empty() {
        // Checked as endpoints (tcp://host:port) once, then advertised in every
        // namespace the broker covers.
        for ns in &config.namespaces {
            StaticDiscovery::from_endpoints(ns, "static", "static", config.static_endpoints.iter())
                .map_err(|e| Refusal::Config(chain(&e)))?;
        }
        let mut instances = Vec::new();
        for ns in &config.namespaces {
            for (i, endpoint) in config.static_endpoints.iter().enumerate() {
                let id = ChannelId::new(ns.clone(), "static", "static", i as u64)
                    .map_err(|e| Refusal::Config(chain(&e)))?;
                instances.push(Instance::new(id, Transport::zmq(endpoint.clone()), 1));
            }
        }
        return Ok(Arc::new(StaticDiscovery::new(instances)) as Arc<dyn Discovery>);
    }
    let (backend, key) = match &config.kubernetes {
        // Dynamo's resources; `watch` returns once every namespace's first list is
        // read, so the broker's view is complete at its first `Resync` (§7.2).
        Some(k) => {
            let containers = match k.mode.as_deref() {
                None | Some("pod") => false,
                Some("container") => true,
                Some(other) => {
                    return Err(Refusal::Config(format!(
                        "discovery.kubernetes.mode: {other:?} is neither pod nor container"
                    )));
                }
            };
            let mut backend = Backend::kube()
                .kube_namespaces(k.namespaces.clone())
                .kube_containers(containers);
            // That the API server answers, and lets us read.
            if let Some(ns) = config.namespaces.first() {
                backend = backend.check(Query::new(ns.clone()));
            }
            (backend, "discovery.kubernetes")
        }
        None => {
            let dialect = match config.record_format.as_deref() {
                Some("dynamo") => Dialect::Dynamo,
                _ => Dialect::EventPlane,
            };
            (
                Backend::etcd(&config.etcd).dialect(dialect),
                "discovery.etcd",
            )
        }
    };
    match backend.connect().await {
        Ok(connected) => Ok(connected.discovery().clone()),
        Err(DiscoveryError::InvalidConfig(c)) => Err(Refusal::Config(format!("{key}: {c}"))),
        Err(other) => Err(Refusal::Discovery(chain(&other))),
    }
}

/// The optional buffer sizes, deadlines and backoff, applied to `config`, with the
/// deadlines it ends with; `BrokerConfig::validate` checks the result.
fn apply_tuning(file: &FileConfig, mut config: BrokerConfig) -> (BrokerConfig, Deadlines) {
    let ms = |v: Option<u64>| v.map(Duration::from_millis);
    let t = &file.timeouts;
    let mut d = Deadlines::default();
    type Stage = (Option<u64>, fn(Deadlines, Duration) -> Deadlines);
    let stages: [Stage; 6] = [
        (t.dns_ms, Deadlines::dns),
        (t.connect_ms, Deadlines::connect),
        (t.connect_attempt_ms, Deadlines::connect_attempt),
        (t.stream_slot_ms, Deadlines::stream_slot),
        (t.response_ms, Deadlines::response),
        (t.bus_connect_ms, Deadlines::bus_connect),
    ];
    for (value, set) in stages {
        if let Some(v) = ms(value) {
            d = set(d, v);
        }
    }
    config = config.deadlines(d);
    if let Some(v) = ms(file.backoff.min_ms) {
        config = config.reconnect_min(v);
    }
    if let Some(v) = ms(file.backoff.max_ms) {
        config = config.reconnect_max(v);
    }
    if let Some(bytes) = file.max_stream_buffer_bytes {
        config = config.max_stream_buffer_bytes(bytes);
    }
    if let Some(bytes) = file.max_session_buffer_bytes {
        config = config.max_session_buffer_bytes(bytes);
    }
    (config, d)
}

#[tokio::main]
async fn main() -> ExitCode {
    service::print_man_page_if_asked(Args::command());
    // Before anything connects: a signal from now on drains.
    let mut signals = common::signals();
    let args = Args::parse();
    service::init_logging(
        args.service.log_format.unwrap_or_default(),
        "warn,eventplane::tunnel=info",
    );
    let refused = |r: Refusal| match r {
        Refusal::Config(e) => {
            eprintln!("refused configuration: {e}");
            ExitCode::from(2)
        }
        Refusal::Discovery(e) => {
            eprintln!("cannot reach discovery: {e}");
            ExitCode::from(3)
        }
    };
    let (file, token, filter) = match load(&args) {
        Ok(loaded) => loaded,
        Err(r) => return refused(r),
    };
    if args.print_token_sha256 {
        println!("{}", eventplane::tunnel::TokenDigest::of(&token).to_hex());
        return ExitCode::SUCCESS;
    }
    let tls = match client_tls(&file.ca_file) {
        Ok(tls) => tls,
        Err(e) => return refused(Refusal::Config(chain(&e))),
    };
    // The admin endpoint comes first: probes get an answer (503, starting) while
    // discovery is reached and its first view read.
    let checking = args.check_config || args.check_bus;
    let admin_listen = args
        .service
        .admin_listen
        .as_ref()
        .or(file.admin_listen.as_ref());
    let started = Started::default();
    let admin_listen = admin_listen.filter(|_| !checking);
    let recorder = match service::Recorder::install_if(admin_listen.is_some()) {
        Ok(r) => r,
        Err(e) => return refused(Refusal::Config(e)),
    };
    let admin = match admin_listen.zip(recorder.as_ref()) {
        None => None,
        Some((listen, recorder)) => match start_admin(listen, recorder, &started).await {
            Ok(admin) => Some(admin),
            Err(e) => return refused(Refusal::Config(format!("admin_listen {listen}: {e}"))),
        },
    };
    let discovery = match discovery(&file.discovery).await {
        Ok(d) => d,
        Err(r) => return refused(r),
    };
    let _ = started.discovery.set(discovery.clone());
    let mut config = BrokerConfig::new(
        file.bus_url.clone(),
        file.client_id.clone(),
        file.discovery.namespaces.clone(),
        token,
        tls,
        discovery,
    )
    .addr_filter(filter);
    if let Some(ms) = file.drain_deadline_ms {
        config = config.drain_deadline(Duration::from_millis(ms));
    }
    let (mut config, deadlines) = apply_tuning(&file, config);
    if let Err(e) = config.validate() {
        return refused(Refusal::Config(chain(&e)));
    }
    if args.check_config {
        println!("configuration ok: {} as {}", file.bus_url, file.client_id);
        return ExitCode::SUCCESS;
    }
    // A session's stages, one after the other: TCP and TLS (each within
    // bus_connect), then the bus's answer (response); the check waits that long, plus
    // discovery's first list.
    let session_deadline = deadlines.session_start();
    if args.check_bus {
        // Under an id of its own: a session as CLIENT_ID would supersede a broker
        // running with this configuration (and reset every stream it carries).
        config = config.client_id(format!("{}.check", file.client_id));
        if let Err(e) = config.validate() {
            return refused(Refusal::Config(chain(&e)));
        }
    }
    let broker = match Broker::spawn(config) {
        Ok(b) => b,
        Err(e) => return refused(Refusal::Config(chain(&e))),
    };
    if args.check_bus {
        return check_bus(broker, &file, session_deadline, &mut signals).await;
    }
    let _ = started.broker.set(broker.handle());
    signals.recv().await;
    let stats = broker.handle();
    let code = tokio::select! {
        () = broker.shutdown() => 0,
        _ = signals.recv() => {
            eprintln!("second signal: exiting now");
            1
        }
    };
    if let Some(admin) = admin {
        admin.stop().await;
    }
    eprintln!(
        "{}",
        serde_json::to_string(&stats.stats()).unwrap_or_default()
    );
    ExitCode::from(code)
}

/// What the admin endpoint reads, set as the broker starts.
#[derive(Clone, Default)]
struct Started {
    discovery: Arc<std::sync::OnceLock<Arc<dyn Discovery>>>,
    broker: Arc<std::sync::OnceLock<eventplane::tunnel::BrokerHandle>>,
}

/// The admin endpoint: the broker's and discovery's counters once they exist; ready
/// once the broker's discovery view is complete and the bus welcomed a session
/// (DESIGN §7.2): only then can it relay what a router subscribes to.
async fn start_admin(
    listen: &str,
    recorder: &service::Recorder,
    started: &Started,
) -> Result<service::Admin, String> {
    let (broker, discovery, probed) = (started.clone(), started.clone(), started.clone());
    let exporter = Exporter::new()
        .source(move || broker.broker.get().map(|b| b.stats()).unwrap_or_default())
        .source(move || {
            discovery
                .discovery
                .get()
                .map(|d| d.stats())
                .unwrap_or_default()
        });
    let ready = move || {
        let Some(broker) = probed.broker.get() else {
            return Err("starting: discovery not reached yet".to_owned());
        };
        let s = broker.stats();
        match (s.discovery_ready, s.connected) {
            (true, true) => Ok(()),
            (false, _) => Err("discovery has not given a complete view yet".to_owned()),
            (true, false) => Err("no session with the bus".to_owned()),
        }
    };
    service::Admin::start(listen, recorder, exporter, ready).await
}

/// `--check-bus`: the first session's outcome, then a prompt stop.
async fn check_bus(
    broker: Broker,
    file: &FileConfig,
    session_deadline: Duration,
    signals: &mut common::Signals,
) -> ExitCode {
    let handle = broker.handle();
    let waited = session_deadline + Duration::from_secs(5);
    let give_up = tokio::time::Instant::now() + waited;
    let code = loop {
        let stats = handle.stats();
        // Welcomed at least once (it may have ended since: a welcome is the answer).
        if stats.sessions > 0 {
            println!(
                "bus ok: {} welcomed {}.check (this configuration's credential and CA)",
                file.bus_url, file.client_id
            );
            break 0;
        }
        if stats.session_failures > 0 {
            eprintln!(
                "bus check failed: {} did not welcome {}.check (see the warning above)",
                file.bus_url, file.client_id
            );
            break 3;
        }
        if tokio::time::Instant::now() >= give_up {
            eprintln!(
                "bus check failed: no session with {} within {waited:?}",
                file.bus_url
            );
            break 3;
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
            () = signals.recv() => {
                eprintln!("bus check interrupted");
                break 1;
            }
        }
    };
    broker.abort();
    ExitCode::from(code)
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )]
    use super::{FileConfig, LONG_HELP};

    /// The configuration file's reference: `(key, value)` of each `key = value` line,
    /// and each `[table]` as `(table, "")`.
    fn documented() -> Vec<(String, String)> {
        let reference = &LONG_HELP[LONG_HELP.find("Configuration file").unwrap()..];
        reference
            .lines()
            .filter_map(|line| {
                let line = line.strip_prefix("  ")?;
                if let Some(table) = line.strip_prefix('[') {
                    return Some((table.split(']').next()?.to_owned(), String::new()));
                }
                let (key, rest) = line.split_once(" = ")?;
                let value = rest.split("  ").next()?.trim();
                Some((key.to_owned(), value.to_owned()))
            })
            .collect()
    }

    /// The field names of the configuration's structs, from this file's source.
    fn fields() -> Vec<String> {
        let source = include_str!("event_broker.rs");
        let mut names = Vec::new();
        for name in [
            "FileConfig",
            "TimeoutsConfig",
            "BackoffConfig",
            "DiscoveryConfig",
            "KubernetesConfig",
        ] {
            let start = source.find(&format!("struct {name} {{")).unwrap();
            let body = &source[start..start + source[start..].find("\n}").unwrap()];
            names.extend(body.lines().skip(1).filter_map(|l| {
                let l = l.trim();
                let (field, _) = l.split_once(": ")?;
                (!l.starts_with("//") && !l.starts_with('#')).then(|| field.to_owned())
            }));
        }
        assert!(names.len() >= 25, "fields read: {names:?}");
        names
    }

    #[test]
    fn every_key_is_in_the_reference() {
        // Keys, and the keys of inline tables (`kubernetes = { namespaces = [], … }`).
        let mut keys = Vec::new();
        for (key, value) in documented() {
            if let Some(inline) = value.strip_prefix('{') {
                keys.extend(
                    inline
                        .split(',')
                        .filter_map(|kv| Some(kv.split_once(" = ")?.0.trim().to_owned())),
                );
            }
            keys.push(key);
        }
        let missing: Vec<String> = fields().into_iter().filter(|f| !keys.contains(f)).collect();
        assert!(
            missing.is_empty(),
            "keys missing from event-broker's configuration reference (LONG_HELP): {missing:?}"
        );
    }

    #[test]
    fn every_documented_key_is_read() {
        // The reference as a file: every key it names, with its example value, parses
        // (unknown keys are refused), whatever the checks after parsing say of it.
        let mut file = String::new();
        for (key, value) in documented() {
            if value.is_empty() {
                file.push_str(&format!("[{key}]\n"));
            } else {
                file.push_str(&format!("{key} = {value}\n"));
            }
        }
        let parsed: Result<FileConfig, _> = toml::from_str(&file);
        assert!(parsed.is_ok(), "{file}\n{parsed:?}");
    }
}

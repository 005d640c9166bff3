//! A Kubernetes API server for tests: the part of the API that Dynamo's discovery and
//! ours use, over HTTP/1.1 on loopback. Ours, written from the API conventions
//! (no real kube-apiserver can be installed here); the clients that talk to it are
//! real: kube-rs in `KubeDiscovery`, and Dynamo 1.6.1's own client.
//!
//! - Transport and authentication ([`KubeApi::start`]): HTTPS with the tunnel's test
//!   certificate (`tests/fixtures/tunnel/bus.pem`, for `localhost` and `127.0.0.1`),
//!   and every request without `Authorization: Bearer` [`TOKEN`] is answered 401 (a
//!   `Status`, reason `Unauthorized`), before anything else, as a real API server
//!   authenticates first. Its kubeconfig ([`KubeApi::kubeconfig`]) carries the CA
//!   data and the token; [`KubeApi::service_account`] writes the in-cluster files.
//!   [`KubeApi::plain`]: plain HTTP and no authentication.
//! - Resources: `dynamoworkermetadatas` (`/apis/nvidia.com/v1alpha1`), `endpointslices`
//!   (`/apis/discovery.k8s.io/v1`) and `pods` (`/api/v1`), namespaced.
//! - Lists with `limit` / `continue` and `labelSelector` (`k=v`, comma-separated). A
//!   list of more than one page is served from a snapshot taken at its first page
//!   (its resourceVersion): what is written after it never shows in its later pages.
//!   The token names the list's version, its snapshot and the last name; a token
//!   older than the compaction point, or whose snapshot is gone (the last page was
//!   served, or 64 newer lists pushed it out), answers 410 `Expired`.
//! - Watches (`watch=true`) from `resourceVersion`: every change after it, then live
//!   changes, as chunked JSON lines; `BOOKMARK`s every `bookmark_every` when asked for;
//!   ended after `timeoutSeconds`; a version older than the compaction point gets an
//!   `ERROR` event with code 410.
//! - Server-side apply (`PATCH`, `application/apply-patch+yaml`) creates or replaces
//!   the object (fields of `spec` it does not set are kept: another manager's),
//!   recording the field manager; like a real API server applying a
//!   resource whose schema is disabled, a `spec.data` map emptied by the apply is
//!   stored as `null`. `DELETE` removes.
//! - Faults: drop every open watch, stall them (open, silent), compact, compact
//!   between the pages of a list ([`KubeApi::compact_after_pages`]), and answer the
//!   next N requests with a status (500, 401…), with a 429 and its `Retry-After`
//!   ([`KubeApi::throttle`]) or with a 504 ([`KubeApi::gateway_timeouts`]). Each
//!   logged request says whether it was authorized, which fault answered it and when
//!   it came.
#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod serve;
mod tls;

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::sync::broadcast;

pub use tls::{TOKEN, fixture};

/// What a test reads back of a request.
#[derive(Debug, Clone)]
pub struct Logged {
    pub method: String,
    pub path: String,
    pub query: BTreeMap<String, String>,
    pub content_type: Option<String>,
    pub body: Option<Value>,
    /// It carried the bearer token the server requires (always, without one).
    pub authorized: bool,
    /// The status of the injected fault that answered it (401 for a request that was
    /// not authorized), if one did.
    pub fault: Option<u16>,
    /// When it came.
    pub at: Instant,
}

/// An answer injected for one request.
#[derive(Debug, Clone, Copy)]
struct Fault {
    code: u16,
    reason: &'static str,
    message: &'static str,
    /// Seconds, sent as `Retry-After` and as the Status's `details.retryAfterSeconds`.
    retry_after: Option<u64>,
}

#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    kind: &'static str,
    namespace: String,
    kind_of_event: &'static str,
    object: Value,
}

#[derive(Default)]
struct Store {
    rv: u64,
    /// (kind, namespace, name) → object.
    objects: BTreeMap<(&'static str, String, String), Value>,
    history: Vec<Change>,
    compacted: u64,
    /// (namespace, name) → field managers of applies.
    managers: BTreeMap<(String, String), Vec<String>>,
    log: Vec<Logged>,
    faults: VecDeque<Fault>,
    /// Answers left that are a 500 whose body (not JSON) never ends.
    endless_errors: usize,
    /// List pages left to serve before the next continue token answers 410 (and
    /// history is compacted); `Some(0)`: the next one does.
    compact_after_pages: Option<usize>,
    /// Snapshots of the lists being paged: id → every object the list holds, in name
    /// order (at most [`MAX_SNAPSHOTS`]; a list's goes with its last page).
    snapshots: BTreeMap<u64, Vec<Value>>,
    next_snapshot: u64,
}

/// Lists paged at once (a client that starts lists and never finishes them pushes
/// the oldest out: its next page answers 410, as an expired continue token does).
const MAX_SNAPSHOTS: usize = 64;

struct State {
    store: Mutex<Store>,
    changes: broadcast::Sender<Change>,
    /// Bumped to end every open watch.
    generation: tokio::sync::watch::Sender<u64>,
    stalled: AtomicBool,
    /// Every watch is answered with an `ERROR` 410 at once.
    always_gone: AtomicBool,
    /// While set, every request waits (logged, then held) before it is answered.
    held: tokio::sync::watch::Sender<bool>,
    bookmark_every: Duration,
    next_uid: AtomicU64,
    /// The bearer token every request must carry (`None`: no authentication).
    token: Option<String>,
    /// TLS handshakes that failed (a client that does not trust the certificate).
    tls_refused: AtomicU64,
}

/// The server; dropping it stops it.
pub struct KubeApi {
    pub addr: SocketAddr,
    /// It serves HTTPS (the test certificate).
    tls: bool,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn kind_of(segment: &str) -> Option<(&'static str, &'static str, &'static str)> {
    // (plural, apiVersion, kind)
    match segment {
        "dynamoworkermetadatas" => Some((
            "dynamoworkermetadatas",
            "nvidia.com/v1alpha1",
            "DynamoWorkerMetadata",
        )),
        "endpointslices" => Some(("endpointslices", "discovery.k8s.io/v1", "EndpointSlice")),
        "pods" => Some(("pods", "v1", "Pod")),
        _ => None,
    }
}

impl KubeApi {
    /// Starts on an ephemeral loopback port: HTTPS, every request needing the bearer
    /// [`TOKEN`]; bookmarks every second.
    pub async fn start() -> KubeApi {
        KubeApi::with_bookmarks(Duration::from_secs(1)).await
    }

    /// HTTPS and [`TOKEN`], bookmarks every `bookmark_every`.
    pub async fn with_bookmarks(bookmark_every: Duration) -> KubeApi {
        KubeApi::launch(bookmark_every, true, Some(TOKEN.to_owned())).await
    }

    /// Plain HTTP, any request answered (no authentication); bookmarks every second.
    pub async fn plain() -> KubeApi {
        KubeApi::launch(Duration::from_secs(1), false, None).await
    }

    /// Starts with HTTPS (the test certificate) or plain HTTP, requiring `token`
    /// when given.
    pub async fn launch(bookmark_every: Duration, https: bool, token: Option<String>) -> KubeApi {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (changes, _) = broadcast::channel(65_536);
        let state = Arc::new(State {
            store: Mutex::new(Store {
                rv: 100,
                ..Store::default()
            }),
            changes,
            generation: tokio::sync::watch::Sender::new(0),
            stalled: AtomicBool::new(false),
            always_gone: AtomicBool::new(false),
            held: tokio::sync::watch::Sender::new(false),
            bookmark_every,
            next_uid: AtomicU64::new(1),
            token,
            tls_refused: AtomicU64::new(0),
        });
        let acceptor = https.then(|| tokio_rustls::TlsAcceptor::from(tls::server_config()));
        let task = tokio::spawn(serve::accept(listener, acceptor, Arc::clone(&state)));
        KubeApi {
            addr,
            tls: https,
            state,
            task,
        }
    }

    /// `https://127.0.0.1:PORT` (the certificate names the address), or `http://…`.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// The token this server requires, if any.
    pub fn token(&self) -> Option<&str> {
        self.state.token.as_deref()
    }

    /// A kube-rs client for this server (namespace `default`), configured from the
    /// kubeconfig [`kubeconfig`](Self::kubeconfig) writes (CA data, token), as the
    /// services' binaries configure theirs.
    pub fn client(&self) -> kube::Client {
        let ca = self.tls.then(|| fixture("ca.pem"));
        kube::Client::try_from(self.config_with(ca.as_deref(), self.token())).unwrap()
    }

    /// The client configuration a kubeconfig naming this server gives, trusting the
    /// CA of PEM file `ca` (`None`: no CA data; kube-rs then trusts the system's
    /// roots) and presenting `token` (`None`: none).
    pub fn config_with(&self, ca: Option<&Path>, token: Option<&str>) -> kube::Config {
        let text = tls::kubeconfig_text(&self.url(), "default", ca, token);
        let kubeconfig = kube::config::Kubeconfig::from_yaml(&text).unwrap();
        kube::Config::try_from(kubeconfig).unwrap()
    }

    /// Writes a kubeconfig naming this server (and `namespace`) into `dir`: with the
    /// test CA as its `certificate-authority-data` over HTTPS, and the token.
    pub fn kubeconfig(&self, dir: &Path, namespace: &str) -> PathBuf {
        let path = dir.join("kubeconfig");
        let ca = self.tls.then(|| fixture("ca.pem"));
        std::fs::write(
            &path,
            tls::kubeconfig_text(&self.url(), namespace, ca.as_deref(), self.token()),
        )
        .unwrap();
        path
    }

    /// Writes what Kubernetes mounts into a pod at
    /// `/var/run/secrets/kubernetes.io/serviceaccount` (`token`, `ca.crt`,
    /// `namespace`) into `dir`, for a process that finds its API server in-cluster;
    /// with [`in_cluster_env`](Self::in_cluster_env).
    pub fn service_account(&self, dir: &Path, namespace: &str) -> PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("token"), self.token().unwrap_or("")).unwrap();
        std::fs::copy(fixture("ca.pem"), dir.join("ca.crt")).unwrap();
        std::fs::write(dir.join("namespace"), namespace).unwrap();
        dir.to_owned()
    }

    /// `KUBERNETES_SERVICE_HOST` and `KUBERNETES_SERVICE_PORT` naming this server, as
    /// a pod's environment does.
    pub fn in_cluster_env(&self) -> [(&'static str, String); 2] {
        [
            ("KUBERNETES_SERVICE_HOST", self.addr.ip().to_string()),
            ("KUBERNETES_SERVICE_PORT", self.addr.port().to_string()),
        ]
    }

    /// TLS handshakes that failed so far (a client that refused the certificate).
    pub fn tls_refused(&self) -> u64 {
        self.state.tls_refused.load(Ordering::SeqCst)
    }

    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.state.store.lock().unwrap()
    }

    /// Creates or replaces an object as a controller would (a new version).
    pub fn put(&self, plural: &str, namespace: &str, mut object: Value) {
        let (plural, api_version, kind) = kind_of(plural).unwrap();
        object["apiVersion"] = json!(api_version);
        object["kind"] = json!(kind);
        object["metadata"]["namespace"] = json!(namespace);
        let name = object["metadata"]["name"].as_str().unwrap().to_owned();
        write(&self.state, plural, namespace, &name, object);
    }

    pub fn delete(&self, plural: &str, namespace: &str, name: &str) {
        let (plural, ..) = kind_of(plural).unwrap();
        remove(&self.state, plural, namespace, name);
    }

    pub fn get(&self, plural: &str, namespace: &str, name: &str) -> Option<Value> {
        let (plural, ..) = kind_of(plural).unwrap();
        self.store()
            .objects
            .get(&(plural, namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// A ready EndpointSlice naming `pods` (name, uid), labelled for discovery.
    pub fn ready_slice(&self, namespace: &str, slice: &str, pods: &[(&str, &str, bool)]) {
        let endpoints: Vec<Value> = pods
            .iter()
            .map(|(name, uid, ready)| {
                json!({"addresses": ["10.0.0.1"], "conditions": {"ready": ready},
                       "targetRef": {"kind": "Pod", "name": name, "uid": uid, "namespace": namespace}})
            })
            .collect();
        self.put(
            "endpointslices",
            namespace,
            json!({"metadata": {"name": slice,
                    "labels": {"nvidia.com/dynamo-discovery-enabled": "true"}},
                   "addressType": "IPv4", "endpoints": endpoints}),
        );
    }

    pub fn log(&self) -> Vec<Logged> {
        self.store().log.clone()
    }

    pub fn field_managers(&self, namespace: &str, name: &str) -> Vec<String> {
        self.store()
            .managers
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
            .unwrap_or_default()
    }

    /// The current resourceVersion.
    pub fn version(&self) -> u64 {
        self.store().rv
    }

    /// Ends every open watch (their clients see the stream end).
    pub fn drop_watches(&self) {
        self.state.generation.send_modify(|g| *g += 1);
    }

    /// Keeps watches open but silent (no events, no bookmarks) while set.
    pub fn stall_watches(&self, stalled: bool) {
        self.state.stalled.store(stalled, Ordering::SeqCst);
    }

    /// From now on, every watch is answered at once with an `ERROR` 410 (watch caches
    /// that disagree behind a load balancer).
    pub fn always_gone(&self, gone: bool) {
        self.state.always_gone.store(gone, Ordering::SeqCst);
    }

    /// Forgets history up to now: a watch or continue token from an older version
    /// gets 410 Gone. With `drop_watches`, every client must read afresh.
    pub fn compact(&self) {
        let mut s = self.store();
        s.compacted = s.rv;
        s.history.clear();
    }

    /// Holds every request (lists, gets, watches) until released: a client's first
    /// list then never completes.
    pub fn hold(&self, held: bool) {
        self.state.held.send_replace(held);
    }

    /// The next `n` requests are answered 500 with a body that is not JSON and never
    /// ends (it sends 64 KiB chunks for as long as the client reads).
    pub fn endless_errors(&self, n: usize) {
        self.store().endless_errors += n;
    }

    /// The next `n` requests are answered with `status` (a `Status`, reason
    /// `Injected`).
    pub fn fail_next(&self, n: usize, status: u16) {
        self.inject(
            n,
            Fault {
                code: status,
                reason: "Injected",
                message: "injected fault",
                retry_after: None,
            },
        );
    }

    /// The next `n` requests are answered 429 `TooManyRequests` with `Retry-After`
    /// (whole seconds of `after`), as API Priority and Fairness rejects a request.
    pub fn throttle(&self, n: usize, after: Duration) {
        self.inject(
            n,
            Fault {
                code: 429,
                reason: "TooManyRequests",
                message: "too many requests, please try again later",
                retry_after: Some(after.as_secs()),
            },
        );
    }

    /// The next `n` requests are answered 504 `Timeout` (with `Retry-After` when
    /// `after` is given), as a lagging replica answers a version it has not reached.
    pub fn gateway_timeouts(&self, n: usize, after: Option<Duration>) {
        self.inject(
            n,
            Fault {
                code: 504,
                reason: "Timeout",
                message: "Too large resource version",
                retry_after: after.map(|a| a.as_secs()),
            },
        );
    }

    fn inject(&self, n: usize, fault: Fault) {
        self.store().faults.extend(std::iter::repeat_n(fault, n));
    }

    /// After `n` more list pages are served, history is compacted and the next
    /// request with a continue token is answered 410 `Expired` (the list it
    /// continues must start again), once.
    pub fn compact_after_pages(&self, n: usize) {
        self.store().compact_after_pages = Some(n);
    }
}

fn write(
    state: &State,
    plural: &'static str,
    namespace: &str,
    name: &str,
    mut object: Value,
) -> Value {
    let mut s = state.store.lock().unwrap();
    s.rv += 1;
    let rv = s.rv;
    object["metadata"]["resourceVersion"] = json!(rv.to_string());
    let key = (plural, namespace.to_owned(), name.to_owned());
    let existed = s.objects.contains_key(&key);
    if object["metadata"].get("uid").is_none() {
        let uid = s
            .objects
            .get(&key)
            .and_then(|o| o["metadata"]["uid"].as_str().map(String::from))
            .unwrap_or_else(|| format!("uid-{}", state.next_uid.fetch_add(1, Ordering::Relaxed)));
        object["metadata"]["uid"] = json!(uid);
    }
    // Set by the server at creation (a client's is ignored), kept on updates; one
    // second a version, so that creation order is timestamp order.
    let created = s
        .objects
        .get(&key)
        .and_then(|o| {
            o["metadata"]["creationTimestamp"]
                .as_str()
                .map(String::from)
        })
        .unwrap_or_else(|| {
            let (day, secs) = (1 + rv / 86_400, rv % 86_400);
            format!(
                "2026-01-{day:02}T{:02}:{:02}:{:02}Z",
                secs / 3600,
                secs / 60 % 60,
                secs % 60
            )
        });
    object["metadata"]["creationTimestamp"] = json!(created);
    s.objects.insert(key, object.clone());
    let change = Change {
        rv,
        kind: plural,
        namespace: namespace.to_owned(),
        kind_of_event: if existed { "MODIFIED" } else { "ADDED" },
        object: object.clone(),
    };
    s.history.push(change.clone());
    let _ = state.changes.send(change);
    object
}

fn remove(state: &State, plural: &'static str, namespace: &str, name: &str) -> Option<Value> {
    let mut s = state.store.lock().unwrap();
    let mut object = s
        .objects
        .remove(&(plural, namespace.to_owned(), name.to_owned()))?;
    s.rv += 1;
    let rv = s.rv;
    object["metadata"]["resourceVersion"] = json!(rv.to_string());
    let change = Change {
        rv,
        kind: plural,
        namespace: namespace.to_owned(),
        kind_of_event: "DELETED",
        object: object.clone(),
    };
    s.history.push(change.clone());
    let _ = state.changes.send(change);
    Some(object)
}

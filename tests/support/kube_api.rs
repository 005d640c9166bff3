//! A Kubernetes API server for tests: the part of the API that Dynamo's discovery and
//! ours use, over plain HTTP/1.1 on loopback. Ours, written from the API conventions
//! (no real kube-apiserver can be installed here); the clients that talk to it are
//! real: kube-rs in `KubeDiscovery`, and Dynamo 1.6.1's own client.
//!
//! - Resources: `dynamoworkermetadatas` (`/apis/nvidia.com/v1alpha1`), `endpointslices`
//!   (`/apis/discovery.k8s.io/v1`) and `pods` (`/api/v1`), namespaced.
//! - Lists with `limit` / `continue` (the token names the list's version and the last
//!   name; a token older than the compaction point answers 410) and `labelSelector`
//!   (`k=v`, comma-separated).
//! - Watches (`watch=true`) from `resourceVersion`: every change after it, then live
//!   changes, as chunked JSON lines; `BOOKMARK`s every `bookmark_every` when asked for;
//!   ended after `timeoutSeconds`; a version older than the compaction point gets an
//!   `ERROR` event with code 410.
//! - Server-side apply (`PATCH`, `application/apply-patch+yaml`) creates or replaces
//!   the object (fields of `spec` it does not set are kept: another manager's),
//!   recording the field manager; like a real API server applying a
//!   resource whose schema is disabled, a `spec.data` map emptied by the apply is
//!   stored as `null`. `DELETE` removes.
//! - Faults: drop every open watch, stall them (open, silent), compact, and answer
//!   the next N requests with a status (500, 401…).
#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::broadcast;

/// What a test reads back of a request.
#[derive(Debug, Clone)]
pub struct Logged {
    pub method: String,
    pub path: String,
    pub query: BTreeMap<String, String>,
    pub content_type: Option<String>,
    pub body: Option<Value>,
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
    fail_next: Vec<u16>,
    /// Answers left that are a 500 whose body (not JSON) never ends.
    endless_errors: usize,
}

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
}

/// The server; dropping it stops it.
pub struct KubeApi {
    pub addr: SocketAddr,
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
    /// Starts on an ephemeral loopback port; bookmarks every second.
    pub async fn start() -> KubeApi {
        KubeApi::with_bookmarks(Duration::from_secs(1)).await
    }

    pub async fn with_bookmarks(bookmark_every: Duration) -> KubeApi {
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
        });
        let st = Arc::clone(&state);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let st = Arc::clone(&st);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let st = Arc::clone(&st);
                        async move { Ok::<_, Infallible>(handle(st, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        KubeApi { addr, state, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kube-rs client for this server (namespace `default`).
    pub fn client(&self) -> kube::Client {
        let config = kube::Config::new(self.url().parse().unwrap());
        kube::Client::try_from(config).unwrap()
    }

    /// Writes a kubeconfig naming this server (and `namespace`) into `dir`.
    pub fn kubeconfig(&self, dir: &std::path::Path, namespace: &str) -> std::path::PathBuf {
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {}\n\
                 contexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n    namespace: {namespace}\n\
                 current-context: test\nusers:\n- name: test\n  user:\n    token: test-token\n",
                self.url()
            ),
        )
        .unwrap();
        path
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

    /// The next `n` requests are answered with `status`.
    /// The next `n` requests are answered 500 with a body that is not JSON and never
    /// ends (it sends 64 KiB chunks for as long as the client reads).
    pub fn endless_errors(&self, n: usize) {
        self.store().endless_errors += n;
    }

    pub fn fail_next(&self, n: usize, status: u16) {
        self.store()
            .fail_next
            .extend(std::iter::repeat_n(status, n));
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

type Body = BoxBody<Bytes, Infallible>;

fn full(status: StatusCode, body: Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed())
        .unwrap()
}

fn status(code: u16, reason: &str, message: &str) -> Response<Body> {
    full(
        StatusCode::from_u16(code).unwrap(),
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": message, "reason": reason, "code": code}),
    )
}

fn labels_match(object: &Value, selector: Option<&String>) -> bool {
    let Some(selector) = selector else {
        return true;
    };
    selector.split(',').filter(|s| !s.is_empty()).all(|term| {
        let (k, v) = term.split_once('=').unwrap_or((term, ""));
        object["metadata"]["labels"][k].as_str() == Some(v)
    })
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let query: BTreeMap<String, String> = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (k.to_owned(), percent_decode(v))
        })
        .collect();
    let content_type = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(String::from);
    let bytes = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let body: Option<Value> = serde_json::from_slice(&bytes).ok();
    {
        let mut s = state.store.lock().unwrap();
        s.log.push(Logged {
            method: method.to_string(),
            path: path.clone(),
            query: query.clone(),
            content_type: content_type.clone(),
            body: body.clone(),
        });
        if !s.fail_next.is_empty() {
            let code = s.fail_next.remove(0);
            return status(code, "Injected", "injected fault");
        }
        if s.endless_errors > 0 {
            s.endless_errors -= 1;
            let chunk = Bytes::from(vec![b'x'; 64 << 10]);
            let stream = futures_util::stream::repeat_with(move || {
                Ok::<_, Infallible>(Frame::data(chunk.clone()))
            });
            return Response::builder()
                .status(StatusCode::INTERNAL_SERVER_ERROR)
                .header("content-type", "text/plain")
                .body(BodyExt::boxed(StreamBody::new(stream)))
                .unwrap();
        }
    }
    let _ = state.held.subscribe().wait_for(|held| !held).await;
    // /apis/{group}/{version}/namespaces/{ns}/{plural}[/{name}] or /api/v1/namespaces/...
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let rest = match segs.first() {
        Some(&"api") => segs.get(2..),
        Some(&"apis") => segs.get(3..),
        _ => None,
    };
    let Some(["namespaces", ns, plural, name @ ..]) = rest else {
        return status(404, "NotFound", "no such path");
    };
    let Some((plural, api_version, kind)) = kind_of(plural) else {
        return status(404, "NotFound", "no such resource");
    };
    let ns = (*ns).to_owned();
    match (method, name) {
        (Method::GET, []) if query.get("watch").map(String::as_str) == Some("true") => {
            watch(state, plural, api_version, kind, ns, query)
        }
        (Method::GET, []) => list(&state, plural, api_version, kind, &ns, &query),
        (Method::GET, [name]) => {
            let s = state.store.lock().unwrap();
            match s.objects.get(&(plural, ns.clone(), (*name).to_owned())) {
                Some(o) => full(StatusCode::OK, o.clone()),
                None => status(404, "NotFound", "not found"),
            }
        }
        (Method::PATCH, [name]) => {
            let Some(mut object) = body else {
                return status(400, "BadRequest", "body is not JSON");
            };
            if content_type.as_deref() != Some("application/apply-patch+yaml") {
                return status(415, "UnsupportedMediaType", "only server-side apply");
            }
            let Some(manager) = query.get("fieldManager") else {
                return status(422, "Invalid", "fieldManager is required for apply");
            };
            {
                let mut s = state.store.lock().unwrap();
                s.managers
                    .entry((ns.clone(), (*name).to_owned()))
                    .or_default()
                    .push(manager.clone());
                // An emptied map of spec.data is stored as null (as observed from a
                // real API server with the resource's schema disabled).
                let old = s.objects.get(&(plural, ns.clone(), (*name).to_owned()));
                if let (Some(old), Some(data)) = (old, object["spec"]["data"].as_object_mut()) {
                    for (k, v) in data.iter_mut() {
                        let was_full = old["spec"]["data"][k]
                            .as_object()
                            .is_some_and(|m| !m.is_empty());
                        if was_full && v.as_object().is_some_and(|m| m.is_empty()) {
                            *v = Value::Null;
                        }
                    }
                }
                if let Some(old) = old {
                    object["metadata"]["uid"] = old["metadata"]["uid"].clone();
                    // Fields of spec the apply does not set stay (another manager's).
                    if let (Some(kept), Some(spec)) =
                        (old["spec"].as_object(), object["spec"].as_object_mut())
                    {
                        for (k, v) in kept {
                            spec.entry(k.clone()).or_insert_with(|| v.clone());
                        }
                    }
                }
            }
            object["metadata"]["namespace"] = json!(ns);
            object["apiVersion"] = json!(api_version);
            object["kind"] = json!(kind);
            let stored = write(&state, plural, &ns, name, object);
            full(StatusCode::OK, stored)
        }
        (Method::DELETE, [name]) => match remove(&state, plural, &ns, name) {
            Some(_) => full(
                StatusCode::OK,
                json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 200}),
            ),
            None => status(404, "NotFound", "not found"),
        },
        _ => status(405, "MethodNotAllowed", "not supported here"),
    }
}

fn percent_decode(s: &str) -> String {
    let mut out = Vec::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn list(
    state: &State,
    plural: &'static str,
    api_version: &str,
    kind: &str,
    ns: &str,
    query: &BTreeMap<String, String>,
) -> Response<Body> {
    let s = state.store.lock().unwrap();
    let limit: usize = query
        .get("limit")
        .and_then(|l| l.parse().ok())
        .unwrap_or(usize::MAX);
    let (list_rv, after) = match query.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => {
            let (rv, name) = token.split_once(':').unwrap_or(("0", ""));
            let rv: u64 = rv.parse().unwrap_or(0);
            if rv < s.compacted {
                return status(410, "Expired", "the continue token is too old");
            }
            (rv, Some(name.to_owned()))
        }
        None => (s.rv, None),
    };
    let mut items = Vec::new();
    let mut more = None;
    for ((p, n_ns, name), object) in &s.objects {
        if *p != plural || n_ns != ns {
            continue;
        }
        if after.as_ref().is_some_and(|a| name.as_str() <= a.as_str()) {
            continue;
        }
        if !labels_match(object, query.get("labelSelector")) {
            continue;
        }
        if items.len() == limit {
            more = Some(format!(
                "{list_rv}:{}",
                items
                    .last()
                    .and_then(|o: &Value| o["metadata"]["name"].as_str())
                    .unwrap_or("")
            ));
            break;
        }
        items.push(object.clone());
    }
    let mut metadata = json!({"resourceVersion": list_rv.to_string()});
    if let Some(token) = more {
        metadata["continue"] = json!(token);
    }
    full(
        StatusCode::OK,
        json!({"apiVersion": api_version, "kind": format!("{kind}List"), "metadata": metadata, "items": items}),
    )
}

fn watch(
    state: Arc<State>,
    plural: &'static str,
    api_version: &'static str,
    kind: &'static str,
    ns: String,
    query: BTreeMap<String, String>,
) -> Response<Body> {
    let from: u64 = query
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let timeout = Duration::from_secs(
        query
            .get("timeoutSeconds")
            .and_then(|t| t.parse().ok())
            .unwrap_or(290),
    );
    let bookmarks = query.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let selector = query.get("labelSelector").cloned();
    let mut live = state.changes.subscribe();
    let (backlog, gone) = {
        let s = state.store.lock().unwrap();
        if from < s.compacted || state.always_gone.load(Ordering::SeqCst) {
            (Vec::new(), true)
        } else {
            (
                s.history
                    .iter()
                    .filter(|c| c.rv > from && c.kind == plural && c.namespace == ns)
                    .cloned()
                    .collect::<Vec<_>>(),
                false,
            )
        }
    };
    let mut generation = state.generation.subscribe();
    generation.mark_unchanged();
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1024);
    tokio::spawn(async move {
        let line = |v: Value| Bytes::from(format!("{v}\n"));
        if gone {
            let _ = tx
                .send(line(
                    json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1",
                    "metadata": {}, "status": "Failure", "message": "too old resource version",
                    "reason": "Expired", "code": 410}}),
                ))
                .await;
            return;
        }
        let matches = |c: &Change| {
            c.kind == plural
                && c.namespace == ns
                && c.rv > from
                && labels_match(&c.object, selector.as_ref())
        };
        let mut last = from;
        for c in backlog.iter().filter(|c| matches(c)) {
            last = c.rv;
            if tx
                .send(line(json!({"type": c.kind_of_event, "object": c.object})))
                .await
                .is_err()
            {
                return;
            }
        }
        let mut end = tokio::time::Instant::now() + timeout;
        let mut tick = tokio::time::interval(state.bookmark_every);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = generation.changed() => return,
                () = tokio::time::sleep_until(end) => {
                    // A stalled server does not even end the watch on time.
                    if !state.stalled.load(Ordering::SeqCst) {
                        return;
                    }
                    end += Duration::from_secs(3600);
                }
                _ = tick.tick() => {
                    if bookmarks && !state.stalled.load(Ordering::SeqCst) {
                        // Only a version this watch has passed (as a real server does).
                        let b = json!({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": api_version,
                            "metadata": {"resourceVersion": last.to_string()}}});
                        if tx.send(line(b)).await.is_err() { return; }
                    }
                }
                c = live.recv() => match c {
                    Ok(c) if c.rv > last && matches(&c) => {
                        while state.stalled.load(Ordering::SeqCst) {
                            if generation.has_changed().unwrap_or(true) { return; }
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        last = c.rv;
                        if tx.send(line(json!({"type": c.kind_of_event, "object": c.object}))).await.is_err() {
                            return;
                        }
                    }
                    Ok(c) => last = last.max(c.rv),
                    Err(broadcast::error::RecvError::Lagged(_)) => return,
                    Err(broadcast::error::RecvError::Closed) => return,
                },
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(BodyExt::boxed(StreamBody::new(stream)))
        .unwrap()
}

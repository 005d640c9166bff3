//! How the test API server answers: the connections (TLS or not), authentication,
//! injected faults, and the requests it understands (get, list, watch, apply, delete).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::broadcast;

use super::{Change, Fault, Logged, MAX_SNAPSHOTS, State, Store, kind_of, remove, write};

/// Accepts connections for ever: each one's TLS handshake first (with `acceptor`),
/// then HTTP/1.1.
pub(super) async fn accept(
    listener: tokio::net::TcpListener,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    state: Arc<State>,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let st = Arc::clone(&state);
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            match acceptor {
                Some(acceptor) => match acceptor.accept(stream).await {
                    Ok(stream) => connection(st, hyper_util::rt::TokioIo::new(stream)).await,
                    // A client that does not trust the certificate ends it here.
                    Err(_) => {
                        st.tls_refused.fetch_add(1, Ordering::SeqCst);
                    }
                },
                None => connection(st, hyper_util::rt::TokioIo::new(stream)).await,
            }
        });
    }
}

/// Serves one connection.
async fn connection<I>(state: Arc<State>, io: I)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let st = Arc::clone(&state);
        async move { Ok::<_, Infallible>(handle(st, req).await) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(io, service)
        .await;
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

/// The answer of an injected fault: its `Status` (with `details.retryAfterSeconds`)
/// and, with a delay, the `Retry-After` header a real API server sends beside it.
fn injected(fault: Fault) -> Response<Body> {
    let mut body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": fault.message, "reason": fault.reason,
        "code": fault.code});
    if let Some(after) = fault.retry_after {
        body["details"] = json!({"retryAfterSeconds": after});
    }
    let mut response = full(StatusCode::from_u16(fault.code).unwrap(), body);
    if let Some(after) = fault.retry_after {
        response.headers_mut().insert(
            hyper::header::RETRY_AFTER,
            hyper::header::HeaderValue::from(after),
        );
    }
    response
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
    let authorized = state.token.as_ref().is_none_or(|token| {
        req.headers()
            .get(hyper::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            == Some(format!("Bearer {token}").as_str())
    });
    let bytes = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let body: Option<Value> = serde_json::from_slice(&bytes).ok();
    {
        let mut s = state.store.lock().unwrap();
        let mut logged = Logged {
            method: method.to_string(),
            path: path.clone(),
            query: query.clone(),
            content_type: content_type.clone(),
            body: body.clone(),
            authorized,
            fault: None,
            at: Instant::now(),
        };
        // Authentication comes first, as on a real API server (before priority and
        // fairness, before anything is read).
        if !authorized {
            logged.fault = Some(401);
            s.log.push(logged);
            return status(401, "Unauthorized", "Unauthorized");
        }
        if let Some(fault) = s.faults.pop_front() {
            logged.fault = Some(fault.code);
            s.log.push(logged);
            return injected(fault);
        }
        if s.endless_errors > 0 {
            logged.fault = Some(500);
            s.log.push(logged);
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
        s.log.push(logged);
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
    let mut s = state.store.lock().unwrap();
    let limit: usize = query
        .get("limit")
        .and_then(|l| l.parse().ok())
        .filter(|l| *l > 0)
        .unwrap_or(usize::MAX);
    // The list's version, its snapshot (none yet on a first page) and the name its
    // previous page ended with.
    let (list_rv, snapshot, after) = match query.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => {
            if s.compact_after_pages == Some(0) {
                // Compacted between two pages of this list.
                s.compact_after_pages = None;
                s.compacted = s.rv;
                s.history.clear();
                s.snapshots.clear();
                return expired();
            }
            let mut parts = token.splitn(3, ':');
            let rv: u64 = parts.next().and_then(|v| v.parse().ok()).unwrap_or(0);
            let id: u64 = parts.next().and_then(|v| v.parse().ok()).unwrap_or(0);
            let after = parts.next().unwrap_or("").to_owned();
            if rv < s.compacted || !s.snapshots.contains_key(&id) {
                return expired();
            }
            (rv, Some(id), Some(after))
        }
        None => (s.rv, None, None),
    };
    let id = match snapshot {
        Some(id) => id,
        None => {
            // A first page: everything the list holds, now.
            let matching: Vec<Value> = s
                .objects
                .iter()
                .filter(|((p, n_ns, _), object)| {
                    *p == plural && n_ns == ns && labels_match(object, query.get("labelSelector"))
                })
                .map(|(_, object)| object.clone())
                .collect();
            if matching.len() <= limit {
                s.count_page();
                return list_answer(api_version, kind, list_rv, None, matching);
            }
            let id = s.next_snapshot;
            s.next_snapshot += 1;
            s.snapshots.insert(id, matching);
            while s.snapshots.len() > MAX_SNAPSHOTS {
                s.snapshots.pop_first();
            }
            id
        }
    };
    let held: &[Value] = s.snapshots.get(&id).map(Vec::as_slice).unwrap_or_default();
    let name = |o: &Value| o["metadata"]["name"].as_str().unwrap_or("").to_owned();
    let rest: Vec<&Value> = held
        .iter()
        .filter(|o| after.as_ref().is_none_or(|a| name(o).as_str() > a.as_str()))
        .collect();
    let items: Vec<Value> = rest.iter().take(limit).map(|o| Value::clone(o)).collect();
    let more = (rest.len() > items.len()).then(|| {
        format!(
            "{list_rv}:{id}:{}",
            items.last().map(name).unwrap_or_default()
        )
    });
    if more.is_none() {
        // Its last page: the snapshot goes.
        s.snapshots.remove(&id);
    }
    s.count_page();
    list_answer(api_version, kind, list_rv, more, items)
}

/// A 410 `Expired` for a continue token (as a real API server words it).
fn expired() -> Response<Body> {
    status(
        410,
        "Expired",
        "The provided continue parameter is too old to display a consistent list result. \
         You can start a new list without the continue parameter.",
    )
}

fn list_answer(
    api_version: &str,
    kind: &str,
    list_rv: u64,
    more: Option<String>,
    items: Vec<Value>,
) -> Response<Body> {
    let mut metadata = json!({"resourceVersion": list_rv.to_string()});
    if let Some(token) = more {
        metadata["continue"] = json!(token);
    }
    full(
        StatusCode::OK,
        json!({"apiVersion": api_version, "kind": format!("{kind}List"), "metadata": metadata, "items": items}),
    )
}

impl Store {
    /// One list page served: counts down to a compaction between pages.
    fn count_page(&mut self) {
        if let Some(n) = self.compact_after_pages.as_mut() {
            *n = n.saturating_sub(1);
        }
    }
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

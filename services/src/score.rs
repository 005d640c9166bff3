//! `kv-router --serve`: the router's index as a scoring service, for routers in any
//! language (as llm-d's indexer is one).
//!
//! `POST /v1/scores` with a JSON body, either `{"local_hashes": [u64, …]}` (a
//! request's local block hashes) or `{"tokens": [u32, …], "block_size": N}` (its
//! tokens: hashed as Dynamo's router hashes them, `eventplane::kv::router::local_block_hashes`),
//! answers `200` with `{"scores": [{"worker_id": W, "dp_rank": R, "blocks": N}, …]}`:
//! every (worker, rank) holding at least the first block, with how many leading
//! blocks it holds, ordered by worker then rank. Device-tier blocks only (the index
//! scores those, as Dynamo's radix tree does).
//!
//! Bounded: a body of at most 1 MiB (413 past it, refused on `Content-Length` before
//! reading), at most 65,536 hashes or blocks of tokens (400), a request head read
//! within 5 s and a body within 10 s (408), one request per connection, at most 64
//! connections at once (further ones closed on accept and counted) and 8 requests
//! read and scored at once. Anything else is a clear 4xx with a one-line JSON
//! `{"error": "…"}`: 400 malformed JSON or fields, 404 another path, 405 another
//! method. A request only reads the index (a read lock held for one walk); the router
//! applies events 64 at a time, so a query waits for at most that many.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use eventplane::kv::{
    TokensHash,
    router::{IndexFeed, local_block_hashes},
};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Largest request body read.
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// Most local hashes a request may score.
pub const MAX_HASHES: usize = 1 << 16;
/// Most tokens a request may send.
pub const MAX_TOKENS: usize = 1 << 22;
/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 64;
/// Requests parsed and scored at once (each holds its parsed numbers: a few MiB).
/// Bodies are read before, outside this bound (one per connection: at most
/// `MAX_CONNECTIONS` × `MAX_BODY_BYTES`, 64 MiB), so a client that stalls its body
/// holds its connection, never the scorer.
pub const MAX_IN_FLIGHT: usize = 8;
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// The index the router keeps and the service reads.
pub type SharedFeed = Arc<RwLock<IndexFeed>>;

/// Counters of the scoring service.
#[derive(Debug, Default, serde::Serialize)]
pub struct ScoreStats {
    /// Requests answered 200.
    pub scored: AtomicU64,
    /// Requests answered 4xx.
    pub refused: AtomicU64,
    /// Connections closed on accept (every slot taken).
    pub refused_connections: AtomicU64,
}

/// A running scoring service.
#[derive(Debug)]
pub struct ScoreServer {
    local_addr: SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    stats: Arc<ScoreStats>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ScoreRequest {
    local_hashes: Option<Vec<u64>>,
    tokens: Option<Vec<u32>>,
    block_size: Option<usize>,
}

impl ScoreServer {
    /// Serves `feed`'s index on `listen` (ip:port).
    pub async fn bind(listen: &str, feed: SharedFeed) -> std::io::Result<ScoreServer> {
        let listener = TcpListener::bind(listen).await?;
        let local_addr = listener.local_addr()?;
        let stop = CancellationToken::new();
        let stats = Arc::new(ScoreStats::default());
        let task = tokio::spawn(accept_loop(listener, feed, stats.clone(), stop.clone()));
        Ok(ScoreServer {
            local_addr,
            stop,
            task,
            stats,
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Its counters, as JSON.
    pub fn stats(&self) -> serde_json::Value {
        serde_json::to_value(&*self.stats).unwrap_or_default()
    }

    /// Stops accepting and closes every connection.
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

async fn accept_loop(
    listener: TcpListener,
    feed: SharedFeed,
    stats: Arc<ScoreStats>,
    stop: CancellationToken,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
    let tracker = tokio_util::task::TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            a = listener.accept() => a,
        };
        let Ok((stream, _)) = accepted else {
            // Out of descriptors, most likely: breathe, then go on.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            stats.refused_connections.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let (feed, stats, stop) = (feed.clone(), stats.clone(), stop.clone());
        let in_flight = in_flight.clone();
        tracker.spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |req| {
                let (feed, stats, in_flight) = (feed.clone(), stats.clone(), in_flight.clone());
                async move {
                    Ok::<_, std::convert::Infallible>(answer(req, &feed, &stats, &in_flight).await)
                }
            });
            // One request per connection: a client cannot keep a slot by trickling
            // requests.
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .keep_alive(false)
                .header_read_timeout(HEADER_TIMEOUT)
                .max_buf_size(16 << 10)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                () = stop.cancelled() => conn.as_mut().graceful_shutdown(),
            }
        });
    }
    tracker.close();
    tracker.wait().await;
}

fn json(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

fn refuse(stats: &ScoreStats, status: StatusCode, why: &str) -> Response<Full<Bytes>> {
    stats.refused.fetch_add(1, Ordering::Relaxed);
    json(
        status,
        serde_json::json!({ "error": why }).to_string() + "\n",
    )
}

/// Reads, checks and scores one request. The body is read before a scoring permit
/// is taken: a client that stalls holds its connection, never the scorer.
async fn answer(
    req: Request<Incoming>,
    feed: &SharedFeed,
    stats: &ScoreStats,
    in_flight: &tokio::sync::Semaphore,
) -> Response<Full<Bytes>> {
    if req.uri().path() != "/v1/scores" {
        return refuse(
            stats,
            StatusCode::NOT_FOUND,
            "no such path: POST /v1/scores",
        );
    }
    if req.method() != Method::POST {
        let mut r = refuse(stats, StatusCode::METHOD_NOT_ALLOWED, "POST only");
        r.headers_mut().insert(
            hyper::header::ALLOW,
            hyper::header::HeaderValue::from_static("POST"),
        );
        return r;
    }
    let declared = req
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return refuse(stats, StatusCode::PAYLOAD_TOO_LARGE, "body over 1 MiB");
    }
    let body = Limited::new(req.into_body(), MAX_BODY_BYTES);
    let body = match tokio::time::timeout(BODY_TIMEOUT, body.collect()).await {
        Err(_) => {
            return refuse(
                stats,
                StatusCode::REQUEST_TIMEOUT,
                "body not sent within 10 s",
            );
        }
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            return refuse(stats, StatusCode::PAYLOAD_TOO_LARGE, "body over 1 MiB");
        }
        Ok(Err(_)) => return refuse(stats, StatusCode::BAD_REQUEST, "body not read"),
        Ok(Ok(body)) => body.to_bytes(),
    };
    let _permit = in_flight.acquire().await;
    let request: ScoreRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return refuse(
                stats,
                StatusCode::BAD_REQUEST,
                &format!("malformed JSON: {e}"),
            );
        }
    };
    let hashes: Vec<TokensHash> = match (request.local_hashes, request.tokens, request.block_size) {
        (Some(hashes), None, None) => {
            if hashes.len() > MAX_HASHES {
                return refuse(
                    stats,
                    StatusCode::BAD_REQUEST,
                    "more than 65536 local_hashes",
                );
            }
            hashes.into_iter().map(TokensHash).collect()
        }
        (None, Some(tokens), Some(block_size)) => {
            if block_size == 0 || block_size > 1 << 16 {
                return refuse(
                    stats,
                    StatusCode::BAD_REQUEST,
                    "block_size must be 1 to 65536",
                );
            }
            if tokens.len() > MAX_TOKENS {
                return refuse(stats, StatusCode::BAD_REQUEST, "more than 4194304 tokens");
            }
            if tokens.len() / block_size > MAX_HASHES {
                return refuse(
                    stats,
                    StatusCode::BAD_REQUEST,
                    "more than 65536 blocks of tokens",
                );
            }
            local_block_hashes(&tokens, block_size)
        }
        _ => {
            return refuse(
                stats,
                StatusCode::BAD_REQUEST,
                "send {\"local_hashes\": [...]} or {\"tokens\": [...], \"block_size\": N}",
            );
        }
    };
    let scores = {
        let feed = feed.read().unwrap_or_else(|p| p.into_inner());
        feed.index().find_matches(&hashes)
    };
    let scores: Vec<serde_json::Value> = scores
        .iter()
        .map(|s| serde_json::json!({"worker_id": s.worker_id.0, "dp_rank": s.dp_rank, "blocks": s.blocks}))
        .collect();
    stats.scored.fetch_add(1, Ordering::Relaxed);
    json(
        StatusCode::OK,
        serde_json::json!({ "scores": scores }).to_string() + "\n",
    )
}

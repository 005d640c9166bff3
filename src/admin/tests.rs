#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

use std::sync::atomic::AtomicBool;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

async fn ask(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: admin\r\n\r\n").into_bytes()
}

/// A server whose readiness is the flag returned, counting its metric renders.
async fn server(config: AdminConfig) -> (AdminServer, Arc<AtomicBool>) {
    let (admin, ready, _) = counting_server(config).await;
    (admin, ready)
}

async fn counting_server(
    config: AdminConfig,
) -> (
    AdminServer,
    Arc<AtomicBool>,
    Arc<std::sync::atomic::AtomicU64>,
) {
    let renders = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let ready = Arc::new(AtomicBool::new(false));
    let flag = ready.clone();
    let routes = Routes::new(move || {
        if flag.load(Ordering::Relaxed) {
            Ok(())
        } else {
            Err("no view yet".into())
        }
    })
    .metrics({
        let renders = renders.clone();
        move || {
            renders.fetch_add(1, Ordering::Relaxed);
            "eventplane_up 1\n".to_owned()
        }
    });
    let server = AdminServer::bind("127.0.0.1:0", config, routes)
        .await
        .unwrap();
    (server, ready, renders)
}

#[tokio::test]
async fn probes_and_scrapes_get_their_answers() {
    let (admin, ready, renders) = counting_server(AdminConfig::default()).await;
    let addr = admin.local_addr();
    let r = ask(addr, &get("/readyz")).await;
    assert!(r.starts_with("HTTP/1.1 503 "), "{r}");
    assert!(r.ends_with("not ready: no view yet\n"), "{r}");
    ready.store(true, Ordering::Relaxed);
    assert!(
        ask(addr, &get("/readyz"))
            .await
            .starts_with("HTTP/1.1 200 ")
    );
    assert!(ask(addr, &get("/livez")).await.ends_with("\r\n\r\nok\n"));
    let m = ask(addr, &get("/metrics?name[]=x")).await;
    assert!(m.contains("content-type: text/plain; version=0.0.4"), "{m}");
    assert!(m.ends_with("\r\n\r\neventplane_up 1\n"), "{m}");
    let rendered = renders.load(Ordering::Relaxed);
    let head = ask(addr, b"HEAD /metrics HTTP/1.1\r\n\r\n").await;
    assert!(
        head.starts_with("HTTP/1.1 200 ") && head.ends_with("\r\n\r\n"),
        "{head}"
    );
    // A HEAD renders nothing (issue 49 L5: it rendered the whole text to drop it).
    assert_eq!(renders.load(Ordering::Relaxed), rendered);
    assert!(!head.contains("content-length"), "{head}");
    assert!(ask(addr, &get("/other")).await.starts_with("HTTP/1.1 404 "));
    let post = ask(
        addr,
        b"POST /readyz HTTP/1.1\r\ncontent-length: 5\r\n\r\nhello",
    )
    .await;
    assert!(
        post.starts_with("HTTP/1.1 405 ") && post.contains("allow: GET, HEAD"),
        "{post}"
    );
    assert!(
        ask(addr, b"BREW /pot HTTP/1.1 extra\r\n\r\n")
            .await
            .starts_with("HTTP/1.1 400 ")
    );
    let long = format!("GET / HTTP/1.1\r\nx: {}\r\n\r\n", "a".repeat(8 << 10));
    assert!(
        ask(addr, long.as_bytes())
            .await
            .starts_with("HTTP/1.1 431 ")
    );
    let stats = admin.stats();
    assert_eq!(
        (stats.requests, stats.bad_requests, stats.timeouts),
        (9, 2, 0)
    );
    admin.shutdown().await;
}

#[tokio::test]
async fn without_metrics_the_route_is_not_found() {
    let admin = AdminServer::bind(
        "127.0.0.1:0",
        AdminConfig::default(),
        Routes::new(|| Ok(())),
    )
    .await
    .unwrap();
    assert!(
        ask(admin.local_addr(), &get("/metrics"))
            .await
            .starts_with("HTTP/1.1 404 ")
    );
    assert!(
        ask(admin.local_addr(), &get("/readyz"))
            .await
            .starts_with("HTTP/1.1 200 ")
    );
}

#[tokio::test]
async fn a_silent_connection_is_closed_at_its_deadline() {
    let timeout = Duration::from_millis(200);
    let (admin, _) = server(AdminConfig::default().request_timeout(timeout)).await;
    let mut s = TcpStream::connect(admin.local_addr()).await.unwrap();
    // Half a request head, then nothing.
    s.write_all(b"GET /readyz HTTP/1.1\r\n").await.unwrap();
    let start = Instant::now();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(30), s.read(&mut buf))
        .await
        .unwrap()
        .unwrap_or(0);
    let took = start.elapsed();
    assert_eq!(n, 0, "closed without an answer");
    assert!(took >= timeout - Duration::from_millis(20), "{took:?}");
    assert!(took < timeout + Duration::from_secs(1), "{took:?}");
    assert_eq!(admin.stats().timeouts, 1);
}

/// Connections that send nothing hold slots only until others come: the oldest one
/// waiting for its head is closed to make room, so a probe still gets its answer.
#[tokio::test]
async fn silent_connections_make_room_for_a_probe() {
    let (admin, ready) = server(AdminConfig::default().max_connections(2)).await;
    ready.store(true, Ordering::Relaxed);
    let addr = admin.local_addr();
    // Two connections take both slots with half a request head each.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /readyz HTTP/1.1\r\nX: ").await.unwrap();
        held.push(s);
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        ask(addr, &get("/readyz"))
            .await
            .starts_with("HTTP/1.1 200 ")
    );
    // The oldest was closed without an answer.
    let mut out = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(30), held[0].read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(n, 0);
    let stats = admin.stats();
    assert_eq!(
        (stats.evicted_connections, stats.refused_connections),
        (1, 0)
    );
}

/// Only when every slot is busy answering is a new connection closed on accept: here
/// a client that asked for a large `/metrics` and does not read it, so the answer
/// waits in the socket's buffers.
#[tokio::test]
async fn a_connection_finding_every_slot_answering_is_closed_on_accept() {
    const BODY: usize = 32 << 20;
    let routes = Routes::new(|| Ok(())).metrics(|| {
        let mut body = "x".repeat(BODY - 4);
        body.push_str("end\n");
        body
    });
    let config = AdminConfig::default()
        .max_connections(1)
        .request_timeout(Duration::from_secs(30));
    let admin = AdminServer::bind("127.0.0.1:0", config, routes)
        .await
        .unwrap();
    let addr = admin.local_addr();
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(&get("/metrics")).await.unwrap();
    // Its request is read (counted before the answer is written): it is answering.
    tokio::time::timeout(Duration::from_secs(30), async {
        while admin.stats().requests == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    let mut refused = TcpStream::connect(addr).await.unwrap();
    let _ = refused.write_all(&get("/livez")).await;
    let mut out = Vec::new();
    let _ = refused.read_to_end(&mut out).await;
    assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));
    let mut answer = Vec::new();
    slow.read_to_end(&mut answer).await.unwrap();
    assert!(answer.ends_with(b"end\n") && answer.len() > BODY);
    let stats = admin.stats();
    assert_eq!(
        (stats.refused_connections, stats.evicted_connections),
        (1, 0)
    );
    // Once it answered, the slot serves again.
    assert!(ask(addr, &get("/livez")).await.starts_with("HTTP/1.1 200 "));
}

/// The default cap is 8: eight silent connections hold a slot each, a ninth makes
/// room by closing the oldest, exactly once.
#[tokio::test]
async fn eight_connections_are_served_at_once_by_default() {
    let (admin, _) = server(AdminConfig::default()).await;
    let addr = admin.local_addr();
    let mut held = Vec::new();
    for _ in 0..9 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /livez HTTP/1.1\r\nX: ").await.unwrap();
        held.push(s);
        // Accepted in this order (the oldest is the one evicted).
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut out = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(30), held[0].read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(n, 0, "the oldest was closed without an answer");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stats = admin.stats();
    assert_eq!(
        (stats.evicted_connections, stats.refused_connections),
        (1, 0)
    );
}

/// A client that read its answer but keeps the connection open lingers a bounded
/// time, and is not a timeout: what it sends meanwhile is read, and once the linger
/// ended the socket is gone (a write then meets a reset).
#[tokio::test]
async fn an_answered_client_that_stays_is_closed_after_its_linger() {
    let (admin, _) = server(AdminConfig::default()).await;
    let mut s = TcpStream::connect(admin.local_addr()).await.unwrap();
    s.write_all(&get("/livez")).await.unwrap();
    let mut out = vec![0u8; 4096];
    let n = s.read(&mut out).await.unwrap();
    assert!(String::from_utf8_lossy(&out[..n]).starts_with("HTTP/1.1 200 "));
    // The server shut its side: EOF, and it closes once the linger ends.
    let start = Instant::now();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut rest)).await;
    assert!(start.elapsed() < Duration::from_secs(30));
    // Within the linger the server still reads: a write is taken, no reset.
    s.write_all(b"more").await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    s.write_all(b"more").await.unwrap();
    tokio::time::sleep(LINGER_TIME + Duration::from_millis(500)).await;
    // Past it: the first write draws a reset, the next fails on it.
    let _ = s.write_all(b"late").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let late = s.write_all(b"late").await.unwrap_err();
    assert!(
        matches!(
            late.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        ),
        "{late}"
    );
    assert_eq!(admin.stats().timeouts, 0);
}

#[test]
fn configs_out_of_range_are_refused() {
    let c = AdminConfig::default();
    assert_eq!(
        c.clone().max_connections(0).validate().unwrap_err().field(),
        "max_connections"
    );
    assert_eq!(
        c.clone()
            .request_timeout(Duration::ZERO)
            .validate()
            .unwrap_err()
            .field(),
        "request_timeout"
    );
    assert_eq!(
        c.max_request_bytes(128 << 10)
            .validate()
            .unwrap_err()
            .field(),
        "max_request_bytes"
    );
}

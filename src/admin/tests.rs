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

async fn server(config: AdminConfig) -> (AdminServer, Arc<AtomicBool>) {
    let ready = Arc::new(AtomicBool::new(false));
    let flag = ready.clone();
    let routes = Routes::new(move || {
        if flag.load(Ordering::Relaxed) {
            Ok(())
        } else {
            Err("no view yet".into())
        }
    })
    .metrics(|| "eventplane_up 1\n".to_owned());
    let server = AdminServer::bind("127.0.0.1:0", config, routes)
        .await
        .unwrap();
    (server, ready)
}

#[tokio::test]
async fn probes_and_scrapes_get_their_answers() {
    let (admin, ready) = server(AdminConfig::default()).await;
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
    let head = ask(addr, b"HEAD /metrics HTTP/1.1\r\n\r\n").await;
    assert!(
        head.starts_with("HTTP/1.1 200 ") && head.ends_with("\r\n\r\n"),
        "{head}"
    );
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
    assert_eq!((stats.requests, stats.bad_requests), (9, 2));
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

#[tokio::test]
async fn connections_past_the_limit_are_closed_on_accept() {
    let (admin, ready) = server(AdminConfig::default().max_connections(2)).await;
    ready.store(true, Ordering::Relaxed);
    let addr = admin.local_addr();
    // Two connections hold both slots, sending nothing.
    let held = [
        TcpStream::connect(addr).await.unwrap(),
        TcpStream::connect(addr).await.unwrap(),
    ];
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut third = TcpStream::connect(addr).await.unwrap();
    let _ = third.write_all(&get("/readyz")).await;
    let mut out = Vec::new();
    let _ = third.read_to_end(&mut out).await;
    assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));
    assert_eq!(admin.stats().refused_connections, 1);
    // A slot freed serves again.
    drop(held);
    let answered = async {
        loop {
            let r = ask(addr, &get("/readyz")).await;
            if r.starts_with("HTTP/1.1 200 ") {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), answered)
        .await
        .unwrap();
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

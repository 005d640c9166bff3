//! The bus's accept path (DESIGN §7.3): connections wait in the unauthenticated pool,
//! ranked by how long they went without progress, under the TLS and credential deadlines; their first
//! accepted credential (`serve::authenticate`) moves them to an authenticated slot.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::tunnel::bus::admission::{Admit, Progress};
use crate::tunnel::bus::serve::{Conn, Inner, route};

/// Takes the connection out of the unauthenticated pool when its task ends.
struct LeavePending<'a> {
    inner: &'a Inner,
    id: u64,
}

impl Drop for LeavePending<'_> {
    fn drop(&mut self) {
        self.inner
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(self.id);
    }
}

pub(crate) async fn accept_loop(
    inner: Arc<Inner>,
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
) {
    loop {
        let accepted = tokio::select! {
            () = inner.cancel.cancelled() => return,
            a = listener.accept() => a,
        };
        let Ok((tcp, peer)) = accepted else {
            // Out of descriptors, most likely: pause instead of spinning.
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let id = inner.next_conn.fetch_add(1, Ordering::Relaxed);
        let close = CancellationToken::new();
        // Unauthenticated connections wait in a small pool of their own.
        // A broker's client hello is usually there by now: it ranks above the silent.
        let progress = if has_bytes(&tcp) {
            Progress::Spoke
        } else {
            Progress::Silent
        };
        let admitted = inner
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .admit_at(
                id,
                source_key(peer.ip()),
                progress,
                std::time::Instant::now(),
                close.clone(),
            );
        match admitted {
            Admit::Admitted => {}
            Admit::Evicted(old) => {
                old.cancel();
                inner
                    .counters
                    .pending_evicted
                    .fetch_add(1, Ordering::Relaxed);
                inner.warn(
                    "pending_evicted",
                    format_args!(
                        "event bus: the pool of unauthenticated connections (or {}'s share of it) is full: the connection longest without progress closed",
                        peer.ip()
                    ),
                );
            }
        }
        let state = Arc::new(Conn {
            id,
            auth: Mutex::new(None),
            authenticated: AtomicBool::new(false),
            busy: AtomicBool::new(false),
            welcomed: AtomicBool::new(false),
            unauthenticated_requests: std::sync::atomic::AtomicU64::new(0),
            close,
        });
        let (inner2, acceptor) = (inner.clone(), acceptor.clone());
        inner.tracker.spawn(async move {
            let _leave = LeavePending {
                inner: &inner2,
                id: state.id,
            };
            let tls_deadline = tokio::time::Instant::now() + inner2.config.tls_handshake_timeout;
            // A connection that speaks (a TLS client hello) is evicted only after every
            // silent one.
            let spoke = tokio::select! {
                () = state.close.cancelled() => return,
                r = tokio::time::timeout_at(tls_deadline, tcp.readable()) => r,
            };
            match spoke {
                Ok(Ok(())) => inner2
                    .pending
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .progressed(state.id, Progress::Spoke, std::time::Instant::now()),
                Ok(Err(_)) => return,
                Err(_) => {
                    inner2
                        .counters
                        .pending_timeouts
                        .fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
            let handshake = tokio::time::timeout_at(tls_deadline, acceptor.accept(tcp));
            let tls = tokio::select! {
                () = state.close.cancelled() => return,
                r = handshake => match r {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "TLS handshake with a broker failed");
                        return;
                    }
                    Err(_) => {
                        inner2.counters.pending_timeouts.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                },
            };
            inner2
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .progressed(state.id, Progress::Tls, std::time::Instant::now());
            let (service_inner, service_state) = (inner2.clone(), state.clone());
            let service = hyper::service::service_fn(move |req| {
                let (inner, state) = (service_inner.clone(), service_state.clone());
                async move { Ok::<_, Infallible>(route(inner, state, req).await) }
            });
            let unauthenticated = async {
                tokio::time::sleep(inner2.config.auth_timeout).await;
                if state.authenticated.load(Ordering::Relaxed) {
                    std::future::pending::<()>().await;
                }
            };
            let unwelcomed = async {
                tokio::time::sleep(inner2.config.session_start_timeout).await;
                if state.welcomed.load(Ordering::Relaxed) {
                    std::future::pending::<()>().await;
                }
            };
            // Every stream the welcome allows, plus the session's own.
            // Windows: one stalled stream holds at most 256 KiB of the connection's
            // 16 MiB; 64 stalled at once hold all of it and stall the others (a
            // broker's streams are its own: it can stall only itself).
            let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .max_concurrent_streams(inner2.config.limits.max_streams.saturating_add(1))
                .initial_stream_window_size(256 << 10)
                .initial_connection_window_size(16 << 20)
                .serve_connection(TokioIo::new(tls), service);
            tokio::select! {
                () = inner2.cancel.cancelled() => {}
                r = conn => if let Err(e) = r {
                    tracing::debug!(error = %e, "broker connection ended");
                },
                () = unauthenticated => {
                    inner2.counters.pending_timeouts.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!("a connection sent no accepted credential in time: closed");
                }
                () = unwelcomed => {
                    tracing::debug!("a connection had no session welcomed in time: closed");
                }
                () = state.close.cancelled() => {}
            }
        });
    }
}

/// Whether bytes wait to be read on `tcp` now (one non-blocking peek).
fn has_bytes(tcp: &tokio::net::TcpStream) -> bool {
    let mut byte = [0u8; 1];
    let mut buf = tokio::io::ReadBuf::new(&mut byte);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    matches!(tcp.poll_peek(&mut cx, &mut buf), std::task::Poll::Ready(Ok(n)) if n > 0)
}

/// The source a connection counts against in the unauthenticated pool: its IPv4
/// address, or its IPv6 /64 (one host's usual allocation).
fn source_key(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.into(),
            None => {
                let mut octets = v6.octets();
                if let Some(host) = octets.get_mut(8..) {
                    host.fill(0);
                }
                std::net::Ipv6Addr::from(octets).into()
            }
        },
        v4 => v4,
    }
}

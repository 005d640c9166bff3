//! What a bus client (a broker or a source) does to start a session: TCP, TLS and
//! HTTP/2 to the bus under their deadlines, then the session's request, whose body
//! carries the client's control frames and whose response carries the router's.

use std::sync::Arc;

use hyper::Request;
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::tunnel::config::Deadlines;
use crate::tunnel::error::TunnelError;
use crate::tunnel::io::{BODY_CHANNEL, BrokerBody, ChannelBody, Secret};
use crate::tunnel::{BrokerSession, ControlDecoder, DrainReason};

/// A session's transport, once the bus answered its request.
pub(crate) struct BusSession {
    /// Opens the session's data streams on the same connection.
    pub(crate) sender: SendRequest<BrokerBody>,
    /// The bus's `host:port`, for the data streams' URLs.
    pub(crate) authority: String,
    /// Cancelled when the connection ends.
    pub(crate) conn_done: CancellationToken,
    /// The client's control frames, encoded.
    pub(crate) ctrl_tx: mpsc::Sender<Result<bytes::Bytes, std::io::Error>>,
    /// The router's control frames.
    pub(crate) body: Incoming,
}

/// Dials `bus_url` with `tls`, presents `token`, and opens the session stream; the
/// connection stops when `hard` is cancelled.
pub(crate) async fn open_session(
    bus_url: &str,
    tls: &Arc<rustls::ClientConfig>,
    token: &Secret,
    deadlines: &Deadlines,
    hard: &CancellationToken,
) -> Result<BusSession, TunnelError> {
    let (host, port, authority) = crate::tunnel::config::parse_bus_url(bus_url)?;
    let tcp = tokio::time::timeout(
        deadlines.bus_connect,
        TcpStream::connect((host.as_str(), port)),
    )
    .await
    .map_err(|_| TunnelError::Timeout("connecting to the bus"))??;
    let _ = tcp.set_nodelay(true);
    let name =
        rustls::pki_types::ServerName::try_from(host.clone()).map_err(|e| TunnelError::Config {
            field: "bus_url",
            reason: e.to_string(),
        })?;
    let tls = tokio::time::timeout(
        deadlines.bus_connect,
        tokio_rustls::TlsConnector::from(tls.clone()).connect(name, tcp),
    )
    .await
    .map_err(|_| TunnelError::Timeout("the TLS handshake with the bus"))??;
    // Router → publisher is bounded by a 64 KiB stream window (DESIGN §7.2).
    // Publisher → router: what h2 holds per stream is capped (see
    // PER_STREAM_UNCHARGED_BYTES), however large the windows the router grants.
    let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(64 << 10)
        .initial_connection_window_size(16 << 20)
        .max_send_buf_size(crate::tunnel::H2_SEND_BUFFER_BYTES)
        .handshake(TokioIo::new(tls))
        .await?;
    let conn_done = CancellationToken::new();
    let conn_guard = conn_done.clone();
    let cut = hard.clone();
    tokio::spawn(async move {
        tokio::select! {
            r = conn => if let Err(e) = r {
                tracing::debug!(error = %e, "bus connection ended");
            },
            () = cut.cancelled() => {}
        }
        conn_guard.cancel();
    });
    let (ctrl_tx, ctrl_rx) = mpsc::channel(BODY_CHANNEL);
    let request = Request::post(format!("https://{authority}/bus/v1/session"))
        .header(hyper::header::AUTHORIZATION, token.header_value())
        .body(BrokerBody::Control(ChannelBody::new(ctrl_rx)))
        .map_err(|e| TunnelError::Config {
            field: "bus_url",
            reason: e.to_string(),
        })?;
    let mut sender_for_session = sender.clone();
    let response =
        tokio::time::timeout(deadlines.response, sender_for_session.send_request(request))
            .await
            .map_err(|_| TunnelError::Timeout("the bus's answer"))??;
    match response.status().as_u16() {
        200 => {}
        401 => return Err(TunnelError::Unauthorized),
        other => return Err(TunnelError::Status(other)),
    }
    Ok(BusSession {
        sender,
        authority,
        conn_done,
        ctrl_tx,
        body: response.into_body(),
    })
}

/// How a client's session ended, for the reconnect delay.
pub(crate) enum Outcome {
    Failed,
    Drained(DrainReason),
    Stopped,
}

/// Where a client's session stands on its way out: asked to drain by the router
/// (why, and until when), or stopping (until when).
#[derive(Default)]
pub(crate) struct Ending {
    pub(crate) drain: Option<(DrainReason, tokio::time::Instant)>,
    pub(crate) stopping: Option<tokio::time::Instant>,
}

impl Ending {
    /// How the ended session ended.
    pub(crate) fn outcome(&self) -> Outcome {
        match (self.drain, self.stopping) {
            (_, Some(_)) => Outcome::Stopped,
            (Some((reason, _)), _) => Outcome::Drained(reason),
            _ => Outcome::Failed,
        }
    }

    /// When open streams must be done by, if draining or stopping.
    pub(crate) fn deadline(&self) -> Option<tokio::time::Instant> {
        self.stopping.or(self.drain.map(|(_, d)| d))
    }

    /// When the session loop must wake next: `session`'s timers or the deadline.
    pub(crate) fn timer(&self, session: &BrokerSession) -> Option<tokio::time::Instant> {
        [
            session.poll_timeout().map(tokio::time::Instant::from_std),
            self.deadline(),
        ]
        .into_iter()
        .flatten()
        .min()
    }
}

/// Hands what the router sent (`chunk`, from its response body) to `session`: every
/// complete frame; an undecodable one aborts the session, the body's end closes it.
pub(crate) fn feed(
    session: &mut BrokerSession,
    decoder: &mut ControlDecoder,
    chunk: Option<Result<bytes::Bytes, hyper::Error>>,
) {
    let Some(Ok(bytes)) = chunk else {
        return session.close();
    };
    let now = std::time::Instant::now();
    let mut input = &bytes[..];
    loop {
        match decoder.decode(&mut input) {
            Ok(Some(frame)) => session.handle(frame, now),
            Ok(None) => break,
            Err(e) => {
                tracing::warn!(error = %e, "undecodable control frame from the bus");
                session.abort(crate::tunnel::SessionEnd::Protocol(
                    "undecodable control frame",
                ));
                break;
            }
        }
    }
}

//! `DealerSocket`: the client side of a request to a ZMQ ROUTER, over any byte stream.

use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use super::retain::Retention;
use super::sub::{connect_tcp, dial_filtered};
use super::{Config, Error, Message, PeerInfo, SessionStats, SocketType, SubBuffers, SubSocket};

/// A ZMQ DEALER connected to one peer (a ROUTER, a DEALER or a REP).
///
/// It sends whole messages and receives every message the peer sends, unfiltered. A
/// ROUTER sees our messages prefixed with the identity it gave this connection and
/// routes its answers back by it; to talk to a REP-style ROUTER service, start each
/// request with an empty delimiter frame, as an engine's replay endpoint expects.
///
/// It is a [`SubSocket`] without subscriptions and with [`send`](Self::send): the same
/// limits on what the peer may send ([`Config::max_frame_size`],
/// [`Config::max_message_size`], parts), the same read buffers and retention account
/// (see [Memory](SubSocket#memory)), heartbeats and write-stall timeout. There is no
/// reconnect and no queue of our own: [`send`](Self::send) returns once the message
/// is written to the stream, and when a call fails the socket is dead.
///
/// ```
/// use eventplane::zmtp::{Config, DealerSocket, Message};
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), eventplane::zmtp::Error> {
/// // Two dealers back to back over an in-memory pipe (in production: a TCP
/// // connection to a ROUTER, or a tunnel stream).
/// let (a, b) = tokio::io::duplex(64 << 10);
/// let (left, right) = tokio::join!(
///     DealerSocket::handshake(a, Config::default()),
///     DealerSocket::handshake(b, Config::default()),
/// );
/// let (mut left, mut right) = (left?, right?);
/// left.send(&Message::from_parts(["", "from 7"])).await?;
/// let request = right.recv().await?;
/// assert_eq!(request.get(1), Some(&b"from 7"[..]));
/// right.send(&Message::from_parts(["", "reply"])).await?;
/// assert_eq!(left.recv().await?.get(1), Some(&b"reply"[..]));
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct DealerSocket<S = TcpStream> {
    inner: SubSocket<S>,
}

impl DealerSocket<TcpStream> {
    /// Connects to `tcp://host:port` (within `connect_timeout`) and performs the
    /// handshake (within `handshake_timeout`).
    pub async fn connect(endpoint: &str, config: Config) -> Result<Self, Error> {
        let stream = connect_tcp(endpoint, &config).await?;
        Self::handshake(stream, config).await
    }

    /// [`connect`](Self::connect), dialling only the resolved addresses `filter`
    /// accepts ([`Error::Refused`] when it accepts none), as
    /// [`SubSocket::connect_filtered`] does.
    pub async fn connect_filtered(
        endpoint: &str,
        config: Config,
        filter: &crate::net::AddrFilter,
    ) -> Result<Self, Error> {
        let stream = dial_filtered(endpoint, &config, filter).await?;
        Self::handshake(stream, config).await
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send> DealerSocket<S> {
    /// Performs the handshake as a DEALER over `stream`.
    pub async fn handshake(stream: S, config: Config) -> Result<Self, Error> {
        let retention = Arc::new(Retention::new(config.max_retained_bytes));
        let inner =
            SubSocket::handshake_as(SocketType::Dealer, stream, config, retention, false).await?;
        Ok(DealerSocket { inner })
    }

    /// Performs the handshake as one connection of a ROUTER over `stream` (the server
    /// side of a DEALER's requests): it receives what the peer sends and answers on
    /// the same connection.
    pub async fn accept_as_router(stream: S, config: Config) -> Result<Self, Error> {
        let retention = Arc::new(Retention::new(config.max_retained_bytes));
        let inner =
            SubSocket::handshake_as(SocketType::Router, stream, config, retention, false).await?;
        Ok(DealerSocket { inner })
    }

    /// Sends `msg` and waits until it is written to the stream. Cancel-safe in the
    /// sense that the message is either queued whole or not at all; a cancelled send
    /// may leave it queued, written by the next call.
    pub async fn send(&mut self, msg: &Message) -> Result<(), Error> {
        self.inner.send_message(msg).await
    }

    /// Receives the next message. Cancel-safe, as [`SubSocket::recv`] is.
    pub async fn recv(&mut self) -> Result<Message, Error> {
        self.inner.recv().await
    }

    /// Poll form of [`recv`](Self::recv).
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Message, Error>> {
        self.inner.poll_recv(cx)
    }

    /// What the peer told us in its greeting and READY.
    pub fn peer(&self) -> Option<&PeerInfo> {
        self.inner.peer()
    }

    /// Counters of this connection.
    pub fn stats(&self) -> SessionStats {
        self.inner.stats()
    }

    /// The memory this connection holds.
    pub fn buffers(&self) -> SubBuffers {
        self.inner.buffers()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;
    use crate::zmtp::PubSocket;

    #[tokio::test]
    async fn a_dealer_refuses_a_publisher() {
        let publisher = PubSocket::new(Config::default());
        let (a, b) = tokio::io::duplex(64 << 10);
        publisher.accept_stream(a, "in-memory");
        let err = DealerSocket::handshake(b, Config::default())
            .await
            .unwrap_err();
        assert!(err.to_string().contains("incompatible"), "{err}");
    }

    #[tokio::test]
    async fn a_message_over_the_frame_limit_fails_the_dealer() {
        let small = Config::builder().max_frame_size(1024).build().unwrap();
        let (a, b) = tokio::io::duplex(64 << 10);
        let (left, right) = tokio::join!(
            DealerSocket::handshake(a, Config::default()),
            DealerSocket::handshake(b, small),
        );
        let (mut left, mut right) = (left.unwrap(), right.unwrap());
        left.send(&Message::from_parts([vec![0u8; 4096]]))
            .await
            .unwrap();
        assert!(right.recv().await.is_err());
    }
}

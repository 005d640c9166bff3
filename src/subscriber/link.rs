//! The byte stream under one publisher connection: TCP, or (feature `tunnel`) a
//! stream through an event broker. ZMTP runs the same over both.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// One publisher connection's transport.
#[derive(Debug)]
pub(crate) enum Link {
    Tcp(TcpStream),
    #[cfg(feature = "tunnel")]
    Tunnel(crate::tunnel::TunnelStream),
}

impl AsyncRead for Link {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Link::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            #[cfg(feature = "tunnel")]
            Link::Tunnel(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Link {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Link::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            #[cfg(feature = "tunnel")]
            Link::Tunnel(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Link::Tcp(s) => Pin::new(s).poll_flush(cx),
            #[cfg(feature = "tunnel")]
            Link::Tunnel(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Link::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            #[cfg(feature = "tunnel")]
            Link::Tunnel(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

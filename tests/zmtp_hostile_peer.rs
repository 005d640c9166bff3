//! Hostile publishers on real TCP: each violation gives the right typed error, quickly,
//! without a panic and without allocating what the peer claims.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

mod support;

use std::time::Duration;

use bytes::{BufMut, BytesMut};
use eventplane::zmtp::{Config, Error, ProtocolError, SubSocket, TimeoutKind};
use support::{greeting, within};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

fn handshake_then(bytes: &[u8]) -> Vec<u8> {
    let mut out = greeting(3, 1, b"NULL");
    out.extend_from_slice(b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB");
    out.extend_from_slice(bytes);
    out
}

/// A one-shot TCP "publisher" that writes `script`, then keeps the connection open
/// (reading and discarding) until the client goes away.
async fn hostile_server(script: Vec<u8>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let _ = stream.write_all(&script).await;
        let mut sink = [0u8; 4096];
        while let Ok(n) = stream.read(&mut sink).await {
            if n == 0 {
                break;
            }
        }
    });
    endpoint
}

fn config() -> Config {
    Config::builder()
        .handshake_timeout(Duration::from_millis(300))
        .build()
        .unwrap()
}

/// Connects, subscribes and receives until the first error.
async fn first_error(script: Vec<u8>, config: Config) -> Error {
    let endpoint = hostile_server(script).await;
    let result: Result<(), Error> = within(async {
        let mut sub = SubSocket::connect(&endpoint, config).await?;
        sub.subscribe("").await?;
        loop {
            sub.recv().await?;
        }
    })
    .await;
    result.unwrap_err()
}

fn long_header(size: u64) -> Vec<u8> {
    let mut b = BytesMut::new();
    b.put_u8(0x02);
    b.put_u64(size);
    b.to_vec()
}

// Forged lengths and what they make us allocate: tests/forged_lengths.rs (it counts
// allocations, which resident memory cannot show).

#[tokio::test]
async fn frame_over_configured_limit() {
    let config = Config::builder()
        .max_frame_size(1 << 20)
        .max_message_size(1 << 21)
        .build()
        .unwrap();
    let err = first_error(handshake_then(&long_header((1 << 20) + 1)), config).await;
    assert!(
        matches!(err.protocol(), Some(ProtocolError::FrameTooLarge { max, .. }) if *max == 1 << 20),
        "{err:?}"
    );
}

#[tokio::test]
async fn message_over_configured_limit() {
    let config = Config::builder()
        .max_frame_size(1000)
        .max_message_size(1500)
        .build()
        .unwrap();
    let mut body = Vec::new();
    for _ in 0..2 {
        body.extend_from_slice(&[0x03, 0, 0, 0, 0, 0, 0, 0x03, 0xe8]);
        body.extend_from_slice(&[0u8; 1000]);
    }
    let err = first_error(handshake_then(&body), config).await;
    assert!(
        matches!(err.protocol(), Some(ProtocolError::MessageTooLarge { .. })),
        "{err:?}"
    );
}

#[tokio::test]
async fn sixty_four_parts_pass_and_sixty_five_do_not() {
    let mut body = Vec::new();
    for parts in [64, 65] {
        for _ in 1..parts {
            body.extend_from_slice(b"\x01\x01x");
        }
        body.extend_from_slice(b"\x00\x01x");
    }
    let endpoint = hostile_server(handshake_then(&body)).await;
    let mut sub = within(SubSocket::connect(&endpoint, config()))
        .await
        .unwrap();
    sub.subscribe("").await.unwrap();
    assert_eq!(within(sub.recv()).await.unwrap().len(), 64);
    let err = within(sub.recv()).await.unwrap_err();
    assert_eq!(
        err.protocol(),
        Some(&ProtocolError::TooManyParts { max: 64 }),
        "{err:?}"
    );
}

#[tokio::test]
async fn bad_greetings() {
    let mut bad_sig = greeting(3, 1, b"NULL");
    bad_sig[0] = 0x7f;
    let err = first_error(bad_sig, config()).await;
    assert_eq!(err.protocol(), Some(&ProtocolError::BadSignature));

    let err = first_error(greeting(2, 0, b"NULL"), config()).await;
    assert!(
        matches!(
            err.protocol(),
            Some(ProtocolError::UnsupportedVersion { major: 2, .. })
        ),
        "{err:?}"
    );

    let err = first_error(greeting(3, 1, b"PLAIN"), config()).await;
    assert!(
        matches!(err.protocol(), Some(ProtocolError::UnsupportedMechanism { mechanism }) if mechanism == "PLAIN"),
        "{err:?}"
    );
}

#[tokio::test]
async fn stall_mid_greeting_times_out() {
    let err = first_error(greeting(3, 1, b"NULL")[..11].to_vec(), config()).await;
    assert!(
        matches!(err, Error::Timeout(TimeoutKind::Handshake)),
        "{err:?}"
    );
}

#[tokio::test]
async fn more_flag_on_command() {
    let err = first_error(handshake_then(b"\x05\x05\x04PING"), config()).await;
    assert_eq!(err.protocol(), Some(&ProtocolError::CommandWithMore));
}

#[tokio::test]
async fn error_during_handshake() {
    let mut script = greeting(3, 1, b"NULL");
    script.extend_from_slice(b"\x04\x0e\x05ERROR\x07go away");
    let err = first_error(script, config()).await;
    assert!(
        matches!(&err, Error::PeerError { reason } if reason == "go away"),
        "{err:?}"
    );
    assert!(err.is_protocol());
}

#[tokio::test]
async fn unknown_command_after_handshake_is_ignored() {
    let endpoint = hostile_server(handshake_then(b"\x04\x09\x05HELLOabc\x00\x02hi")).await;
    let mut sub = within(SubSocket::connect(&endpoint, config()))
        .await
        .unwrap();
    sub.subscribe("").await.unwrap();
    let msg = within(sub.recv()).await.unwrap();
    assert_eq!(msg.get(0).unwrap(), b"hi");
    assert_eq!(sub.stats().unknown_commands, 1);
}

#[tokio::test]
async fn peer_closing_gives_closed_after_delivering_buffered_messages() {
    let endpoint = hostile_server(handshake_then(b"\x00\x02hi")).await;
    // The server keeps the socket open; use a server that closes instead.
    drop(endpoint);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut g = [0u8; 64];
        stream.read_exact(&mut g).await.unwrap();
        stream
            .write_all(&handshake_then(b"\x00\x02hi\x00\x02ho"))
            .await
            .unwrap();
    });
    let mut sub = within(SubSocket::connect(&endpoint, config()))
        .await
        .unwrap();
    sub.subscribe("").await.ok();
    let mut got = Vec::new();
    let err = within(async {
        loop {
            match sub.recv().await {
                Ok(m) => got.push(m.part(0).unwrap()),
                Err(e) => break e,
            }
        }
    })
    .await;
    assert_eq!(got, vec!["hi", "ho"]);
    assert!(err.is_io(), "{err:?}");
}

#[tokio::test]
async fn connect_refused_is_io() {
    let (_held, port) = support::refusing_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let err = within(SubSocket::connect(&endpoint, config()))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Io(_)), "{err:?}");
    let err = SubSocket::connect("udp://x:1", config()).await.unwrap_err();
    assert!(matches!(err, Error::InvalidEndpoint { .. }));
}

//! Interop with the zeromq crate (ZMTP 3.0), both directions. zeromq-rs closes the
//! connection on any command but READY, so our SUB must subscribe with messages and
//! must never PING it.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, missing_docs)]

#[path = "../../tests/support/mod.rs"]
mod support;

use std::time::Duration;

use bytes::Bytes;
use eventplane::zmtp::{Config, Message, PubSocket, SubSocket};
use support::within;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

fn zmq_msg(parts: Vec<Bytes>) -> ZmqMessage {
    ZmqMessage::try_from(parts).unwrap()
}

#[tokio::test]
async fn zeromq_pub_to_our_sub() {
    let mut publisher = zeromq::PubSocket::new();
    let endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap();
    let endpoint = endpoint.to_string();
    // Heartbeats configured on our side: they must not be sent to a 3.0 peer.
    let config = Config::builder()
        .heartbeat_interval(Some(Duration::from_millis(20)))
        .build()
        .unwrap();
    let mut sub = within(SubSocket::connect(&endpoint, config)).await.unwrap();
    assert_eq!(sub.peer().unwrap().minor, 0);
    sub.subscribe("kv").await.unwrap();

    // zeromq-rs learns about the subscription asynchronously: publish warmups until
    // one arrives.
    let (warm_tx, mut warm_rx) = tokio::sync::oneshot::channel();
    let receiver = tokio::spawn(async move {
        let mut data = Vec::new();
        let mut warm_tx = Some(warm_tx);
        loop {
            let m = sub.recv().await.unwrap();
            match m.get(1).unwrap() {
                b"warmup" => {
                    if let Some(tx) = warm_tx.take() {
                        let _ = tx.send(());
                    }
                }
                b"end" => break,
                _ => data.push(m),
            }
        }
        (sub, data)
    });
    let mut ticker = tokio::time::interval(Duration::from_millis(10));
    // Warmups until one arrived, and for at least 300 ms (many heartbeat intervals
    // of ours, which must not PING a 3.0 peer).
    let mut ticks = 0;
    let mut warm = false;
    while !warm || ticks < 30 {
        ticks += 1;
        assert!(ticks < 3000, "no warmup arrived in 30 s");
        ticker.tick().await;
        warm |= warm_rx.try_recv().is_ok();
        publisher
            .send(zmq_msg(vec!["kv".into(), "warmup".into()]))
            .await
            .unwrap();
        publisher
            .send(zmq_msg(vec!["other".into(), "warmup".into()]))
            .await
            .unwrap();
    }
    for seq in 0u64..200 {
        publisher
            .send(zmq_msg(vec![
                "kv-events".into(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::from(vec![seq as u8; 100]),
            ]))
            .await
            .unwrap();
        publisher
            .send(zmq_msg(vec!["other".into(), "x".into()]))
            .await
            .unwrap();
    }
    publisher
        .send(zmq_msg(vec!["kv".into(), "end".into()]))
        .await
        .unwrap();
    let (sub, data) = within(receiver).await.unwrap();
    assert_eq!(data.len(), 200);
    for (i, m) in data.iter().enumerate() {
        assert_eq!(m.get(1).unwrap(), &(i as u64).to_be_bytes());
        assert_eq!(m.get(2).unwrap().len(), 100);
    }
    let stats = sub.stats();
    assert_eq!(stats.pings_sent, 0);
    // zeromq-rs filtered "other" on its side: none of it crossed the wire.
    assert_eq!(stats.filtered, 0, "{stats:?}");
}

#[tokio::test]
async fn our_pub_to_zeromq_sub() {
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let endpoint = publisher.local_endpoint().unwrap().to_owned();
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&endpoint).await.unwrap();
    sub.subscribe("kv").await.unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    for seq in 0u64..500 {
        for topic in ["kv-events", "other"] {
            publisher.send(Message::from_parts([
                Bytes::from(topic),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::from(vec![7u8; 100]),
            ]));
        }
    }
    for seq in 0u64..500 {
        let m = within(sub.recv()).await.unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(&m.get(0).unwrap()[..], b"kv-events");
        assert_eq!(&m.get(1).unwrap()[..], &seq.to_be_bytes());
    }
    let stats = publisher.stats();
    assert_eq!(stats.queued, 500);
    assert_eq!(stats.dropped, 0);
    assert_eq!(stats.subscribed, 1);
}

//! `event_broker` with Kubernetes discovery (features `tunnel` and `kube`): its view
//! comes from Dynamo's `DynamoWorkerMetadata` resources on the API test server.
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use eventplane::tunnel::{EventBus, EventBusConfig, server_tls};
use eventplane::zmtp::{Config, Message, PubSocket, SubSocket};
use tokio::process::Command;

use crate::event_broker::{body, clients, config, fixture};
use crate::support::{example, within};

/// A broker whose discovery is Kubernetes (`[discovery] kubernetes`, feature `kube`)
/// relays a publisher found only through its `DynamoWorkerMetadata` resource (its pod
/// ready in an EndpointSlice), and refuses one the resource does not advertise.
#[tokio::test]
async fn a_broker_in_kube_mode_relays_a_publisher_found_only_through_its_resource() {
    use serde_json::json;
    let api = crate::kube_api::KubeApi::start().await;
    let tls = server_tls(fixture("bus.pem"), fixture("bus.key")).unwrap();
    let bus = EventBus::bind("127.0.0.1:0", tls, clients(), EventBusConfig::default())
        .await
        .unwrap();
    let publisher = Arc::new(
        PubSocket::bind("tcp://127.0.0.1:0", Config::default())
            .await
            .unwrap(),
    );
    let endpoint = publisher.local_endpoint().unwrap().to_owned();
    let unadvertised = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let key = "namespace/prod/component/backend/endpoint/generate/topic/kv-events/2a";
    api.put(
        "dynamoworkermetadatas",
        "dyn",
        json!({"metadata": {"name": "worker-0", "ownerReferences": [{"apiVersion": "v1",
                "kind": "Pod", "name": "worker-0", "uid": "u0", "controller": true,
                "blockOwnerDeletion": false}]},
               "spec": {"data": {"endpoints": {}, "model_cards": {}, "event_sources": null,
                 "event_channels": {(key): {"type": "EventChannel",
                   "scope": {"kind": "endpoint", "endpoint": {"namespace": "prod",
                     "component": "backend", "name": "generate"}},
                   "topic": "kv-events", "instance_id": 42,
                   "transport": {"kind": "Zmq", "config": {"endpoint": endpoint}},
                   "namespace": "prod", "component": "backend"}}}}}),
    );
    api.ready_slice("dyn", "worker-0-slice", &[("worker-0", "u0", true)]);
    let dir = config("kube", "").parent().unwrap().to_owned();
    let kubeconfig = api.kubeconfig(&dir, "dyn");
    let text = body(
        &format!("https://localhost:{}", bus.local_addr().port()),
        &dir,
        &["tcp://127.0.0.1:1"],
        "",
    )
    .replace(
        "static_endpoints = [\"tcp://127.0.0.1:1\"]",
        "kubernetes = { namespaces = [\"dyn\"] }",
    );
    let path = config("kube", &text);
    let check = Command::new(example("event-broker"))
        .arg("--config")
        .arg(&path)
        .arg("--check-config")
        .env("KUBECONFIG", &kubeconfig)
        .output();
    let check = within(check).await.unwrap();
    assert_eq!(check.status.code(), Some(0), "{check:?}");
    let broker = Command::new(example("event-broker"))
        .arg("--config")
        .arg(&path)
        .env("KUBECONFIG", &kubeconfig)
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    within(async {
        while bus.brokers_for("prod").is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let stream = within(bus.open_stream("prod", 42, &endpoint))
        .await
        .unwrap();
    let mut sub = within(SubSocket::handshake(stream, Config::default()))
        .await
        .unwrap();
    sub.subscribe("t").await.unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    let message = Message::from_parts([Bytes::from_static(b"t"), Bytes::from_static(b"k")]);
    publisher.send(message.clone());
    assert_eq!(within(sub.recv()).await.unwrap(), message);
    // A publisher no resource advertises is not in the broker's view: refused.
    let other = unadvertised.local_endpoint().unwrap().to_owned();
    assert!(within(bus.open_stream("prod", 43, &other)).await.is_err());
    drop(broker);
    bus.shutdown().await;
}

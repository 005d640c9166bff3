//! `event_broker` with Kubernetes discovery (features `tunnel` and `kube`): its view
//! comes from Dynamo's `DynamoWorkerMetadata` resources on the API test server.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::BTreeSet;
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
    put_worker(&api, &endpoint, "kv-events");
    let dir = config("kube", "").parent().unwrap().to_owned();
    let kubeconfig = api.kubeconfig(&dir, "dyn");
    let text = kube_mode(&bus, &dir);
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
    relays(&bus, &publisher, &endpoint).await;
    // A publisher no resource advertises is not in the broker's view: refused.
    let other = unadvertised.local_endpoint().unwrap().to_owned();
    assert!(within(bus.open_stream("prod", 43, &other)).await.is_err());
    drop(broker);
    bus.shutdown().await;
    // It spoke HTTPS (the server serves nothing else) with the kubeconfig's token.
    let log = api.log();
    assert!(log.iter().all(|l| l.authorized), "{log:#?}");
    // Everything the broker asked the API server, against the Role the manifests
    // give it.
    let seen = requests(&log);
    assert!(seen.iter().any(|(_, _, v)| v == "watch"), "{seen:?}");
    the_role_grants("event-broker", &["get", "list", "watch"], &seen);
}

/// Where a pod's service account is mounted (kube-rs reads `token`, `ca.crt` and
/// `namespace` there when it finds its API server in-cluster).
const SERVICE_ACCOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// A broker in kube mode with no kubeconfig finds its API server as in a pod:
/// `KUBERNETES_SERVICE_HOST` / `_PORT`, and the service account's token and CA
/// mounted at [`SERVICE_ACCOUNT`] (bind-mounted in a mount namespace of its own, over
/// a tmpfs on /var/run: root and `unshare`, as CI has; skipped elsewhere). The server
/// answers 401 without the token, so the relayed stream proves the token was read,
/// and HTTPS with the test CA proves `ca.crt` was.
/// `EVENTPLANE_SERVICES_DIR` points it at an installed broker (.ci/run's .deb).
#[tokio::test]
async fn a_broker_in_kube_mode_finds_its_api_server_in_cluster() {
    let can_unshare = std::process::Command::new("unshare")
        .args(["--mount", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !can_unshare {
        assert!(
            std::env::var_os("EVENTPLANE_REQUIRE_ROOT_TESTS").is_none(),
            "EVENTPLANE_REQUIRE_ROOT_TESTS is set (.ci/run sets it): this test must run \
             (unshare --mount failed)"
        );
        eprintln!("SKIPPED: an in-cluster service account needs root (unshare --mount)");
        return;
    }
    let api = crate::kube_api::KubeApi::start().await;
    let tls = server_tls(fixture("bus.pem"), fixture("bus.key")).unwrap();
    let bus = EventBus::bind("127.0.0.1:0", tls, clients(), EventBusConfig::default())
        .await
        .unwrap();
    let publisher = PubSocket::bind("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let endpoint = publisher.local_endpoint().unwrap().to_owned();
    put_worker(&api, &endpoint, "kv-events");
    let dir = config("kube-in-cluster", "").parent().unwrap().to_owned();
    let account = api.service_account(&dir.join("serviceaccount"), "dyn");
    let text = kube_mode(&bus, &dir);
    let path = config("kube-in-cluster", &text);
    let mut command = Command::new("unshare");
    command.args(["--mount", "--propagation", "private", "sh", "-c"]);
    command.arg(format!(
        "mount -t tmpfs tmpfs /var/run && mkdir -p {SERVICE_ACCOUNT} && \
         mount --bind {} {SERVICE_ACCOUNT} && exec {} \"$@\"",
        account.display(),
        example("event-broker").display()
    ));
    command.arg("event-broker").arg("--config").arg(&path);
    // No kubeconfig anywhere: in-cluster it is.
    command.env_remove("KUBECONFIG").env("HOME", &dir);
    for (key, value) in api.in_cluster_env() {
        command.env(key, value);
    }
    let broker = command
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // Its view came from the server: the advertised publisher is relayed.
    relays(&bus, &publisher, &endpoint).await;
    drop(broker);
    bus.shutdown().await;
    let log = api.log();
    assert!(!log.is_empty());
    assert!(log.iter().all(|l| l.authorized), "{log:#?}");
}

/// Dynamo's resource for pod `worker-0` in namespace `dyn`, advertising a publisher of
/// `topic` at `endpoint` (instance 42 of `prod/backend`), its pod ready.
pub(crate) fn put_worker(api: &crate::kube_api::KubeApi, endpoint: &str, topic: &str) {
    use serde_json::json;
    let key = format!("namespace/prod/component/backend/endpoint/generate/topic/{topic}/2a");
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
                   "topic": topic, "instance_id": 42,
                   "transport": {"kind": "Zmq", "config": {"endpoint": endpoint}},
                   "namespace": "prod", "component": "backend"}}}}}),
    );
    api.ready_slice("dyn", "worker-0-slice", &[("worker-0", "u0", true)]);
}

/// (API group, resource, verb) of each request the API test server logged.
fn requests(log: &[crate::kube_api::Logged]) -> BTreeSet<(String, String, String)> {
    log.iter()
        .map(|r| {
            // /apis/{group}/{version}/namespaces/{ns}/{plural}[/{name}], or /api/v1/….
            let segs: Vec<&str> = r.path.trim_start_matches('/').split('/').collect();
            let (group, rest) = match segs[0] {
                "api" => ("", &segs[2..]),
                _ => (segs[1], &segs[3..]),
            };
            assert_eq!(rest[0], "namespaces", "a cluster-wide request: {}", r.path);
            let named = rest.len() > 3;
            let verb = match (r.method.as_str(), named) {
                ("GET", true) => "get",
                ("GET", false)
                    if r.query
                        .get("watch")
                        .is_some_and(|w| w == "true" || w == "1") =>
                {
                    "watch"
                }
                ("GET", false) => "list",
                ("PATCH", true) => "patch",
                ("PUT", true) => "update",
                ("POST", false) => "create",
                ("DELETE", true) => "delete",
                (m, _) => panic!("an unexpected {m}: {}", r.path),
            };
            (group.to_owned(), rest[2].to_owned(), verb.to_owned())
        })
        .collect()
}

/// The Role `role` of `deploy/kubernetes/rbac.yaml` grants every request in `seen`,
/// only the verbs in `allowed`, and no resource the process did not use.
fn the_role_grants_exactly(
    role: &str,
    allowed: &[&str],
    seen: &BTreeSet<(String, String, String)>,
) {
    let granted = the_role_grants(role, allowed, seen);
    let resources = |set: &BTreeSet<(String, String, String)>| -> BTreeSet<(String, String)> {
        set.iter().map(|(g, r, _)| (g.clone(), r.clone())).collect()
    };
    assert_eq!(
        resources(&granted),
        resources(seen),
        "the Role's resources are not the ones the process uses"
    );
}

/// The Role `role` of `deploy/kubernetes/rbac.yaml` grants every request in `seen`
/// and only the verbs in `allowed`; what it grants.
fn the_role_grants(
    role: &str,
    allowed: &[&str],
    seen: &BTreeSet<(String, String, String)>,
) -> BTreeSet<(String, String, String)> {
    let manifests = manifests("rbac.yaml");
    let role = manifests
        .iter()
        .find(|m| m["kind"] == "Role" && m["metadata"]["name"] == role)
        .unwrap_or_else(|| panic!("rbac.yaml has no Role {role}"));
    let mut granted = BTreeSet::new();
    for rule in role["rules"].as_sequence().unwrap() {
        let list = |key: &str| -> Vec<String> {
            rule[key]
                .as_sequence()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap().to_owned())
                .collect()
        };
        for group in list("apiGroups") {
            for resource in list("resources") {
                for verb in list("verbs") {
                    assert!(
                        allowed.contains(&verb.as_str()),
                        "the Role grants {verb} on {resource}"
                    );
                    granted.insert((group.clone(), resource.clone(), verb));
                }
            }
        }
    }
    for request in seen {
        assert!(granted.contains(request), "not granted: {request:?}");
    }
    granted
}

/// What a broker in kube mode asks the API server for, following Dynamo workers in
/// `mode` ("pod": readiness from EndpointSlices; "container": from Pods), until it
/// watches both the resources and their readiness.
async fn broker_requests(mode: &str) -> BTreeSet<(String, String, String)> {
    let api = crate::kube_api::KubeApi::start().await;
    let tls = server_tls(fixture("bus.pem"), fixture("bus.key")).unwrap();
    let bus = EventBus::bind("127.0.0.1:0", tls, clients(), EventBusConfig::default())
        .await
        .unwrap();
    put_worker(&api, "tcp://127.0.0.1:1", "kv-events");
    let dir = config(&format!("kube-{mode}"), "")
        .parent()
        .unwrap()
        .to_owned();
    let kubeconfig = api.kubeconfig(&dir, "dyn");
    let text = kube_mode(&bus, &dir).replace(
        "kubernetes = { namespaces = [\"dyn\"] }",
        &format!("kubernetes = {{ namespaces = [\"dyn\"], mode = \"{mode}\" }}"),
    );
    let path = config(&format!("kube-{mode}"), &text);
    let mut broker = Command::new(example("event-broker"))
        .arg("--config")
        .arg(&path)
        .env("KUBECONFIG", &kubeconfig)
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let readiness = if mode == "container" {
        "pods"
    } else {
        "endpointslices"
    };
    within(async {
        loop {
            let seen = requests(&api.log());
            let watches = |r: &str| seen.contains(&(group(r), r.to_owned(), "watch".to_owned()));
            if watches("dynamoworkermetadatas") && watches(readiness) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    broker.kill().await.unwrap();
    bus.shutdown().await;
    requests(&api.log())
}

/// The API group of the resources a broker reads.
fn group(resource: &str) -> String {
    match resource {
        "dynamoworkermetadatas" => "nvidia.com",
        "endpointslices" => "discovery.k8s.io",
        _ => "",
    }
    .to_owned()
}

/// `deploy/kubernetes/rbac.yaml`'s `event-broker` Role grants exactly what a broker
/// reads following pod-mode workers (EndpointSlices) and container-mode ones (Pods,
/// `[discovery] kubernetes = { mode = "container" }`), read verbs only.
#[tokio::test]
async fn the_broker_role_grants_exactly_what_a_broker_reads_in_either_mode() {
    let pod = broker_requests("pod").await;
    let container = broker_requests("container").await;
    assert!(pod.iter().all(|(_, r, _)| r != "pods"), "{pod:?}");
    assert!(
        container.iter().all(|(_, r, _)| r != "endpointslices"),
        "{container:?}"
    );
    let seen: BTreeSet<_> = pod.union(&container).cloned().collect();
    the_role_grants_exactly("event-broker", &["get", "list", "watch"], &seen);
}

/// A worker (`kv-relay --kube`) in Dynamo's container mode registers, is stopped and
/// applies its maps empty (Dynamo's shutdown), deleting the stale resource of its
/// container's previous incarnation first: `deploy/kubernetes/rbac.yaml`'s
/// `eventplane-worker` Role grants exactly what it asked the API server for.
#[tokio::test]
async fn a_container_mode_worker_needs_exactly_the_worker_role() {
    let api = crate::kube_api::KubeApi::start().await;
    // What the container's previous incarnation in this pod left (another pod uid).
    api.put(
        "dynamoworkermetadatas",
        "dyn",
        serde_json::json!({"metadata": {"name": "worker-0-engine-0", "ownerReferences": [
            {"apiVersion": "v1", "kind": "Pod", "name": "worker-0", "uid": "u-old",
             "controller": true, "blockOwnerDeletion": false}]},
           "spec": {"data": {"endpoints": {}, "model_cards": {}, "event_channels": {},
               "event_sources": {}}}}),
    );
    let dir = std::env::temp_dir().join(format!("eventplane-worker-role-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = api.kubeconfig(&dir, "dyn");
    let engine = crate::support::Engine::bind("kv").await;
    let relay = Command::new(example("kv-relay"))
        .args([
            "--connect",
            &engine.endpoint(),
            "--topic",
            "kv",
            "--block-size",
            "4",
        ])
        .args([
            "--worker-id",
            "7",
            "--bind",
            "tcp://127.0.0.1:0",
            "--wire",
            "dynamo",
        ])
        .args(["--kube", "--namespace", "prod", "--component", "backend"])
        .env("KUBECONFIG", &kubeconfig)
        .env("POD_NAME", "worker-0")
        .env("POD_UID", "u-new")
        .env("POD_NAMESPACE", "dyn")
        .env("DYN_KUBE_DISCOVERY_MODE", "container")
        .env("CONTAINER_NAME", "engine-0")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // Registered: its resource is its own pod's now.
    within(async {
        while api
            .get("dynamoworkermetadatas", "dyn", "worker-0-engine-0")
            .is_none_or(|r| r["metadata"]["ownerReferences"][0]["uid"] != "u-new")
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    crate::support::terminate_for_stats(relay).await;
    let _ = std::fs::remove_dir_all(&dir);
    let seen = requests(&api.log());
    assert!(
        seen.iter()
            .any(|(_, r, v)| r == "dynamoworkermetadatas" && v == "delete"),
        "the stale resource was not deleted: {seen:?}"
    );
    the_role_grants_exactly(
        "eventplane-worker",
        &[
            "get", "list", "watch", "create", "patch", "update", "delete",
        ],
        &seen,
    );
}

/// The documents of `deploy/kubernetes/NAME`.
fn manifests(name: &str) -> Vec<serde_yaml::Value> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/kubernetes")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .collect()
}

/// The Deployment probes `/readyz` and `/livez` on the port the ConfigMap's
/// `broker.toml` gives `admin_listen` (and Prometheus scrapes it), runs as a non-root
/// user on a read-only root without capabilities, and its ServiceAccount is the one
/// the RoleBinding binds.
#[test]
fn the_deployment_probes_the_admin_endpoint_and_runs_unprivileged() {
    let config = &manifests("configmap.yaml")[0];
    let toml: toml::Table = config["data"]["broker.toml"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let admin = toml["admin_listen"].as_str().unwrap();
    let port: u64 = admin.rsplit(':').next().unwrap().parse().unwrap();
    let deployment = &manifests("deployment.yaml")[0];
    let pod = &deployment["spec"]["template"];
    let container = &pod["spec"]["containers"][0];
    assert_eq!(container["ports"][0]["containerPort"].as_u64(), Some(port));
    assert_eq!(container["ports"][0]["name"], "admin");
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/livez")] {
        assert_eq!(container[probe]["httpGet"]["path"], path);
        assert_eq!(container[probe]["httpGet"]["port"], "admin");
    }
    let annotations = &pod["metadata"]["annotations"];
    assert_eq!(
        annotations["prometheus.io/port"].as_str(),
        Some(&*port.to_string())
    );
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
    let security = &container["securityContext"];
    assert_eq!(security["readOnlyRootFilesystem"].as_bool(), Some(true));
    assert_eq!(security["allowPrivilegeEscalation"].as_bool(), Some(false));
    assert_eq!(security["capabilities"]["drop"][0], "ALL");
    let pod_security = &pod["spec"]["securityContext"];
    assert_eq!(pod_security["runAsNonRoot"].as_bool(), Some(true));
    // The Secret's files (mode 0440) are readable through the pod's group.
    assert_eq!(pod_security["fsGroup"], pod_security["runAsGroup"]);
    // One client id: the old pod goes before the new one comes.
    assert_eq!(deployment["spec"]["strategy"]["type"], "Recreate");
    let rbac = manifests("rbac.yaml");
    let binding = rbac.iter().find(|m| m["kind"] == "RoleBinding").unwrap();
    assert_eq!(
        binding["subjects"][0]["name"],
        pod["spec"]["serviceAccountName"]
    );
    assert_eq!(binding["roleRef"]["name"], "event-broker");
    assert_eq!(
        config["data"]["broker.toml"]
            .as_str()
            .map(|t| t.contains("kubernetes")),
        Some(true)
    );
}

/// Once a broker joined `bus` for "prod", a subscriber through it (publisher 42 at
/// `endpoint`) receives what `publisher` sends.
async fn relays(bus: &EventBus, publisher: &PubSocket, endpoint: &str) {
    within(async {
        while bus.brokers_for("prod").is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let stream = within(bus.open_stream("prod", 42, endpoint)).await.unwrap();
    let mut sub = within(SubSocket::handshake(stream, Config::default()))
        .await
        .unwrap();
    sub.subscribe("t").await.unwrap();
    within(publisher.wait_for_subscribers(1)).await;
    let message = Message::from_parts([Bytes::from_static(b"t"), Bytes::from_static(b"k")]);
    publisher.send(message.clone());
    assert_eq!(within(sub.recv()).await.unwrap(), message);
}

/// A broker configuration for `bus` in kube mode, following namespace "dyn".
fn kube_mode(bus: &EventBus, dir: &std::path::Path) -> String {
    body(
        &format!("https://localhost:{}", bus.local_addr().port()),
        dir,
        &["tcp://127.0.0.1:1"],
        "",
    )
    .replace(
        "static_endpoints = [\"tcp://127.0.0.1:1\"]",
        "kubernetes = { namespaces = [\"dyn\"] }",
    )
}

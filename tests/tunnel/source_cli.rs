//! Sources through the built binaries: `kv_relay --bus-url …` dials out to
//! `kv_router --bus-listen …` (a `[[source]]` credential, no etcd, no `--static`), and
//! the router indexes exactly what the engine said, in both wires; a relay killed is
//! forgotten and, restarted, counted as a reset; SIGTERM drains and exits 0.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::path::{Path, PathBuf};
use std::process::Stdio;

use eventplane::kv::RouterEvent;
use eventplane::tunnel::{Secret, TokenDigest};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStderr, ChildStdout, Command};

use crate::event_broker::{bus_address, fixture};
use crate::support::{self, Engine, WARM_RANK, example, within};

const SOURCE_TOKEN: &str = "source-token-of-gpu-box-1-0123456789";

/// A directory with the source's token and the router's `--bus-clients` file.
fn credentials(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("eventplane-source-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("token"), format!("{SOURCE_TOKEN}\n")).unwrap();
    let digest = TokenDigest::of(&Secret::new(SOURCE_TOKEN).unwrap()).to_hex();
    std::fs::write(
        dir.join("clients.toml"),
        format!(
            "[[source]]\nclient_id = \"gpu-box-1\"\ntoken_sha256 = \"{digest}\"\nnamespaces = [\"prod\"]\n"
        ),
    )
    .unwrap();
    dir
}

struct Router {
    child: Child,
    stdout: Lines<BufReader<ChildStdout>>,
    stderr: Lines<BufReader<ChildStderr>>,
    port: String,
}

/// `kv_router --bus-listen` with the source credential of `dir`, and `follow` (its
/// wire, or other discovery to follow beside the announced sources).
async fn router(dir: &Path, follow: &[&str]) -> Router {
    router_at(dir, follow, "127.0.0.1:0").await
}

/// [`router`], its bus listening on `listen`.
async fn router_at(dir: &Path, follow: &[&str], listen: &str) -> Router {
    let mut child = Command::new(example("kv-router"))
        .args(["--allow-cidr", "127.0.0.0/8"])
        .args(["--namespace", "prod", "--topic", "kv-events"])
        .args(follow)
        .args(["--bus-listen", listen])
        .arg("--bus-cert")
        .arg(fixture("bus.pem"))
        .arg("--bus-key")
        .arg(fixture("bus.key"))
        .arg("--bus-clients")
        .arg(dir.join("clients.toml"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = bus_address(&mut stderr).await;
    let port = addr.rsplit(':').next().unwrap().to_owned();
    Router {
        child,
        stdout,
        stderr,
        port,
    }
}

async fn relay(dir: &Path, engine: &Engine, wire: &str, port: &str) -> Child {
    relay_with(dir, engine, wire, port, &[]).await
}

/// [`relay`] with `extra` arguments.
async fn relay_with(dir: &Path, engine: &Engine, wire: &str, port: &str, extra: &[&str]) -> Child {
    Command::new(example("kv-relay"))
        .args(["--connect", &engine.endpoint(), "--topic", "kv"])
        .args(["--block-size", "4", "--worker-id", "11", "--wire", wire])
        .args(["--bus-url", &format!("https://localhost:{port}")])
        .arg("--bus-ca")
        .arg(fixture("ca.pem"))
        .arg("--bus-token-file")
        .arg(dir.join("token"))
        .args([
            "--client-id",
            "gpu-box-1",
            "--namespace",
            "prod",
            "--component",
            "backend",
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// Sends clears until one comes through to the router (PUB/SUB keeps nothing for a
/// subscriber not there yet).
async fn warm(engine: &mut Engine, router: &mut Router) {
    let lines = &mut router.stdout;
    engine
        .warm_up(async |wait| {
            tokio::time::timeout(wait, lines.next_line())
                .await
                .ok()
                .map(|l| l.unwrap().unwrap())
        })
        .await;
}

/// The fixtures through engine → relay → bus → router: exactly the router events the
/// sans-IO pipeline makes of them.
async fn fixtures_arrive_exactly(engine: &mut Engine, router: &mut Router, wire: &str) {
    let expected = support::expected_router_events(&support::kv_fixture_files(), 11, 4);
    for f in support::kv_fixture_files() {
        engine.send(std::fs::read(f).unwrap());
    }
    let mut got = Vec::new();
    while got.len() < expected.len() {
        let line = within(router.stdout.next_line())
            .await
            .unwrap()
            .expect("router exited");
        let ev: RouterEvent = serde_json::from_str(&line).unwrap();
        if ev.event.dp_rank != WARM_RANK {
            got.push(ev);
        }
    }
    let first = got[0].event.id;
    for (g, e) in got.iter_mut().zip(&expected) {
        g.event.id = g.event.id - first + 1;
        assert_eq!(g, e, "{wire}");
    }
}

/// Sends SIGTERM to `child` and returns its exit status and last stderr line (its
/// stats), reading what is left of `stderr`.
async fn terminate(
    mut child: Child,
    stderr: Option<&mut Lines<BufReader<ChildStderr>>>,
) -> (std::process::ExitStatus, serde_json::Value) {
    signal(&child, "-TERM");
    let mut last = String::new();
    match stderr {
        Some(lines) => {
            while let Some(line) = within(lines.next_line()).await.unwrap() {
                last = line;
            }
        }
        None => {
            let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
            while let Some(line) = within(lines.next_line()).await.unwrap() {
                last = line;
            }
        }
    }
    let status = within(child.wait()).await.unwrap();
    let stats = serde_json::from_str(&last).unwrap_or_else(|e| panic!("{e}: {last}"));
    (status, stats)
}

fn signal(child: &Child, signal: &str) {
    let pid = child.id().unwrap().to_string();
    assert!(
        std::process::Command::new("kill")
            .args([signal, &pid])
            .status()
            .unwrap()
            .success()
    );
}

/// Reads the router's stderr until a line contains `text`.
async fn stderr_until(router: &mut Router, text: &str) -> String {
    within(async {
        loop {
            let line = router
                .stderr
                .next_line()
                .await
                .unwrap()
                .expect("router exited");
            if line.contains(text) {
                return line;
            }
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_relay_dials_out_and_kv_router_follows_it_without_etcd() {
    for wire in ["eventplane", "dynamo"] {
        let dir = credentials(wire);
        let mut router = router(&dir, &["--wire", wire]).await;
        let mut engine = Engine::bind("kv").await;
        let first = relay(&dir, &engine, wire, &router.port).await;
        within(engine.socket.wait_for_subscribers(1)).await;
        warm(&mut engine, &mut router).await;
        fixtures_arrive_exactly(&mut engine, &mut router, wire).await;
        if wire == "eventplane" {
            // Killed: its session drops, the router forgets its blocks. Restarted (the
            // same client id, worker and rank: the same publisher id), the router
            // follows the new incarnation and counts its restart as a reset.
            signal(&first, "-KILL");
            stderr_until(&mut router, "left: forgot").await;
            let second = relay(&dir, &engine, wire, &router.port).await;
            within(engine.socket.wait_for_subscribers(1)).await;
            warm(&mut engine, &mut router).await;
            fixtures_arrive_exactly(&mut engine, &mut router, wire).await;
            let (status, stats) = terminate(second, None).await;
            assert_eq!(status.code(), Some(0), "{stats}");
            assert_eq!(stats["source"]["sessions"], 1, "{stats}");
        } else {
            let (status, stats) = terminate(first, None).await;
            assert_eq!(status.code(), Some(0), "{stats}");
            // Its counters after the drain: one session, ended by the drain, not lost.
            assert_eq!(stats["source"]["sessions"], 1, "{stats}");
            assert_eq!(stats["source"]["session_failures"], 0, "{stats}");
            assert_eq!(stats["source"]["connected"], false, "{stats}");
            assert_eq!(stats["source"]["streams_opened"], 1, "{stats}");
        }
        // The relay drained its session: its publisher departed.
        stderr_until(&mut router, "left: forgot").await;
        let Router {
            child, mut stderr, ..
        } = router;
        let (status, stats) = terminate(child, Some(&mut stderr)).await;
        assert_eq!(status.code(), Some(0), "{stats}");
        let subscriber = &stats["subscriber"]["total"];
        assert_eq!(subscriber["dropped_malformed"], 0, "{stats}");
        assert_eq!(stats["bus"]["announced_sources"], 0, "{stats}");
        assert_eq!(stats["bus"]["source_sessions"], 0, "{stats}");
        if wire == "eventplane" {
            assert!(
                subscriber["sequence_resets"].as_u64() >= Some(1),
                "the restart is counted: {stats}"
            );
        }
    }
}

/// `kv_router --static EP --bus-listen …`: a relay it dials and a relay that dials it,
/// followed together (the static list and the announced view, merged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_router_follows_a_static_publisher_and_an_announced_source_together() {
    use eventplane::kv::engine::{EngineEvent, encode_engine_batch};
    let dir = credentials("merged");
    let mut direct_engine = Engine::bind("kv").await;
    let (direct, endpoint) = support::spawn_example(
        "kv-relay",
        &[
            "--connect",
            &direct_engine.endpoint(),
            "--topic",
            "kv",
            "--block-size",
            "4",
            "--worker-id",
            "21",
            "--bind",
            "tcp://127.0.0.1:0",
        ],
        true,
    )
    .await;
    let endpoint = endpoint.unwrap();
    let mut router = router(&dir, &["--static", &endpoint]).await;
    let mut source_engine = Engine::bind("kv").await;
    let source = relay(&dir, &source_engine, "eventplane", &router.port).await;
    within(direct_engine.socket.wait_for_subscribers(1)).await;
    within(source_engine.socket.wait_for_subscribers(1)).await;
    // Clears from both engines until the router printed one of each worker.
    let clear = encode_engine_batch(0.0, WARM_RANK, 4, &[EngineEvent::Cleared]).unwrap();
    let mut seen = std::collections::HashSet::new();
    within(async {
        while seen.len() < 2 {
            direct_engine.send(clear.clone());
            source_engine.send(clear.clone());
            if let Ok(Ok(Some(line))) = tokio::time::timeout(
                std::time::Duration::from_millis(100),
                router.stdout.next_line(),
            )
            .await
            {
                let ev: RouterEvent = serde_json::from_str(&line).unwrap();
                seen.insert(ev.worker_id.0);
            }
        }
    })
    .await;
    assert_eq!(seen, [11, 21].into_iter().collect());
    let (status, stats) = terminate(source, None).await;
    assert_eq!(status.code(), Some(0), "{stats}");
    let stats = support::terminate_for_stats(direct).await;
    assert_eq!(stats["wire"], "eventplane");
    let Router {
        child, mut stderr, ..
    } = router;
    let (status, stats) = terminate(child, Some(&mut stderr)).await;
    assert_eq!(status.code(), Some(0), "{stats}");
    assert_eq!(stats["bus"]["sessions_started"], 1, "{stats}");
}

/// A source's credential limited to worker 7 cannot write another worker's blocks:
/// `kv-router` indexes its events under the identity the bus granted the announced
/// publisher (worker 7), and an event whose payload names worker 8 is refused and
/// counted, through the real bus over TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_writes_only_the_blocks_of_the_worker_it_was_granted() {
    use eventplane::discovery::{ChannelId, WorkerIdentity};
    use eventplane::publish::EventPublisher;
    use eventplane::tunnel::{AnnouncedSource, Source, SourceConfig, client_tls};
    use eventplane::wire::Dialect;

    let dir = credentials("granted");
    let digest = TokenDigest::of(&Secret::new(SOURCE_TOKEN).unwrap()).to_hex();
    std::fs::write(
        dir.join("clients.toml"),
        format!(
            "[[source]]\nclient_id = \"gpu-box-1\"\ntoken_sha256 = \"{digest}\"\n\
             namespaces = [\"prod\"]\nworker_ids = [7]\n"
        ),
    )
    .unwrap();
    let mut router = router(&dir, &["--dump-index"]).await;
    let publisher = EventPublisher::unregistered("kv-events")
        .build()
        .await
        .unwrap();
    let source = Source::spawn(SourceConfig::new(
        format!("https://localhost:{}", router.port),
        "gpu-box-1",
        vec!["prod".to_owned()],
        Secret::new(SOURCE_TOKEN).unwrap(),
        client_tls(fixture("ca.pem")).unwrap(),
    ))
    .unwrap();
    let channel = ChannelId::new("prod", "backend", "kv-events", publisher.publisher_id()).unwrap();
    source
        .announce(
            AnnouncedSource::new(&channel, Dialect::EventPlane)
                .with_worker(WorkerIdentity::new(7, 0)),
            publisher.acceptor(),
        )
        .unwrap();
    within(publisher.wait_for_subscribers(1)).await;

    let stored = crate::support::stored_at_root;
    // Its own worker's block, one claimed for worker 8, its own again.
    for ev in [stored(7, 1, 71), stored(8, 2, 81), stored(7, 3, 72)] {
        publisher.publish(Dialect::EventPlane.encode_router_events(&[ev]).unwrap());
    }
    for _ in 0..3 {
        within(router.stdout.next_line())
            .await
            .unwrap()
            .expect("router exited");
    }
    let (status, stats) = terminate(router.child, Some(&mut router.stderr)).await;
    assert!(status.success(), "{stats}");
    assert_eq!(
        stats["index_stats"]["refused_events"]["foreign_worker"], 1,
        "{stats}"
    );
    assert_eq!(
        stats["index"],
        serde_json::json!([{"worker_id": 7, "dp_rank": 0, "tier": "device", "block_hashes": [71, 72]}]),
        "{stats}"
    );
    source.shutdown().await;
}

/// `kv-relay --bus-url … --admin-listen`: with its engine connected, `/readyz` is 503
/// until the router's bus welcomed it (and it announced), 200 then, 503 again once
/// the router is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_relay_is_ready_while_the_bus_holds_its_session() {
    use crate::support::admin::{admin_address, get, until};
    let dir = credentials("ready");
    let engine = Engine::bind("kv").await;
    // A port no bus listens on yet, that the router binds later.
    let bus = support::restartable_endpoint();
    let listen = bus.trim_start_matches("tcp://");
    let port = listen.rsplit(':').next().unwrap();
    let mut relay = relay_with(
        &dir,
        &engine,
        "eventplane",
        port,
        &["--admin-listen", "127.0.0.1:0"],
    )
    .await;
    let mut lines = BufReader::new(relay.stderr.take().unwrap()).lines();
    let admin = admin_address(&mut lines).await;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let not_yet = "not ready: no session with the router's bus\n";
    until(&admin, "/readyz", |status, reason| {
        status == 503 && reason == not_yet
    })
    .await;
    // Held while no bus answers: still not ready, still alive.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(get(&admin, "/readyz").await, (503, not_yet.to_owned()));
    assert_eq!(get(&admin, "/livez").await.0, 200);
    let router = router_at(&dir, &[], listen).await;
    until(&admin, "/readyz", |status, _| status == 200).await;
    drop(router);
    until(&admin, "/readyz", |status, reason| {
        status == 503 && reason == not_yet
    })
    .await;
    drop(relay);
}

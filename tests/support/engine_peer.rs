//! An engine's own KV-event publisher (vLLM's or SGLang's module, unmodified), driven
//! by `engine_replay_peer.py` (see there).

use std::collections::HashSet;
use std::path::PathBuf;

use super::{PyPeer, Watched, dynamo_python, restartable_endpoint, support_dir};

/// The engines' topic in these tests.
pub const TOPIC: &str = "kv";
/// Their block size.
pub const BLOCK_SIZE: &str = "16";

pub fn engine_module(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target/engines")
        .join(name)
        .join("kv_events.py");
    assert!(
        path.exists(),
        "{} missing: run `python3 tools/engine_sources.py` (.ci/run does)",
        path.display()
    );
    path
}

/// An engine's own publisher, driven line by line.
pub struct EnginePeer {
    pub peer: PyPeer,
    /// Its PUB.
    pub publish: String,
    /// Its replay ROUTER.
    pub replay: String,
}

impl EnginePeer {
    pub async fn start(module: &str, flavor: &str) -> EnginePeer {
        let python = dynamo_python();
        let port = |e: &str| e.rsplit(':').next().unwrap().to_owned();
        let (publish, replay) = (restartable_endpoint(), restartable_endpoint());
        let module = engine_module(module);
        let mut peer = PyPeer::with_python(
            &python,
            support_dir().join("engine_replay_peer.py"),
            &[
                module.to_str().unwrap(),
                flavor,
                TOPIC,
                BLOCK_SIZE,
                &port(&publish),
                &port(&replay),
            ],
        );
        assert_eq!(peer.line().await, "ready");
        EnginePeer {
            peer,
            publish,
            replay,
        }
    }

    /// Publishes `n` batches; the last sequence used.
    pub async fn burst(&mut self, n: u32) -> u64 {
        self.peer.send_line(&format!("burst {n}")).await;
        let ok = self.peer.line().await;
        ok.strip_prefix("ok ").unwrap().parse().unwrap()
    }

    /// Publishes one batch removing the `n` newest blocks; the last sequence used.
    pub async fn remove_newest(&mut self, n: u32) -> u64 {
        self.peer.send_line(&format!("remove {n}")).await;
        let ok = self.peer.line().await;
        ok.strip_prefix("ok ").unwrap().parse().unwrap()
    }

    /// From now on, evicts whole batches, children before parents (see the peer).
    pub async fn evict_chains(&mut self) {
        self.peer.send_line("evict chains").await;
        assert_eq!(self.peer.line().await, "ok");
    }

    pub async fn restart(&mut self) {
        self.peer.send_line("restart").await;
        assert_eq!(self.peer.line().await, "ok");
    }

    pub async fn truth(&mut self) -> HashSet<u64> {
        self.peer.send_line("truth").await;
        let line = self.peer.line().await;
        line.strip_prefix("truth")
            .unwrap()
            .split_whitespace()
            .map(|h| h.parse().unwrap())
            .collect()
    }
}

impl EnginePeer {
    /// `kv-relay --engine-replay` in front of this engine (worker 1, publishing on a
    /// free loopback port) with `extra` arguments; returns once it printed its
    /// endpoint, with that endpoint.
    pub async fn relay(&self, extra: &[&str]) -> (Watched, String) {
        let mut args = vec![
            "--connect",
            &self.publish,
            "--engine-replay",
            &self.replay,
            "--topic",
            TOPIC,
            "--block-size",
            BLOCK_SIZE,
            "--worker-id",
            "1",
            "--bind",
            "tcp://127.0.0.1:0",
        ];
        args.extend(extra);
        let mut relay = Watched::spawn("kv-relay", &args);
        let endpoint = relay.line().await;
        (relay, endpoint)
    }
}

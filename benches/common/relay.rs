//! What the worker-process benches (`kv_worker`, `dynamo_relay`) share to check that
//! their closed loop was lossless: a tally of the router events that came out, and
//! the `kv_relay` process's own stats, read after SIGTERM.

use std::io::Read;
use std::process::Child;

use eventplane::kv::{KvEventData, RouterEvent};

/// Router events seen at a relay's output, by what they did to blocks.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tally {
    pub(crate) stored_blocks: u64,
    pub(crate) removed_blocks: u64,
    pub(crate) cleared: u64,
}

impl Tally {
    pub(crate) fn add(&mut self, events: &[RouterEvent]) {
        for e in events {
            match &e.event.data {
                KvEventData::Stored { blocks, .. } => self.stored_blocks += blocks.len() as u64,
                KvEventData::Removed { block_hashes } => {
                    self.removed_blocks += block_hashes.len() as u64
                }
                KvEventData::Cleared => self.cleared += 1,
                other => panic!("a router event this bench does not send: {other:?}"),
            }
        }
    }

    /// What came out since `earlier`.
    pub(crate) fn since(&self, earlier: &Tally) -> Tally {
        Tally {
            stored_blocks: self.stored_blocks - earlier.stored_blocks,
            removed_blocks: self.removed_blocks - earlier.removed_blocks,
            cleared: self.cleared - earlier.cleared,
        }
    }
}

/// Collects a child's stderr on a thread, so a chatty child never blocks on a full
/// pipe; `finish` waits for the end of it.
pub(crate) struct Stderr(std::thread::JoinHandle<String>);

impl Stderr {
    pub(crate) fn drain(child: &mut Child) -> Stderr {
        let mut pipe = child.stderr.take().expect("stderr piped");
        Stderr(std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        }))
    }

    pub(crate) fn finish(self) -> String {
        self.0.join().unwrap_or_default()
    }
}

/// Sends SIGTERM to `child`, waits for it (at most 30 s) and returns the JSON stats
/// object it printed as the last line of stderr.
pub(crate) fn terminate_for_stats(child: &mut Child, stderr: Stderr) -> serde_json::Value {
    let text = terminate(child, stderr);
    let last = text.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("no stats line ({e}): {text}"))
}

/// Sends SIGTERM to `child`, waits for it (at most 30 s) and returns its stderr.
pub(crate) fn terminate(child: &mut Child, stderr: Stderr) -> String {
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success(), "kill -TERM {}", child.id());
    let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "the relay did not exit within 30 s of SIGTERM"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    stderr.finish()
}

/// Asserts from `kv_relay`'s own stats that it decoded every engine batch it was sent,
/// processed every engine event, and neither it nor its publisher dropped any.
pub(crate) fn assert_relay_lossless(
    name: &str,
    stats: &serde_json::Value,
    batches: u64,
    events: u64,
) {
    let at = |path: &[&str]| {
        path.iter()
            .fold(stats, |v, k| &v[*k])
            .as_u64()
            .unwrap_or_else(|| panic!("{name}: no {} in {stats}", path.join(".")))
    };
    assert_eq!(
        at(&["listener", "decoder", "batches"]),
        batches,
        "{name}: batches decoded {stats}"
    );
    assert_eq!(
        at(&["listener", "seq_gaps"]),
        0,
        "{name}: engine sequence gaps {stats}"
    );
    assert_eq!(
        at(&["listener", "malformed_messages"]),
        0,
        "{name}: {stats}"
    );
    assert_eq!(at(&["listener", "discarded_events"]), 0, "{name}: {stats}");
    assert_eq!(
        at(&["processor", "input_events"]),
        events,
        "{name}: processor input {stats}"
    );
    assert_eq!(at(&["processor", "publish_errors"]), 0, "{name}: {stats}");
    assert_eq!(at(&["processor", "publish_timeouts"]), 0, "{name}: {stats}");
    assert_eq!(
        at(&["publisher", "dropped"]),
        0,
        "{name}: publisher drops {stats}"
    );
}

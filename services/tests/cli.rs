//! The services as an operator meets them: `--version`, the man pages checked in
//! under `services/man/`, `--log-format json`. (Their behaviour is tested from the
//! library's suites, which run these binaries: tests/kv_router_cli.rs,
//! tests/tunnel/event_broker.rs, tests/admin_endpoint.rs, …)
#![allow(clippy::unwrap_used, missing_docs)]

use std::io::BufRead;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// Generous bound on anything a test awaits, so a bug fails the test instead of
/// hanging CI. Not a timing assertion.
const DEADLINE: Duration = Duration::from_secs(30);

const SERVICES: [(&str, &str); 3] = [
    ("event-broker", env!("CARGO_BIN_EXE_event-broker")),
    ("kv-relay", env!("CARGO_BIN_EXE_kv-relay")),
    ("kv-router", env!("CARGO_BIN_EXE_kv-router")),
];

#[test]
fn version_names_the_crate_version_and_the_commit() {
    for (name, program) in SERVICES {
        let out = Command::new(program).arg("--version").output().unwrap();
        assert!(out.status.success(), "{name}");
        let line = String::from_utf8(out.stdout).unwrap();
        let expected = format!("{name} {} (", env!("CARGO_PKG_VERSION"));
        assert!(line.starts_with(&expected), "{line}");
        let commit = line
            .trim_end()
            .trim_end_matches(')')
            .rsplit('(')
            .next()
            .unwrap();
        assert_eq!(commit, head_commit(), "{line}");
    }
}

/// The commit a build of this checkout names (`git rev-parse --short=12 HEAD`), or
/// `unknown` outside a git checkout.
fn head_commit() -> String {
    Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// The checked-in pages are what the binaries generate from their command lines;
/// `EVENTPLANE_BLESS=1` rewrites them.
#[test]
fn man_pages_are_current() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("man");
    for (name, program) in SERVICES {
        let out = Command::new(program)
            .arg("--print-man-page")
            .output()
            .unwrap();
        assert!(out.status.success(), "{name}");
        let page = dir.join(format!("{name}.1"));
        if std::env::var_os("EVENTPLANE_BLESS").is_some() {
            std::fs::write(&page, &out.stdout).unwrap();
            continue;
        }
        let checked_in = std::fs::read(&page).unwrap_or_default();
        assert!(
            checked_in == out.stdout,
            "{} is not what {name} generates: run `EVENTPLANE_BLESS=1 cargo test -p \
             eventplane-services --test cli man_pages`",
            page.display()
        );
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.contains(&format!(".TH {name} 1")), "{name}");
        assert!(text.contains("admin\\-listen"), "{name}");
    }
}

/// With `--log-format json` every stderr line before the exit summary is one JSON
/// object with a level and a message.
#[test]
fn json_logs_are_one_object_per_line() {
    // A closed port: the relay warns that the engine connection failed, and retries.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let mut child = Command::new(SERVICES[1].1)
        .args([
            "--connect",
            &format!("tcp://127.0.0.1:{port}"),
            "--topic",
            "kv",
            "--block-size",
            "16",
            "--worker-id",
            "1",
            "--bind",
            "tcp://127.0.0.1:0",
            "--log-format",
            "json",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Its stderr as it comes, until the warning: then it is stopped.
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in stderr.lines() {
            if tx.send(line.unwrap()).is_err() {
                break;
            }
        }
    });
    let until = Instant::now() + DEADLINE;
    let mut lines = Vec::new();
    while !lines
        .iter()
        .any(|l: &String| l.contains("engine connection failed"))
    {
        let left = until.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => lines.push(line),
            Err(e) => {
                let _ = child.kill();
                panic!(
                    "no \"engine connection failed\" in {:?} ({e}): {lines:#?}",
                    DEADLINE
                );
            }
        }
    }
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    child.wait_with_output().unwrap();
    // The rest, up to the exit summary (the reader ends with the pipe).
    lines.extend(rx.iter());
    let stderr = lines.join("\n");
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(lines.len() >= 2, "{stderr}");
    // The last line is the exit summary (the counters); every other one a log event.
    for line in &lines[..lines.len() - 1] {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(
            v["level"].is_string() && v["fields"]["message"].is_string(),
            "{line}"
        );
    }
    assert!(
        lines.iter().any(|l| l.contains("engine connection failed")),
        "{stderr}"
    );
}

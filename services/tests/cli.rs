//! The services as an operator meets them: `--version`, the man pages checked in
//! under `services/man/`, `--log-format json`. (Their behaviour is tested from the
//! library's suites, which run these binaries: tests/kv_router_cli.rs,
//! tests/tunnel/event_broker.rs, tests/admin_endpoint.rs, …)
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::PathBuf;
use std::process::Command;

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
        assert!(
            commit == "unknown"
                || (commit.len() == 12 && commit.bytes().all(|b| b.is_ascii_hexdigit())),
            "{line}"
        );
    }
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
    let child = Command::new(SERVICES[1].1)
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
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
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

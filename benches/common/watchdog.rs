//! A deadline on a whole bench process: every wait in a bench (a closed loop that stops
//! receiving, a child that never answers) ends in a failure instead of a hang.

use std::time::Duration;

/// Ends this process with exit code 3 if it still runs after `full` (or 5 minutes in
/// criterion's test mode, `--test`), saying which bench hung.
pub(crate) fn arm(bench: &'static str, full: Duration) {
    let test_mode = std::env::args().any(|a| a == "--test");
    let limit = if test_mode {
        Duration::from_secs(300)
    } else {
        full
    };
    std::thread::spawn(move || {
        std::thread::sleep(limit);
        eprintln!("{bench}: still running after {limit:?}: a wait that never ended (watchdog)");
        // Exiting runs no destructor: end the children (relays, etcd, Python peers)
        // here, so they do not outlive the bench.
        let _ = std::process::Command::new("pkill")
            .args(["-KILL", "-P", &std::process::id().to_string()])
            .status();
        std::process::exit(3);
    });
}

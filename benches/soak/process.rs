//! The processes a soak runs: spawned with their stdout read line by line into a
//! bounded queue and their stderr in a log file; signalled by pid; sampled for RSS
//! and open fds.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

/// A running child.
#[derive(Debug)]
pub(crate) struct Proc {
    /// `relay w3#2`: role, target and incarnation.
    pub(crate) name: String,
    pub(crate) child: Child,
    pub(crate) pid: u32,
    pub(crate) stdin: Option<ChildStdin>,
    pub(crate) lines: mpsc::Receiver<String>,
    /// Lines [`line`](Self::line) read past while it waited for another (the last
    /// [`LINE_QUEUE`]), for the supervisor.
    pub(crate) skipped: std::collections::VecDeque<String>,
    pub(crate) log: PathBuf,
}

/// Lines of stdout kept unread at most (a child that prints more waits).
const LINE_QUEUE: usize = 256;

impl Proc {
    /// Spawns `program args` with stdin and stdout piped and stderr to `log_dir/NAME.log`.
    pub(crate) fn spawn(
        name: String,
        program: &Path,
        args: &[String],
        log_dir: &Path,
        env: &[(&str, &str)],
    ) -> Result<Proc, String> {
        let log = log_dir.join(format!("{}.log", name.replace([' ', '#'], "-")));
        let file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(file))
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {name} ({}): {e}", program.display()))?;
        let pid = child.id().unwrap_or(0);
        let (tx, lines) = mpsc::channel(LINE_QUEUE);
        if let Some(out) = child.stdout.take() {
            tokio::spawn(async move {
                let mut reader = tokio::io::BufReader::new(out).lines();
                while let Ok(Some(line)) = reader.next_line().await {
                    if tx.send(line).await.is_err() {
                        break;
                    }
                }
            });
        }
        let stdin = child.stdin.take();
        Ok(Proc {
            name,
            child,
            pid,
            stdin,
            lines,
            skipped: std::collections::VecDeque::new(),
            log,
        })
    }

    /// The next stdout line starting with `prefix` (others kept in `skipped`), its
    /// rest.
    pub(crate) async fn line(&mut self, prefix: &str, within: Duration) -> Result<String, String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some(line)) => {
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return Ok(rest.trim().to_owned());
                    }
                    if self.skipped.len() >= LINE_QUEUE {
                        self.skipped.pop_front();
                    }
                    self.skipped.push_back(line);
                }
                Ok(None) => return Err(format!("{} ended before printing {prefix:?}", self.name)),
                Err(_) => {
                    return Err(format!(
                        "{} printed no {prefix:?} within {within:?}",
                        self.name
                    ));
                }
            }
        }
    }

    /// The lines waiting: those `line` read past first, then the queue's.
    pub(crate) fn take_lines(&mut self) -> Vec<String> {
        let mut lines: Vec<String> = self.skipped.drain(..).collect();
        while let Ok(line) = self.lines.try_recv() {
            lines.push(line);
        }
        lines
    }

    /// Writes one command line to its stdin.
    pub(crate) async fn tell(&mut self, command: &str) -> Result<(), String> {
        let stdin = self.stdin.as_mut().ok_or("stdin closed")?;
        stdin
            .write_all(format!("{command}\n").as_bytes())
            .await
            .map_err(|e| format!("{}: {e}", self.name))
    }

    /// Sends `signal` (`KILL`, `TERM`, `STOP`, `CONT`); `kill`'s failure as an error
    /// naming the process.
    pub(crate) fn signal(&self, signal: &str) -> Result<(), String> {
        signal_pid(self.pid, signal).map_err(|e| format!("{}: {e}", self.name))
    }

    /// Waits up to `within` for the exit: its status, or `None` if it still runs
    /// (nothing killed: the caller decides).
    pub(crate) async fn ended_within(
        &mut self,
        within: Duration,
    ) -> Option<std::process::ExitStatus> {
        tokio::time::timeout(within, self.child.wait())
            .await
            .ok()
            .and_then(Result::ok)
    }

    /// Whether the kernel shows it stopped (`T` in `/proc/PID/stat`) or not, polled
    /// for up to `within` until it is as `stopped` says; the last state seen.
    pub(crate) async fn await_stopped(&self, stopped: bool, within: Duration) -> Option<char> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let state = proc_state(self.pid);
            if state.is_some_and(|s| (s == 'T') == stopped)
                || tokio::time::Instant::now() >= deadline
            {
                return state;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits up to `within` for the exit; kills it after that.
    pub(crate) async fn wait(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        match tokio::time::timeout(within, self.child.wait()).await {
            Ok(status) => status.ok(),
            Err(_) => {
                let _ = self.child.start_kill();
                self.child.wait().await.ok()
            }
        }
    }

    /// Whether it has exited (its status then).
    pub(crate) fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The last non-empty line of its stderr log.
    pub(crate) fn last_log_line(&self) -> String {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or_default()
            .to_owned()
    }
}

/// `kill -SIGNAL PID`; its failure (no such process, a refused signal) as an error.
pub(crate) fn signal_pid(pid: u32, signal: &str) -> Result<(), String> {
    let status = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("kill -{signal} {pid}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill -{signal} {pid}: {status}"))
    }
}

/// A process's state letter (`R`, `S`, `T` for stopped, `Z`…), `None` once it is
/// gone. The letter follows the command name, which is in parentheses and may hold
/// spaces: read after the last `)`.
pub(crate) fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_state(&stat)
}

fn parse_state(stat: &str) -> Option<char> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.trim_start().chars().next()
}

/// A process's resident set (KiB) and open fds, `None` once it is gone.
pub(crate) fn sample(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some((rss, fds))
}

/// A port free now (bound and released: another process may take it first, which a
/// start then reports).
pub(crate) fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    l.local_addr().map(|a| a.port()).map_err(|e| e.to_string())
}

/// Runs a command to completion; its failure as an error naming it.
pub(crate) fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_is_read_after_the_command_name() {
        assert_eq!(parse_state("42 (kv relay) T 1 42 42 0"), Some('T'));
        assert_eq!(parse_state("42 (a)b) S 1"), Some('S'));
        assert_eq!(parse_state("garbage"), None);
    }
}

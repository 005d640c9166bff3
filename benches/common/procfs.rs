//! Reading a process's memory figures from `/proc`, and raising its open-file limit,
//! shared by the benches.
// Each bench includes this file and uses what it needs of it.
#![allow(dead_code)]

/// Field `field` (e.g. `"VmRSS:"`, `"VmHWM:"`) of `/proc/<proc>/status` in KiB, where
/// `proc` is a pid or `"self"`; 0 when absent.
pub(crate) fn status_kib(proc: &str, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{proc}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Raises this process's soft open-file limit to its hard limit (benches holding
/// thousands of connections, each a descriptor on both sides when both are here).
pub(crate) fn raise_fd_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    limit.current = limit.maximum;
    let _ = setrlimit(Resource::Nofile, limit);
}

/// User plus system CPU time of process `pid`, all its threads, from `/proc/PID/stat`
/// (clock ticks of 10 ms).
pub(crate) fn cpu_time(pid: u32) -> std::time::Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name, which is in parentheses.
    let rest = stat
        .rfind(')')
        .map_or("", |i| stat.get(i + 2..).unwrap_or(""));
    let fields: Vec<&str> = rest.split(' ').collect();
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    std::time::Duration::from_millis((tick(11) + tick(12)) * 10)
}

/// CPU time of the calling thread (exact, from the kernel's scheduler clock).
pub(crate) fn thread_cpu() -> std::time::Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    std::time::Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

//! Reading a process's memory figures from `/proc`, shared by the benches.

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

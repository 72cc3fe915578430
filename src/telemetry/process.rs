//! The process's own series: build information, and memory, CPU and open
//! files read from `/proc/self` at each scrape.
//!
//! Owns `tollgate_build_info` and the `tollgate_process_*` gauges. They are
//! sampled when `/metrics` is rendered, never on the request path. Where
//! `/proc` is missing (not Linux) the process series are simply absent.

use std::path::Path;

use super::{BUILD_INFO, PROCESS_CPU_SECONDS, PROCESS_OPEN_FDS, PROCESS_RESIDENT_MEMORY_BYTES};

/// Clock ticks per second of `/proc/<pid>/stat`'s CPU times: `USER_HZ`,
/// which Linux fixes at 100 for user space on every architecture it
/// exports these files on.
const USER_HZ: f64 = 100.0;

/// Registers the help text of these series and sets `tollgate_build_info`.
pub(super) fn describe() {
    use metrics::{Unit, describe_gauge};
    describe_gauge!(
        BUILD_INFO,
        Unit::Count,
        "Always 1; the version label says which build is running."
    );
    describe_gauge!(
        PROCESS_RESIDENT_MEMORY_BYTES,
        Unit::Bytes,
        "Resident memory of the gateway process."
    );
    describe_gauge!(
        PROCESS_CPU_SECONDS,
        Unit::Seconds,
        "User and system CPU time the gateway process has used since it started."
    );
    describe_gauge!(
        PROCESS_OPEN_FDS,
        Unit::Count,
        "Open file descriptors of the gateway process (sockets included)."
    );
    #[allow(clippy::disallowed_macros)] // Named above, in this module.
    metrics::gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
}

/// What `/proc/self` says about the process now.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    /// Resident set size, bytes.
    resident_bytes: f64,
    /// User plus system CPU time, seconds.
    cpu_seconds: f64,
    /// Open file descriptors.
    open_fds: f64,
}

/// Reads the process series from `/proc/self` and records them; does
/// nothing where `/proc` cannot be read.
pub fn sample_process() {
    let Some(sample) = read(Path::new("/proc/self")) else {
        return;
    };
    #[allow(clippy::disallowed_macros)] // Named above, in this module.
    {
        metrics::gauge!(PROCESS_RESIDENT_MEMORY_BYTES).set(sample.resident_bytes);
        metrics::gauge!(PROCESS_CPU_SECONDS).set(sample.cpu_seconds);
        metrics::gauge!(PROCESS_OPEN_FDS).set(sample.open_fds);
    }
}

/// Reads one sample from a `/proc/<pid>` directory.
fn read(proc: &Path) -> Option<Sample> {
    let stat = std::fs::read_to_string(proc.join("stat")).ok()?;
    let status = std::fs::read_to_string(proc.join("status")).ok()?;
    let open_fds = std::fs::read_dir(proc.join("fd")).ok()?.count();
    Some(Sample {
        resident_bytes: resident_kib(&status)? * 1024.0,
        cpu_seconds: cpu_ticks(&stat)? / USER_HZ,
        open_fds: open_fds as f64,
    })
}

/// `utime + stime` from a `stat` line. The command name (field 2) is in
/// parentheses and may hold spaces, so fields are counted after its `)`.
fn cpu_ticks(stat: &str) -> Option<f64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    // After the name: state is field 3, utime field 14, stime field 15.
    let mut fields = after_name.split_whitespace().skip(11);
    let utime: f64 = fields.next()?.parse().ok()?;
    let stime: f64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// `VmRSS` in KiB from a `status` file.
fn resident_kib(status: &str) -> Option<f64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_read_after_a_command_name_with_spaces() {
        let stat = "4242 (tollgate (w 1)) S 1 4242 4242 0 -1 4194560 900 0 0 0 \
                    250 75 0 0 20 0 3 0 1234 5000000 2048 18446744073709551615";
        assert_eq!(cpu_ticks(stat), Some(325.0));
        assert_eq!(cpu_ticks("no parenthesis"), None);
    }

    #[test]
    fn resident_memory_is_vmrss() {
        let status = "Name:\ttollgate\nVmPeak:\t  90000 kB\nVmRSS:\t   51234 kB\nThreads:\t5\n";
        assert_eq!(resident_kib(status), Some(51_234.0));
        assert_eq!(resident_kib("Name:\tx\n"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_can_be_read_on_linux() {
        let sample = read(Path::new("/proc/self")).unwrap();
        assert!(
            sample.resident_bytes > 0.0 && sample.open_fds >= 3.0,
            "{sample:?}"
        );
    }
}

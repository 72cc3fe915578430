//! The processes the helpers run: starting a service binary (failing with
//! the package to install when it is missing), signalling it, and
//! stopping it on drop.

use std::process::{Child, Command, Output};
use std::time::Duration;

use super::wait_until;

/// Spawns `command`; fails naming the Debian `package` to install when its
/// program cannot run.
pub fn spawn_from(package: &str, command: &mut Command) -> Child {
    command
        .spawn()
        .unwrap_or_else(|e| panic!("{}", cannot_run(command, package, &e)))
}

/// Runs `command` to its end, as [`spawn_from`] starts it.
pub fn output_from(package: &str, command: &mut Command) -> Output {
    command
        .output()
        .unwrap_or_else(|e| panic!("{}", cannot_run(command, package, &e)))
}

/// Runs `command` to its end, as [`spawn_from`] starts it; it must
/// succeed. Its stdout.
pub fn stdout_from(package: &str, command: &mut Command) -> String {
    let out = output_from(package, command);
    assert!(
        out.status.success(),
        "{:?} failed: {}",
        command,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn cannot_run(command: &Command, package: &str, error: &std::io::Error) -> String {
    format!(
        "cannot run {} ({error}); install it with `apt-get install -y {package}`",
        command.get_program().to_string_lossy()
    )
}

/// Whether process `pid` itself holds the socket listening on
/// 127.0.0.1:`port` (from `/proc`): a port found free may be taken by
/// another process before `pid` binds it, and a connection that succeeds
/// proves only that someone listens there.
pub fn listens_on(pid: u32, port: u16) -> bool {
    let local = format!("0100007F:{port:04X}");
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return false;
    };
    let inodes: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local_address, state (0A: LISTEN), inode.
            (fields.get(1) == Some(&local.as_str()) && fields.get(3) == Some(&"0A"))
                .then(|| fields.get(9).map(|inode| format!("socket:[{inode}]")))
                .flatten()
        })
        .collect();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.filter_map(Result::ok).any(|fd| {
        std::fs::read_link(fd.path())
            .is_ok_and(|target| inodes.iter().any(|i| target.as_os_str() == i.as_str()))
    })
}

/// Sends `sig` (`-STOP`, `-CONT`, `-TERM`) to process `pid`.
pub fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill(1) is available");
    assert!(status.success(), "kill {sig} {pid} failed");
}

/// Stops `child` as its operators would: `signal` (e.g. `-TERM`, on which
/// nginx's master stops its workers first), then SIGKILL if it has not
/// exited within five seconds; reaps it either way.
pub fn stop_child(child: &mut Child, signal: &str) {
    if is_running(child) {
        self::signal(child.id(), signal);
        if !wait_until(Duration::from_secs(5), || !is_running(child)) {
            let _ = child.kill();
        }
    }
    let _ = child.wait();
}

/// Whether `child` has not exited yet.
fn is_running(child: &mut Child) -> bool {
    child.try_wait().is_ok_and(|exited| exited.is_none())
}

/// Whether every thread of process `pid` is stopped (state `T` in its
/// `/proc` stat line, after the command name in parentheses).
fn all_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                == Some("T")
        })
    })
}

/// A child process that is killed (SIGKILL, after a SIGCONT in case it
/// was paused) and reaped on drop.
pub struct KillOnDrop(pub Child);

impl KillOnDrop {
    /// Its process id.
    pub fn id(&self) -> u32 {
        self.0.id()
    }

    /// Whether it has not exited yet.
    pub fn is_running(&mut self) -> bool {
        is_running(&mut self.0)
    }

    /// Kills and reaps it now.
    pub fn kill(&mut self) {
        if self.is_running() {
            let _ = Command::new("kill")
                .args(["-CONT", &self.id().to_string()])
                .status();
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }

    /// Freezes it (SIGSTOP): its sockets stay open, nothing answers. Returns
    /// once every thread has stopped: kill(2) returns before a busy process
    /// has, and a thread still running could answer one more request.
    pub fn pause(&self) {
        let pid = self.id();
        signal(pid, "-STOP");
        assert!(
            wait_until(Duration::from_secs(5), || all_stopped(pid)),
            "process {pid} did not stop within 5 s of SIGSTOP"
        );
    }

    /// Thaws it after [`KillOnDrop::pause`] (SIGCONT).
    pub fn resume(&self) {
        signal(self.id(), "-CONT");
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        self.kill();
    }
}

//! Signals to child processes, sent with `kill(1)`: SIGTERM for a graceful stop, SIGKILL for a
//! crash, to a process or to a whole process group.

use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

/// A child process with a process id: `std`'s or tokio's.
pub trait Pid {
    /// The process id; panics when a tokio child was already reaped.
    fn pid(&self) -> u32;
}

impl Pid for std::process::Child {
    fn pid(&self) -> u32 {
        self.id()
    }
}

impl Pid for tokio::process::Child {
    fn pid(&self) -> u32 {
        self.id().expect("child running")
    }
}

/// Sends `signal` (a name: `TERM`, `KILL`, `INT`, ...) to process `pid`; whether `kill`
/// delivered it (best effort: for a process that may be gone already).
pub fn try_signal_pid(pid: u32, signal: &str) -> bool {
    Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Sends `signal` to process `pid` and asserts that `kill` delivered it.
pub fn signal_pid(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{signal} {pid}");
}

/// SIGTERM to a running child: a graceful stop.
pub fn sigterm(child: &impl Pid) {
    signal_pid(child.pid(), "TERM");
}

/// SIGKILL to a running child: a crash.
pub fn sigkill(child: &impl Pid) {
    signal_pid(child.pid(), "KILL");
}

/// SIGTERM to a running tokio child, then its exit status; panics when it has not exited
/// within `timeout`.
pub async fn sigterm_and_wait(child: &mut tokio::process::Child, timeout: Duration) -> ExitStatus {
    sigterm(child);
    tokio::time::timeout(timeout, child.wait())
        .await
        .unwrap_or_else(|_| panic!("the child did not exit within {timeout:?} of SIGTERM"))
        .expect("wait for the child")
}

/// `signal` to every process of process group `pgid` (a server and its helpers), best effort:
/// a group already gone is not an error.
pub fn signal_group(pgid: u32, signal: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{signal}"), "--", &format!("-{pgid}")])
        .stderr(Stdio::null())
        .status();
}

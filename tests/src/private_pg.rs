//! A PostgreSQL instance of the test's own (initdb + pg_ctl on a free port, in a temporary
//! directory), to crash and restart; never the machine's shared one. Runs as the `postgres` user
//! (initdb refuses root), trust authentication, user `postgres`, database `postgres`. Stopped and
//! removed on drop.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = "/usr/lib/postgresql/15/bin";
/// Longest wait for the instance to accept connections after a start.
pub const START_TIMEOUT: Duration = Duration::from_secs(60);

pub struct PrivatePg {
    dir: PathBuf,
    port: u16,
    running: bool,
}

fn as_postgres(program: &str) -> Command {
    let mut c = Command::new("runuser");
    c.args(["-u", "postgres", "--", &format!("{BIN}/{program}")]);
    c.stdin(Stdio::null());
    c
}

fn check(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl PrivatePg {
    /// initdb, append `extra_conf_lines` to postgresql.conf, start, wait until it answers.
    pub fn start(extra_conf_lines: &[&str]) -> PrivatePg {
        let dir = std::env::temp_dir().join(format!("outbox-pg-{}", crate::unique("pg")));
        std::fs::create_dir_all(&dir).expect("pg dir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        check(Command::new("chown").arg("postgres").arg(&dir));
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let data = dir.join("data");
        check(as_postgres("initdb").arg("-D").arg(&data).args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
        ]));
        let mut conf = String::from("\nfsync = off\nmax_connections = 200\n");
        for line in extra_conf_lines {
            conf.push_str(line);
            conf.push('\n');
        }
        let conf_path = data.join("postgresql.conf");
        let mut existing = std::fs::read_to_string(&conf_path).expect("read postgresql.conf");
        existing.push_str(&conf);
        std::fs::write(&conf_path, existing).expect("write postgresql.conf");
        let mut pg = PrivatePg {
            dir,
            port,
            running: false,
        };
        pg.start_again();
        pg
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:PORT/DB`.
    pub fn url(&self, db_name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db_name}", self.port)
    }

    /// A crash: `pg_ctl -m immediate stop` (no checkpoint; recovery replays the WAL at start).
    pub fn stop_immediate(&mut self) {
        if !self.running {
            return;
        }
        check(
            as_postgres("pg_ctl")
                .arg("-D")
                .arg(self.dir.join("data"))
                .args(["-m", "immediate", "-w", "-t", "60", "stop"]),
        );
        self.running = false;
    }

    /// Starts the instance (again) and waits until it accepts connections.
    pub fn start_again(&mut self) {
        assert!(!self.running, "already running");
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1",
            self.port,
            self.dir.display()
        );
        check(
            as_postgres("pg_ctl")
                .arg("-D")
                .arg(self.dir.join("data"))
                .arg("-o")
                .arg(opts)
                .arg("-l")
                .arg(self.dir.join("log"))
                .args(["-w", "-t", "60", "start"]),
        );
        self.running = true;
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let ready = as_postgres("pg_isready")
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ready {
                return;
            }
            assert!(Instant::now() < deadline, "PostgreSQL did not become ready");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        if self.running {
            let _ = as_postgres("pg_ctl")
                .arg("-D")
                .arg(self.dir.join("data"))
                .args(["-m", "immediate", "-w", "-t", "30", "stop"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

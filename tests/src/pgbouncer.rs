//! A PgBouncer of the test's own (Debian's `pgbouncer`), on a free port with its own
//! configuration, in front of a PostgreSQL server (the shared one or a private one).

use crate::tls_pg::{chown, run_as};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// A running PgBouncer (trust authentication for `postgres`, every database forwarded).
/// Stopped and removed when dropped.
pub struct PgBouncer {
    dir: PathBuf,
    port: u16,
}

impl PgBouncer {
    /// Starts PgBouncer in `pool_mode` (`transaction`, `session`) in front of
    /// `127.0.0.1:server_port`, with `extra_conf_lines` in its `[pgbouncer]` section.
    pub fn start(server_port: u16, pool_mode: &str, extra_conf_lines: &[&str]) -> Self {
        let dir = std::env::temp_dir().join(crate::unique("pgbouncer"));
        std::fs::create_dir_all(&dir).expect("create PgBouncer directory");
        let port = crate::free_addr().port();
        let d = dir.to_string_lossy().into_owned();
        let mut conf = format!(
            "[databases]\n* = host=127.0.0.1 port={server_port}\n\n[pgbouncer]\n\
             listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
             auth_type = trust\nauth_file = {d}/users.txt\n\
             pool_mode = {pool_mode}\nmax_client_conn = 500\n\
             pidfile = {d}/pid\nlogfile = {d}/log\n"
        );
        for line in extra_conf_lines {
            conf.push_str(line);
            conf.push('\n');
        }
        std::fs::write(dir.join("pgbouncer.ini"), conf).expect("write pgbouncer.ini");
        std::fs::write(dir.join("users.txt"), "\"postgres\" \"\"\n").expect("write users.txt");
        chown(&dir, "postgres");
        let bouncer = Self { dir, port };
        // -d: daemonizes once it listens (or fails with its reason on stderr).
        run_as(
            "postgres",
            "/usr/sbin/pgbouncer",
            &["-d", &format!("{d}/pgbouncer.ini")],
            || bouncer.log(),
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "pgbouncer does not listen:\n{}",
                bouncer.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        bouncer
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Connection string for database `db` through PgBouncer.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// PgBouncer's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// The pid PgBouncer wrote, once it runs.
    fn pid(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.join("pid"))
            .ok()
            .map(|p| p.trim().to_string())
            .filter(|p| !p.is_empty())
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        if let Some(pid) = self.pid() {
            // SIGINT: PgBouncer's immediate shutdown (SIGTERM would wait for clients to leave).
            if let Ok(pid) = pid.parse() {
                crate::signals::try_signal_pid(pid, "INT");
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while std::path::Path::new(&format!("/proc/{pid}")).exists()
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

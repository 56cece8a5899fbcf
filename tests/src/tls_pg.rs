//! A PostgreSQL server of the test's own (initdb + pg_ctl on a free port in a temporary
//! directory), for tests that need a server configured differently (TLS) or that crash it.
//! The machine's shared PostgreSQL is never touched.

use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = "/usr/lib/postgresql/15/bin";

/// A running private PostgreSQL (trust authentication, superuser `postgres`, listening on
/// 127.0.0.1). Stopped and removed when dropped.
pub struct PrivatePg {
    dir: PathBuf,
    port: u16,
}

impl PrivatePg {
    /// initdb, append `extra_conf_lines` to postgresql.conf, start. See [`Self::start_with_files`].
    pub fn start(extra_conf_lines: &[&str]) -> Self {
        Self::start_with_files(extra_conf_lines, &[])
    }

    /// Like [`Self::start`], after writing `files` (name, contents) into the instance's directory,
    /// owned by the server's user with mode 0600 (as PostgreSQL wants for a private key).
    /// `{dir}` in a configuration line is replaced by that directory's absolute path.
    pub fn start_with_files(extra_conf_lines: &[&str], files: &[(&str, &[u8])]) -> Self {
        let dir = std::env::temp_dir().join(crate::unique("private_pg"));
        std::fs::create_dir_all(&dir).expect("create private PostgreSQL directory");
        let port = crate::free_addr().port();
        let pg = Self { dir, port };
        for (name, contents) in files {
            let path = pg.dir.join(name);
            std::fs::write(&path, contents).expect("write private PostgreSQL file");
            set_mode(&path, 0o600);
        }
        chown(&pg.dir, "postgres");
        pg.run(
            "initdb",
            &[
                "-D",
                &pg.data().to_string_lossy(),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        );
        let conf_path = pg.data().join("postgresql.conf");
        let mut conf = std::fs::read_to_string(&conf_path).expect("read postgresql.conf");
        conf.push_str("\nfsync = off\n");
        for line in extra_conf_lines {
            conf.push_str(&line.replace("{dir}", &pg.dir.to_string_lossy()));
            conf.push('\n');
        }
        std::fs::write(&conf_path, conf).expect("write postgresql.conf");
        pg.start_again();
        pg
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The instance's directory (its files, the data directory, the log).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Connection string for database `db` (`postgres` always exists).
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// A crash: `pg_ctl stop -m immediate` (no checkpoint, connections cut).
    pub fn stop_immediate(&self) {
        self.run(
            "pg_ctl",
            &[
                "-D",
                &self.data().to_string_lossy(),
                "-m",
                "immediate",
                "-w",
                "stop",
            ],
        );
    }

    /// Starts the server (again, after [`Self::stop_immediate`]) and waits until it accepts
    /// connections.
    pub fn start_again(&self) {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1",
            self.port,
            self.dir.display()
        );
        self.run(
            "pg_ctl",
            &[
                "-D",
                &self.data().to_string_lossy(),
                "-o",
                &opts,
                "-l",
                &self.dir.join("log").to_string_lossy(),
                "-w",
                "-t",
                "120",
                "start",
            ],
        );
    }

    /// The server log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn run(&self, tool: &str, args: &[&str]) {
        run_as("postgres", &format!("{BIN}/{tool}"), args, || self.log());
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        let _ = as_user(
            "postgres",
            &format!("{BIN}/pg_ctl"),
            &[
                "-D",
                &self.data().to_string_lossy(),
                "-m",
                "immediate",
                "stop",
            ],
        )
        .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `program args` as `user` (through runuser when the tests run as root, as in CI).
/// Runs `program` with `args` as `user` ([`as_user`]) to its end; panics unless it succeeded,
/// with its output and the `log` it wrote to (read only then).
pub(crate) fn run_as(user: &str, program: &str, args: &[&str], log: impl FnOnce() -> String) {
    let out = as_user(user, program, args)
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}{}\nlog:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        log()
    );
}

pub(crate) fn as_user(user: &str, program: &str, args: &[&str]) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", user, "--", program]).args(args);
        c
    } else {
        let mut c = Command::new(program);
        c.args(args);
        c
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Gives `path` (recursively) to `user` when running as root; otherwise the files stay ours.
pub(crate) fn chown(path: &Path, user: &str) {
    if is_root() {
        let status = Command::new("chown")
            .args(["-R", &format!("{user}:{user}")])
            .arg(path)
            .status()
            .expect("run chown");
        assert!(status.success(), "chown {user} {}", path.display());
    }
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

//! A RabbitMQ node of the test's own: its own node name, ports, configuration file, data and log
//! directories (owned by the `rabbitmq` user, as the server runs as it), no plugins. For tests
//! that need a broker configured differently (TLS) or that kill it. The machine's shared node is
//! never touched.

use crate::tls_pg::{as_user, chown};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// A running private RabbitMQ node (user guest/guest, allowed from anywhere). Killed and removed
/// when dropped.
pub struct RabbitNode {
    name: String,
    dir: PathBuf,
    amqp_port: u16,
    tls_port: u16,
    dist_port: u16,
    /// Whether the configuration opens the TLS listener (then start-up waits for it too).
    tls: bool,
    child: Option<Child>,
}

impl RabbitNode {
    /// Starts node `name@localhost` with a plain listener on [`Self::amqp_port`] and
    /// `extra_conf_lines` appended to its rabbitmq.conf. Waits until it accepts connections.
    pub fn start(name: &str, extra_conf_lines: &[&str]) -> Self {
        Self::start_with_files(name, extra_conf_lines, &[])
    }

    /// Like [`Self::start`], after writing `files` (name, contents) into the node's directory.
    /// In configuration lines, `{dir}` is replaced by that directory and `{tls_port}` by
    /// [`Self::tls_port`] (for `listeners.ssl.1 = 127.0.0.1:{tls_port}`).
    pub fn start_with_files(
        name: &str,
        extra_conf_lines: &[&str],
        files: &[(&str, &[u8])],
    ) -> Self {
        let dir = std::env::temp_dir().join(crate::unique("private_rabbit"));
        std::fs::create_dir_all(dir.join("mnesia")).expect("create node directory");
        std::fs::create_dir_all(dir.join("log")).expect("create node log directory");
        let mut node = Self {
            name: format!("{}@localhost", crate::unique(name)),
            dir,
            amqp_port: crate::free_addr().port(),
            tls_port: crate::free_addr().port(),
            dist_port: crate::free_addr().port(),
            tls: extra_conf_lines.iter().any(|l| l.contains("{tls_port}")),
            child: None,
        };
        for (file, contents) in files {
            std::fs::write(node.dir.join(file), contents).expect("write node file");
        }
        let mut conf = format!(
            "listeners.tcp.1 = 127.0.0.1:{}\nloopback_users = none\n",
            node.amqp_port
        );
        for line in extra_conf_lines {
            conf.push_str(
                &line
                    .replace("{dir}", &node.dir.to_string_lossy())
                    .replace("{tls_port}", &node.tls_port.to_string()),
            );
            conf.push('\n');
        }
        std::fs::write(node.dir.join("rabbitmq.conf"), conf).expect("write rabbitmq.conf");
        std::fs::write(node.dir.join("plugins"), "[].\n").expect("write plugins file");
        chown(&node.dir, "rabbitmq");
        node.start_again();
        node
    }

    /// The plain AMQP listener's port.
    pub fn amqp_port(&self) -> u16 {
        self.amqp_port
    }

    /// The port `{tls_port}` in the configuration stands for.
    pub fn tls_port(&self) -> u16 {
        self.tls_port
    }

    /// The node's directory (configuration, files, data, logs).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f` on the plain listener.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.amqp_port)
    }

    /// SIGKILL of the whole node (the Erlang VM and its helpers): a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // The node runs in a process group of its own, led by the child we started.
            crate::signals::signal_group(child.id(), "KILL");
            let _ = child.wait();
        }
    }

    /// Starts the node (again, after [`Self::kill`]) and waits until its listeners accept
    /// connections (bounded: panics after two minutes, with the node's log).
    pub fn start_again(&mut self) {
        let d = |p: &str| self.dir.join(p).to_string_lossy().into_owned();
        let mut cmd = as_user("rabbitmq", "/usr/lib/rabbitmq/bin/rabbitmq-server", &[]);
        cmd.env("HOME", &self.dir)
            .env("RABBITMQ_CONFIG_FILE", d("rabbitmq.conf"))
            .env("RABBITMQ_NODENAME", &self.name)
            .env("RABBITMQ_NODE_PORT", self.amqp_port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d("mnesia"))
            .env("RABBITMQ_LOG_BASE", d("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d("plugins"))
            .env("RABBITMQ_PID_FILE", d("pid"))
            .env("RABBITMQ_FEATURE_FLAGS_FILE", d("ff"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0);
        let child = cmd.spawn().expect("spawn rabbitmq-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let open = |port| std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
            if open(self.amqp_port) && (!self.tls || open(self.tls_port)) {
                return;
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!(
                    "RabbitMQ node {} exited ({status}):\n{}",
                    self.name,
                    self.log()
                );
            }
            if Instant::now() > deadline {
                panic!("RabbitMQ node {} did not start:\n{}", self.name, self.log());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The node's log so far (for failure messages).
    pub fn log(&self) -> String {
        let mut out = String::new();
        if let Ok(entries) = std::fs::read_dir(self.dir.join("log")) {
            for e in entries.flatten() {
                out.push_str(&std::fs::read_to_string(e.path()).unwrap_or_default());
            }
        }
        out
    }
}

impl Drop for RabbitNode {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

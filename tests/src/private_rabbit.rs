//! A RabbitMQ node of the test's own, to kill, restart, cluster and put under alarms, never the
//! machine's shared node: its own node name, AMQP and distribution ports, config file, data and
//! log directories (owned by the `rabbitmq` user the server runs as) and Erlang cookie.
//!
//! Nodes started with the same `cookie` can form a cluster ([`RabbitNode::join`]). Every wait is a
//! bounded poll; a node is killed (SIGKILL, its whole process group) and its directory removed on
//! drop.

use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a node may take to start on a loaded 2-core machine (typically 10-25 s).
pub const START_TIMEOUT: Duration = Duration::from_secs(120);
const SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";

/// One private RabbitMQ node.
pub struct RabbitNode {
    /// `name@localhost`.
    pub node: String,
    dir: PathBuf,
    amqp_port: u16,
    dist_port: u16,
    cookie: String,
    child: Option<Child>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{cmd:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

impl RabbitNode {
    /// Starts a node named `name@localhost` (give each node of a test its own name) with a random
    /// cookie of its own, and waits until it accepts AMQP connections.
    pub fn start(name: &str, extra_conf_lines: &[&str]) -> RabbitNode {
        let cookie = uuid::Uuid::new_v4().simple().to_string().to_uppercase();
        Self::start_with_cookie(name, extra_conf_lines, &cookie)
    }

    /// Starts a node with a given Erlang cookie (the same for every node of one cluster).
    pub fn start_with_cookie(name: &str, extra_conf_lines: &[&str], cookie: &str) -> RabbitNode {
        let unique = crate::unique(name);
        let dir = std::env::temp_dir().join(format!("outbox-rabbit-{unique}"));
        std::fs::create_dir_all(dir.join("mnesia")).expect("node dir");
        std::fs::create_dir_all(dir.join("log")).expect("node log dir");
        let amqp_port = free_port();
        let dist_port = free_port();
        let mut conf = format!(
            "listeners.tcp.1 = 127.0.0.1:{amqp_port}\nloopback_users = none\n\
             cluster_partition_handling = pause_minority\n"
        );
        for line in extra_conf_lines {
            conf.push_str(line);
            conf.push('\n');
        }
        std::fs::write(dir.join("rabbitmq.conf"), conf).expect("write rabbitmq.conf");
        std::fs::write(dir.join("plugins"), "[].\n").expect("write plugins");
        let cookie_file = dir.join(".erlang.cookie");
        std::fs::write(&cookie_file, cookie).expect("write cookie");
        run(Command::new("chmod").arg("400").arg(&cookie_file)).expect("chmod cookie");
        run(Command::new("chown")
            .args(["-R", "rabbitmq:rabbitmq"])
            .arg(&dir))
        .expect("chown node dir");
        let mut node = RabbitNode {
            node: format!("{unique}@localhost"),
            dir,
            amqp_port,
            dist_port,
            cookie: cookie.to_string(),
            child: None,
        };
        node.start_again();
        node
    }

    /// The AMQP port (127.0.0.1).
    pub fn amqp_port(&self) -> u16 {
        self.amqp_port
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f`.
    pub fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.amqp_port)
    }

    pub fn amqp_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.amqp_port))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Starts the (stopped or killed) node again with its data, and waits until it accepts AMQP
    /// connections. A clustered node rejoins its cluster.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "{} is already running", self.node);
        let d = &self.dir;
        let log = std::fs::File::create(d.join("log").join("stdout.log")).expect("stdout log");
        let err = log.try_clone().expect("log handle");
        let child = Command::new("runuser")
            // runuser sets HOME to the rabbitmq user's (the shared node's cookie): set it after.
            .args(["-u", "rabbitmq", "--", "env"])
            .arg(format!("HOME={}", d.display()))
            .arg(SERVER)
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbitmq.conf"))
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_PORT", self.amqp_port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("plugins"))
            .env("RABBITMQ_PID_FILE", d.join("pid"))
            .env("RABBITMQ_FEATURE_FLAGS_FILE", d.join("ff"))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .process_group(0)
            .spawn()
            .expect("spawn rabbitmq-server");
        self.child = Some(child);
        self.wait_accepting();
    }

    /// Polls the AMQP port until the node accepts connections (bounded by [`START_TIMEOUT`]).
    fn wait_accepting(&mut self) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if TcpStream::connect_timeout(&self.amqp_addr(), Duration::from_millis(500)).is_ok()
                && self.ctl(&["await_startup", "--timeout", "30"]).is_ok()
            {
                return;
            }
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!(
                    "{} exited while starting ({status}); see {}",
                    self.node,
                    self.dir.join("log").display()
                );
            }
            assert!(
                Instant::now() < deadline,
                "{} did not accept AMQP connections within {START_TIMEOUT:?}; see {}",
                self.node,
                self.dir.join("log").display()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// SIGKILLs the node (every process of its group: the wrapper and the Erlang VM) and waits
    /// until it is gone. No-op when it is not running.
    pub fn kill(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        crate::signals::signal_group(child.id(), "KILL");
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pid"))
            && let Ok(pid) = pid.trim().parse()
        {
            crate::signals::try_signal_pid(pid, "KILL");
        }
        let _ = child.wait();
        // The VM is gone once its port no longer accepts (bounded).
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect_timeout(&self.amqp_addr(), Duration::from_millis(200)).is_ok()
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs `rabbitmqctl` against this node (with its cookie); stdout, or the error output.
    pub fn ctl(&self, args: &[&str]) -> Result<String, String> {
        run(Command::new("rabbitmqctl")
            .args(["--erlang-cookie", &self.cookie, "-n", &self.node])
            .args(args)
            .stdin(Stdio::null()))
    }

    /// Makes this node a member of `other`'s cluster (stop_app, join_cluster, start_app). Both
    /// must have been started with the same cookie.
    pub fn join(&mut self, other: &RabbitNode) {
        self.ctl(&["stop_app"]).expect("stop_app");
        self.ctl(&["join_cluster", &other.node])
            .expect("join_cluster");
        self.ctl(&["start_app"]).expect("start_app");
        self.wait_accepting();
    }

    /// The node currently leading quorum queue `queue` (vhost `/`), if the cluster knows one.
    pub fn quorum_leader(&self, queue: &str) -> Option<String> {
        let out = self
            .ctl(&["list_queues", "-q", "--no-table-headers", "name", "leader"])
            .ok()?;
        out.lines().find_map(|l| {
            let mut parts = l.split_whitespace();
            (parts.next() == Some(queue))
                .then(|| parts.next().map(str::to_string))
                .flatten()
        })
    }
}

/// Starts `names.len()` nodes with one shared cookie and joins every node to the first.
pub fn start_cluster(names: &[&str], extra_conf_lines: &[&str]) -> Vec<RabbitNode> {
    let cookie = uuid::Uuid::new_v4().simple().to_string().to_uppercase();
    // Started one after the other: on 2 cores, parallel boots only take longer each.
    let mut nodes: Vec<RabbitNode> = names
        .iter()
        .map(|n| RabbitNode::start_with_cookie(n, extra_conf_lines, &cookie))
        .collect();
    let (first, rest) = nodes.split_at_mut(1);
    for n in rest {
        n.join(&first[0]);
    }
    nodes
}

impl Drop for RabbitNode {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

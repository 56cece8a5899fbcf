//! `process_worker` child processes (they know the test definitions of [`crate::process_fixtures`]
//! and [`crate::wait_fixtures`]), and waiting for a process's status.

use crate::{TestDb, bin_path, signals, wait_until};
use processes::{Registry, Worker, WorkerConfig};
use sqlx::PgPool;
use std::io::BufRead;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// How long the process tests wait for a status or a worker.
pub const WAIT: Duration = Duration::from_secs(60);

/// A `process_worker` child process, 1.5 s leases, whose stderr the test reads (and echoes,
/// prefixed with the worker's id). Killed when dropped.
pub struct ChildWorker {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl ChildWorker {
    /// Starts worker `id` on `db` with `env` (`PROCESS_FAILPOINT`, `PROCESS_VERSION`: neither is
    /// inherited from the environment).
    pub fn spawn(db: &TestDb, id: &str, env: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(bin_path("process_worker"));
        cmd.env("DATABASE_URL", &db.url)
            .env("WORKER_ID", id)
            .env("LEASE_MS", "1500")
            .env("RUST_LOG", "info")
            .env_remove("PROCESS_FAILPOINT")
            .env_remove("PROCESS_VERSION")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn process_worker");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("stderr");
        let l = lines.clone();
        let name = id.to_string();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                eprintln!("[{name}] {line}");
                l.lock().unwrap().push(line);
            }
        });
        Self { child, lines }
    }

    /// Whether a line of its stderr so far contains `needle`.
    pub fn said(&self, needle: &str) -> bool {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains(needle))
    }

    /// Sends `sig` (`STOP`, `CONT`, `TERM`, ...).
    pub fn signal(&self, sig: &str) {
        signals::signal_pid(self.child.id(), sig);
    }

    /// SIGKILL, and reap it.
    pub fn sigkill(&mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }

    /// SIGTERM, and its exit status.
    pub fn sigterm_and_wait(&mut self) -> ExitStatus {
        self.signal("TERM");
        self.child.wait().expect("reap")
    }

    /// Waits (up to [`WAIT`]) for the worker to die by itself (a failpoint aborts it).
    pub async fn exited(&mut self) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return s;
            }
            assert!(started.elapsed() < WAIT, "the worker did not die");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for ChildWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A process worker in the test's process (schema `outbox`): 3 s leases, 500 ms heartbeats,
/// 100 ms polls, 200 ms stats.
pub struct InProcessWorker {
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
}

impl InProcessWorker {
    pub fn start(pool: &PgPool, id: &str, registry: Registry) -> Self {
        let mut config = WorkerConfig::new(pool.clone(), Default::default(), id);
        config.lease = Duration::from_secs(3);
        config.heartbeat = Duration::from_millis(500);
        config.poll_interval = Duration::from_millis(100);
        config.stats_interval = Duration::from_millis(200);
        Self::start_with(config, registry)
    }

    /// A worker with `config` as it is.
    pub fn start_with(config: WorkerConfig, registry: Registry) -> Self {
        let stop = CancellationToken::new();
        let s = stop.clone();
        let handle = tokio::spawn(async move {
            Worker::run(config, registry, s).await.expect("worker runs");
        });
        Self { stop, handle }
    }

    /// Stops it and waits until it has.
    pub async fn stop(self) {
        self.stop.cancel();
        self.handle.await.unwrap();
    }
}

/// The status of process `id`.
pub async fn status(pool: &PgPool, id: Uuid) -> String {
    sqlx::query_scalar("SELECT status FROM outbox.processes WHERE id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Waits (up to [`WAIT`]) until process `id` has status `want`.
pub async fn wait_status(pool: &PgPool, id: Uuid, want: &str) {
    let p = pool.clone();
    wait_until(&format!("process {id} {want}"), WAIT, || {
        let p = p.clone();
        async move { (status(&p, id).await == want).then_some(()) }
    })
    .await;
}

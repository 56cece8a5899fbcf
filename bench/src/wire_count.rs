//! Counts PostgreSQL round trips, statements and transactions on the wire: a TCP proxy in front
//! of the server that reads both sides of the protocol.
//!
//! - A round trip is a message that makes the server answer and wait for the client again:
//!   `Sync` (the end of an extended-protocol exchange; alone, it is sqlx's pool ping) or `Query`
//!   (a simple query, such as sqlx's `BEGIN` and `COMMIT`).
//! - A statement is a `Bind` (one execution of a prepared statement, named by the SQL its `Parse`
//!   gave) or a `Query`; a `Sync` with neither before it is a ping.
//! - A transaction ends when the server reports itself idle (`ReadyForQuery` with status `I`)
//!   after a transaction block or after a statement run outside one (autocommit): commits, and the
//!   rare rollbacks, as `pg_stat_database` would count them but exactly for these connections and
//!   without its reporting delay.
//!
//! Connections must not use TLS (`sslmode=disable`): the counts read plain messages.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// SSLRequest and GSSENCRequest: a client may ask before its startup message; the server answers
/// one untyped byte (`N`: refused).
const SSL_REQUEST: i32 = 80_877_103;
const GSSENC_REQUEST: i32 = 80_877_104;

/// What the proxy counted so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    pub round_trips: u64,
    pub transactions: u64,
    pub pings: u64,
    /// Statements by the start of their SQL (whitespace collapsed).
    pub statements: HashMap<String, u64>,
}

impl Counts {
    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &Counts) -> Counts {
        Counts {
            round_trips: self.round_trips - earlier.round_trips,
            transactions: self.transactions - earlier.transactions,
            pings: self.pings - earlier.pings,
            statements: self
                .statements
                .iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        v - earlier.statements.get(k).copied().unwrap_or(0),
                    )
                })
                .filter(|(_, v)| *v > 0)
                .collect(),
        }
    }
}

#[derive(Default)]
struct Shared {
    round_trips: AtomicU64,
    transactions: AtomicU64,
    pings: AtomicU64,
    statements: Mutex<HashMap<String, u64>>,
}

/// The proxy; stops when dropped.
pub struct WireCounter {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

impl WireCounter {
    /// Listens on a free local port and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        let stop = CancellationToken::new();
        let (sh, s) = (shared.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    _ = s.cancelled() => return,
                };
                let Ok((client, _)) = accepted else { continue };
                let (sh, s) = (sh.clone(), s.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        _ = relay(client, upstream, sh) => {}
                        _ = s.cancelled() => {}
                    }
                });
            }
        });
        Ok(Self { addr, shared, stop })
    }

    /// `url` (a `postgres://user@host:port/db` URL) pointed at the proxy, without TLS.
    pub fn url_for(&self, url: &str) -> anyhow::Result<String> {
        let (scheme_user, rest) = url
            .split_once('@')
            .ok_or_else(|| anyhow::anyhow!("database url has no user@host"))?;
        let (_, path) = rest
            .split_once('/')
            .ok_or_else(|| anyhow::anyhow!("database url has no database"))?;
        let sep = if path.contains('?') { '&' } else { '?' };
        Ok(format!(
            "{scheme_user}@{}/{path}{sep}sslmode=disable",
            self.addr
        ))
    }

    pub fn counts(&self) -> Counts {
        Counts {
            round_trips: self.shared.round_trips.load(Ordering::Relaxed),
            transactions: self.shared.transactions.load(Ordering::Relaxed),
            pings: self.shared.pings.load(Ordering::Relaxed),
            statements: self
                .shared
                .statements
                .lock()
                .map(|m| m.clone())
                .unwrap_or_default(),
        }
    }
}

impl Drop for WireCounter {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// One message: its type (None in the startup phase) and body.
async fn read_message<R: AsyncRead + Unpin>(
    r: &mut R,
    typed: bool,
) -> std::io::Result<(Option<u8>, Vec<u8>)> {
    let mut head = [0u8; 5];
    let kind = if typed {
        r.read_exact(&mut head).await?;
        Some(head[0])
    } else {
        r.read_exact(&mut head[1..]).await?;
        None
    };
    let len = i32::from_be_bytes([head[1], head[2], head[3], head[4]]);
    let body_len = usize::try_from(len.saturating_sub(4)).unwrap_or(0);
    let from = if typed { 0 } else { 1 };
    let mut msg = Vec::with_capacity(5 + body_len);
    msg.extend_from_slice(&head[from..]);
    msg.resize(msg.len() + body_len, 0);
    let at = msg.len() - body_len;
    r.read_exact(&mut msg[at..]).await?;
    Ok((kind, msg))
}

/// The NUL-terminated strings at the start of a message body.
fn cstrings(body: &[u8], n: usize) -> Vec<String> {
    body.split(|&b| b == 0)
        .take(n)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

fn head_of(sql: &str) -> String {
    let collapsed = sql.split_whitespace().collect::<Vec<_>>().join(" ");
    collapsed.chars().take(48).collect()
}

async fn relay(client: TcpStream, upstream: SocketAddr, sh: Arc<Shared>) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (from_client, mut to_client) = client.into_split();
    let (from_server, mut to_server) = server.into_split();
    let mut from_client = tokio::io::BufReader::new(from_client);
    let mut from_server = tokio::io::BufReader::new(from_server);
    // A statement ran since the server last said it was ready.
    let executed = Arc::new(AtomicBool::new(false));
    let (sh_up, executed_up) = (sh.clone(), executed.clone());
    let up = async move {
        let mut typed = false;
        let mut prepared: HashMap<String, String> = HashMap::new();
        let mut since_sync = false;
        loop {
            let (kind, msg) = read_message(&mut from_client, typed).await?;
            let body = &msg[if kind.is_some() { 5 } else { 4 }..];
            match kind {
                None => {
                    let code = body
                        .get(..4)
                        .map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
                        .unwrap_or(0);
                    typed = code != SSL_REQUEST && code != GSSENC_REQUEST;
                }
                Some(b'P') => {
                    let s = cstrings(body, 2);
                    if let [name, sql] = &s[..] {
                        prepared.insert(name.clone(), head_of(sql));
                    }
                }
                Some(b'B') => {
                    let s = cstrings(body, 2);
                    let head = s
                        .get(1)
                        .and_then(|name| prepared.get(name))
                        .cloned()
                        .unwrap_or_else(|| "(unnamed)".into());
                    if let Ok(mut m) = sh_up.statements.lock() {
                        *m.entry(head).or_default() += 1;
                    }
                    since_sync = true;
                    executed_up.store(true, Ordering::SeqCst);
                }
                Some(b'Q') => {
                    let sql = cstrings(body, 1).pop().unwrap_or_default();
                    if let Ok(mut m) = sh_up.statements.lock() {
                        *m.entry(head_of(&sql)).or_default() += 1;
                    }
                    sh_up.round_trips.fetch_add(1, Ordering::Relaxed);
                    executed_up.store(true, Ordering::SeqCst);
                }
                Some(b'S') => {
                    sh_up.round_trips.fetch_add(1, Ordering::Relaxed);
                    if !since_sync {
                        sh_up.pings.fetch_add(1, Ordering::Relaxed);
                    }
                    since_sync = false;
                }
                Some(_) => {}
            }
            to_server.write_all(&msg).await?;
        }
        #[allow(unreachable_code)]
        Ok::<(), std::io::Error>(())
    };
    let down = async move {
        let mut last_status = b'I';
        loop {
            let (kind, msg) = read_message(&mut from_server, true).await?;
            if kind == Some(b'Z') {
                let status = msg.get(5).copied().unwrap_or(b'I');
                let ran = executed.swap(false, Ordering::SeqCst);
                if status == b'I' && (last_status != b'I' || ran) {
                    sh.transactions.fetch_add(1, Ordering::Relaxed);
                }
                last_status = status;
            }
            to_client.write_all(&msg).await?;
        }
        #[allow(unreachable_code)]
        Ok::<(), std::io::Error>(())
    };
    tokio::select! {
        _ = down => {}
        _ = up => {}
    }
}

//! TLS to PostgreSQL and RabbitMQ, against a private PostgreSQL with `ssl = on` and a private
//! RabbitMQ node with a TLS listener, both using certificates this test generates (a CA of its
//! own, and a second CA that signed nothing the servers use, as the wrong one).

use consumer::{Config, Consumer, Handler, HandlerError, Handlers};
use plumbing::amqp_tls::AmqpTls;
use plumbing::telemetry::ErrorChain;
use serde_json::json;
use shared::{Envelope, NewMessage};
use sqlx::{PgConnection, PgPool};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use system_tests::tls_pg::PrivatePg;
use system_tests::tls_rabbit::RabbitNode;
use system_tests::*;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

const LONG: Duration = Duration::from_secs(90);

/// A CA and a server certificate it signed for `localhost` and `127.0.0.1`, in PEM.
struct Pki {
    ca: String,
    server_cert: String,
    server_key: String,
}

fn ca_params(name: &str) -> rcgen::CertificateParams {
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.distinguished_name
        .push(rcgen::DnType::CommonName, name.to_string());
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    p
}

fn pki() -> Pki {
    pki_for(&["localhost", "127.0.0.1"])
}

/// A CA and a server certificate for `names` only.
fn pki_for(names: &[&str]) -> Pki {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params("outbox test CA"), ca_key).unwrap();
    let server_key = rcgen::KeyPair::generate().unwrap();
    let mut params =
        rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "localhost");
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let server = params.signed_by(&server_key, &ca).unwrap();
    Pki {
        ca: ca.pem(),
        server_cert: server.pem(),
        server_key: server_key.serialize_pem(),
    }
}

/// A CA that signed nothing the servers present.
fn wrong_ca() -> String {
    let key = rcgen::KeyPair::generate().unwrap();
    rcgen::CertifiedIssuer::self_signed(ca_params("some other CA"), key)
        .unwrap()
        .pem()
}

fn tls_pg(pki: &Pki) -> PrivatePg {
    PrivatePg::start_with_files(
        &[
            "ssl = on",
            "ssl_cert_file = '{dir}/server.crt'",
            "ssl_key_file = '{dir}/server.key'",
        ],
        &[
            ("server.crt", pki.server_cert.as_bytes()),
            ("server.key", pki.server_key.as_bytes()),
        ],
    )
}

fn with_tls(url: &str, mode: &str, root: Option<&Path>) -> String {
    match root {
        Some(ca) => format!("{url}?sslmode={mode}&sslrootcert={}", ca.display()),
        None => format!("{url}?sslmode={mode}"),
    }
}

/// Creates database `app` on the private server (over its plain admin connection).
async fn create_app_database(pg: &PrivatePg) {
    let mut admin = <PgConnection as sqlx::Connection>::connect(&pg.url("postgres"))
        .await
        .unwrap();
    sqlx::query("CREATE DATABASE app")
        .execute(&mut admin)
        .await
        .unwrap();
}

/// Whether the pool's connection is encrypted, as the server sees it.
async fn is_ssl(pool: &PgPool) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sslmodes_require_verify_ca_and_verify_full_connect_and_a_wrong_ca_is_refused() {
    init_logging();
    let pki = pki();
    let pg = tls_pg(&pki);
    let files = TempDir::new("tls_files");
    let ca = files.write("ca.pem", &pki.ca);
    let wrong = files.write("wrong-ca.pem", &wrong_ca());
    let url = pg.url("postgres");

    for (mode, root) in [
        ("verify-full", Some(ca.as_path())),
        ("verify-ca", Some(ca.as_path())),
        ("require", None),
    ] {
        let pool = plumbing::db::connect(&with_tls(&url, mode, root), 2, "tls-test")
            .await
            .unwrap_or_else(|e| panic!("sslmode={mode}: {}", ErrorChain(&e)));
        assert!(
            is_ssl(&pool).await,
            "sslmode={mode} gives an encrypted connection"
        );
        pool.close().await;
    }

    for (mode, root) in [
        ("verify-full", Some(wrong.as_path())),
        ("verify-ca", Some(wrong.as_path())),
        // No CA file: the system's roots do not know the test's CA.
        ("verify-full", None),
    ] {
        let err = plumbing::db::connect(&with_tls(&url, mode, root), 2, "tls-test")
            .await
            .err()
            .unwrap_or_else(|| panic!("sslmode={mode} with {root:?} must be refused"));
        let text = ErrorChain(&err).to_string();
        eprintln!("sslmode={mode} with {root:?}: {text}");
        assert!(
            text.contains("cannot connect to PostgreSQL") && text.contains("certificate"),
            "a clear error for sslmode={mode} with {root:?}: {text}"
        );
    }

    // A certificate from the right CA, for another host: verify-ca accepts it, verify-full not.
    let elsewhere = pki_for(&["db.elsewhere.example"]);
    let other_pg = tls_pg(&elsewhere);
    let other_ca = files.write("other-ca.pem", &elsewhere.ca);
    let other_url = other_pg.url("postgres");
    let pool = plumbing::db::connect(&with_tls(&other_url, "verify-ca", Some(&other_ca)), 1, "t")
        .await
        .unwrap_or_else(|e| panic!("verify-ca ignores the host name: {}", ErrorChain(&e)));
    assert!(is_ssl(&pool).await);
    pool.close().await;
    let err = plumbing::db::connect(
        &with_tls(&other_url, "verify-full", Some(&other_ca)),
        1,
        "t",
    )
    .await
    .expect_err("verify-full checks the host name");
    let text = ErrorChain(&err).to_string();
    eprintln!("verify-full, certificate for another host: {text}");
    assert!(
        text.contains("certificate not valid for name"),
        "a clear error for a host name mismatch: {text}"
    );
}

fn spawn_relay(
    db_url: &str,
    amqp_url: &str,
    amqp_ca: Option<&Path>,
    exchange: &str,
    extra: &[&str],
) -> Child {
    let mut cmd = relays::relay_command(db_url, amqp_url, exchange, free_addr());
    cmd.args(["--lease-ms", "2000", "--confirm-timeout-ms", "800"])
        .args(["--retry-base-ms", "50", "--retry-max-ms", "200"])
        .args(extra);
    if let Some(ca) = amqp_ca {
        cmd.env("AMQP_CA_FILE", ca);
    }
    cmd.spawn().expect("spawn relay")
}

fn msg(n: i64) -> NewMessage {
    NewMessage::new(
        "order",
        format!("o-{n}"),
        "order.created",
        json!({ "n": n }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_binary_publishes_over_verify_full_with_every_connection_encrypted() {
    init_logging();
    let pki = pki();
    let pg = tls_pg(&pki);
    let files = TempDir::new("tls_files");
    let ca = files.write("ca.pem", &pki.ca);
    create_app_database(&pg).await;
    let url = with_tls(&pg.url("app"), "verify-full", Some(&ca));
    let pool = plumbing::db::connect_and_migrate(
        &url,
        4,
        "tls-test",
        &Default::default(),
        Duration::from_secs(30),
    )
    .await
    .unwrap();

    let broker = TestBroker::new();
    let (conn, exchange) = broker.declared_outbox(true).await;
    let queue = broker.queue("tls");
    let mut rx = collect_queue(&conn, &exchange, &queue, &["#"]).await;

    for n in 0..50 {
        shared::outbox::enqueue(&pool, &msg(n)).await.unwrap();
    }
    let _relay = spawn_relay(&url, &amqp_url(), None, &exchange, &[]);
    let first = receive_n(&mut rx, 50, LONG).await;
    assert_eq!(first.len(), 50);

    // Every relay connection is encrypted, the LISTEN connection included.
    let relay_conns = || async {
        sqlx::query_as::<_, (i64, i64, bool)>(
            "SELECT count(*), count(*) FILTER (WHERE a.query ILIKE 'LISTEN%'), \
                    COALESCE(bool_and(s.ssl), false) \
             FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.application_name = 'outbox-relay'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let (count, listening, all_ssl) = wait_until("the relay LISTENs", LONG, || async {
        let c = relay_conns().await;
        (c.1 == 1).then_some(c)
    })
    .await;
    assert!(
        count >= 2,
        "the relay's pool and LISTEN connection are open"
    );
    assert_eq!(listening, 1);
    assert!(all_ssl, "every relay connection is encrypted");

    for n in 50..60 {
        shared::outbox::enqueue(&pool, &msg(n)).await.unwrap();
    }
    let second = receive_n(&mut rx, 10, LONG).await;
    assert_eq!(
        second.len(),
        10,
        "woken by NOTIFY over TLS, not by the hour-long poll"
    );
}

// ---------------------------------------------------------------------------------------------
// RabbitMQ
// ---------------------------------------------------------------------------------------------

fn tls_node(pki: &Pki) -> RabbitNode {
    RabbitNode::start_with_files(
        "tls",
        &[
            "listeners.ssl.1 = 127.0.0.1:{tls_port}",
            "ssl_options.cacertfile = {dir}/ca.pem",
            "ssl_options.certfile = {dir}/server.pem",
            "ssl_options.keyfile = {dir}/server.key",
            "ssl_options.verify = verify_none",
            "ssl_options.fail_if_no_peer_cert = false",
        ],
        &[
            ("ca.pem", pki.ca.as_bytes()),
            ("server.pem", pki.server_cert.as_bytes()),
            ("server.key", pki.server_key.as_bytes()),
        ],
    )
}

struct Count;

impl Handler for Count {
    async fn handle(&self, _tx: &mut PgConnection, _msg: &Envelope) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_consumer_over_amqps_with_a_ca_file_and_a_wrong_ca_is_refused() {
    init_logging();
    let pki = pki();
    let node = tls_node(&pki);
    let files = TempDir::new("tls_files");
    let ca = files.write("ca.pem", &pki.ca);
    let wrong = files.write("wrong-ca.pem", &wrong_ca());
    let not_pem = files.write("not-pem.txt", "hello\n");
    let amqps = format!("amqps://guest:guest@127.0.0.1:{}/%2f", node.tls_port());

    // Refused: the wrong CA, no CA (the system's roots), a file that is no certificate.
    for tls in [AmqpTls::with_ca_file(&wrong), AmqpTls::default()] {
        let err = plumbing::amqp::connect(&amqps, &tls, "tls-test")
            .await
            .err()
            .unwrap_or_else(|| panic!("{tls:?} must be refused"));
        let text = ErrorChain(&err).to_string();
        eprintln!("{tls:?}: {text}");
        assert!(
            text.contains("cannot connect to RabbitMQ") && text.contains("certificate"),
            "a clear error for {tls:?}: {text}"
        );
    }
    let err = plumbing::amqp::connect(&amqps, &AmqpTls::with_ca_file(&not_pem), "tls-test")
        .await
        .expect_err("a file without a certificate is refused");
    let text = ErrorChain(&err).to_string();
    assert!(
        text.contains("holds no PEM CERTIFICATE"),
        "a clear error for a bad CA file: {text}"
    );

    // The relay binary publishes and the consumer library consumes, both over amqps.
    let db = TestDb::new().await;
    let exchange = unique("outbox");
    let name = unique("cons");
    let mut config = Config::new(&name, &amqps, &exchange);
    config.amqp_tls = AmqpTls::with_ca_file(&ca);
    config.retry_delays = vec![Duration::from_millis(100)];
    let pool = plumbing::db::connect(&db.url, config.pool_size(), "consumer-tls")
        .await
        .unwrap();
    let consumer = Consumer::new(config, pool, Handlers::new().on("order.created", Count))
        .expect("valid config");
    let readiness = consumer.readiness();
    let stop = CancellationToken::new();
    let running = tokio::spawn(consumer.run(stop.clone()));
    wait_until("consumer connected over amqps", LONG, || {
        let r = readiness.clone();
        async move { r.rabbitmq().then_some(()) }
    })
    .await;

    for n in 0..40 {
        shared::outbox::enqueue(&db.pool, &msg(n)).await.unwrap();
    }
    let mut relay = spawn_relay(&db.url, &amqps, Some(&ca), &exchange, &[]);
    wait_until("40 messages consumed over amqps", LONG, || async {
        let n = consumers::processed_rows(&db.pool, &name).await;
        (n == 40).then_some(())
    })
    .await;
    // The relay marks a row after the broker's confirm, which may come after the consumer's commit.
    wait_no_pending(&db.pool, LONG).await;
    relay.kill().await.unwrap();

    stop.cancel();
    tokio::time::timeout(LONG, running)
        .await
        .expect("consumer stops")
        .unwrap()
        .unwrap();
}

// ---------------------------------------------------------------------------------------------
// Every binary
// ---------------------------------------------------------------------------------------------

/// Runs a one-shot command and returns its standard output; panics with its output if it failed.
async fn run_ok(bin: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new(bin_path(bin))
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .output()
        .await
        .unwrap_or_else(|e| panic!("run {bin}: {e}"));
    assert!(out.status.success(), "{bin} {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A long-running binary with `env`, killed when dropped.
fn daemon(bin: &str, args: &[&str], env: &[(&str, &str)]) -> Child {
    Command::new(bin_path(bin))
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {bin}: {e}"))
}

async fn wait_ready(what: &str, addr: std::net::SocketAddr, path: &str) {
    wait_http_ok(what, addr, path, LONG).await;
}

/// Every binary of the system with `sslmode=verify-full` against the test's CA, and every one
/// that talks to RabbitMQ over `amqps://` with `AMQP_CA_FILE`: the migrations, the API, the
/// payment provider, the payment worker, the relay, the ledger consumer, the console (its API and
/// its dead-letter view) and `consumer dlq list`. A payment runs end to end, and every connection
/// the server sees is encrypted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_binary_runs_over_verify_full_postgres_and_amqps() {
    init_logging();
    let pki = pki();
    let pg = tls_pg(&pki);
    let node = tls_node(&pki);
    let files = TempDir::new("tls_files");
    let ca = files.write("ca.pem", &pki.ca);
    let ca_file = ca.to_str().unwrap().to_string();
    create_app_database(&pg).await;
    let url = with_tls(&pg.url("app"), "verify-full", Some(&ca));
    let amqps = format!("amqps://guest:guest@localhost:{}/%2f", node.tls_port());
    let exchange = unique("outbox");
    let db = [("DATABASE_URL", url.as_str())];

    // One-shot commands: each binary's migrations, an API key, a console user.
    for bin in ["relay", "producer", "console"] {
        run_ok(bin, &["migrate"], &db).await;
    }
    let key = run_ok("producer", &["api-key", "create", "--tenant", "acme"], &db).await;
    let key = key.lines().last().unwrap().trim().to_string();
    let token = run_ok(
        "console",
        &["user", "create", "--name", "ops", "--role", "admin"],
        &db,
    )
    .await;
    let token = token.lines().last().unwrap().trim().to_string();

    // The services.
    let ledger_metrics = free_addr().to_string();
    let _ledger = daemon(
        "producer",
        &["ledger", "--name", "ledger", "--bind", "payment.captured"],
        &[
            ("DATABASE_URL", &url),
            ("AMQP_URL", &amqps),
            ("AMQP_CA_FILE", &ca_file),
            ("OUTBOX_EXCHANGE", &exchange),
            ("METRICS_ADDR", &ledger_metrics),
        ],
    );
    let relay_metrics = free_addr().to_string();
    let _relay = daemon(
        "relay",
        &[],
        &[
            ("DATABASE_URL", &url),
            ("AMQP_URL", &amqps),
            ("AMQP_CA_FILE", &ca_file),
            ("OUTBOX_EXCHANGE", &exchange),
            ("METRICS_ADDR", &relay_metrics),
        ],
    );
    let provider_addr = free_addr();
    let _provider = daemon(
        "payment-provider",
        &[],
        &[
            ("DATABASE_URL", &url),
            ("PROVIDER_ADDR", &provider_addr.to_string()),
        ],
    );
    let worker_metrics = free_addr().to_string();
    let _worker = daemon(
        "producer",
        &["worker"],
        &[
            ("DATABASE_URL", &url),
            ("PROVIDER_URL", &format!("http://{provider_addr}")),
            ("METRICS_ADDR", &worker_metrics),
            ("WORKER_POLL_MS", "200"),
        ],
    );
    let api_addr = free_addr();
    let _api = daemon(
        "producer",
        &[],
        &[
            ("DATABASE_URL", &url),
            ("LISTEN_ADDR", &api_addr.to_string()),
        ],
    );
    let console_addr = free_addr();
    let _console = daemon(
        "console",
        &["serve"],
        &[
            ("DATABASE_URL", &url),
            ("AMQP_URL", &amqps),
            ("AMQP_CA_FILE", &ca_file),
            ("CONSOLE_ADDR", &console_addr.to_string()),
            // An allowlist: the ledger's dead letters are browsable only when it is listed.
            ("CONSOLE_CONSUMERS", "ledger"),
        ],
    );
    wait_ready("ledger", ledger_metrics.parse().unwrap(), "/readyz").await;
    wait_ready("relay", relay_metrics.parse().unwrap(), "/readyz").await;
    wait_ready("payment provider", provider_addr, "/readyz").await;
    wait_ready("worker", worker_metrics.parse().unwrap(), "/readyz").await;
    wait_ready("API", api_addr, "/readyz").await;
    wait_ready("console", console_addr, "/readyz").await;

    // A payment end to end: API -> process worker -> provider -> outbox -> relay -> ledger.
    let http = reqwest::Client::new();
    let post = |path: &str, idem: &str, body: serde_json::Value| {
        http.post(format!("http://{api_addr}{path}"))
            .bearer_auth(&key)
            .header("Idempotency-Key", idem)
            .json(&body)
            .send()
    };
    let order = post(
        "/orders",
        "order-1",
        json!({"customer_id": "c-1", "currency": "EUR",
               "items": [{"sku": "sku-1", "quantity": 1, "unit_price": 700}]}),
    )
    .await
    .unwrap();
    assert_eq!(order.status(), 201);
    let order: serde_json::Value = order.json().await.unwrap();
    let payment = post(
        "/payments",
        "pay-1",
        json!({"order_id": order["id"], "amount": 700, "currency": "EUR"}),
    )
    .await
    .unwrap();
    assert_eq!(payment.status(), 202);
    let pool = plumbing::db::connect(&url, 2, "tls-test").await.unwrap();
    let updates: i64 = wait_until("the ledger applied the capture", LONG, || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT coalesce(sum(updates), 0)::bigint FROM demo.ledger_balances",
        )
        .fetch_one(&pool)
        .await
        .ok()
        .filter(|n| *n > 0)
    })
    .await;
    assert_eq!(updates, 1);

    // The console's API (PostgreSQL) and its dead-letter view (RabbitMQ), and the consumer CLI.
    for path in ["/api/processes", "/api/dead-letters?consumer=ledger"] {
        let r = http
            .get(format!("http://{console_addr}{path}"))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}: {:?}", r.text().await);
    }
    run_ok(
        "consumer",
        &["--name", "ledger", "dlq", "list"],
        &[
            ("DATABASE_URL", &url),
            ("AMQP_URL", &amqps),
            ("AMQP_CA_FILE", &ca_file),
        ],
    )
    .await;

    // Every client connection the server has is encrypted, and every service is among them.
    let conns: Vec<(String, bool)> = sqlx::query_as(
        "SELECT a.application_name, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
         WHERE a.backend_type = 'client backend' AND a.datname = 'app'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let unencrypted: Vec<&(String, bool)> = conns.iter().filter(|(_, ssl)| !ssl).collect();
    assert!(unencrypted.is_empty(), "unencrypted: {unencrypted:?}");
    let names: std::collections::BTreeSet<&str> = conns.iter().map(|(n, _)| n.as_str()).collect();
    for service in [
        "outbox-relay",
        "consumer ledger",
        "payment-provider",
        "producer worker",
        "producer",
        "console",
    ] {
        assert!(names.contains(service), "{service} is connected: {names:?}");
    }
}

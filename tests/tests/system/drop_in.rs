//! The product installed into a team's own database: its objects stay in its own schema, the
//! service's tables and migration history are left exactly as they were, two installations share
//! a database without crossing, and a database of the previous release (tables in `public`) is
//! upgraded without losing a row.

use serde_json::json;
use shared::NewMessage;
use shared::outbox::Outbox;
use shared::schema::Schema;
use sqlx::PgPool;
use sqlx::migrate::{Migration, MigrationType, Migrator};
use std::borrow::Cow;
use std::collections::{BTreeSet, HashSet};
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;
use system_tests::consumers::example_consumer_command;
use system_tests::relays::FAST_FLAGS;
use system_tests::*;
use tokio::process::{Child, Command};

const LONG: Duration = Duration::from_secs(60);

/// A service's own schema, with table names the product and its example also use.
const SERVICE_SCHEMA: &str = "
CREATE TABLE public.users (id bigint PRIMARY KEY, email text NOT NULL UNIQUE);
CREATE TABLE public.orders (id bigint PRIMARY KEY, user_id bigint REFERENCES public.users (id), total numeric(12,2));
CREATE TABLE public.order_items (order_id bigint REFERENCES public.orders (id), sku text, PRIMARY KEY (order_id, sku));
CREATE TABLE public.payments (id uuid PRIMARY KEY, order_id bigint, state text CHECK (state IN ('new', 'done')));
CREATE TABLE public.api_keys (name text PRIMARY KEY, secret text);
CREATE TABLE public.ledger_balances (account text PRIMARY KEY, cents bigint);
CREATE TABLE public.processed_messages (id text PRIMARY KEY, at timestamptz);
CREATE TABLE public.messages (id serial PRIMARY KEY, body text);
CREATE INDEX orders_user_idx ON public.orders (user_id);
CREATE FUNCTION public.touch() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$;
CREATE TRIGGER messages_touch BEFORE INSERT ON public.messages FOR EACH ROW EXECUTE FUNCTION public.touch();
INSERT INTO public.users VALUES (1, 'a@example.com'), (2, 'b@example.com');
INSERT INTO public.orders VALUES (10, 1, 12.50), (11, 2, 99.99);
INSERT INTO public.order_items VALUES (10, 'sku-1'), (11, 'sku-2');
INSERT INTO public.payments VALUES ('00000000-0000-0000-0000-000000000001', 10, 'done');
INSERT INTO public.api_keys VALUES ('ci', 'not-a-real-secret');
INSERT INTO public.ledger_balances VALUES ('acct', 4200);
INSERT INTO public.processed_messages VALUES ('m-1', '2024-01-01T00:00:00Z');
INSERT INTO public.messages (body) VALUES ('hello');
";

/// The service's own sqlx migrations, recorded in its `public._sqlx_migrations`.
fn service_migrator() -> Migrator {
    Migrator::with_migrations(vec![Migration::new(
        20240101000000,
        Cow::Borrowed("service tables"),
        MigrationType::Simple,
        sqlx::SqlSafeStr::into_sql_str(SERVICE_SCHEMA),
        false,
    )])
}

/// Everything about `public` that a migration could change: the definitions of its tables,
/// columns, indexes, constraints, triggers and functions, and every row of every table.
async fn public_snapshot(pool: &PgPool) -> String {
    let defs: String = sqlx::query_scalar(
        "SELECT coalesce(string_agg(x, E'\\n' ORDER BY x), '') FROM ( \
           SELECT format('col %s.%s %s %s %s', table_name, column_name, data_type, is_nullable, column_default) \
             FROM information_schema.columns WHERE table_schema = 'public' \
           UNION ALL SELECT 'idx ' || indexdef FROM pg_indexes WHERE schemaname = 'public' \
           UNION ALL SELECT 'con ' || conrelid::regclass || ' ' || conname || ' ' || pg_get_constraintdef(oid) \
             FROM pg_constraint WHERE connamespace = 'public'::regnamespace \
           UNION ALL SELECT 'trg ' || tgrelid::regclass || ' ' || tgname FROM pg_trigger t \
             JOIN pg_class c ON c.oid = t.tgrelid WHERE c.relnamespace = 'public'::regnamespace AND NOT t.tgisinternal \
           UNION ALL SELECT 'fn ' || p.oid::regprocedure || ' ' || md5(p.prosrc) FROM pg_proc p \
             WHERE p.pronamespace = 'public'::regnamespace \
           UNION ALL SELECT 'rel ' || relname || ' ' || relkind::text FROM pg_class \
             WHERE relnamespace = 'public'::regnamespace \
         ) s(x)",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut out = defs;
    for t in tables {
        let rows: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT coalesce(string_agg(t::text, E'\\n' ORDER BY t::text), '') FROM public.\"{t}\" t"
        )))
        .fetch_one(pool)
        .await
        .unwrap();
        out.push_str(&format!("\n== {t}\n{rows}"));
    }
    out
}

/// The schemas of the database, without PostgreSQL's own.
async fn schemas(pool: &PgPool) -> BTreeSet<String> {
    sqlx::query_scalar(
        "SELECT nspname::text FROM pg_namespace \
         WHERE nspname NOT LIKE 'pg\\_%' AND nspname <> 'information_schema'",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn spawn_relay(db_url: &str, schema: &str, exchange: &str, metrics: SocketAddr) -> Child {
    relays::relay_command(db_url, &amqp_url(), exchange, metrics)
        .args(&FAST_FLAGS[..6]) // lease, poll and confirm timeout
        .env("OUTBOX_SCHEMA", schema)
        .spawn()
        .expect("spawn relay")
}

async fn wait_ready(what: &str, addr: SocketAddr) {
    wait_http_ok(what, addr, "/readyz", LONG).await;
}

fn event(aggregate: &str, event_type: &str, payload: serde_json::Value) -> NewMessage {
    NewMessage::new("test", aggregate, event_type, payload)
}

async fn declare(broker: &TestBroker, exchange: &str) {
    broker.track_exchange(&plumbing::amqp::unrouted_name(exchange));
    broker.track_queue(&plumbing::amqp::unrouted_name(exchange));
    let conn = broker.connect().await;
    plumbing::amqp::declare_outbox_exchange(&conn, exchange, true)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_database_keeps_its_tables_and_history_while_relay_consumer_and_demo_run() {
    let db = TestDb::new_unmigrated().await;
    service_migrator().run(&db.pool).await.unwrap();
    let before = public_snapshot(&db.pool).await;
    assert!(
        before.contains("== _sqlx_migrations\n(20240101000000,"),
        "{before}"
    );

    let broker = TestBroker::new();
    let exchange = broker.exchange("dropin");
    declare(&broker, &exchange).await;
    let conn = broker.connect().await;
    let queue = broker.queue("dropin");
    let mut received = collect_queue(&conn, &exchange, &queue, &["order.*"]).await;

    // Three binaries start at once on a database the product has never seen: each migrates.
    let relay_metrics = free_addr();
    let _relay = spawn_relay(&db.url, "outbox", &exchange, relay_metrics);
    let api_addr = free_addr();
    let _api = Command::new(bin_path("producer"))
        .env("DATABASE_URL", &db.url)
        .env("LISTEN_ADDR", api_addr.to_string())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn demo API");
    let ledger_metrics = free_addr();
    let _ledger = example_consumer_command(
        "ledger",
        "ledger",
        &db.url,
        &amqp_url(),
        &exchange,
        ledger_metrics,
    )
    .args(["--bind", "payment.captured"])
    .spawn()
    .expect("spawn ledger consumer");
    // Its whole topology at the consumer's default retry delays (1s, 10s, 1m, 5m), so the retry
    // queues are deleted too (they were left on the shared broker under names never declared).
    system_tests::consumers::track_consumer(
        &broker,
        "ledger",
        &consumer::Config::new("ledger", "", "").retry_delays,
        None,
    );
    wait_ready("relay /readyz", relay_metrics).await;
    wait_ready("ledger /readyz", ledger_metrics).await;
    wait_ready("demo API /readyz", api_addr).await;

    // The demo writes an order through its API; the relay publishes its event.
    let key = std::process::Command::new(bin_path("producer"))
        .args(["api-key", "create", "--tenant", "acme"])
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    assert!(key.status.success(), "{key:?}");
    let key = String::from_utf8(key.stdout).unwrap();
    let key = key.lines().last().unwrap().trim().to_string();
    let resp = reqwest::Client::new()
        .post(format!("http://{api_addr}/orders"))
        .bearer_auth(&key)
        .header("Idempotency-Key", "order-1")
        .json(&json!({"customer_id": "c-1", "currency": "EUR",
                      "items": [{"sku": "sku-9", "quantity": 2, "unit_price": 350}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201, "{:?}", resp.text().await);
    let got = receive_n(&mut received, 1, LONG).await;
    assert_eq!(got[0].routing_key, "order.placed");

    // A payment.captured event written with the Rust API reaches the ledger consumer, once.
    let mut tx = db.pool.begin().await.unwrap();
    shared::outbox::enqueue(
        &mut *tx,
        &event(
            "pay-1",
            "payment.captured",
            json!({"account": "acct", "amount": 700}),
        ),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let pool = db.pool.clone();
    let (balance, updates): (i64, i64) = wait_until("ledger applied the payment", LONG, || {
        let pool = pool.clone();
        async move {
            sqlx::query_as(
                "SELECT balance, updates FROM demo.ledger_balances WHERE account = 'acct'",
            )
            .fetch_optional(&pool)
            .await
            .unwrap()
        }
    })
    .await;
    assert_eq!((balance, updates), (700, 1));

    // The service's tables, rows and migration history are exactly as they were, its own
    // migrator still accepts its history, and nothing of ours is outside our two schemas.
    assert_eq!(public_snapshot(&db.pool).await, before);
    service_migrator().run(&db.pool).await.unwrap();
    assert_eq!(schemas(&db.pool).await, set(&["public", "outbox", "demo"]));
    let ours: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox._migrations WHERE success")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        ours as usize,
        shared::migrate::migrator(&Schema::default()).iter().count()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_installations_in_two_schemas_of_one_database_never_cross() {
    let db = TestDb::new_unmigrated().await;
    let broker = TestBroker::new();
    let conn = broker.connect().await;
    let mut installs = Vec::new();
    for schema in ["billing_outbox", "shipping_outbox"] {
        let exchange = broker.exchange(schema);
        declare(&broker, &exchange).await;
        let queue = broker.queue(schema);
        let rx = collect_queue(&conn, &exchange, &queue, &["#"]).await;
        let metrics = free_addr();
        let relay = spawn_relay(&db.url, schema, &exchange, metrics);
        installs.push((schema, relay, metrics, rx));
    }
    for (schema, _, metrics, _) in &installs {
        wait_ready(&format!("relay of {schema}"), *metrics).await;
    }
    // Relays alone create their schema and nothing else: no example tables, nothing in public.
    assert_eq!(
        schemas(&db.pool).await,
        set(&["public", "billing_outbox", "shipping_outbox"])
    );
    let in_public: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_class WHERE relnamespace = 'public'::regnamespace",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(in_public, 0);

    // The same aggregates in both: each installation publishes only its own rows.
    let mut sent: Vec<HashSet<String>> = Vec::new();
    for (schema, ..) in &installs {
        let outbox = Outbox::new(Schema::new(schema).unwrap());
        let msgs: Vec<NewMessage> = (0..60)
            .map(|i| {
                event(
                    &format!("agg-{}", i % 7),
                    "thing.happened",
                    json!({"i": i, "s": schema}),
                )
            })
            .collect();
        let mut tx = db.pool.begin().await.unwrap();
        outbox.enqueue_many(&mut *tx, &msgs).await.unwrap();
        tx.commit().await.unwrap();
        sent.push(msgs.iter().map(|m| m.id.to_string()).collect());
    }
    for (i, (schema, _, _, rx)) in installs.iter_mut().enumerate() {
        let got = receive_n(rx, 60, LONG).await;
        let ids: HashSet<String> = got.iter().map(|r| r.message_id.clone()).collect();
        assert_eq!(ids, sent[i], "{schema} received exactly its own messages");
        assert!(got.iter().all(|r| r.body["s"] == json!(schema)));
        let extra = drain(rx, Duration::from_millis(500)).await;
        assert!(extra.is_empty(), "{schema} received {} more", extra.len());
    }
}

/// The previous release's migration files, as they were (public, public._sqlx_migrations).
fn legacy_migrator() -> Migrator {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/legacy-migrations");
    let mut migrations = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for path in files {
        let name = path.file_stem().unwrap().to_str().unwrap().to_string();
        let (version, description) = name.split_once('_').unwrap();
        migrations.push(Migration::new(
            version.parse().unwrap(),
            Cow::Owned(description.replace('_', " ")),
            MigrationType::Simple,
            sqlx::SqlSafeStr::into_sql_str(sqlx::AssertSqlSafe(
                std::fs::read_to_string(&path).unwrap(),
            )),
            false,
        ));
    }
    Migrator::with_migrations(migrations)
}

/// A login-less role of the cluster, dropped when the guard is (declare it before the `TestDb`,
/// so the database and its grants go first).
struct Role(String);

impl Role {
    async fn create(name: &str) -> Self {
        let admin = PgPool::connect(&admin_url()).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE ROLE {name} NOLOGIN")))
            .execute(&admin)
            .await
            .unwrap();
        admin.close().await;
        Self(name.to_string())
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let _ = std::process::Command::new("psql")
            .args([
                admin_url().as_str(),
                "-qc",
                &format!("DROP ROLE IF EXISTS {}", self.0),
            ])
            .output();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_of_the_previous_release_is_upgraded_without_losing_a_row() {
    let role = Role::create(&unique("legacy_app")).await;
    let db = TestDb::new_unmigrated().await;
    legacy_migrator().run(&db.pool).await.unwrap();
    // The old release's producers and consumers ran as a role of their own, granted what they use.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "GRANT INSERT ON public.outbox TO {r}; \
         GRANT SELECT, INSERT, DELETE ON public.processed_messages TO {r}",
        r = role.0
    )))
    .execute(&db.pool)
    .await
    .unwrap();

    // What the old release left: pending rows (the old SQL contract), a dead row, dedup records,
    // an idempotency record, a demo order.
    let mut pending = Vec::new();
    for i in 0..40 {
        let id: uuid::Uuid = sqlx::query_scalar(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', $1, 'order.placed', $2) RETURNING id",
        )
        .bind(format!("o-{}", i % 5))
        .bind(json!({"i": i}))
        .fetch_one(&db.pool)
        .await
        .unwrap();
        pending.push(id.to_string());
    }
    let dead: uuid::Uuid = sqlx::query_scalar(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, state, attempts, last_error) \
         VALUES ('order', 'o-dead', 'order.placed', '{}', 'dead', 10, 'nacked') RETURNING id",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let processed: Vec<uuid::Uuid> = (0..25).map(|_| uuid::Uuid::now_v7()).collect();
    sqlx::query(
        "INSERT INTO processed_messages (consumer, message_id) SELECT 'ledger', unnest($1::uuid[])",
    )
    .bind(&processed)
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO idempotency_keys (tenant, operation, key_hash, fingerprint, status, response_status, \
           response_body, created_at, updated_at, expires_at) \
         VALUES ('acme', 'create_order', sha256('k'), sha256('f'), 'completed', 201, '{}', now(), now(), now() + interval '1 day')",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    let broker = TestBroker::new();
    let exchange = broker.exchange("upgrade");
    declare(&broker, &exchange).await;
    let conn = broker.connect().await;
    let queue = broker.queue("upgrade");
    let mut rx = collect_queue(&conn, &exchange, &queue, &["#"]).await;

    // The new relay migrates (moving the old rows into its schema) and publishes them.
    let metrics = free_addr();
    let _relay = spawn_relay(&db.url, "outbox", &exchange, metrics);
    let got = receive_n(&mut rx, pending.len(), LONG).await;
    let ids: Vec<String> = got.iter().map(|r| r.message_id.clone()).collect();
    let mut sorted_got = ids.clone();
    sorted_got.sort();
    let mut sorted_sent = pending.clone();
    sorted_sent.sort();
    assert_eq!(sorted_got, sorted_sent, "every pending row published once");
    // Per aggregate, in the order they were written.
    for agg in 0..5 {
        let want: Vec<&String> = pending
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 5 == agg)
            .map(|(_, id)| id)
            .collect();
        let have: Vec<&String> = ids.iter().filter(|id| want.contains(id)).collect();
        assert_eq!(have, want);
    }
    assert!(drain(&mut rx, Duration::from_millis(500)).await.is_empty());

    let (state, attempts, last_error): (String, i32, Option<String>) =
        sqlx::query_as("SELECT state, attempts, last_error FROM outbox.messages WHERE id = $1")
            .bind(dead)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (state.as_str(), attempts, last_error.as_deref()),
        ("dead", 10, Some("nacked"))
    );
    let kept: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox.processed_messages WHERE consumer = 'ledger' AND message_id = ANY($1)",
    )
    .bind(&processed)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(kept, 25);
    let records: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox.idempotency_keys WHERE scope = 'acme'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(records, 1);

    // Producers and consumers of the previous release keep working until their teams upgrade
    // them: public.outbox and public.processed_messages are views of the new tables. An old-style
    // INSERT is published (woken by the new table's NOTIFY, after the moved rows of its
    // aggregate), and an old consumer's dedup statement sees the moved rows.
    for view in ["public.outbox", "public.processed_messages"] {
        let kind: Option<String> =
            sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)")
                .bind(view)
                .fetch_optional(&db.pool)
                .await
                .unwrap();
        assert_eq!(kind.as_deref(), Some("v"), "{view} is a view");
    }
    // As the old producers' and consumers' own least-privilege role, with only the grants it had
    // on the old tables (the views carry them over).
    let mut legacy = db.pool.acquire().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SET ROLE {}", role.0)))
        .execute(&mut *legacy)
        .await
        .unwrap();
    let late = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) \
         VALUES ($1, 'order', 'o-0', 'order.placed', '{\"late\": true}', '{}')",
    )
    .bind(late)
    .execute(&mut *legacy)
    .await
    .unwrap();
    let got = receive_n(&mut rx, 1, LONG).await;
    assert_eq!(got[0].message_id, late.to_string());
    assert_eq!(got[0].body, json!({"late": true}));
    let old_dedup = "INSERT INTO processed_messages (consumer, message_id) \
         SELECT $1, id FROM unnest($2::uuid[]) AS t(id) \
         ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id";
    let fresh: Vec<uuid::Uuid> = sqlx::query_scalar(old_dedup)
        .bind("ledger")
        .bind(vec![processed[0], late])
        .fetch_all(&mut *legacy)
        .await
        .unwrap();
    assert_eq!(fresh, vec![late], "a moved dedup row is a duplicate");
    // What it was not granted, it still may not do.
    let refused = sqlx::query("DELETE FROM outbox")
        .execute(&mut *legacy)
        .await
        .expect_err("the old role had no DELETE on the outbox");
    assert!(
        refused.to_string().contains("permission denied"),
        "{refused}"
    );
    sqlx::raw_sql("RESET ROLE")
        .execute(&mut *legacy)
        .await
        .unwrap();
    drop(legacy);
    let in_new: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox.processed_messages WHERE consumer = 'ledger' AND message_id = $1",
    )
    .bind(late)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(in_new, 1);
    // Once every producer and consumer is upgraded, the views go without touching anything else.
    sqlx::query("DROP VIEW public.outbox, public.processed_messages")
        .execute(&db.pool)
        .await
        .unwrap();

    // The old tables and the old history are gone; nothing of ours is left in public.
    for gone in [
        "public.outbox",
        "public.processed_messages",
        "public.idempotency_keys",
        "public.relay_partitions",
        "public.relay_instances",
        "public._sqlx_migrations",
    ] {
        let exists: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
            .bind(gone)
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(exists, None, "{gone} is still there");
    }
    let functions: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_proc WHERE pronamespace = 'public'::regnamespace AND proname LIKE 'outbox%'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(functions, 0);

    // The example application's migrations move its old tables to its schema.
    let out = Command::new(bin_path("producer"))
        .arg("migrate")
        .env("DATABASE_URL", &db.url)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let in_public: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(in_public, 0);
}

/// A service that embeds the product runs its own sqlx migrations and the product's from its own
/// start-up code, here three instances at once on a fresh database: each history lands in its
/// own table, complete and once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_runs_the_products_migrations_next_to_its_own_in_parallel_instances() {
    let db = TestDb::new_unmigrated().await;
    let schema = Schema::new("billing_outbox").unwrap();
    let instance = |pool: PgPool, schema: Schema| async move {
        service_migrator().run(&pool).await?;
        shared::migrate::run(&pool, &schema).await
    };
    let results = futures::future::join_all(
        (0..3).map(|_| tokio::spawn(instance(db.pool.clone(), schema.clone()))),
    )
    .await;
    for r in results {
        r.unwrap().unwrap();
    }
    let theirs: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM public._sqlx_migrations ORDER BY version")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(theirs, vec![20240101000000]);
    let ours: Vec<i64> = sqlx::query_scalar(
        "SELECT version FROM billing_outbox._migrations WHERE success ORDER BY version",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let want: Vec<i64> = shared::migrate::migrator(&schema)
        .iter()
        .map(|m| m.version)
        .collect();
    assert_eq!(ours, want);
    assert_eq!(schemas(&db.pool).await, set(&["public", "billing_outbox"]));
}

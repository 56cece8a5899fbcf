//! The fault campaign on `demo.timeline` (issue 22, ordered consumers): two relays and three
//! `producer timeline --ordered` instances as child processes, every broker and database link of
//! theirs through a [`TcpProxy`] of the test's, while producers commit events (a hot aggregate
//! with 40 % of them, the rest over 40 others, in small transactions from two tasks at once).
//! One after the other, with the load running:
//!
//! 1. **nacks in the middle of the relays' pipelines**: a second queue bound to the outbox
//!    exchange with `x-max-length` and `x-overflow: reject-publish`, purged every 200 ms, so the
//!    broker nacks some publishes and takes the next (the nacked message still reached the
//!    partition queues: the consumer gets it again when the relay sends it again);
//! 2. **a relay SIGKILLed while it publishes**, the other one taking its partitions over after the
//!    lease, then restarted;
//! 3. **a relay's broker link cut** and restored;
//! 4. **a consumer's broker link cut** (its partitions move to the others after the lease) and
//!    restored;
//! 5. **a consumer's database link cut**: its fenced applies apply nothing after its leases end,
//!    the others take its partitions over and apply everything committed before the cut while the
//!    link is still down; restored;
//! 6. **a consumer SIGKILLed mid-batch** (right after a commit, inside the 100 ms it waits before
//!    acknowledging: `--debug-ack-delay`), restarted.
//!
//! At the end every committed event is in `demo.timeline` exactly once, no aggregate stepped
//! back, nothing is held or parked, every aggregate's position is its last number, the outbox has
//! nothing pending or dead, and `relay verify` finds nothing missing. What each fault did is
//! printed: publishes nacked, the consumers' outcomes (`consumer_messages_total{outcome}`: stale
//! copies, held messages) during it, how long the takeover took. Every wait is a bounded poll.

use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use serde_json::json;
use shared::NewMessage;
use sqlx::PgPool;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use system_tests::consumers::track_consumer;
use system_tests::fleet::{self, Component};
use system_tests::*;

const LONG: Duration = Duration::from_secs(90);
const PARTITIONS: u16 = 6;
const RETRY_DELAYS: [Duration; 2] = [Duration::from_millis(100), Duration::from_millis(200)];
/// The outcomes of `consumer_messages_total` the campaign reports.
const OUTCOMES: [&str; 4] = ["processed", "held", "stale", "duplicate"];

type Outcomes = BTreeMap<&'static str, f64>;

/// A consumer's outcome counters (None while its /metrics does not answer).
async fn outcomes(addr: SocketAddr) -> Option<Outcomes> {
    let mut out = Outcomes::new();
    for o in OUTCOMES {
        let v = fleet::metric(addr, "consumer_messages_total", &[("outcome", o)])
            .await
            .unwrap_or(0.0);
        out.insert(o, v);
    }
    // A process that does not answer has no counters to read.
    http_status(addr, "/metrics").await?;
    Some(out)
}

fn add(a: &mut Outcomes, b: &Outcomes) {
    for (k, v) in b {
        *a.entry(k).or_default() += v;
    }
}

fn delta(now: &Outcomes, before: &Outcomes) -> String {
    OUTCOMES
        .iter()
        .map(|o| {
            let d = now.get(o).copied().unwrap_or(0.0) - before.get(o).copied().unwrap_or(0.0);
            format!("{o} {d}")
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The host:port of a service URL (`scheme://user@host:port/path`).
async fn service_addr(url: &str) -> SocketAddr {
    let rest = url.split_once('@').map_or(url, |(_, r)| r);
    let host = rest.split_once('/').map_or(rest, |(h, _)| h);
    tokio::net::lookup_host(host)
        .await
        .expect("resolve the service")
        .next()
        .expect("an address")
}

/// A timeline instance with its links.
struct Instance {
    component: Component,
    amqp: TcpProxy,
    db: TcpProxy,
}

/// The campaign's consumers: the running ones' counters plus the last ones read from processes
/// that were SIGKILLed since.
struct Consumers {
    instances: Vec<Instance>,
    killed: Outcomes,
}

impl Consumers {
    async fn total(&self) -> Outcomes {
        let mut sum = self.killed.clone();
        for i in &self.instances {
            if let Some(o) = outcomes(i.component.metrics).await {
                add(&mut sum, &o);
            }
        }
        sum
    }
}

async fn applied(pool: &PgPool, name: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM demo.timeline WHERE consumer = $1")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn committed(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox.messages")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Of the events at or before outbox position `seq`: how many, and how many are not in the
/// timeline (looked up by aggregate and number, which the timeline's index serves; that each is
/// there once and by its message id is checked at the end).
async fn unapplied_up_to(pool: &PgPool, name: &str, seq: i64) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE NOT EXISTS ( \
             SELECT 1 FROM demo.timeline t WHERE t.consumer = $1 \
             AND t.aggregate_type = m.aggregate_type AND t.aggregate_id = m.aggregate_id \
             AND t.aggregate_seq = m.aggregate_seq)) \
         FROM outbox.messages m WHERE m.seq <= $2",
    )
    .bind(name)
    .bind(seq)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Waits until `more` events beyond what the timeline shows now were applied.
async fn wait_applied_more(pool: &PgPool, name: &str, more: i64, what: &str) {
    let start = applied(pool, name).await;
    wait_until(what, LONG, || async move {
        (applied(pool, name).await >= start + more).then_some(())
    })
    .await;
}

/// Partitions held with a live lease, per owner, most first.
async fn owners(pool: &PgPool, name: &str) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox.consumer_partitions WHERE consumer = $1 \
         AND owner IS NOT NULL AND lease_until > now() GROUP BY owner ORDER BY 1 DESC",
    )
    .bind(name)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// A consumer whose link came back: it is ready again (`ready`), the three share the partitions
/// again, and 200 more events are applied (`applied`).
async fn rejoined(pool: &PgPool, name: &str, consumer: &Component, ready: &str, applied: &str) {
    consumer.wait_ready(ready, LONG).await;
    wait_held_by(pool, name, 3, "the three share the partitions again").await;
    wait_applied_more(pool, name, 200, applied).await;
}

/// Waits until all partitions are held by exactly `n` instances (none by one that lost them).
async fn wait_held_by(pool: &PgPool, name: &str, n: usize, what: &str) -> Duration {
    let t = Instant::now();
    wait_until(what, LONG, || async move {
        let o = owners(pool, name).await;
        (o.len() == n && o.iter().sum::<i64>() == i64::from(PARTITIONS)).then_some(())
    })
    .await;
    t.elapsed()
}

/// The sum of a relay counter over the running relays.
async fn relay_counter(relays: &[Component], name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut sum = 0.0;
    for r in relays {
        sum += fleet::metric(r.metrics, name, labels).await.unwrap_or(0.0);
    }
    sum
}

/// Commits events in transactions of 10 until `stop`: 40 % to aggregate `hot`, the rest over 40
/// others. `salt` keeps two producers' payloads apart.
fn load(pool: PgPool, stop: Arc<AtomicBool>, salt: u64) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let batch: Vec<NewMessage> = (0..10)
                .map(|i| {
                    let k = n + i;
                    let aggregate = if k % 5 < 2 {
                        "hot".to_string()
                    } else {
                        format!("agg-{}", (k * 7 + salt) % 40)
                    };
                    NewMessage::new(
                        "test",
                        aggregate,
                        "thing.happened",
                        json!({ "producer": salt, "n": k }),
                    )
                })
                .collect();
            let mut tx = pool.begin().await.unwrap();
            shared::outbox::enqueue_many(&mut *tx, &batch)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            n += 10;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        n
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_applied_once_in_order_through_relay_kills_link_cuts_and_nacks() {
    init_logging();
    let started = Instant::now();
    let db = TestDb::new().await;
    let broker = TestBroker::new();
    let exchange = broker.outbox_exchange("outbox");
    let name = unique("ofc");
    track_consumer(&broker, &name, &RETRY_DELAYS, Some(PARTITIONS));
    let rabbit = service_addr(&amqp_url()).await;
    let pg = service_addr(&db.url).await;
    let amqp_via = |p: &TcpProxy| format!("amqp://guest:guest@{}/%2f", p.addr);

    // Three ordered timeline instances, each through its own broker and database proxies.
    let mut consumers = Consumers {
        instances: Vec::new(),
        killed: Outcomes::new(),
    };
    for _ in 0..3 {
        let amqp = TcpProxy::start(rabbit).await;
        let dbp = TcpProxy::start(pg).await;
        let component = Component::ordered_timeline(
            &db.url_via(dbp.addr),
            &amqp_via(&amqp),
            &exchange,
            &name,
            PARTITIONS,
            &["--debug-ack-delay", "100ms"],
        );
        consumers.instances.push(Instance {
            component,
            amqp,
            db: dbp,
        });
    }
    for i in &consumers.instances {
        i.component.wait_ready("timeline instance", LONG).await;
    }
    wait_held_by(&db.pool, &name, 3, "the partitions spread over the three").await;
    // Two relays, each through its own broker proxy.
    let relay_links = [TcpProxy::start(rabbit).await, TcpProxy::start(rabbit).await];
    let mut relays: Vec<Component> = relay_links
        .iter()
        .map(|p| Component::relay(&db.url, &amqp_via(p), &exchange))
        .collect();
    for r in &relays {
        r.wait_ready("relay", LONG).await;
    }
    println!("set up in {:?}", started.elapsed());

    let stop = Arc::new(AtomicBool::new(false));
    let producers = [
        load(db.pool.clone(), stop.clone(), 1),
        load(db.pool.clone(), stop.clone(), 2),
    ];
    wait_applied_more(&db.pool, &name, 300, "the first events applied").await;

    // 1. Nacks in the middle of the pipelines.
    let before = consumers.total().await;
    let conn = broker.connect().await;
    let full = unique("full");
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(10));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    let ch = declare_bound_queue(&conn, &exchange, &full, &["#"], exclusive, args).await;
    let draining = Arc::new(AtomicBool::new(true));
    let drainer = {
        let (ch, full, draining) = (ch.clone(), full.clone(), draining.clone());
        tokio::spawn(async move {
            while draining.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let _ = ch
                    .queue_purge(full.as_str().into(), Default::default())
                    .await;
            }
        })
    };
    wait_until("publishes nacked", LONG, || async {
        let nacks = relay_counter(
            &relays,
            "relay_publish_failures_total",
            &[("reason", "nack")],
        )
        .await;
        (nacks >= 50.0).then_some(())
    })
    .await;
    wait_applied_more(&db.pool, &name, 300, "events applied between nacks").await;
    draining.store(false, Ordering::Relaxed);
    drainer.await.unwrap();
    ch.queue_delete(full.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let nacks = relay_counter(
        &relays,
        "relay_publish_failures_total",
        &[("reason", "nack")],
    )
    .await;
    let charged: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox.messages WHERE attempts > 0")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    wait_applied_more(&db.pool, &name, 200, "events applied after the nacks").await;
    let after = consumers.total().await;
    println!(
        "1. nacks: {nacks} publishes nacked, {charged} rows charged an attempt; consumers: {}",
        delta(&after, &before)
    );

    // 2. A relay SIGKILLed while it publishes; the other takes over; restarted.
    let before = after;
    let published = fleet::metric(relays[0].metrics, "relay_published_total", &[])
        .await
        .unwrap_or(0.0);
    let addr = relays[0].metrics;
    wait_until("relay 0 publishing", LONG, || async move {
        let now = fleet::metric(addr, "relay_published_total", &[]).await?;
        (now > published).then_some(())
    })
    .await;
    relays[0].kill().await;
    let killed_at = Instant::now();
    wait_applied_more(&db.pool, &name, 300, "events applied with a relay killed").await;
    let pending_at_kill: i64 = outbox_count(&db.pool, "pending").await;
    relays[0].start();
    relays[0].wait_ready("restarted relay", LONG).await;
    wait_applied_more(
        &db.pool,
        &name,
        200,
        "events applied after the relay restart",
    )
    .await;
    let after = consumers.total().await;
    println!(
        "2. relay SIGKILL while publishing: 300 events applied through the other relay, the killed one restarted and ready {:?} after the kill ({pending_at_kill} rows pending meanwhile); consumers: {}",
        killed_at.elapsed(),
        delta(&after, &before)
    );

    // 3. A relay's broker link cut, restored.
    let before = after;
    relay_links[1].set_mode(ProxyMode::Down);
    wait_applied_more(&db.pool, &name, 300, "events applied with a relay link cut").await;
    relay_links[1].set_mode(ProxyMode::Pass);
    relays[1]
        .wait_ready("relay after its link came back", LONG)
        .await;
    wait_applied_more(&db.pool, &name, 200, "events applied after the relay link").await;
    let reconnects =
        relay_counter(&relays, "relay_reconnects_total", &[("target", "rabbitmq")]).await;
    let after = consumers.total().await;
    println!(
        "3. relay broker link cut: {reconnects} relay reconnects; consumers: {}",
        delta(&after, &before)
    );

    // 4. A consumer's broker link cut: its partitions move to the others; restored.
    let before = after;
    consumers.instances[0].amqp.set_mode(ProxyMode::Down);
    let moved = wait_held_by(&db.pool, &name, 2, "the others hold every partition").await;
    wait_applied_more(
        &db.pool,
        &name,
        300,
        "events applied with a consumer link cut",
    )
    .await;
    consumers.instances[0].amqp.set_mode(ProxyMode::Pass);
    rejoined(
        &db.pool,
        &name,
        &consumers.instances[0].component,
        "consumer after its broker link came back",
        "events applied after the consumer link",
    )
    .await;
    let after = consumers.total().await;
    println!(
        "4. consumer broker link cut: partitions moved in {moved:?}; consumers: {}",
        delta(&after, &before)
    );

    // 5. A consumer's database link cut: its workers stop once its leases ended unrenewed, the
    // others take its partitions over and apply everything committed before the cut while it is
    // still cut off.
    let before = after;
    consumers.instances[1].db.set_mode(ProxyMode::Down);
    let cut_at = Instant::now();
    let cut_seq: i64 = sqlx::query_scalar("SELECT max(seq) FROM outbox.messages")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let moved = wait_held_by(&db.pool, &name, 2, "the others hold every partition").await;
    let before_cut = wait_until(
        "every event committed before the database link cut applied while it is cut",
        LONG,
        || async {
            let (total, missing) = unapplied_up_to(&db.pool, &name, cut_seq).await;
            (missing == 0).then_some(total)
        },
    )
    .await;
    let caught_up = cut_at.elapsed();
    consumers.instances[1].db.set_mode(ProxyMode::Pass);
    rejoined(
        &db.pool,
        &name,
        &consumers.instances[1].component,
        "consumer after its database link came back",
        "events applied after the database link",
    )
    .await;
    let after = consumers.total().await;
    println!(
        "5. consumer database link cut: partitions moved in {moved:?}, the {before_cut} events committed before the cut applied after {caught_up:?}; consumers: {}",
        delta(&after, &before)
    );

    // 6. A consumer SIGKILLed mid-batch: right after one of its commits, before its ack.
    let before = after;
    let victim = consumers.instances[2].component.metrics;
    let at_kill = outcomes(victim).await.expect("consumer 2 answers");
    let processed = |addr| async move {
        fleet::metric(addr, "consumer_messages_total", &[("outcome", "processed")]).await
    };
    let last = processed(victim).await.unwrap_or(0.0);
    wait_until("consumer 2 commits a batch", LONG, || async move {
        (processed(victim).await? > last).then_some(())
    })
    .await;
    consumers.instances[2].component.kill().await;
    add(&mut consumers.killed, &at_kill);
    let moved = wait_held_by(&db.pool, &name, 2, "the others hold every partition").await;
    wait_applied_more(
        &db.pool,
        &name,
        300,
        "events applied with a consumer killed",
    )
    .await;
    consumers.instances[2].component.start();
    consumers.instances[2]
        .component
        .wait_ready("restarted consumer", LONG)
        .await;
    wait_held_by(&db.pool, &name, 3, "the three share the partitions again").await;
    let after = consumers.total().await;
    println!(
        "6. consumer SIGKILL mid-batch: partitions moved in {moved:?}; consumers: {}",
        delta(&after, &before)
    );

    // The end: stop the load, let everything drain, check.
    stop.store(true, Ordering::Relaxed);
    for p in producers {
        p.await.unwrap();
    }
    let total = committed(&db.pool).await;
    wait_until(
        "the outbox published and the timeline caught up",
        LONG,
        || async {
            let pending = outbox_count(&db.pool, "pending").await;
            (pending == 0 && applied(&db.pool, &name).await >= total).then_some(())
        },
    )
    .await;
    // Late copies (a redelivery, a relay's resend) would show now.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let end = consumers.total().await;
    assert_eq!(outbox_count(&db.pool, "dead").await, 0, "rows went dead");

    // Every committed event exactly once, none that was not committed.
    let wrong: Vec<(uuid::Uuid, i64)> = sqlx::query_as(
        "SELECT m.id, count(t.message_id) FROM outbox.messages m \
         LEFT JOIN demo.timeline t ON t.message_id = m.id AND t.consumer = $1 \
         GROUP BY m.id HAVING count(t.message_id) <> 1 LIMIT 10",
    )
    .bind(&name)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(
        wrong.is_empty(),
        "events not applied exactly once: {wrong:?}"
    );
    assert_eq!(
        applied(&db.pool, &name).await,
        total,
        "rows of events never committed"
    );
    let v = demo::timeline::violations(&db.pool, &name).await.unwrap();
    assert_eq!(v, demo::timeline::Violations::default(), "{v:?}");

    // Nothing stuck: nothing held, nothing parked or waiting, every position at its last number.
    let held: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox.consumer_held WHERE consumer = $1")
            .bind(&name)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(held, 0, "messages left held");
    let stuck: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox.consumer_positions WHERE consumer = $1 \
         AND (parked_at IS NOT NULL OR attempts > 0)",
    )
    .bind(&name)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(stuck, 0, "aggregates parked or waiting for a retry");
    let behind: Vec<(String, i64, Option<i64>)> = sqlx::query_as(
        "SELECT m.aggregate_id, max(m.aggregate_seq), max(p.applied_seq) FROM outbox.messages m \
         LEFT JOIN outbox.consumer_positions p ON p.consumer = $1 \
           AND p.aggregate_type = m.aggregate_type AND p.aggregate_id = m.aggregate_id \
         GROUP BY m.aggregate_type, m.aggregate_id \
         HAVING max(p.applied_seq) IS DISTINCT FROM max(m.aggregate_seq)",
    )
    .bind(&name)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(
        behind.is_empty(),
        "positions not at the last number: {behind:?}"
    );

    // `relay verify` reconciles the outbox with the ordered consumer's positions.
    let (code, report) = fleet::relay_verify(&db.url, &name, &[]);
    assert_eq!(code, Some(0), "relay verify: {report}");
    assert_eq!(report["missing"], 0, "{report}");
    assert_eq!(report["processed"], total, "{report}");

    // A graceful stop of everything.
    for i in consumers.instances.iter_mut() {
        assert!(
            i.component.stop().await,
            "a timeline instance exits 0 on SIGTERM"
        );
    }
    for r in relays.iter_mut() {
        assert!(r.stop().await, "a relay exits 0 on SIGTERM");
    }
    let hot: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox.messages WHERE aggregate_id = 'hot'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    println!(
        "ordered fault campaign: {total} events ({hot} on the hot aggregate) applied once each, in order; \
         over the whole run the consumers counted {}; total {:?}",
        delta(&end, &Outcomes::new()),
        started.elapsed()
    );
}

//! The fault campaign: a 3-node RabbitMQ cluster and a PostgreSQL of the test's own, 2 relays and
//! 2 instances of the ledger consumer (`producer ledger`), steady payment load; meanwhile, in an
//! order drawn from a seed, broker nodes are SIGKILLed (the consumer queue's quorum leader first)
//! and restarted, relays and consumers SIGKILLed and restarted, broker and database links cut,
//! and PostgreSQL is crashed (`pg_ctl -m immediate`) and restarted once. Beside the load, a
//! producer holds each of its transactions open for 2-5 s, so the relays move past its rows'
//! positions before they commit (issue 39). At the end `relay verify` and the exact ledger must
//! agree: nothing lost, nothing skipped, nothing applied twice.
//!
//! `FAULT_SEED=<n>` replays a campaign (the seed is printed); `FAULT_ROUNDS=<n>` sets the number
//! of faults (default 8: each kind at least once, the quorum leader's node first),
//! `FAULT_MAX_BROKER_KILLS=<n>` caps the broker kills (default 2: a node restart is the slow part);
//! `FAULT_MESSAGES=<n>` goes on with faults until at least that many messages were committed
//! (`scripts/fault-campaign.sh` runs 100,000). Every wait is a bounded poll for a condition.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use sqlx::PgPool;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use system_tests::fleet::{self, Component};
use system_tests::private_pg::PrivatePg;
use system_tests::private_rabbit;
use system_tests::*;

const LONG: Duration = Duration::from_secs(120);

fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

#[derive(Debug, Default)]
struct Tally {
    broker_kills: u32,
    leader_kills: u32,
    relay_kills: u32,
    consumer_kills: u32,
    broker_link_cuts: u32,
    db_link_cuts: u32,
    db_restarts: u32,
    longest_publish_pause_after_node_kill: Duration,
    ready_after_db_restart: Vec<Duration>,
}

/// Samples the number of published rows every 100 ms, to measure pauses in publishing.
#[derive(Clone, Default)]
struct PublishLog(Arc<Mutex<Vec<(Instant, i64)>>>);

impl PublishLog {
    fn start(pool: PgPool, stop: Arc<AtomicBool>) -> Self {
        let log = PublishLog::default();
        let l = log.clone();
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Some(n) = fleet::outbox_rows(&pool, "published").await
                    && let Ok(mut v) = l.0.lock()
                {
                    v.push((Instant::now(), n));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        log
    }

    /// The longest time the published count did not grow, between the first and the last sample.
    fn longest_stall(&self) -> Duration {
        let Ok(v) = self.0.lock() else {
            return Duration::ZERO;
        };
        let mut longest = Duration::ZERO;
        let mut last_growth: Option<(Instant, i64)> = None;
        for &(at, n) in v.iter() {
            match last_growth {
                Some((t, m)) if n > m => {
                    longest = longest.max(at - t);
                    last_growth = Some((at, n));
                }
                None => last_growth = Some((at, n)),
                _ => {}
            }
        }
        longest
    }

    /// How long after `t` the published count first grew (None if it has not yet).
    fn pause_after(&self, t: Instant) -> Option<Duration> {
        let v = self.0.lock().ok()?;
        let base = v.iter().rev().find(|(at, _)| *at <= t).map(|(_, n)| *n)?;
        v.iter()
            .find(|(at, n)| *at > t && *n > base)
            .map(|(at, _)| *at - t)
    }
}

/// Waits until the ledger applied at least `more` payments beyond what it shows now.
async fn wait_progress(pool: &PgPool, more: i64, what: &str) {
    let start = loop {
        if let Some(u) = fleet::total_updates(pool).await {
            break u;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    wait_until(what, LONG, || async move {
        let u = fleet::total_updates(pool).await?;
        (u >= start + more).then_some(())
    })
    .await;
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    KillBroker,
    KillRelay,
    KillConsumer,
    CutBrokerLink,
    CutDbLink,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_lost_nothing_applied_twice_under_faults() {
    init_logging();
    let seed: u64 = std::env::var("FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    let rounds: usize = std::env::var("FAULT_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    let target_messages: u64 = std::env::var("FAULT_MESSAGES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    println!("fault campaign seed {seed} ({rounds} faults): replay with FAULT_SEED={seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let started = Instant::now();

    let mut nodes = blocking(|| private_rabbit::start_cluster(&["ca", "cb", "cc"], &[]));
    let mut pg = blocking(|| PrivatePg::start(&[]));
    let pool = fleet::migrated_db(&pg, "campaign").await;
    // Components reach every service through a proxy of the test's, to cut links.
    let db_proxy = TcpProxy::start(([127, 0, 0, 1], pg.port()).into()).await;
    let db_url = format!("postgres://postgres@{}/campaign", db_proxy.addr);
    let mut broker_proxies = Vec::new();
    for n in &nodes {
        broker_proxies.push(TcpProxy::start(n.amqp_addr()).await);
    }
    let amqp_list = broker_proxies
        .iter()
        .map(|p| format!("amqp://guest:guest@{}/%2f", p.addr))
        .collect::<Vec<_>>()
        .join(",");
    let exchange = unique("outbox");
    let name = unique("ledger");
    let mut consumers = vec![
        Component::ledger(&db_url, &amqp_list, &exchange, &name),
        Component::ledger(&db_url, &amqp_list, &exchange, &name),
    ];
    for c in &consumers {
        c.wait_ready("consumer", LONG).await;
    }
    let mut relays = vec![
        Component::relay(&db_url, &amqp_list, &exchange),
        Component::relay(&db_url, &amqp_list, &exchange),
    ];
    for r in &relays {
        r.wait_ready("relay", LONG).await;
    }
    println!("set up in {:?}", started.elapsed());

    let stop = Arc::new(AtomicBool::new(false));
    let load = fleet::PaymentLoad::start(pool.clone(), 50, stop.clone());
    // Transactions held open while the relays move past their rows (issue 39): nothing may be
    // skipped, under every fault too.
    let late = fleet::LateCommits::start(pool.clone(), stop.clone());
    let publish_log = PublishLog::start(pool.clone(), stop.clone());
    wait_progress(&pool, 200, "the first payments").await;

    let mut tally = Tally::default();
    let mut leader_first = true;
    let mut deck = vec![
        Fault::KillBroker,
        Fault::KillRelay,
        Fault::KillConsumer,
        Fault::CutBrokerLink,
        Fault::CutDbLink,
    ];
    deck.shuffle(&mut rng);
    deck.push(Fault::KillBroker); // popped first: the leader
    let max_broker_kills: u32 = std::env::var("FAULT_MAX_BROKER_KILLS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let db_restart_at = rng.random_range(1..=rounds.max(1));
    let mut round = 0;
    while round < rounds || load.committed() < target_messages {
        round += 1;
        if round == db_restart_at {
            // PostgreSQL crashes and comes back; every component must be ready again.
            blocking(|| pg.stop_immediate());
            tokio::time::sleep(Duration::from_secs(1)).await;
            blocking(|| pg.start_again());
            let back = Instant::now();
            for c in relays.iter().chain(consumers.iter()) {
                c.wait_ready("component after the database restart", LONG)
                    .await;
            }
            tally.db_restarts += 1;
            tally.ready_after_db_restart.push(back.elapsed());
            println!(
                "round {round}: PostgreSQL restarted; all ready after {:?}",
                back.elapsed()
            );
            wait_progress(&pool, 100, "payments after the database restart").await;
        }
        // The quorum leader dies first, then every kind of fault once in a seeded order, then
        // faults drawn at random; broker kills (the slow ones: a node restarts in 10-80 s here)
        // are capped.
        let fault = match deck.pop() {
            Some(f) => f,
            None => match rng.random_range(0..5) {
                0 if tally.broker_kills < max_broker_kills => Fault::KillBroker,
                0 | 1 => Fault::KillRelay,
                2 => Fault::KillConsumer,
                3 => Fault::CutBrokerLink,
                _ => Fault::CutDbLink,
            },
        };
        match fault {
            Fault::KillBroker => {
                let victim = if leader_first {
                    let leader = blocking(|| nodes[0].quorum_leader(&name));
                    leader
                        .and_then(|l| nodes.iter().position(|n| n.node == l))
                        .unwrap_or(0)
                } else {
                    rng.random_range(0..nodes.len())
                };
                let t = Instant::now();
                blocking(|| nodes[victim].kill());
                tally.broker_kills += 1;
                if leader_first {
                    tally.leader_kills += 1;
                    leader_first = false;
                }
                wait_progress(&pool, 100, "payments while a broker node is down").await;
                if let Some(p) = publish_log.pause_after(t) {
                    tally.longest_publish_pause_after_node_kill =
                        tally.longest_publish_pause_after_node_kill.max(p);
                }
                blocking(|| nodes[victim].start_again());
                println!(
                    "round {round}: killed broker {} and restarted it ({:?})",
                    nodes[victim].node,
                    t.elapsed()
                );
            }
            Fault::KillRelay => {
                let i = rng.random_range(0..relays.len());
                relays[i].kill().await;
                tally.relay_kills += 1;
                wait_progress(&pool, 50, "payments with a relay killed").await;
                relays[i].start();
                relays[i].wait_ready("restarted relay", LONG).await;
                println!("round {round}: killed relay {i} and restarted it");
            }
            Fault::KillConsumer => {
                let i = rng.random_range(0..consumers.len());
                consumers[i].kill().await;
                tally.consumer_kills += 1;
                wait_progress(&pool, 50, "payments with a consumer killed").await;
                consumers[i].start();
                consumers[i].wait_ready("restarted consumer", LONG).await;
                println!("round {round}: killed consumer {i} and restarted it");
            }
            Fault::CutBrokerLink => {
                let i = rng.random_range(0..broker_proxies.len());
                broker_proxies[i].set_mode(ProxyMode::Down);
                tally.broker_link_cuts += 1;
                wait_progress(&pool, 50, "payments with a broker link cut").await;
                broker_proxies[i].set_mode(ProxyMode::Pass);
                println!("round {round}: cut the links to broker {i} and restored them");
            }
            Fault::CutDbLink => {
                db_proxy.set_mode(ProxyMode::Down);
                tally.db_link_cuts += 1;
                tokio::time::sleep(Duration::from_millis(rng.random_range(500..3000))).await;
                db_proxy.set_mode(ProxyMode::Pass);
                wait_progress(&pool, 50, "payments after a database link cut").await;
                println!("round {round}: cut the database links and restored them");
            }
        }
    }

    let longest_stall = publish_log.longest_stall();
    // Everything back: wait until every component is ready, stop the load, drain.
    for c in relays.iter().chain(consumers.iter()) {
        c.wait_ready("component at the end", LONG).await;
    }
    stop.store(true, Ordering::Relaxed);
    load.join().await;
    let late_commits = late.committed();
    late.join().await;
    assert!(
        late_commits > 0,
        "no held transaction committed (seed {seed})"
    );
    fleet::wait_drained(&pool, LONG, &format!(" (seed {seed})")).await;
    let published = fleet::outbox_rows(&pool, "published").await.unwrap_or(-1);
    let dead = fleet::outbox_rows(&pool, "dead").await.unwrap_or(-1);
    assert_eq!(dead, 0, "rows went dead (seed {seed})");
    let ledger = fleet::ledger(&pool).await;
    let expected = fleet::expected_ledger(&pool).await;
    let updates: i64 = ledger.values().map(|(_, u)| u).sum();
    let lost = published - updates;
    assert_eq!(
        ledger, expected,
        "the ledger is exactly what was committed (seed {seed})"
    );
    let verify_url = pg.url("campaign");
    let (code, report) =
        fleet::relay_verify(&verify_url, &name, &["--event-type", "payment.captured"]);
    assert_eq!(code, Some(0), "relay verify (seed {seed}): {report}");
    assert_eq!(report["missing"], 0);
    assert_eq!(report["processed"], published);

    println!(
        "fault campaign seed {seed}: {published} messages, {} broker kills ({} of the quorum leader), \
         {} relay kills, {} consumer kills, {} broker link cuts, {} database link cuts, {} database restarts, \
         {late_commits} transactions held 2-5 s past the relays' positions; lost {lost}, applied twice 0; longest publishing pause after a node kill {:?} (longest without any publish {longest_stall:?}); \
         back to ready after the database restart {:?}; lag p50 {} s, p99 {} s, max {} s; total {:?}",
        tally.broker_kills,
        tally.leader_kills,
        tally.relay_kills,
        tally.consumer_kills,
        tally.broker_link_cuts,
        tally.db_link_cuts,
        tally.db_restarts,
        tally.longest_publish_pause_after_node_kill,
        tally.ready_after_db_restart,
        report["lag"]["p50_seconds"],
        report["lag"]["p99_seconds"],
        report["lag"]["max_seconds"],
        started.elapsed()
    );
    for c in relays.iter_mut().chain(consumers.iter_mut()) {
        c.kill().await;
    }
    pool.close().await;
    drop(nodes.drain(..));
}

//! A PostgreSQL instance of the test's own crashes (`pg_ctl -m immediate`) mid-stream and comes
//! back: the relay and the ledger consumer survive, report not-ready meanwhile, are ready again
//! within a bounded time after the database returns; nothing is lost, nothing applied twice.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use system_tests::fleet::{self, Component};
use system_tests::private_pg::PrivatePg;
use system_tests::*;

const LONG: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_consumer_survive_an_immediate_postgres_stop() {
    init_logging();
    let mut pg = tokio::task::block_in_place(|| PrivatePg::start(&[]));
    let pool = fleet::migrated_db(&pg, "crash").await;
    let db_url = pg.url("crash");
    let broker = TestBroker::new();
    let (exchange, name) = fleet::tracked_names(&broker);
    let amqp = amqp_url();
    let mut consumer = Component::ledger(&db_url, &amqp, &exchange, &name);
    consumer.wait_ready("consumer", LONG).await;
    let mut relay = Component::relay(&db_url, &amqp, &exchange);
    relay.wait_ready("relay", LONG).await;

    // Steady load; commits that fail while the database is down are simply not made.
    let stop = Arc::new(AtomicBool::new(false));
    let load = fleet::PaymentLoad::start(pool.clone(), 25, stop.clone());
    let p = pool.clone();
    wait_until("300 payments applied", LONG, || {
        let p = p.clone();
        async move { (fleet::total_updates(&p).await? >= 300).then_some(()) }
    })
    .await;

    let ready_after = crash_and_restart(&mut pg, &[relay.metrics, consumer.metrics]).await;
    println!(
        "back to ready after PostgreSQL accepted connections again: relay {:?}, consumer {:?}",
        ready_after[0], ready_after[1]
    );

    // More load after the restart, then drain.
    let before = load.committed();
    load.wait_committed("payments committed after the restart", before + 200, LONG)
        .await;
    stop.store(true, Ordering::Relaxed);
    load.join().await;
    fleet::wait_drained(&pool, LONG, "").await;
    assert_eq!(fleet::outbox_rows(&pool, "dead").await, Some(0));
    assert_eq!(
        fleet::ledger(&pool).await,
        fleet::expected_ledger(&pool).await,
        "every committed payment applied exactly once"
    );
    let (code, report) = fleet::relay_verify(&db_url, &name, &["--event-type", "payment.captured"]);
    assert_eq!(code, Some(0), "relay verify: {report}");
    assert_eq!(report["missing"], 0);
    assert_eq!(report["processed"], report["published"]);
    assert!(relay.stop().await, "relay exits cleanly");
    assert!(consumer.stop().await, "consumer exits cleanly");
    pool.close().await;
}

/// Process workers through the same crash: every process started (committed) before, during or
/// after it ends succeeded, with exactly one charge at the (fake) remote and one confirmation;
/// both workers are ready again within a bounded time after the database returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_workers_survive_an_immediate_postgres_stop() {
    use system_tests::process_fixtures as fx;
    init_logging();
    let mut pg = tokio::task::block_in_place(|| PrivatePg::start(&[]));
    let pool = fleet::migrated_db(&pg, "pcrash").await;
    fx::setup(&pool).await.expect("fake remote");
    let db_url = pg.url("pcrash");
    let mut workers = [
        Component::process_worker(&db_url, "crash-w1"),
        Component::process_worker(&db_url, "crash-w2"),
    ];
    for w in &workers {
        w.wait_ready("process worker", LONG).await;
    }

    // Steady starts; a start whose commit fails is not counted (it may still exist: checked below).
    let stop = Arc::new(AtomicBool::new(false));
    let committed = Arc::new(std::sync::Mutex::new(Vec::new()));
    let load = {
        let (pool, stop, committed) = (pool.clone(), stop.clone(), committed.clone());
        tokio::spawn(async move {
            let def = fx::order(
                "order_key",
                processes::Remote::HonoursKey,
                1,
                &pool,
                &fx::Failpoint::default(),
            );
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let input =
                    serde_json::json!({"amount": 5, "card": "4111111111111111", "charge": "ok"});
                let key = format!("crash-{n}");
                let started = async {
                    processes::start(&pool, &def, &key, &input)
                        .await
                        .ok()
                        .map(|s| s.id)
                };
                if let Ok(Some(id)) = tokio::time::timeout(Duration::from_secs(5), started).await {
                    committed.lock().unwrap().push(id);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let succeeded = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM outbox.processes WHERE status = 'succeeded'",
        )
        .fetch_one(&pool)
        .await
        .ok()
    };
    let p = pool.clone();
    wait_until("100 processes succeeded", LONG, || {
        let p = p.clone();
        async move { (succeeded(p).await? >= 100).then_some(()) }
    })
    .await;

    let ready_after = crash_and_restart(&mut pg, &[workers[0].metrics, workers[1].metrics]).await;
    println!("process workers back to ready after PostgreSQL returned: {ready_after:?}");

    let before = committed.lock().unwrap().len();
    let c2 = committed.clone();
    wait_until("processes started after the restart", LONG, || {
        let c2 = c2.clone();
        async move { (c2.lock().unwrap().len() >= before + 100).then_some(()) }
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();

    let p = pool.clone();
    wait_until("every process finished", LONG, || {
        let p = p.clone();
        async move {
            let open: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM outbox.processes WHERE status NOT IN ('succeeded', 'failed', 'compensated', 'manual_review', 'cancelled')",
            )
            .fetch_one(&p)
            .await
            .ok()?;
            (open == 0).then_some(())
        }
    })
    .await;
    let rows: Vec<(uuid::Uuid, String)> =
        sqlx::query_as("SELECT id, status FROM outbox.processes WHERE kind = 'order_key'")
            .fetch_all(&pool)
            .await
            .unwrap();
    let statuses: std::collections::HashMap<uuid::Uuid, String> = rows.into_iter().collect();
    let committed = committed.lock().unwrap().clone();
    for id in &committed {
        assert!(statuses.contains_key(id), "committed process {id} lost");
    }
    let not_succeeded: Vec<_> = statuses
        .iter()
        .filter(|(_, s)| s.as_str() != "succeeded")
        .collect();
    assert!(
        not_succeeded.is_empty(),
        "every process succeeded: {not_succeeded:?}"
    );
    // Exactly one charge, no refund, one confirmation per process: nothing done twice.
    let (charges, refunds, confirmations): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM fake_remote.charges), (SELECT count(*) FROM fake_remote.refunds), \
                (SELECT count(*) FROM fake_shop.confirmations)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let twice: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT process_id FROM fake_remote.charges GROUP BY 1 HAVING count(*) > 1) d",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(twice, 0, "no process charged twice");
    assert_eq!(charges, statuses.len() as i64, "one charge per process");
    assert_eq!(refunds, 0);
    assert_eq!(confirmations, statuses.len() as i64);
    println!(
        "{} processes ({} counted as committed by the load), {charges} charges",
        statuses.len(),
        committed.len()
    );
    for w in &mut workers {
        assert!(w.stop().await, "process worker exits cleanly");
    }
    pool.close().await;
}

/// Stops `pg` in immediate mode, waits until every one of `components` answers `/readyz` 503,
/// starts it again and returns how long after that each answered 200 (asserting within [`LONG`]).
async fn crash_and_restart(
    pg: &mut PrivatePg,
    components: &[std::net::SocketAddr],
) -> Vec<Duration> {
    tokio::task::block_in_place(|| pg.stop_immediate());
    wait_until("every component /readyz 503", LONG, || async move {
        for addr in components {
            if http_status(*addr, "/readyz").await != Some(503) {
                return None;
            }
        }
        Some(())
    })
    .await;
    tokio::task::block_in_place(|| pg.start_again());
    let back = Instant::now();
    let mut ready_after = vec![None; components.len()];
    while ready_after.iter().any(Option::is_none) {
        assert!(
            back.elapsed() < LONG,
            "not ready {LONG:?} after PostgreSQL came back: {ready_after:?}"
        );
        for (i, addr) in components.iter().enumerate() {
            if ready_after[i].is_none() && http_status(*addr, "/readyz").await == Some(200) {
                ready_after[i] = Some(back.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ready_after.into_iter().flatten().collect()
}

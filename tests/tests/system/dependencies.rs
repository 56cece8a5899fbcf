//! The `breaker` crate against real PostgreSQL: two handles on one dependency stand for two
//! instances (each has its own cache and holder id, as two processes would); what they share is
//! only the database. A rate limit and a concurrency cap hold across them; a circuit opened
//! through one is seen by the other and by a handle made after a "restart"; an operator's hand
//! on the circuit is recorded, append-only.

use breaker::{Admission, Dependency, Outcome, Policy, WaitReason, admin};
use shared::schema::Schema;
use std::time::{Duration, Instant};
use system_tests::TestDb;

fn instance(policy: Policy) -> Dependency {
    Dependency::new("remote", policy).expect("valid")
}

const LEASE: Duration = Duration::from_secs(5);

fn down() -> Outcome {
    Outcome::Unavailable {
        retry_after: None,
        message: "503 Service Unavailable".into(),
    }
}

#[tokio::test]
async fn two_instances_share_one_rate_limit() {
    let db = TestDb::new().await;
    let schema = Schema::default();
    let policy = Policy::default().rate(10.0, 2);
    let (a, b) = (instance(policy), instance(policy));
    let start = Instant::now();
    let mut granted = 0;
    let mut limited = 0;
    while start.elapsed() < Duration::from_secs(2) {
        for d in [&a, &b] {
            match d.acquire(&db.pool, &schema, LEASE).await.unwrap() {
                Admission::Go(p) => {
                    granted += 1;
                    p.record(Outcome::Answered).await;
                }
                Admission::Wait(w) => {
                    assert_eq!(w.reason, WaitReason::RateLimited);
                    limited += 1;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let elapsed = start.elapsed().as_secs_f64();
    // The bucket: a burst of 2, then 10 a second, for both instances together.
    let most = 2.0 + 10.0 * elapsed + 1.0;
    assert!(
        f64::from(granted) <= most,
        "{granted} calls granted in {elapsed:.2}s across two instances (at most {most:.0})"
    );
    assert!(granted >= 15, "the limit lets its rate through: {granted}");
    assert!(limited > 0, "the rest was held back");
    // The bucket as the gauge dependency_rate_tokens reads it: drained, then refilled at the
    // rate up to the burst.
    let drained = a.usage(&db.pool, &schema).await.unwrap().tokens.unwrap();
    assert!(drained < 2.0, "{drained} tokens right after the calls");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let refilled = b.usage(&db.pool, &schema).await.unwrap().tokens.unwrap();
    assert_eq!(refilled, 2.0, "refilled to the burst");
}

#[tokio::test]
async fn two_instances_share_one_concurrency_cap_and_a_slot_comes_back() {
    let db = TestDb::new().await;
    let schema = Schema::default();
    let policy = Policy::default().concurrency(2);
    let (a, b) = (instance(policy), instance(policy));
    let p1 = match a.acquire(&db.pool, &schema, LEASE).await.unwrap() {
        Admission::Go(p) => p,
        w => panic!("first call: {w:?}"),
    };
    let p2 = match b.acquire(&db.pool, &schema, LEASE).await.unwrap() {
        Admission::Go(p) => p,
        w => panic!("second call: {w:?}"),
    };
    for d in [&a, &b] {
        match d.acquire(&db.pool, &schema, LEASE).await.unwrap() {
            Admission::Wait(w) => assert_eq!(w.reason, WaitReason::Saturated),
            Admission::Go(_) => panic!("a third call in flight past a cap of 2"),
        }
    }
    // The slots held are seen from any instance (the gauge dependency_slots_in_use reads this).
    assert_eq!(
        instance(policy)
            .usage(&db.pool, &schema)
            .await
            .unwrap()
            .slots_held,
        2
    );
    p1.record(Outcome::Answered).await;
    assert_eq!(a.usage(&db.pool, &schema).await.unwrap().slots_held, 1);
    let Admission::Go(p3) = b.acquire(&db.pool, &schema, LEASE).await.unwrap() else {
        panic!("a slot given back is taken again");
    };
    p3.record(Outcome::Answered).await;
    // A holder that dies keeps its slot only until the slot's lease ends: p2's holder dies with
    // the long lease, a third instance's with a short one.
    drop(p2);
    let c = instance(policy);
    let short = Duration::from_millis(300);
    let Admission::Go(dying) = c.acquire(&db.pool, &schema, short).await.unwrap() else {
        panic!("the free slot");
    };
    drop(dying);
    match c.acquire(&db.pool, &schema, LEASE).await.unwrap() {
        Admission::Wait(w) => assert_eq!(w.reason, WaitReason::Saturated),
        Admission::Go(_) => panic!("both slots are still held"),
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        matches!(
            c.acquire(&db.pool, &schema, LEASE).await.unwrap(),
            Admission::Go(_)
        ),
        "the dead holder's slot is taken again after its lease"
    );
}

#[tokio::test]
async fn a_circuit_opened_through_one_instance_holds_the_others_and_survives_a_restart() {
    let db = TestDb::new().await;
    let schema = Schema::default();
    let policy = Policy::default()
        .consecutive(2)
        .cooldown(Duration::from_millis(500), Duration::from_secs(2))
        .cache_for(Duration::ZERO);
    let (a, b) = (instance(policy), instance(policy));
    for _ in 0..2 {
        let Admission::Go(p) = a.acquire(&db.pool, &schema, LEASE).await.unwrap() else {
            panic!("closed circuit");
        };
        p.record(down()).await;
    }
    // The other instance, and one started after a restart, see it open.
    let restarted = instance(policy);
    for d in [&b, &restarted] {
        match d.acquire(&db.pool, &schema, LEASE).await.unwrap() {
            Admission::Wait(w) => assert!(matches!(w.reason, WaitReason::Open { .. }), "{w:?}"),
            Admission::Go(_) => panic!("an open circuit let a call through"),
        }
    }
    // After the cool-down exactly one probe goes; the others wait for it.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let probe = match b.acquire(&db.pool, &schema, LEASE).await.unwrap() {
        Admission::Go(p) => p,
        w => panic!("the probe: {w:?}"),
    };
    assert!(probe.is_probe());
    match restarted.acquire(&db.pool, &schema, LEASE).await.unwrap() {
        Admission::Wait(w) => assert!(matches!(w.reason, WaitReason::Probing { .. }), "{w:?}"),
        Admission::Go(_) => panic!("a second probe"),
    }
    probe.record(Outcome::Answered).await;
    assert!(matches!(
        a.acquire(&db.pool, &schema, LEASE).await.unwrap(),
        Admission::Go(_)
    ));
    let states: Vec<String> = sqlx::query_scalar(
        "SELECT to_state FROM outbox.dependency_history WHERE name = 'remote' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(states, ["closed", "open", "half_open", "closed"]);
}

#[tokio::test]
async fn an_operator_opens_and_closes_a_circuit_by_hand_with_a_reason_and_it_is_recorded() {
    let db = TestDb::new().await;
    let schema = Schema::default();
    let d = instance(Policy::default().cache_for(Duration::ZERO));
    d.circuit(&db.pool, &schema).await.unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    // A name and a reason are required; "system" is not an operator.
    for (actor, reason) in [("", "maintenance"), ("system", "maintenance"), ("ana", " ")] {
        let e = admin::force_open(&mut conn, &schema, "remote", actor, reason).await;
        assert!(matches!(e, Err(breaker::AdminError::Invalid(_))), "{e:?}");
    }
    let e = admin::force_open(&mut conn, &schema, "nobody", "ana", "x").await;
    assert!(matches!(e, Err(breaker::AdminError::NotFound(_))), "{e:?}");

    let v = admin::force_open(
        &mut conn,
        &schema,
        "remote",
        "ana",
        "provider maintenance 02:00-03:00",
    )
    .await
    .unwrap();
    assert!(v.forced_open && v.down_since.is_some());
    match d.acquire(&db.pool, &schema, LEASE).await.unwrap() {
        Admission::Wait(w) => assert_eq!(w.reason, WaitReason::ForcedOpen),
        Admission::Go(_) => panic!("a held-open circuit let a call through"),
    }
    let v = admin::close(&mut conn, &schema, "remote", "ben", "maintenance over")
        .await
        .unwrap();
    assert!(!v.forced_open && v.down_since.is_none());
    assert!(matches!(
        d.acquire(&db.pool, &schema, LEASE).await.unwrap(),
        Admission::Go(_)
    ));
    let history = admin::history(&db.pool, &schema, "remote", 10)
        .await
        .unwrap();
    let actions: Vec<(&str, &str)> = history
        .iter()
        .map(|h| (h.actor.as_str(), h.reason.as_str()))
        .collect();
    assert_eq!(
        actions[..2],
        [
            ("ben", "closed by hand: maintenance over"),
            ("ana", "opened by hand: provider maintenance 02:00-03:00")
        ]
    );
    // Append-only.
    let edit = sqlx::query("UPDATE outbox.dependency_history SET actor = 'mallory'")
        .execute(&db.pool)
        .await;
    assert!(edit.is_err(), "history rows cannot be edited");
    let delete = sqlx::query("DELETE FROM outbox.dependency_history")
        .execute(&db.pool)
        .await;
    assert!(delete.is_err(), "history rows cannot be deleted");
}

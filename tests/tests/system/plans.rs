//! Plans that hold whatever the outbox's statistics say (migration 18, `relay::store`): the
//! outbox is emptied as fast as it fills, so its statistics are usually wrong, and the two
//! statements that run for every row must read their index anyway. The counter flush (migration
//! 19) must read the counters' primary key whatever collation its call runs in.
//!
//! Each test makes the statistics wrong on purpose, runs the statement, and reads which scans it
//! did from `pg_stat_get_xact_numscans` in the same transaction (before and after, so counts that
//! the session has not flushed yet do not count).

use relay::store::{self, ClaimArgs, Claimed, Statements};
use shared::NewMessage;
use shared::schema::Schema;
use sqlx::PgConnection;
use std::time::Duration;
use system_tests::TestDb;

/// Scans of `outbox.messages` so far in this session's unflushed statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Scans {
    seq: i64,
    claim_idx: i64,
    pkey: i64,
    id_idx: i64,
}

impl Scans {
    async fn now(conn: &mut PgConnection) -> Scans {
        let [seq, claim_idx, pkey, id_idx] = numscans(
            conn,
            [
                "outbox.messages",
                "outbox.messages_claim_idx",
                "outbox.messages_pkey",
                "outbox.messages_id_idx",
            ],
        )
        .await;
        Scans {
            seq,
            claim_idx,
            pkey,
            id_idx,
        }
    }

    fn since(self, before: Scans) -> Scans {
        Scans {
            seq: self.seq - before.seq,
            claim_idx: self.claim_idx - before.claim_idx,
            pkey: self.pkey - before.pkey,
            id_idx: self.id_idx - before.id_idx,
        }
    }
}

/// Scans of each relation so far in this session's unflushed statistics, this transaction's
/// included: for a table its sequential scans, for an index its scans.
async fn numscans<const N: usize>(conn: &mut PgConnection, relations: [&str; N]) -> [i64; N] {
    let counts: Vec<i64> = sqlx::query_scalar(
        "SELECT pg_stat_get_xact_numscans(r::regclass) \
         FROM unnest($1::text[]) WITH ORDINALITY AS t(r, i) ORDER BY i",
    )
    .bind(relations.as_slice())
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    counts.try_into().expect("one count per relation")
}

/// Claims `args` for owner `plans` in one indexed transaction on `pool`; returns the claimed rows
/// and the scans the claim made.
async fn claim_counting_scans(
    pool: &sqlx::PgPool,
    schema: &Schema,
    args: &ClaimArgs<'_>,
) -> (Vec<Claimed>, Scans) {
    let mut tx = store::begin_indexed(pool, false).await.unwrap();
    let before = Scans::now(&mut tx).await;
    let claimed = store::claim_in(&mut tx, schema, "plans", args)
        .await
        .unwrap();
    let scans = Scans::now(&mut tx).await.since(before);
    tx.commit().await.unwrap();
    (claimed, scans)
}

/// A claim of every partition, all owned by `plans`: `per` rows from each, `limit` in all.
struct ClaimAll {
    partitions: Vec<i16>,
    per_partition: Vec<i64>,
    /// Each partition read from its start (a relay's first claim).
    floors: Vec<i64>,
    limit: i64,
}

impl ClaimAll {
    async fn owning(db: &TestDb, per: i64, limit: i64) -> Self {
        sqlx::query("UPDATE outbox.relay_partitions SET owner = 'plans', lease_until = now() + interval '1 hour'")
            .execute(&db.pool)
            .await
            .unwrap();
        Self {
            partitions: (0..64).collect(),
            per_partition: vec![per; 64],
            floors: vec![0; 64],
            limit,
        }
    }

    fn args(&self) -> ClaimArgs<'_> {
        ClaimArgs {
            partitions: &self.partitions,
            per_partition: &self.per_partition,
            floors: &self.floors,
            limit: self.limit,
            held: &[],
            late_running: &[],
            late_from: None,
            statements: Statements::Prepared,
        }
    }
}

fn rows(keys: impl Iterator<Item = String>) -> Vec<NewMessage> {
    keys.map(|k| NewMessage::new("plans", k, "plans.test", serde_json::json!({"k": 1})))
        .collect()
}

/// The last ANALYZE saw every pending row on one aggregate (one partition); then a backlog over
/// 10,000 aggregates arrived. The planner, trusting the sample, took `partition = $p` to match
/// nearly every row and read the primary key in seq order for each of the 64 partitions. The
/// relay's claim reads each partition's head from `messages_claim_idx` all the same, and returns
/// the oldest rows.
#[tokio::test]
async fn a_claim_reads_the_partition_index_when_the_statistics_saw_one_hot_aggregate() {
    let db = TestDb::new().await;
    let schema = Schema::default();
    shared::outbox::enqueue_many(&db.pool, &rows((0..2000).map(|_| "hot".to_string())))
        .await
        .unwrap();
    sqlx::query("ANALYZE outbox.messages")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM outbox.messages")
        .execute(&db.pool)
        .await
        .unwrap();
    let backlog = rows((0..20_000).map(|i| format!("agg-{}", i % 10_000)));
    for chunk in backlog.chunks(1000) {
        shared::outbox::enqueue_many(&db.pool, chunk).await.unwrap();
    }
    let claim = ClaimAll::owning(&db, 64, 2000).await;
    let args = claim.args();

    let (claimed, scans) = claim_counting_scans(&db.pool, &schema, &args).await;

    assert_eq!(claimed.len(), 2000, "a full claim");
    let seqs: Vec<i64> = claimed
        .iter()
        .map(|c| match c {
            Claimed::Row(r) => r.seq,
            Claimed::Undecodable { seq, .. } => *seq,
        })
        .collect();
    let oldest: Vec<i64> = sqlx::query_scalar(
        "SELECT seq FROM outbox.messages WHERE state = 'pending' ORDER BY seq LIMIT 2000",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let mut sorted = seqs.clone();
    sorted.sort_unstable();
    assert!(
        sorted.iter().zip(&oldest).filter(|(a, b)| a == b).count() > 1500,
        "the claim returns the heads of the partitions, mostly the oldest rows"
    );
    assert_eq!(
        (scans.seq, scans.pkey),
        (0, 0),
        "no sequential scan and no walk of the primary key: {scans:?}"
    );
    assert_eq!(
        scans.claim_idx, 64,
        "one read of messages_claim_idx per owned partition: {scans:?}"
    );

    // Prepared on one connection, the claim is planned anew for five runs and may then keep a
    // generic plan: every run, that one included, reads the partition index.
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .unwrap();
    for run in 1..=8 {
        let (claimed, scans) = claim_counting_scans(&one, &schema, &args).await;
        assert_eq!(claimed.len(), 2000, "run {run}: a full claim");
        assert_eq!(
            (scans.seq, scans.pkey, scans.claim_idx),
            (0, 0, 64),
            "run {run} of the prepared claim on one connection: {scans:?}"
        );
    }
    one.close().await;
}

/// Heap blocks of `outbox.messages` this session has read so far, this transaction's included.
async fn heap_blocks(conn: &mut PgConnection) -> i64 {
    sqlx::query_scalar("SELECT pg_stat_get_xact_blocks_fetched('outbox.messages'::regclass)")
        .fetch_one(&mut *conn)
        .await
        .unwrap()
}

/// A relay that starts on an empty outbox prepares its claim then and keeps the plan (a generic
/// plan after five runs): planned for a table of a few rows, the per-partition read became a
/// bitmap scan of the whole partition and a sort, so every claim read the entire backlog to take
/// its head (165 ms instead of 10 ms a claim at a 100,000-row backlog, the bench's drain spending
/// more PostgreSQL CPU per message the longer the backlog). The claim reads each partition's head
/// in index order and stops there, whatever the plan was made for.
#[tokio::test]
async fn a_claim_prepared_on_an_empty_outbox_reads_only_the_heads_it_takes_once_a_backlog_arrives()
{
    let db = TestDb::new().await;
    let schema = Schema::default();
    // Statistics from an earlier backlog, then emptied with TRUNCATE (as the bench does between
    // runs): PostgreSQL forgets the table's size and assumes a small one of a few hundred rows.
    // Autovacuum, which would analyze the new backlog and so make the session plan anew, has not
    // come round yet.
    shared::outbox::enqueue_many(
        &db.pool,
        &rows((0..2000).map(|i| format!("agg-{}", i % 1000))),
    )
    .await
    .unwrap();
    for sql in [
        "ALTER TABLE outbox.messages SET (autovacuum_enabled = off)",
        "ANALYZE outbox.messages",
        "TRUNCATE outbox.messages",
    ] {
        sqlx::query(sql).execute(&db.pool).await.unwrap();
    }
    let claim = ClaimAll::owning(&db, 16, 1024).await;
    let args = claim.args();
    // Whether PostgreSQL keeps a generic plan after five custom ones depends on their costs; the
    // bench's relay kept one (auto_explain showed `unnest` estimated at 10 rows). This session
    // keeps it from the first run.
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query("SET plan_cache_mode = force_generic_plan")
                    .execute(conn)
                    .await
                    .map(drop)
            })
        })
        .connect(&db.url)
        .await
        .unwrap();
    // The relay polls an empty outbox.
    for _ in 0..8 {
        let mut tx = store::begin_indexed(&one, false).await.unwrap();
        let claimed = store::claim_in(&mut tx, &schema, "plans", &args)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert!(claimed.is_empty());
    }
    let backlog = rows((0..20_000).map(|i| format!("agg-{}", i % 10_000)));
    for chunk in backlog.chunks(1000) {
        shared::outbox::enqueue_many(&db.pool, chunk).await.unwrap();
    }

    let mut tx = store::begin_indexed(&one, false).await.unwrap();
    let (before, scans_before) = (heap_blocks(&mut tx).await, Scans::now(&mut tx).await);
    let claimed = store::claim_in(&mut tx, &schema, "plans", &args)
        .await
        .unwrap();
    let read = heap_blocks(&mut tx).await - before;
    let scans = Scans::now(&mut tx).await.since(scans_before);
    tx.commit().await.unwrap();
    one.close().await;

    assert_eq!(claimed.len(), 1024, "a full claim: 16 from each partition");
    // Reading each head in index order fetches about one heap block per row taken; reading whole
    // partitions fetched each of them once per partition, some 20 times more here.
    assert!(
        read < 2 * 1024,
        "the claim read {read} heap blocks of a 20,000-row backlog to take 1,024 rows"
    );
    assert_eq!(
        (scans.seq, scans.pkey, scans.claim_idx),
        (0, 0, 64),
        "one read of messages_claim_idx per partition, no walk of the primary key: {scans:?}"
    );
}

/// The insert trigger looks every new row's id up (a repeated id takes no number). PL/pgSQL keeps
/// that statement's plan for the session; planned on an empty, freshly analyzed outbox it was a
/// sequential scan, run once per row for the rest of the session (quadratic in a bulk load). It
/// probes `messages_id_idx`, whatever the table looked like when the session planned it.
#[tokio::test]
async fn the_insert_triggers_id_lookup_probes_the_index_in_a_session_that_planned_it_on_an_empty_outbox()
 {
    let db = TestDb::new().await;
    sqlx::query("ANALYZE outbox.messages")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    // More than five single-row inserts: PL/pgSQL settles on a generic plan after five.
    for i in 0..8 {
        shared::outbox::enqueue_many(&mut *conn, &rows(std::iter::once(format!("first-{i}"))))
            .await
            .unwrap();
    }
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let before = Scans::now(&mut tx).await;
    let bulk = rows((0..3000).map(|i| format!("bulk-{}", i % 7)));
    for chunk in bulk.chunks(500) {
        shared::outbox::enqueue_many(&mut *tx, chunk).await.unwrap();
    }
    let scans = Scans::now(&mut tx).await.since(before);
    tx.commit().await.unwrap();
    assert_eq!(
        scans.seq, 0,
        "no sequential scan of the outbox per inserted row: {scans:?}"
    );
    // Migration 26: a row probes once while its aggregate numbers on its first counter row (its
    // first 33 numbers), twice after (the first row's upsert, then the current row's update), and
    // once more when it finds the current row full and closes it.
    let closed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox.aggregate_sequences WHERE aggregate_id LIKE 'bulk-%' AND closed",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(closed > 0, "the bulk load filled counter rows");
    assert_eq!(
        scans.id_idx,
        3000 + (3000 - 7 * 33) + closed,
        "one probe of messages_id_idx per inserted row, one more per row past its aggregate's \
         first 33, one more per closed counter row ({closed}): {scans:?}"
    );
    let numbered: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT (aggregate_id, aggregate_seq)) FROM outbox.messages WHERE aggregate_id LIKE 'bulk-%'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(numbered, 3000, "every row got its own number");
}

/// Reads of `outbox.aggregate_sequences` this session has made so far: (sequential scans, scans
/// of its primary key), this transaction's included.
async fn counter_scans(conn: &mut PgConnection) -> (i64, i64) {
    let [seq, pkey] = numscans(
        conn,
        [
            "outbox.aggregate_sequences",
            "outbox.aggregate_sequences_pkey",
        ],
    )
    .await;
    (seq, pkey)
}

/// A transaction that writes two or more messages of one aggregate leaves that aggregate's counter
/// behind and writes it once, when it moves on to another aggregate or at commit. That write
/// found its row with a sequential scan of every counter (one per aggregate that ever had a
/// message): its callers pass the schema as a `name`, whose collation "C" the PL/pgSQL function
/// then compared in, and the primary key is in the database's collation. Here, in a database with
/// a linguistic collation and 20,000 counters, both flushes read the primary key, and the numbers
/// carry on from the written counters.
#[tokio::test]
async fn the_counter_flush_reads_the_primary_key_in_a_database_with_a_linguistic_collation() {
    let db =
        TestDb::new_unmigrated_with("TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US'")
            .await;
    shared::migrate::run(&db.pool, &Schema::default())
        .await
        .unwrap();
    // An installation that has run a while: many aggregates, each with its counter.
    sqlx::query(
        "INSERT INTO outbox.aggregate_sequences (aggregate_type, aggregate_id, first_seq, last_seq) \
         SELECT 'plans', 'agg-' || g, 1, 1 FROM generate_series(1, 20000) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE outbox.aggregate_sequences")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let (seq_before, pkey_before) = counter_scans(&mut tx).await;
    let batch = |key: &str, n: usize| rows(std::iter::repeat_n(key.to_string(), n));
    // agg-7 three times (its counter falls behind), then agg-8: the switch writes agg-7's counter.
    shared::outbox::enqueue_many(&mut *tx, &batch("agg-7", 3))
        .await
        .unwrap();
    shared::outbox::enqueue_many(&mut *tx, &batch("agg-8", 2))
        .await
        .unwrap();
    // The commit-time flush, run now so this transaction's statistics see it: agg-8's counter.
    sqlx::query("SET CONSTRAINTS ALL IMMEDIATE")
        .execute(&mut *tx)
        .await
        .unwrap();
    let (seq_after, pkey_after) = counter_scans(&mut tx).await;
    tx.commit().await.unwrap();
    assert_eq!(
        seq_after - seq_before,
        0,
        "no sequential scan of the counters (primary key scans: {})",
        pkey_after - pkey_before
    );
    assert_eq!(
        pkey_after - pkey_before,
        6,
        "the primary key is read once for each of agg-7's and agg-8's first numbers (the upsert on \
         the first counter row) and twice by each flush (the current row at the top, its update: \
         migration 26)"
    );
    shared::outbox::enqueue_many(&mut *conn, &batch("agg-7", 1))
        .await
        .unwrap();
    shared::outbox::enqueue_many(&mut *conn, &batch("agg-8", 1))
        .await
        .unwrap();
    let numbers: Vec<(String, i64)> = sqlx::query_as(
        "SELECT aggregate_id, aggregate_seq FROM outbox.messages ORDER BY aggregate_id, seq",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let expected: Vec<(String, i64)> = [("agg-7", 2..=5), ("agg-8", 2..=4)]
        .into_iter()
        .flat_map(|(key, ns)| ns.map(move |n| (key.to_string(), n)))
        .collect();
    assert_eq!(numbers, expected, "each count carries on from its counter");
}

/// Index tuples of `messages_claim_idx` and `messages_late_idx` this session has read so far.
async fn index_tuples(conn: &mut PgConnection) -> (i64, i64) {
    sqlx::query_as(
        "SELECT pg_stat_get_xact_tuples_returned('outbox.messages_claim_idx'::regclass) \
                + pg_stat_get_xact_tuples_fetched('outbox.messages_claim_idx'::regclass), \
                pg_stat_get_xact_tuples_returned('outbox.messages_late_idx'::regclass) \
                + pg_stat_get_xact_tuples_fetched('outbox.messages_late_idx'::regclass)",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap()
}

/// Issue 39: while a snapshot older than the published rows is held, their index entries stay.
/// A claim past each partition's floor, with a late watch, reads none of them: its heap blocks do
/// not grow with what was published since the snapshot began.
#[tokio::test]
async fn a_claim_past_its_floors_reads_nothing_published_under_an_old_snapshot() {
    let db = TestDb::new().await;
    let schema = Schema::default();
    let all = ClaimAll::owning(&db, 1000, 100_000).await;
    // A report holds its snapshot from before everything.
    let report = db.held_snapshot().await;
    // 20,000 rows published (deleted) since.
    let backlog = rows((0..20_000).map(|i| format!("agg-{}", i % 5_000)));
    for chunk in backlog.chunks(1000) {
        shared::outbox::enqueue_many(&db.pool, chunk).await.unwrap();
    }
    let mut floors = vec![0i64; 64];
    loop {
        let mut args = all.args();
        args.floors = &floors;
        let (claimed, _) = store::claim(&db.pool, &schema, "plans", &args)
            .await
            .unwrap();
        if claimed.is_empty() {
            break;
        }
        let seqs: Vec<i64> = claimed.iter().map(Claimed::seq).collect();
        let mut next = floors.clone();
        for c in &claimed {
            let f = &mut next[c.partition() as usize];
            *f = (*f).max(c.seq());
        }
        floors = next;
        store::mark_published(&db.pool, &schema, &seqs, false, Statements::Prepared)
            .await
            .unwrap();
    }
    let snapshot: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let xmax = snapshot.split(':').nth(1).unwrap().to_string();
    // Ten new rows, then a claim from the floors with the late watch.
    shared::outbox::enqueue_many(&db.pool, &rows((0..10).map(|i| format!("new-{i}"))))
        .await
        .unwrap();
    let mut tx = store::begin_indexed(&db.pool, false).await.unwrap();
    let (blocks, tuples) = (heap_blocks(&mut tx).await, index_tuples(&mut tx).await);
    let mut args = all.args();
    args.floors = &floors;
    args.late_from = Some(&xmax);
    let claimed = store::claim_in(&mut tx, &schema, "plans", &args)
        .await
        .unwrap();
    let read = heap_blocks(&mut tx).await - blocks;
    let after = index_tuples(&mut tx).await;
    tx.commit().await.unwrap();
    report.rollback().await.unwrap();
    assert_eq!(claimed.len(), 10, "the new rows");
    eprintln!(
        "claim past the floors: {read} heap blocks, index tuples claim {} late {}",
        after.0 - tuples.0,
        after.1 - tuples.1
    );
    assert!(
        read < 100,
        "a claim past its floors read {read} heap blocks for 10 rows, with 20,000 published rows' entries behind the floors"
    );
}

/// Blocks of `outbox.aggregate_sequences` and its primary key this transaction has read so far.
async fn counter_blocks(conn: &mut PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT pg_stat_get_xact_blocks_fetched('outbox.aggregate_sequences'::regclass) \
              + pg_stat_get_xact_blocks_fetched('outbox.aggregate_sequences_pkey'::regclass)",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap()
}

/// The blocks of the counters that one producer transaction on `aggregate` reads, and the number
/// it was given.
async fn one_numbered_insert(db: &TestDb, aggregate: &str) -> (i64, i64) {
    let mut tx = db.pool.begin().await.unwrap();
    let before = counter_blocks(&mut tx).await;
    shared::outbox::enqueue_many(&mut *tx, &rows(std::iter::once(aggregate.to_string())))
        .await
        .unwrap();
    let read = counter_blocks(&mut tx).await - before;
    let n: i64 = sqlx::query_scalar(
        "SELECT max(aggregate_seq) FROM outbox.messages WHERE aggregate_id = $1",
    )
    .bind(aggregate)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    (read, n)
}

/// Issue 39, the producers' side: while a snapshot is held, every transaction that numbered an
/// aggregate used to leave one more version of its counter row, and the next one walked them all
/// (four producers fell to 67% of their rate within 60 s). Since migration 26 a counter row takes
/// at most 32 updates and the next row is found at the top of the primary key: what one insert
/// reads does not grow with the transactions since the snapshot, the closed rows the purge deleted
/// included, and the numbers go on.
#[tokio::test]
async fn a_producer_reads_the_same_counter_blocks_however_many_transactions_an_old_snapshot_keeps()
{
    let db = TestDb::new().await;
    let schema = Schema::default();
    let report = db.held_snapshot().await;
    let hot = "hot-aggregate";
    let mut transactions = 0;
    let mut reads = Vec::new();
    for burst in [200, 3_000] {
        for _ in 0..burst {
            shared::outbox::enqueue_many(&db.pool, &rows(std::iter::once(hot.to_string())))
                .await
                .unwrap();
        }
        transactions += burst;
        let stop = tokio_util::sync::CancellationToken::new();
        let purged = relay::counters::pass(&db.pool, &schema, &stop)
            .await
            .unwrap();
        assert!(purged > 0, "the purge deleted closed rows");
        // 32 transactions, one counter row's worth: the same share of closings in each sample.
        let mut read = 0;
        for _ in 0..32 {
            let (r, n) = one_numbered_insert(&db, hot).await;
            transactions += 1;
            assert_eq!(n, transactions, "the numbers go on without a gap");
            read += r;
        }
        reads.push(read);
    }
    report.rollback().await.unwrap();
    let slots: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox.aggregate_sequences WHERE aggregate_id = $1",
    )
    .bind(hot)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    eprintln!("counter blocks of 32 inserts after 200 and after 3,232 transactions: {reads:?}");
    assert!(
        slots <= 3,
        "the purge keeps the first and the current row (and one closed since): {slots}"
    );
    // 16 times the transactions; what may grow is the primary key's height, not a walk of
    // versions (the update chain before migration 26: one insert read 6 blocks after 200
    // transactions and 22 after 3,200).
    assert!(
        reads[1] * 2 < reads[0] * 3,
        "32 inserts read {} counter blocks after {transactions} transactions under the snapshot, \
         {} after 200",
        reads[1],
        reads[0]
    );
}

/// Index entries of `processes_due_idx` read so far, by every session that has flushed.
async fn due_index_reads(db: &TestDb) -> i64 {
    sqlx::query_scalar(
        "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE schemaname = 'outbox' AND indexrelname = 'processes_due_idx'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Issue 39: every claim and every finished process leaves a dead entry in `processes_due_idx`,
/// and under an old snapshot none can be marked. A worker's claims start from the oldest due time
/// the previous claim took (`processes::claim_floor`), so 4,000 processes cost a few entries each,
/// not the entries of every process claimed before (read from the front: 2,676,753 entries, 670 a
/// process, measured; with the floor 22,940).
#[tokio::test]
async fn a_workers_claims_do_not_walk_the_processes_claimed_before_under_an_old_snapshot() {
    const N: i64 = 4000;
    let db = TestDb::new().await;
    let schema = Schema::default();
    let def = processes::Definition::new("plans_floor", 1).step(processes::Step::local(
        "noop",
        system_tests::process_fixtures::Noop,
    ));
    // Due one millisecond apart, an hour ago (one transaction gives them all the same due time).
    let mut tx = db.pool.begin().await.unwrap();
    for i in 0..N {
        processes::start_in(
            &mut tx,
            &schema,
            &def,
            &format!("p{i}"),
            &serde_json::json!({}),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    sqlx::query(
        "UPDATE outbox.processes SET next_run_at = now() - interval '1 hour' + (n * interval '1 ms') \
         FROM (SELECT id AS pid, row_number() OVER (ORDER BY created_at, id) AS n FROM outbox.processes) o \
         WHERE id = o.pid",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let report = db.held_snapshot().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(12)
        .connect(&db.url)
        .await
        .unwrap();
    let before = due_index_reads(&db).await;
    let mut config = processes::WorkerConfig::new(pool.clone(), schema.clone(), "plans-floor");
    config.concurrency = 8;
    config.stats_interval = Duration::from_secs(3600);
    let stop = tokio_util::sync::CancellationToken::new();
    let registry = processes::Registry::new().with(def).unwrap();
    let worker = tokio::spawn(processes::Worker::run(config, registry, stop.clone()));
    system_tests::wait_until(
        "every process succeeded",
        Duration::from_secs(120),
        || async {
            let done: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM outbox.processes WHERE status = 'succeeded'",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            (done == N).then_some(())
        },
    )
    .await;
    stop.cancel();
    worker.await.unwrap().unwrap();
    // Closed sessions have flushed their statistics.
    pool.close().await;
    let read = due_index_reads(&db).await - before;
    report.rollback().await.unwrap();
    eprintln!(
        "{read} entries of processes_due_idx read to claim {N} processes under an old snapshot"
    );
    assert!(
        read < 10 * N,
        "the claims read {read} entries of processes_due_idx for {N} processes under an old snapshot: each claim walks the processes claimed before it"
    );
}

/// The claim floor's bound: a process that becomes due in front of a worker's floor (here one
/// whose due time is an hour old, as a resumed process keeps its own) is claimed at the worker's
/// next read from the front, within `FRONT_EVERY`, not left behind the floor.
#[tokio::test]
async fn a_process_due_in_front_of_the_claim_floor_is_claimed_within_the_front_interval() {
    let db = TestDb::new().await;
    let schema = Schema::default();
    let def = processes::Definition::new("plans_front", 1).step(processes::Step::local(
        "noop",
        system_tests::process_fixtures::Noop,
    ));
    let mut config = processes::WorkerConfig::new(db.pool.clone(), schema.clone(), "plans-front");
    config.stats_interval = Duration::from_secs(3600);
    let stop = tokio_util::sync::CancellationToken::new();
    let registry = processes::Registry::new().with(def.clone()).unwrap();
    let worker = tokio::spawn(processes::Worker::run(config, registry, stop.clone()));
    let succeeded = |n: i64| {
        let pool = db.pool.clone();
        move || {
            let pool = pool.clone();
            async move {
                let done: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM outbox.processes WHERE status = 'succeeded'",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                (done == n).then_some(())
            }
        }
    };
    // Processes due now give the worker its floor.
    for i in 0..20 {
        let mut tx = db.pool.begin().await.unwrap();
        processes::start_in(
            &mut tx,
            &schema,
            &def,
            &format!("now-{i}"),
            &serde_json::json!({}),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    system_tests::wait_until(
        "the first processes succeeded",
        Duration::from_secs(30),
        succeeded(20),
    )
    .await;
    // One more, due an hour ago: in front of the floor.
    let mut tx = db.pool.begin().await.unwrap();
    let id = processes::start_in(&mut tx, &schema, &def, "behind", &serde_json::json!({}))
        .await
        .unwrap();
    sqlx::query("UPDATE outbox.processes SET next_run_at = now() - interval '1 hour' WHERE business_key = 'behind'")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let at = std::time::Instant::now();
    system_tests::wait_until(
        "the process behind the floor succeeded",
        processes::claim_floor::FRONT_EVERY + Duration::from_secs(5),
        succeeded(21),
    )
    .await;
    eprintln!(
        "process {id:?} behind the floor claimed after {:?}",
        at.elapsed()
    );
    stop.cancel();
    worker.await.unwrap().unwrap();
}

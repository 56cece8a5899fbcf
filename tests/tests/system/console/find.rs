//! Finding processes in the console (issue 23, item 4): one search by every key a person holds,
//! keyset pages that say "N of M" and never cut, counts by status, every filter, and refusals of
//! filters and cursors that are none; in the API and in a real browser.

use super::*;
use std::collections::HashSet;

/// Starts `n` order processes (keys `k-<i>`, input `order_id` `ord-<i>`) of kind `kind` whose
/// charge's remote is `remote`; returns their ids in start order. No worker runs them.
async fn start_many(c: &Console, kind: &str, remote: processes::Remote, n: usize) -> Vec<Uuid> {
    let d = fx::order(kind, remote, 1, &c.db.pool, &fx::Failpoint::default());
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let input = json!({"amount": 5, "card": CARD, "charge": "ok", "order_id": format!("ord-{kind}-{i}")});
        let started = processes::start(&c.db.pool, &d, &format!("k-{kind}-{i}"), &input)
            .await
            .unwrap();
        ids.push(started.id);
    }
    ids
}

/// Puts process `id` in manual review as a worker would after its charge's outcome was `class`
/// (the test arranges the rows; the database's transition rules still apply).
async fn charge_in_review(c: &Console, id: Uuid, class: &str) {
    let mut tx = c.db.pool.begin().await.unwrap();
    sqlx::query(
        "UPDATE outbox.process_steps SET status = 'manual_review', error_class = $2, \
         error_message = 'timed out', last_reason = 'charge outcome ' || $2 \
         WHERE process_id = $1 AND name = 'charge' AND role = 'forward'",
    )
    .bind(id)
    .bind(class)
    .execute(&mut *tx)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE outbox.processes SET status = 'manual_review', last_reason = 'charge in doubt' WHERE id = $1",
    )
    .bind(id)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

/// `GET path` as `token`, a 200 with a JSON body.
async fn page(c: &Console, token: &str, path: &str) -> Value {
    let (s, body) = c.get(token, path).await;
    assert_eq!(s, StatusCode::OK, "{path}: {body}");
    serde_json::from_str(&body).unwrap()
}

/// The ids of a page.
fn ids_of(page: &Value) -> Vec<Uuid> {
    page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_str().unwrap().parse().unwrap())
        .collect()
}

/// `GET /api/processes?<query>` finds exactly `want`, and says so in `total`.
async fn finds(c: &Console, token: &str, query: &str, want: &[Uuid]) {
    let p = page(c, token, &format!("/api/processes?limit=500&{query}")).await;
    let mut got = ids_of(&p);
    got.sort();
    let mut want = want.to_vec();
    want.sort();
    assert_eq!(got, want, "{query}");
    assert_eq!(p["total"], json!(want.len()), "{query}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_fifty_processes_are_paged_each_exactly_once_with_n_of_m_and_no_cut() {
    let c = Console::start().await;
    let viewer = c.user("vera", Role::Viewer).await;
    let ids = start_many(&c, "order_key", processes::Remote::HonoursKey, 250).await;

    let mut seen = Vec::new();
    let mut path = "/api/processes?limit=40".to_string();
    let mut pages = 0;
    loop {
        let p = page(&c, &viewer, &path).await;
        pages += 1;
        assert_eq!(p["total"], json!(250), "every page says how many in all");
        let got = ids_of(&p);
        assert!(got.len() <= 40);
        seen.extend(got);
        match p["next"].as_str() {
            Some(next) => path = format!("/api/processes?limit=40&after={next}"),
            None => break,
        }
    }
    assert_eq!(pages, 7, "250 in pages of 40");
    assert_eq!(seen.len(), 250, "no id twice, none left out");
    let unique: HashSet<Uuid> = seen.iter().copied().collect();
    assert_eq!(unique, ids.iter().copied().collect::<HashSet<_>>());
    assert!(seen.windows(2).all(|w| w[0] > w[1]), "newest first");

    // The page says "showing 41–80 of 250" and links the next page.
    let cookie = login(&c, &viewer).await;
    let first = c
        .http
        .get(format!("{}/processes", c.base))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    let html = first.text().await.unwrap();
    assert!(html.contains("of <span id=\"total\">250</span>"), "{html}");
    let next = html
        .split("id=\"next\" href=\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap()
        .replace("&amp;", "&");
    let second = c
        .http
        .get(format!("{}{next}", c.base))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(second.status(), StatusCode::OK);
    let html = second.text().await.unwrap();
    assert!(
        html.contains("<span id=\"first-row\">51</span>–<span id=\"last-row\">100</span>"),
        "{html}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_search_finds_a_process_by_each_key_and_every_filter_narrows() {
    let c = Console::start().await;
    let op = c.user("olga", Role::Operator).await;
    let keyed = start_many(&c, "order_key", processes::Remote::HonoursKey, 6).await;
    let queried = start_many(&c, "order_query", processes::Remote::Queryable, 3).await;
    let target = keyed[4];
    let (operation,): (Uuid,) = sqlx::query_as(
        "SELECT operation_id FROM outbox.process_steps WHERE process_id = $1 AND name = 'charge'",
    )
    .bind(target)
    .fetch_one(&c.db.pool)
    .await
    .unwrap();
    sqlx::query("UPDATE outbox.process_steps SET remote_ref = 'ch_remote_4' WHERE process_id = $1 AND name = 'charge'")
        .bind(target)
        .execute(&c.db.pool)
        .await
        .unwrap();

    // Each key finds the one process; a secret of its input finds nothing (only the redacted
    // input is searched).
    for key in [
        target.to_string(),
        "k-order_key-4".to_string(),
        "ord-order_key-4".to_string(),
        operation.to_string(),
        "ch_remote_4".to_string(),
    ] {
        finds(
            &c,
            &op,
            &format!("q={}", console::web::url_encode(&key)),
            &[target],
        )
        .await;
    }
    for nothing in [CARD, "k-order_key", "ord-", &Uuid::now_v7().to_string()] {
        finds(&c, &op, &format!("q={nothing}"), &[]).await;
    }

    // Three in manual review (two unknown, one transient), one paused.
    charge_in_review(&c, keyed[0], "unknown").await;
    charge_in_review(&c, keyed[1], "transient").await;
    charge_in_review(&c, queried[0], "unknown").await;
    sqlx::query("UPDATE outbox.processes SET paused = true, last_reason = 'hold' WHERE id = $1")
        .bind(keyed[2])
        .execute(&c.db.pool)
        .await
        .unwrap();

    // Counts by status, as stored.
    let p = page(&c, &op, "/api/processes").await;
    let stored: Vec<(String, i64)> = sqlx::query_as(
        "SELECT status, count(*) FROM outbox.processes GROUP BY status ORDER BY status",
    )
    .fetch_all(&c.db.pool)
    .await
    .unwrap();
    let mut shown: Vec<(String, i64)> = p["counts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["status"].as_str().unwrap().to_string(),
                c["count"].as_i64().unwrap(),
            )
        })
        .collect();
    shown.sort();
    assert_eq!(shown, stored);
    assert_eq!(p["total"], json!(9));

    let in_review = [keyed[0], keyed[1], queried[0]];
    finds(&c, &op, "status=manual_review", &in_review).await;
    finds(&c, &op, "error_class=unknown", &[keyed[0], queried[0]]).await;
    finds(&c, &op, "error_class=transient", &[keyed[1]]).await;
    finds(&c, &op, "error_class=permanent", &[]).await;
    finds(&c, &op, "step=charge", &in_review).await;
    finds(&c, &op, "step=reserve", &[]).await;
    finds(
        &c,
        &op,
        "step=charge&error_class=unknown&remote=honours_key",
        &[keyed[0]],
    )
    .await;
    finds(&c, &op, "remote=queryable", &[queried[0]]).await;
    finds(&c, &op, "paused=true", &[keyed[2]]).await;
    finds(&c, &op, "paused=false&status=manual_review", &in_review).await;
    finds(&c, &op, "kind=order_query", &queried).await;
    finds(&c, &op, "in_review_longer_than=1h", &[]).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    finds(&c, &op, "in_review_longer_than=10ms", &in_review).await;
    finds(
        &c,
        &op,
        "in_review_longer_than=1ms&error_class=unknown",
        &[keyed[0], queried[0]],
    )
    .await;

    // A filter or cursor that is none is a 400 with only `error`, in the API and the page.
    let cookie = login(&c, &op).await;
    for bad in [
        "after=garbage",
        &format!("after={}", target),
        "after=p0123",
        "status=parked",
        "error_class=maybe",
        "remote=sometimes",
        "paused=yes",
        "in_review_longer_than=soon",
        "q=a%00b",
        "step=x%01",
    ] {
        let (s, body) = c.get(&op, &format!("/api/processes?{bad}")).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {body}");
        let err: Value = serde_json::from_str(&body).unwrap();
        assert!(
            err["error"].is_string() && err.as_object().unwrap().len() == 1,
            "{bad}: {err}"
        );
        let r = c
            .http
            .get(format!("{}/processes?{bad}", c.base))
            .header("cookie", &cookie)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "page {bad}");
    }
    // Without a token: refused, and audited as the console audits refusals.
    let (s, _) = c.get("ct_nobody", "/api/processes?status=parked").await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_real_browser_an_operator_searches_and_pages_through_processes() {
    let c = Console::start().await;
    let op = c.user("operator-olivia", Role::Operator).await;
    let ids = start_many(&c, "order_key", processes::Remote::HonoursKey, 120).await;
    charge_in_review(&c, ids[7], "unknown").await;
    let (_driver, b) = chromedriver().await;
    log_in(&b, &c.base, &op).await;

    // The list: counts by status, the first 50 of 120, a Next link.
    b.goto(&format!("{}/processes", c.base)).await.unwrap();
    wait_for(&b, "processes").await;
    let counts = wait_for(&b, "status-counts").await.text().await.unwrap();
    assert!(
        counts.contains("manual_review 1") && counts.contains("pending 119"),
        "{counts}"
    );
    let paging = wait_for(&b, "paging").await.text().await.unwrap();
    assert!(paging.contains("showing 1–50 of 120"), "{paging}");
    click(&b, "next").await;
    let paging = wait_for(&b, "paging").await.text().await.unwrap();
    assert!(paging.contains("showing 51–100 of 120"), "{paging}");
    click(&b, "next").await;
    let paging = wait_for(&b, "paging").await.text().await.unwrap();
    assert!(paging.contains("showing 101–120 of 120"), "{paging}");
    assert!(
        b.find(fantoccini::Locator::Id("next")).await.is_err(),
        "no Next on the last page"
    );

    // A count filters.
    click(&b, "count-manual_review").await;
    wait_for(&b, &format!("process-{}", ids[7])).await;
    let paging = wait_for(&b, "paging").await.text().await.unwrap();
    assert!(paging.contains("showing 1–1 of 1"), "{paging}");

    // The search box finds a process by its order id.
    b.goto(&format!("{}/processes", c.base)).await.unwrap();
    type_into(&b, "search", "ord-order_key-42").await;
    click(&b, "filter").await;
    wait_for(&b, &format!("process-{}", ids[42])).await;
    let paging = wait_for(&b, "paging").await.text().await.unwrap();
    assert!(paging.contains("of 1"), "{paging}");
    let source = b.source().await.unwrap();
    assert!(!source.contains(CARD));
    screenshot_and_close(b, "console-find-search.png").await;
}

/// How many transitions of process `id` an operator's `action` recorded.
async fn acted(c: &Console, id: Uuid, action: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox.process_history WHERE process_id = $1 AND reason LIKE $2 || ':%' AND step_seq IS NOT NULL",
    )
    .bind(id)
    .bind(action)
    .fetch_one(&c.db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_rerun_by_filter_is_dry_run_approved_once_and_acts_on_exactly_the_frozen_versions() {
    let c = Console::start().await;
    let op = c.user("olga", Role::Operator).await;
    let ap = c.user("arthur", Role::Approver).await;
    let viewer = c.user("vera", Role::Viewer).await;
    let keyed = start_many(&c, "order_key", processes::Remote::HonoursKey, 5).await;
    let queried = start_many(&c, "order_query", processes::Remote::Queryable, 2).await;
    for id in [keyed[0], keyed[1], keyed[2], queried[0]] {
        charge_in_review(&c, id, "unknown").await;
    }
    charge_in_review(&c, keyed[3], "transient").await;
    let path = "/api/processes/actions/rerun_step";
    let filter =
        json!({"status": "manual_review", "error_class": "unknown", "remote": "honours_key"});
    let body = |dry: bool| json!({"filter": filter, "step": "charge", "reason": "provider recovered, INC-7", "dry_run": dry});

    // A viewer is refused first and audited, whatever the filter says.
    let (s, _, _) = c
        .post(
            &viewer,
            path,
            json!({"filter": {"error_class": "maybe"}, "step": "charge", "reason": "x"}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    assert_eq!(
        c.audit_count("vera", "process.rerun_step", "denied").await,
        1
    );
    // Filters that are none, actions that need evidence per process (asked by an approver, who
    // may ask for them one by one), a step action without its step: 400 with only `error`.
    for (p, b) in [
        (
            path,
            json!({"filter": {"error_class": "maybe"}, "step": "charge", "reason": "x"}),
        ),
        (
            path,
            json!({"filter": {"in_review_longer_than": "soon"}, "step": "charge", "reason": "x"}),
        ),
        (path, json!({"filter": filter, "reason": "x"})),
        (
            "/api/processes/actions/resolve_failed",
            json!({"filter": filter, "step": "charge", "reason": "x"}),
        ),
        (
            "/api/processes/actions/resolve_succeeded",
            json!({"filter": filter, "step": "charge", "reason": "x"}),
        ),
        (
            "/api/processes/actions/run_compensation",
            json!({"filter": filter, "step": "charge", "reason": "x"}),
        ),
    ] {
        let (s, err, _) = c.post(&ap, p, b.clone(), None).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{p} {b}: {err}");
        assert!(
            err["error"].is_string() && err.as_object().unwrap().len() == 1,
            "{err}"
        );
    }

    // The dry run lists exactly the matching processes with their versions; nothing changes.
    let want: HashSet<Uuid> = keyed[..3].iter().copied().collect();
    let (s, plan, _) = c.post(&op, path, body(true), None).await;
    assert_eq!(s, StatusCode::OK, "{plan}");
    let listed: HashSet<Uuid> = plan["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(listed, want, "{plan}");
    for i in plan["items"].as_array().unwrap() {
        let id: Uuid = i["id"].as_str().unwrap().parse().unwrap();
        assert_eq!(i["version"], json!(c.process_state(id).await.2));
        assert_eq!(i["allowed"], json!(true));
    }
    assert_eq!(c.approvals().await, 0, "a dry run asks nobody");

    // One request, one reason, one approval; asking again answers with it.
    let (s, asked, _) = c.post(&op, path, body(false), Some("bulk-1")).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{asked}");
    assert_eq!(asked["selected"], json!(3));
    let (s, again, _) = c.post(&op, path, body(false), Some("bulk-2")).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    assert_eq!(
        (again["approval"].clone(), again["existing"].clone()),
        (asked["approval"].clone(), json!(true))
    );
    assert_eq!(c.approvals().await, 1);
    for id in &keyed {
        assert_eq!(
            acted(&c, *id, "rerun_step").await,
            0,
            "nothing runs before approval"
        );
    }

    // One of them moves on before the approval: it is skipped and reported, never acted on.
    let moved = keyed[1];
    let v = c.process_state(moved).await.2;
    let (s, b, _) = c
        .post(
            &op,
            &format!("/api/processes/{moved}/actions/pause"),
            json!({"reason": "hold it", "version": v}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{b}");

    let approval = asked["approval"].as_str().unwrap();
    let (s, done, _) = c
        .post(
            &ap,
            &format!("/api/approvals/{approval}/approve"),
            json!({"reason": "checked the provider", "version": 1}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{done}");
    let skipped = done["result"]["skipped"].as_array().unwrap();
    assert_eq!(skipped.len(), 1, "{done}");
    assert_eq!(skipped[0]["id"], json!(moved));
    assert_eq!(
        done["result"]["done"].as_array().unwrap().len(),
        2,
        "{done}"
    );
    for id in [keyed[0], keyed[2]] {
        assert_eq!(
            acted(&c, id, "rerun_step").await,
            1,
            "{id} rerun exactly once"
        );
        assert_ne!(c.process_state(id).await.0, "manual_review");
    }
    for id in [moved, keyed[3], keyed[4], queried[0], queried[1]] {
        assert_eq!(
            acted(&c, id, "rerun_step").await,
            0,
            "{id} not selected or moved on"
        );
    }
    // Approving again changes nothing.
    let (s, _, _) = c
        .post(
            &ap,
            &format!("/api/approvals/{approval}/approve"),
            json!({"reason": "again", "version": 1}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    for id in [keyed[0], keyed[2]] {
        assert_eq!(acted(&c, id, "rerun_step").await, 1);
    }
}

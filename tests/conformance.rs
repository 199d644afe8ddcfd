//! The behaviour every store must show, run once per backend from this one source.
//! A new backend gets the whole suite by adding one line to the `conformance!` call below.
//!
//! Every test of the suite is run only through the list in `conformance!`: one left off the
//! list is dead code, which the lints refuse.

#![cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]

mod common;

macro_rules! conformance {
    ($($backend:ident: $db:ty, $feature:literal;)*) => {$(
        #[cfg(feature = $feature)]
        mod $backend {
            type Db = $db;
            conformance!(@tests
                replay_reproduces_status_headers_and_body_with_replay_header,
                storm_of_50_concurrent_duplicates_executes_once,
                two_instances_on_separate_pools_execute_once,
                two_instances_split_duplicates_of_many_keys_execute_each_once,
                retry_reaching_an_instance_that_never_saw_the_key_gets_the_stored_answer,
                panic_leaves_no_record_and_the_retry_executes_once,
                server_error_leaves_no_record_and_the_retry_executes_once,
                final_client_error_is_replayed_with_its_writes_undone,
                changed_intent_is_rejected_without_execution,
                equivalent_json_and_ignored_fields_replay,
                other_principal_and_other_route_are_isolated,
                concrete_path_and_query_are_part_of_the_intent,
                expired_key_is_a_new_intent_claimed_once,
                purge_deletes_only_expired_records,
                body_over_the_limit_is_rejected_before_any_claim,
                declared_body_over_the_limit_is_refused_before_it_is_sent,
                slow_body_is_answered_by_the_deadline_and_its_connection_closed,
                duplicate_past_the_wait_gets_409_with_retry_after,
                missing_or_malformed_key_is_rejected,
                missing_principal_is_401_unless_anonymous_is_allowed,
                transaction_held_past_the_handler_is_rolled_back_with_an_error,
                oversized_response_is_rolled_back,
                job_and_http_request_racing_on_one_key_execute_once,
                migrate_twice_and_concurrently_is_a_no_op,
                clients_hanging_up_mid_request_leave_no_open_transaction,
                unkeyed_requests_commit_on_success_and_roll_back_on_failure,
                unkeyed_requests_follow_the_layers_classification,
                leased_work_runs_once_while_duplicates_wait_then_replay,
                holder_that_dies_mid_work_is_taken_over_after_its_lease,
                cached_replays_are_answered_without_reading_the_store,
                cached_record_stops_answering_at_its_expiry,
                cached_replays_tell_the_same_intent_from_the_same_bytes,
                storm_across_two_caching_instances_executes_once,
            );
        }
    )*};
    (@tests $($test:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $test() {
            crate::suite::$test::<Db>().await
        }
    )*};
}

conformance! {
    sqlite: sqlx::Sqlite, "sqlite";
    postgres: sqlx::Postgres, "postgres";
    mysql: sqlx::MySql, "mysql";
}

mod suite {
    use std::time::{Duration, Instant, SystemTime};

    use axum::http::{Request, StatusCode};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum_idempotency::{
        Classification, Fingerprint, Fingerprinter, IdempotencyKey, IdempotencyLayer, ManualClock,
        Outcome, Rejection, RunError, Scope, Tx,
    };
    use serde_json::json;

    use crate::common::{App, Backend, Db, body, second_instance, serve, serve_fresh, unique};

    async fn app<DB: Db>() -> App<DB> {
        serve_fresh::<DB>(16, |layer| layer).await
    }

    pub(crate) async fn replay_reproduces_status_headers_and_body_with_replay_header<DB: Db>() {
        let app = app::<DB>().await;
        let key = unique("key");
        let first = app
            .post("/effects", Some("alice"), Some(&key), &body("replay"))
            .await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(
            !first.replayed(),
            "a first execution carries no replay header"
        );
        assert!(first.headers.get("set-cookie").is_some());

        let again = app
            .post("/effects", Some("alice"), Some(&key), &body("replay"))
            .await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert!(again.replayed());
        assert_eq!(again.body, first.body, "byte-identical body");
        assert_eq!(again.headers["location"], first.headers["location"]);
        let links: Vec<_> = again.headers.get_all("link").iter().collect();
        assert_eq!(
            links,
            ["</a>; rel=\"a\"", "</b>; rel=\"b\""],
            "multi-valued headers kept in order"
        );
        assert!(
            again.headers.get("set-cookie").is_none(),
            "Set-Cookie is never replayed"
        );
        assert_eq!(app.executions(), 1);
        assert_eq!(DB::count_effects(&app.pool, "replay").await, 1);
        app.dispose().await;
    }

    pub(crate) async fn cached_replays_are_answered_without_reading_the_store<DB: Db>() {
        let app = serve_fresh::<DB>(8, |layer| layer.cache_replays(1 << 20)).await;
        let key = unique("cached");
        let first = app
            .post("/effects", Some("alice"), Some(&key), &body("cached"))
            .await;
        assert_eq!(first.status, StatusCode::CREATED);
        let refused_key = unique("cached-refusal");
        let refused = app
            .post("/fail/403", Some("alice"), Some(&refused_key), &body("no"))
            .await;
        assert_eq!(refused.status, StatusCode::FORBIDDEN);

        // With the table emptied behind its back, only the cache can still answer.
        DB::delete_records(&app.pool).await;
        let again = app
            .post("/effects", Some("alice"), Some(&key), &body("cached"))
            .await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert!(again.replayed());
        assert_eq!(again.body, first.body, "byte-identical body");
        assert_eq!(again.headers["location"], first.headers["location"]);
        assert!(again.headers.get("set-cookie").is_none());
        let refused_again = app
            .post("/fail/403", Some("alice"), Some(&refused_key), &body("no"))
            .await;
        assert_eq!(refused_again.status, StatusCode::FORBIDDEN);
        assert!(refused_again.replayed(), "a final refusal is cached too");
        assert_eq!(refused_again.body, refused.body);

        let changed = app
            .post("/effects", Some("alice"), Some(&key), &body("changed"))
            .await;
        assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(changed.code(), "idempotency_key_reused");
        let bob = app
            .post("/effects", Some("bob"), Some(&key), &body("cached"))
            .await;
        assert_eq!(bob.status, StatusCode::CREATED);
        assert!(
            !bob.replayed(),
            "another principal's scope is not in the cache"
        );
        assert_eq!(app.executions(), 3);
        assert_eq!(DB::count_effects(&app.pool, "cached").await, 2);
        app.dispose().await;
    }

    pub(crate) async fn cached_replays_tell_the_same_intent_from_the_same_bytes<DB: Db>() {
        let isolated = DB::fresh(8).await;
        let configure = |layer: IdempotencyLayer<DB>| {
            layer
                .cache_replays(1 << 20)
                .ignore_json_fields(["/sent_at"])
        };
        let one = serve(isolated.pool.clone(), configure).await;
        let two = serve(DB::another_pool(&isolated, 8).await, configure).await;
        let key = unique("cached-intent");
        let sent = r#"{"label":"cached-intent","sent_at":"10:00:00"}"#;
        let respelled = r#"{ "sent_at": "10:00:05", "label": "cached-intent" }"#;
        let other = r#"{"label":"cached-intenT","sent_at":"10:00:00"}"#;

        let first = one
            .post("/effects?b=2&a=1", Some("alice"), Some(&key), sent)
            .await;
        assert_eq!(first.status, StatusCode::CREATED);
        for (path, body, what) in [
            ("/effects?b=2&a=1", sent, "the same bytes"),
            ("/effects?a=1&b=2", respelled, "the same intent respelled"),
            (
                "/effects?b=2&a=1",
                sent,
                "the same bytes after a respelled retry",
            ),
        ] {
            let again = one.post(path, Some("alice"), Some(&key), body).await;
            assert_eq!(again.status, StatusCode::CREATED, "{what}");
            assert!(again.replayed(), "{what}");
            assert_eq!(again.body, first.body, "{what}");
        }
        for (path, body, what) in [
            ("/effects?b=2&a=1", other, "one byte changed in the body"),
            ("/effects?b=3&a=1", sent, "one byte changed in the query"),
        ] {
            let refused = one.post(path, Some("alice"), Some(&key), body).await;
            assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY, "{what}");
            assert_eq!(refused.code(), "idempotency_key_reused", "{what}");
        }

        // An instance that reads the record from the store first meets another intent: what it
        // keeps must not make that intent look like the record's.
        for _ in 0..2 {
            let refused = two
                .post("/effects?b=2&a=1", Some("alice"), Some(&key), other)
                .await;
            assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY);
        }
        let replayed = two
            .post("/effects?a=1&b=2", Some("alice"), Some(&key), respelled)
            .await;
        assert!(replayed.replayed());
        assert_eq!(replayed.body, first.body);
        for body in [sent, respelled] {
            assert!(
                two.post("/effects?b=2&a=1", Some("alice"), Some(&key), body)
                    .await
                    .replayed()
            );
        }
        assert_eq!(
            two.post("/effects?b=2&a=1", Some("alice"), Some(&key), other)
                .await
                .status,
            StatusCode::UNPROCESSABLE_ENTITY
        );

        assert_eq!(one.executions() + two.executions(), 1);
        assert_eq!(DB::count_effects(&one.pool, "cached-intent").await, 1);
        one.dispose().await;
        two.dispose().await;
        DB::dispose(isolated).await;
    }

    pub(crate) async fn cached_record_stops_answering_at_its_expiry<DB: Db>() {
        let clock = ManualClock::new(SystemTime::now());
        let app = serve_fresh::<DB>(8, |layer| {
            layer
                .retention(Duration::from_millis(400))
                .cache_replays(1 << 20)
                .timed_by(clock.clone())
        })
        .await;
        let key = unique("cached-ttl");
        let first = app
            .post("/effects", Some("alice"), Some(&key), &body("cached-ttl"))
            .await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(
            app.post("/effects", Some("alice"), Some(&key), &body("cached-ttl"))
                .await
                .replayed()
        );
        clock.advance(Duration::from_millis(600));
        let after = app
            .post("/effects", Some("alice"), Some(&key), &body("cached-ttl"))
            .await;
        assert_eq!(after.status, StatusCode::CREATED);
        assert!(!after.replayed(), "an expired key is a new intent");
        assert_eq!(app.executions(), 2);
        assert_eq!(DB::count_effects(&app.pool, "cached-ttl").await, 2);
        assert_eq!(DB::count_records(&app.pool).await, 1);
        app.dispose().await;
    }

    pub(crate) async fn storm_across_two_caching_instances_executes_once<DB: Db>() {
        let isolated = DB::fresh(8).await;
        let one = serve(isolated.pool.clone(), |layer| layer.cache_replays(1 << 20)).await;
        let two = serve(DB::another_pool(&isolated, 8).await, |layer| {
            layer.cache_replays(1 << 20)
        })
        .await;
        let key = unique("cached-storm");
        let payload = body("cached-storm");
        let mut first_body = None;
        for round in 0..2 {
            let requests = (0..50).map(|i| {
                let app = if i % 2 == 0 { &one } else { &two };
                app.post("/effects", Some("alice"), Some(&key), &payload)
            });
            let replies = futures_util::future::join_all(requests).await;
            assert!(
                replies.iter().all(|r| r.status == StatusCode::CREATED),
                "round {round}: {replies:?}"
            );
            let expected = first_body.get_or_insert_with(|| replies[0].body.clone());
            assert!(replies.iter().all(|r| &r.body == expected));
            let originals = replies.iter().filter(|r| !r.replayed()).count();
            assert_eq!(originals, usize::from(round == 0), "round {round}");
        }
        assert_eq!(one.executions() + two.executions(), 1);
        assert_eq!(DB::count_effects(&one.pool, "cached-storm").await, 1);
        one.dispose().await;
        two.dispose().await;
        DB::dispose(isolated).await;
    }

    async fn storm<DB: Db>(apps: &[&App<DB>], n: usize, label: &str) -> Vec<crate::common::Reply> {
        let key = unique("storm");
        let payload = body(label);
        let mut requests = Vec::new();
        for i in 0..n {
            let app = apps[i % apps.len()];
            requests.push(app.post("/effects", Some("alice"), Some(&key), &payload));
        }
        futures_util::future::join_all(requests).await
    }

    pub(crate) async fn storm_of_50_concurrent_duplicates_executes_once<DB: Db>() {
        let app = app::<DB>().await;
        let replies = storm(&[&app], 50, "storm").await;
        assert_eq!(app.executions(), 1, "the business ran once");
        assert_eq!(DB::count_effects(&app.pool, "storm").await, 1);
        let first = replies
            .iter()
            .find(|r| !r.replayed())
            .expect("one original")
            .clone();
        assert_eq!(first.status, StatusCode::CREATED);
        for reply in &replies {
            assert!(!reply.status.is_server_error(), "no 5xx: {reply:?}");
            assert_eq!(
                reply.status,
                StatusCode::CREATED,
                "every duplicate waited and replayed: {reply:?}"
            );
            assert_eq!(reply.body, first.body);
        }
        assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
        app.dispose().await;
    }

    pub(crate) async fn two_instances_on_separate_pools_execute_once<DB: Db>() {
        let isolated = DB::fresh(8).await;
        let one = serve(isolated.pool.clone(), |layer| layer).await;
        let two = second_instance(&isolated).await;
        let replies = storm(&[&one, &two], 50, "two-instances").await;
        assert_eq!(one.executions() + two.executions(), 1);
        assert_eq!(DB::count_effects(&one.pool, "two-instances").await, 1);
        assert!(
            replies.iter().all(|r| r.status == StatusCode::CREATED),
            "{replies:?}"
        );
        one.dispose().await;
        two.dispose().await;
        DB::dispose(isolated).await;
    }

    pub(crate) async fn two_instances_split_duplicates_of_many_keys_execute_each_once<DB: Db>() {
        const KEYS: usize = 16;
        const DUPLICATES: usize = 8;
        let isolated = DB::fresh(8).await;
        // What two processes would have apart: pools, layers, servers and HTTP clients.
        let one = Arc::new(serve(isolated.pool.clone(), |layer| layer).await);
        let two = Arc::new(second_instance(&isolated).await);
        let keys: Vec<String> = (0..KEYS).map(|_| unique("split")).collect();
        let payload = |k: usize| {
            // The original holds its claim a moment, so duplicates meet it in flight.
            json!({ "label": format!("split-{k}"), "sleep_ms": 100 }).to_string()
        };
        // Every request is spawned and waits for all the others, so they leave at once.
        let start = Arc::new(tokio::sync::Barrier::new(KEYS * DUPLICATES));
        let mut requests = Vec::new();
        for (k, key) in keys.iter().enumerate() {
            for d in 0..DUPLICATES {
                let app = Arc::clone(if d % 2 == 0 { &one } else { &two });
                let start = Arc::clone(&start);
                let key = key.clone();
                let payload = payload(k);
                requests.push(tokio::spawn(async move {
                    start.wait().await;
                    app.post("/effects", Some("alice"), Some(&key), &payload)
                        .await
                }));
            }
        }
        let mut replies = Vec::new();
        for request in requests {
            replies.push(request.await.expect("request task"));
        }

        for (k, (key, answers)) in keys.iter().zip(replies.chunks(DUPLICATES)).enumerate() {
            let label = format!("split-{k}");
            assert_eq!(
                DB::count_effects(&one.pool, &label).await,
                1,
                "{label}: the business ran once"
            );
            let (in_progress, answered): (Vec<_>, Vec<_>) = answers
                .iter()
                .partition(|r| r.status == StatusCode::CONFLICT);
            // A duplicate still waiting when its wait runs out is told to come back later: the
            // one answer the contract allows besides the replay.
            for reply in &in_progress {
                assert_eq!(
                    reply.code(),
                    "idempotency_request_in_progress",
                    "{label}: {reply:?}"
                );
                assert!(reply.headers.contains_key("retry-after"), "{label}");
                assert!(!reply.replayed(), "{label}");
            }
            let originals: Vec<_> = answered.iter().filter(|r| !r.replayed()).collect();
            assert_eq!(originals.len(), 1, "{label}: one original: {answers:?}");
            let original = originals[0];
            assert_eq!(
                original.status,
                StatusCode::CREATED,
                "{label}: {original:?}"
            );
            for reply in &answered {
                assert_eq!(reply.status, original.status, "{label}: {reply:?}");
                assert_eq!(reply.body, original.body, "{label}: {reply:?}");
                assert_eq!(
                    reply.headers["location"], original.headers["location"],
                    "{label}"
                );
            }
            for app in [&one, &two] {
                let again = app
                    .post("/effects", Some("alice"), Some(key), &payload(k))
                    .await;
                assert!(again.replayed(), "{label}: {again:?}");
                assert_eq!(again.status, original.status, "{label}");
                assert_eq!(again.body, original.body, "{label}");
            }
        }
        assert_eq!(one.executions() + two.executions(), KEYS);
        assert_eq!(
            DB::count_records(&one.pool).await,
            i64::try_from(KEYS).expect("keys")
        );
        two.pool.close().await;
        drop((one, two));
        DB::dispose(isolated).await;
    }

    pub(crate) async fn retry_reaching_an_instance_that_never_saw_the_key_gets_the_stored_answer<
        DB: Db,
    >() {
        // The second instance has handled none of these keys, so it claims each one without
        // reading first, and must find the stored record through its failed claim.
        let ttl = Duration::from_millis(1500);
        // One clock for both instances, as one wall clock would be.
        let clock = ManualClock::new(SystemTime::now());
        let isolated = DB::fresh(8).await;
        let one = serve(isolated.pool.clone(), |layer| {
            layer.retention(ttl).timed_by(clock.clone())
        })
        .await;
        let two = serve(DB::another_pool(&isolated, 8).await, |layer| {
            layer.retention(ttl).timed_by(clock.clone())
        })
        .await;
        let key = unique("elsewhere");
        let refused_key = unique("elsewhere-refused");
        let expiring_key = unique("elsewhere-expiring");
        let started = Instant::now();
        let first = one
            .post("/effects", Some("alice"), Some(&key), &body("elsewhere"))
            .await;
        assert_eq!(first.status, StatusCode::CREATED);
        let refused = one
            .post("/fail/403", Some("alice"), Some(&refused_key), &body("no"))
            .await;
        assert_eq!(refused.status, StatusCode::FORBIDDEN);
        let expiring = one
            .post(
                "/effects",
                Some("alice"),
                Some(&expiring_key),
                &body("expiring"),
            )
            .await;
        assert_eq!(expiring.status, StatusCode::CREATED);

        let again = two
            .post("/effects", Some("alice"), Some(&key), &body("elsewhere"))
            .await;
        assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
        assert!(again.replayed());
        assert_eq!(again.body, first.body, "byte-identical body");
        assert_eq!(again.headers["location"], first.headers["location"]);
        let changed = two
            .post("/effects", Some("alice"), Some(&key), &body("changed"))
            .await;
        assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(changed.code(), "idempotency_key_reused");
        let refused_again = two
            .post("/fail/403", Some("alice"), Some(&refused_key), &body("no"))
            .await;
        assert_eq!(refused_again.status, StatusCode::FORBIDDEN);
        assert!(refused_again.replayed());
        assert_eq!(refused_again.body, refused.body);
        assert!(
            started.elapsed() < ttl,
            "the replays above must run before the records expire"
        );
        assert_eq!(two.executions(), 0, "nothing ran twice");
        assert_eq!(DB::count_effects(&one.pool, "elsewhere").await, 1);

        // An expired record is replaced by the claim itself, once.
        clock.advance(ttl + Duration::from_millis(200));
        let payload = body("expiring");
        let storm =
            (0..10).map(|_| two.post("/effects", Some("alice"), Some(&expiring_key), &payload));
        let replies = futures_util::future::join_all(storm).await;
        assert!(
            replies.iter().all(|r| r.status == StatusCode::CREATED),
            "{replies:?}"
        );
        assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
        assert_eq!(two.executions(), 1, "the expired key ran again, once");
        assert_eq!(DB::count_effects(&one.pool, "expiring").await, 2);
        assert_eq!(DB::count_records(&one.pool).await, 3);
        assert_eq!(open_transactions::<DB>(&isolated.url).await, 0);
        one.dispose().await;
        two.dispose().await;
        DB::dispose(isolated).await;
    }

    pub(crate) async fn panic_leaves_no_record_and_the_retry_executes_once<DB: Db>() {
        let app = app::<DB>().await;
        let key = unique("panic");
        let label = unique("panic");
        let payload = json!({ "label": label }).to_string();
        let crashed = app
            .post("/panic", Some("alice"), Some(&key), &payload)
            .await;
        assert_eq!(crashed.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(crashed.code(), "idempotency_internal_error");
        assert_eq!(
            DB::count_records(&app.pool).await,
            0,
            "no record after a panic"
        );
        assert_eq!(
            DB::count_effects(&app.pool, &label).await,
            0,
            "no partial write"
        );

        let retried = app
            .post("/panic", Some("alice"), Some(&key), &payload)
            .await;
        assert_eq!(
            retried.status,
            StatusCode::CREATED,
            "the retry executes: {retried:?}"
        );
        assert!(!retried.replayed());
        assert_eq!(DB::count_effects(&app.pool, &label).await, 1);
        assert_eq!(app.executions(), 2);
        assert!(
            app.post("/panic", Some("alice"), Some(&key), &payload)
                .await
                .replayed()
        );
        assert_eq!(app.executions(), 2, "executed once after the crash");
        app.dispose().await;
    }

    pub(crate) async fn server_error_leaves_no_record_and_the_retry_executes_once<DB: Db>() {
        let app = app::<DB>().await;
        let key = unique("5xx");
        let failed = app
            .post("/fail/503", Some("alice"), Some(&key), &body("5xx"))
            .await;
        assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(!failed.replayed());
        assert_eq!(DB::count_records(&app.pool).await, 0);
        assert_eq!(DB::count_effects(&app.pool, "5xx").await, 0);

        let retried = app
            .post("/fail/503", Some("alice"), Some(&key), &body("5xx"))
            .await;
        assert_eq!(retried.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            !retried.replayed(),
            "a retryable failure is executed again, not replayed"
        );
        assert_eq!(app.executions(), 2);

        for status in [408, 429, 500] {
            let key = unique("retryable");
            let reply = app
                .post(
                    &format!("/fail/{status}"),
                    Some("alice"),
                    Some(&key),
                    &body("retryable"),
                )
                .await;
            assert_eq!(reply.status.as_u16(), status);
        }
        assert_eq!(DB::count_records(&app.pool).await, 0);
        assert_eq!(DB::count_effects(&app.pool, "retryable").await, 0);
        app.dispose().await;
    }

    pub(crate) async fn final_client_error_is_replayed_with_its_writes_undone<DB: Db>() {
        let app = app::<DB>().await;
        for status in [400u16, 403, 404, 409, 422] {
            let key = unique("final");
            let label = format!("final-{status}");
            let first = app
                .post(
                    &format!("/fail/{status}"),
                    Some("alice"),
                    Some(&key),
                    &body(&label),
                )
                .await;
            assert_eq!(first.status.as_u16(), status);
            assert!(!first.replayed());
            assert_eq!(
                DB::count_effects(&app.pool, &label).await,
                0,
                "the refusal's writes are undone"
            );

            let again = app
                .post(
                    &format!("/fail/{status}"),
                    Some("alice"),
                    Some(&key),
                    &body(&label),
                )
                .await;
            assert_eq!(again.status.as_u16(), status);
            assert!(again.replayed(), "a final refusal is replayed");
            assert_eq!(again.body, first.body);
        }
        assert_eq!(app.executions(), 5);
        assert_eq!(DB::count_records(&app.pool).await, 5);
        app.dispose().await;
    }

    pub(crate) async fn changed_intent_is_rejected_without_execution<DB: Db>() {
        let app = app::<DB>().await;
        let key = unique("reuse");
        let first = app
            .post(
                "/effects",
                Some("alice"),
                Some(&key),
                r#"{"label":"reuse","amount":12.5}"#,
            )
            .await;
        assert_eq!(first.status, StatusCode::CREATED);
        let changed = app
            .post(
                "/effects",
                Some("alice"),
                Some(&key),
                r#"{"label":"reuse","amount":12.500000001}"#,
            )
            .await;
        assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(changed.code(), "idempotency_key_reused");
        assert_eq!(changed.headers["content-type"], "application/problem+json");
        assert!(!changed.replayed());
        assert_eq!(
            app.executions(),
            1,
            "neither the old nor the new parameters ran again"
        );
        assert_eq!(DB::count_effects(&app.pool, "reuse").await, 1);
        app.dispose().await;
    }

    pub(crate) async fn equivalent_json_and_ignored_fields_replay<DB: Db>() {
        let app = serve_fresh::<DB>(8, |layer| {
            layer.ignore_json_fields(["/trace_id", "/request_time"])
        })
        .await;
        let key = unique("canon");
        let first = app
            .post(
                "/effects",
                Some("alice"),
                Some(&key),
                r#"{"label":"canon","amount":12.5,"trace_id":"a","request_time":"10:00"}"#,
            )
            .await;
        assert_eq!(first.status, StatusCode::CREATED);
        let same = app
            .post("/effects", Some("alice"), Some(&key), "{ \"request_time\": \"10:05\", \"amount\" : 1.25e1,\n \"label\":\"canon\", \"trace_id\":\"b\" }")
            .await;
        assert!(
            same.replayed(),
            "key order, whitespace, number spelling and ignored fields do not change intent: {same:?}"
        );
        assert_eq!(same.body, first.body);
        assert_eq!(app.executions(), 1);
        app.dispose().await;
    }

    pub(crate) async fn other_principal_and_other_route_are_isolated<DB: Db>() {
        let app = app::<DB>().await;
        let key = unique("shared");
        let alice = app
            .post("/effects", Some("alice"), Some(&key), &body("alice"))
            .await;
        let bob = app
            .post("/effects", Some("bob"), Some(&key), &body("bob"))
            .await;
        assert_eq!(bob.status, StatusCode::CREATED);
        assert!(!bob.replayed(), "bob never sees alice's result");
        assert_ne!(bob.body, alice.body);
        let other_route = app
            .post("/other", Some("alice"), Some(&key), &body("alice"))
            .await;
        assert_eq!(other_route.status, StatusCode::CREATED);
        assert!(
            !other_route.replayed(),
            "a key on another route is another intent"
        );
        assert_eq!(app.executions(), 3);
        let bob_again = app
            .post("/effects", Some("bob"), Some(&key), &body("bob"))
            .await;
        assert!(bob_again.replayed());
        assert_eq!(bob_again.body, bob.body);
        app.dispose().await;
    }

    pub(crate) async fn concrete_path_and_query_are_part_of_the_intent<DB: Db>() {
        let app = app::<DB>().await;
        let key = unique("path");
        let one = app
            .post("/effects/1/touch", Some("alice"), Some(&key), &body("path"))
            .await;
        assert_eq!(one.status, StatusCode::CREATED);
        let two = app
            .post("/effects/2/touch", Some("alice"), Some(&key), &body("path"))
            .await;
        assert_eq!(
            two.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "same route template, other resource"
        );
        let key = unique("query");
        let a = app
            .post(
                "/effects?a=1&b=2",
                Some("alice"),
                Some(&key),
                &body("query"),
            )
            .await;
        assert_eq!(a.status, StatusCode::CREATED);
        let reordered = app
            .post(
                "/effects?b=2&a=1",
                Some("alice"),
                Some(&key),
                &body("query"),
            )
            .await;
        assert!(reordered.replayed());
        let changed = app
            .post(
                "/effects?a=1&b=3",
                Some("alice"),
                Some(&key),
                &body("query"),
            )
            .await;
        assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(app.executions(), 2);
        app.dispose().await;
    }

    pub(crate) async fn expired_key_is_a_new_intent_claimed_once<DB: Db>() {
        let clock = ManualClock::new(SystemTime::now());
        let app = serve_fresh::<DB>(16, |layer| {
            layer
                .retention(Duration::from_millis(400))
                .timed_by(clock.clone())
        })
        .await;
        let key = unique("ttl");
        let first = app
            .post("/effects", Some("alice"), Some(&key), &body("ttl"))
            .await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(
            app.post("/effects", Some("alice"), Some(&key), &body("ttl"))
                .await
                .replayed()
        );
        clock.advance(Duration::from_millis(600));

        let payload = body("ttl");
        let storm = (0..20).map(|_| app.post("/effects", Some("alice"), Some(&key), &payload));
        let replies = futures_util::future::join_all(storm).await;
        assert_eq!(
            app.executions(),
            2,
            "the expired record was replaced exactly once"
        );
        assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
        assert!(replies.iter().all(|r| r.status == StatusCode::CREATED));
        assert_eq!(DB::count_records(&app.pool).await, 1);
        app.dispose().await;
    }

    pub(crate) async fn purge_deletes_only_expired_records<DB: Db>() {
        let isolated = DB::fresh(8).await;
        let short = serve(isolated.pool.clone(), |layer| {
            layer.retention(Duration::from_millis(200))
        })
        .await;
        let long = second_instance(&isolated).await;
        for i in 0..5 {
            short
                .post(
                    "/effects",
                    Some("alice"),
                    Some(&unique("short")),
                    &body(&format!("s{i}")),
                )
                .await;
        }
        long.post(
            "/effects",
            Some("alice"),
            Some(&unique("long")),
            &body("kept"),
        )
        .await;
        assert_eq!(DB::count_records(&short.pool).await, 6);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let purged = short
            .layer
            .engine()
            .store()
            .purge_expired()
            .await
            .expect("purge");
        assert_eq!(purged, 5);
        assert_eq!(
            DB::count_records(&short.pool).await,
            1,
            "the live record survives"
        );
        assert_eq!(
            short
                .layer
                .engine()
                .store()
                .purge_expired()
                .await
                .expect("purge"),
            0
        );
        short.dispose().await;
        long.dispose().await;
        DB::dispose(isolated).await;
    }

    pub(crate) async fn body_over_the_limit_is_rejected_before_any_claim<DB: Db>() {
        let app = serve_fresh::<DB>(8, |layer| layer.max_request_body(1024)).await;
        let big = json!({ "label": "big", "pad": "x".repeat(2048) }).to_string();
        let reply = app
            .post("/effects", Some("alice"), Some(&unique("big")), &big)
            .await;
        assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(reply.code(), "idempotency_body_too_large");
        assert_eq!(app.executions(), 0);
        assert_eq!(DB::count_records(&app.pool).await, 0);
        app.dispose().await;
    }

    /// Sends a keyed `POST /effects` head on a raw connection, declaring `length` body bytes.
    async fn send_head(app: &App<impl Db>, length: usize) -> tokio::net::TcpStream {
        use tokio::io::AsyncWriteExt;
        let mut stream = tokio::net::TcpStream::connect(app.addr)
            .await
            .expect("connect");
        let head = format!(
            "POST /effects HTTP/1.1\r\nhost: test\r\nauthorization: Bearer alice\r\n\
             idempotency-key: {}\r\ncontent-type: application/json\r\n\
             content-length: {length}\r\n\r\n",
            unique("slow-client")
        );
        stream.write_all(head.as_bytes()).await.expect("head");
        stream
    }

    /// Reads until the server closes the connection or `limit` passes; returns what was read
    /// and whether the connection was closed.
    async fn read_until_closed(
        stream: &mut tokio::net::TcpStream,
        limit: Duration,
    ) -> (String, bool) {
        use tokio::io::AsyncReadExt;
        let mut answer = Vec::new();
        let mut buffer = [0u8; 4096];
        let read_all = async {
            loop {
                match stream.read(&mut buffer).await {
                    Ok(0) | Err(_) => return true,
                    Ok(n) => answer.extend_from_slice(&buffer[..n]),
                }
            }
        };
        let closed = tokio::time::timeout(limit, read_all).await.unwrap_or(false);
        (String::from_utf8_lossy(&answer).into_owned(), closed)
    }

    pub(crate) async fn declared_body_over_the_limit_is_refused_before_it_is_sent<DB: Db>() {
        let app = serve_fresh::<DB>(8, |layer| layer).await;
        let started = Instant::now();
        // 50 MiB declared against the default 1 MiB, and never sent.
        let mut stream = send_head(&app, 50 * 1024 * 1024).await;
        let (answer, closed) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        assert!(answer.contains("idempotency_body_too_large"), "{answer}");
        assert!(
            closed,
            "the connection is closed, not left waiting for the body"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "answered without waiting for the body or the deadline"
        );
        assert_eq!(app.executions(), 0);
        assert_eq!(DB::count_records(&app.pool).await, 0);
        app.dispose().await;
    }

    pub(crate) async fn slow_body_is_answered_by_the_deadline_and_its_connection_closed<DB: Db>() {
        use tokio::io::AsyncWriteExt;
        let deadline = Duration::from_secs(1);
        let app = serve_fresh::<DB>(8, |layer| layer.deadline(deadline)).await;
        let started = Instant::now();
        let stream = send_head(&app, 100).await;
        let (mut reader, mut writer) = stream.into_split();
        // One byte every 100 ms: the whole body would take 10 s.
        let trickle = tokio::spawn(async move {
            for _ in 0..100 {
                if writer.write_all(b" ").await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        // Meanwhile a normal keyed request is served as usual.
        let normal = app
            .post(
                "/effects",
                Some("alice"),
                Some(&unique("normal")),
                &body("normal"),
            )
            .await;
        assert_eq!(normal.status, StatusCode::CREATED);

        use tokio::io::AsyncReadExt;
        let mut answer = Vec::new();
        let closed = tokio::time::timeout(deadline + Duration::from_secs(5), async {
            let mut buffer = [0u8; 4096];
            loop {
                match reader.read(&mut buffer).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => answer.extend_from_slice(&buffer[..n]),
                }
            }
        })
        .await
        .is_ok();
        trickle.abort();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("idempotency_body_timeout"), "{answer}");
        assert!(
            answer.to_ascii_lowercase().contains("retry-after: 1"),
            "{answer}"
        );
        assert!(closed, "the connection is closed within deadline + 5 s");
        assert!(started.elapsed() < deadline + Duration::from_secs(5));
        assert_eq!(app.executions(), 1, "only the normal request ran");
        app.dispose().await;
    }

    pub(crate) async fn duplicate_past_the_wait_gets_409_with_retry_after<DB: Db>() {
        let app = serve_fresh::<DB>(8, |layer| {
            layer.wait_for_in_flight(Duration::from_millis(200))
        })
        .await;
        let key = unique("slow");
        let payload = r#"{"label":"slow","sleep_ms":1500}"#;
        let original = app.post("/effects", Some("alice"), Some(&key), payload);
        let duplicate = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            app.post("/effects", Some("alice"), Some(&key), payload)
                .await
        };
        let (original, duplicate) = tokio::join!(original, duplicate);
        assert_eq!(original.status, StatusCode::CREATED);
        assert_eq!(duplicate.status, StatusCode::CONFLICT, "{duplicate:?}");
        assert_eq!(duplicate.code(), "idempotency_request_in_progress");
        assert!(duplicate.headers.get("retry-after").is_some());
        assert_eq!(
            app.executions(),
            1,
            "the duplicate never started the business"
        );
        let later = app
            .post("/effects", Some("alice"), Some(&key), payload)
            .await;
        assert!(later.replayed());
        assert_eq!(later.body, original.body);
        app.dispose().await;
    }

    pub(crate) async fn missing_or_malformed_key_is_rejected<DB: Db>() {
        let app = app::<DB>().await;
        let missing = app.post("/effects", Some("alice"), None, &body("k")).await;
        assert_eq!(missing.status, StatusCode::BAD_REQUEST);
        assert_eq!(missing.code(), "idempotency_key_missing");
        for bad in ["", "has space", &"x".repeat(256), "a,b"] {
            let reply = app
                .post("/effects", Some("alice"), Some(bad), &body("k"))
                .await;
            assert_eq!(reply.status, StatusCode::BAD_REQUEST, "key {bad:?}");
            assert_eq!(reply.code(), "idempotency_key_invalid", "key {bad:?}");
        }
        let two = app
            .send(
                "POST",
                "/effects",
                &[
                    ("authorization", "Bearer alice".into()),
                    ("content-type", "application/json".into()),
                    ("idempotency-key", "k1".into()),
                    ("idempotency-key", "k2".into()),
                ],
                body("k").into_bytes(),
            )
            .await;
        assert_eq!(two.code(), "idempotency_key_invalid");
        assert_eq!(app.executions(), 0);
        let key = unique("sf");
        let bare = app
            .post("/effects", Some("alice"), Some(&key), &body("sf"))
            .await;
        let quoted = app
            .post(
                "/effects",
                Some("alice"),
                Some(&format!("\"{key}\"")),
                &body("sf"),
            )
            .await;
        assert!(!bare.replayed());
        assert!(
            quoted.replayed(),
            "bare and sf-string spellings are one key"
        );
        app.dispose().await;
    }

    pub(crate) async fn missing_principal_is_401_unless_anonymous_is_allowed<DB: Db>() {
        let app = app::<DB>().await;
        let reply = app
            .post("/effects", None, Some(&unique("anon")), &body("anon"))
            .await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
        assert_eq!(reply.code(), "idempotency_principal_missing");
        assert_eq!(app.executions(), 0);

        let open = serve_fresh::<DB>(8, |layer| layer.allow_anonymous()).await;
        let key = unique("anon");
        let first = open.post("/effects", None, Some(&key), &body("anon")).await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(
            open.post("/effects", None, Some(&key), &body("anon"))
                .await
                .replayed()
        );
        let alice = open
            .post("/effects", Some("alice"), Some(&key), &body("anon"))
            .await;
        assert!(!alice.replayed(), "the anonymous scope is not alice's");
        app.dispose().await;
        open.dispose().await;
    }

    pub(crate) async fn transaction_held_past_the_handler_is_rolled_back_with_an_error<DB: Db>() {
        let app = app::<DB>().await;
        let reply = app
            .post("/hold", Some("alice"), Some(&unique("hold")), &body("held"))
            .await;
        assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(reply.code(), "idempotency_transaction_held");
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert_eq!(DB::count_effects(&app.pool, "held").await, 0);
        assert_eq!(DB::count_records(&app.pool).await, 0);
        app.dispose().await;
    }

    pub(crate) async fn oversized_response_is_rolled_back<DB: Db>() {
        let app = app::<DB>().await;
        let reply = app
            .post("/big", Some("alice"), Some(&unique("big")), &body("big"))
            .await;
        assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(reply.code(), "idempotency_response_too_large");
        assert_eq!(DB::count_effects(&app.pool, "big").await, 0);
        assert_eq!(DB::count_records(&app.pool).await, 0);
        app.dispose().await;
    }

    pub(crate) async fn job_and_http_request_racing_on_one_key_execute_once<DB: Db>() {
        let app = app::<DB>().await;
        let key = unique("race");
        let payload = body("race");
        let (parts, _) = Request::post("/effects")
            .header("content-type", "application/json")
            .body(())
            .expect("request")
            .into_parts();
        let fingerprint = Fingerprinter::new().fingerprint(&parts, payload.as_bytes());
        let scope = Scope::new(
            "alice",
            "POST",
            "/effects",
            key.parse::<IdempotencyKey>().expect("key"),
        );

        let engine = app.layer.engine().clone();
        let jobs = (0..10).map(|_| {
            let engine = engine.clone();
            let scope = scope.clone();
            async move {
                engine
                    .run(&scope, fingerprint, |mut tx: Tx<DB>| async move {
                        let id = DB::insert_effect(&mut tx, "race").await.expect("insert");
                        (
                            StatusCode::CREATED,
                            axum::Json(json!({ "id": id, "label": "race", "by": "job" })),
                        )
                    })
                    .await
            }
        });
        let https = (0..10).map(|_| app.post("/effects", Some("alice"), Some(&key), &payload));
        let (jobs, https) = tokio::join!(
            futures_util::future::join_all(jobs),
            futures_util::future::join_all(https)
        );

        assert_eq!(
            DB::count_effects(&app.pool, "race").await,
            1,
            "the business ran once"
        );
        let executed = jobs
            .iter()
            .filter(|r| matches!(r, Ok(e) if e.outcome == Outcome::Executed))
            .count()
            + https.iter().filter(|r| !r.replayed()).count();
        assert_eq!(executed, 1);
        assert!(jobs.iter().all(|r| r.is_ok()), "{jobs:?}");
        assert!(https.iter().all(|r| r.status == StatusCode::CREATED));
        let bodies: Vec<_> = https.iter().map(|r| r.body.clone()).collect();
        assert!(
            bodies.windows(2).all(|w| w[0] == w[1]),
            "everyone got the one outcome"
        );

        let other = Fingerprinter::new().fingerprint(&parts, body("different").as_bytes());
        let mismatch = engine
            .run(&scope, other, |_tx: Tx<DB>| async { StatusCode::OK })
            .await;
        assert!(matches!(
            mismatch,
            Err(RunError::Rejected(Rejection::KeyReused))
        ));
        app.dispose().await;
    }

    pub(crate) async fn migrate_twice_and_concurrently_is_a_no_op<DB: Db>() {
        let isolated = DB::fresh(8).await;
        let store = DB::store(isolated.pool.clone());
        let other = DB::store(DB::another_pool(&isolated, 4).await);
        let (a, b) = tokio::join!(store.migrate(), other.migrate());
        a.expect("first concurrent migrate");
        b.expect("second concurrent migrate");
        store.migrate().await.expect("third migrate is a no-op");
        assert_eq!(DB::count_records(&isolated.pool).await, 0);
        drop((store, other));
        DB::dispose(isolated).await;
    }

    pub(crate) async fn clients_hanging_up_mid_request_leave_no_open_transaction<DB: Db>() {
        let isolated = DB::fresh(4).await;
        let app = serve(isolated.pool.clone(), |layer| layer).await;
        let keys: Vec<String> = (0..60).map(|_| unique("hangup")).collect();
        let payload = r#"{"label":"hangup","sleep_ms":20}"#;
        let hangups = keys.iter().enumerate().map(|(i, key)| {
            let app = &app;
            async move {
                let patience = Duration::from_millis((i % 7) as u64 * 5);
                let _ = tokio::time::timeout(
                    patience,
                    app.post("/effects", Some("alice"), Some(key), payload),
                )
                .await;
            }
        });
        futures_util::future::join_all(hangups).await;

        // Every key then settles to exactly one execution, and nothing waits forever on a
        // connection left inside a transaction (the pool has only four).
        let deadline = Instant::now() + Duration::from_secs(30);
        for key in &keys {
            let reply = tokio::time::timeout(
                Duration::from_secs(15),
                app.post("/effects", Some("alice"), Some(key), payload),
            )
            .await
            .expect("a request after the hang-ups completes");
            assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
            assert!(Instant::now() < deadline);
        }
        assert_eq!(
            DB::count_effects(&app.pool, "hangup").await,
            keys.len() as i64
        );
        assert_eq!(DB::count_records(&app.pool).await, keys.len() as i64);
        assert_eq!(open_transactions::<DB>(&isolated.url).await, 0);
        app.dispose().await;
        DB::dispose(isolated).await;
    }

    /// Sessions of this test's database left idle inside a transaction (none on SQLite).
    #[cfg_attr(
        not(any(feature = "mysql", feature = "postgres")),
        allow(unused_variables)
    )]
    async fn open_transactions<DB: Backend>(url: &str) -> i64 {
        #[cfg(feature = "mysql")]
        if DB::NAME == "MySQL" {
            use sqlx::Connection;
            let mut admin = sqlx::MySqlConnection::connect(&crate::common::mysql_url())
                .await
                .expect("admin");
            let mut open = 0;
            for _ in 0..20 {
                open = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM information_schema.innodb_trx t \
                     JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id \
                     WHERE p.db = ? AND p.command = 'Sleep'",
                )
                .bind(url)
                .fetch_one(&mut admin)
                .await
                .expect("innodb_trx");
                if open == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            return open;
        }
        if DB::NAME != "PostgreSQL" {
            return 0;
        }
        #[cfg(feature = "postgres")]
        {
            let admin = sqlx::PgPool::connect(&crate::common::postgres_url())
                .await
                .expect("admin");
            let mut open = 0;
            for _ in 0..20 {
                open = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1 AND state LIKE 'idle in transaction%'",
                )
                .bind(url)
                .fetch_one(&admin)
                .await
                .expect("pg_stat_activity");
                if open == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            return open;
        }
        #[allow(unreachable_code)]
        0
    }

    pub(crate) async fn unkeyed_requests_commit_on_success_and_roll_back_on_failure<DB: Db>() {
        let app = app::<DB>().await;
        let headers = [
            ("authorization", "Bearer alice".to_owned()),
            ("content-type", "application/json".to_owned()),
        ];
        for _ in 0..2 {
            let ok = app
                .send("PUT", "/unkeyed", &headers, body("unkeyed").into_bytes())
                .await;
            assert_eq!(ok.status, StatusCode::CREATED);
            assert!(!ok.replayed());
        }
        assert_eq!(
            DB::count_effects(&app.pool, "unkeyed").await,
            2,
            "no key: not deduplicated, committed"
        );
        let failed = app
            .send(
                "PUT",
                "/unkeyed/fail/409",
                &headers,
                body("unkeyed-fail").into_bytes(),
            )
            .await;
        assert_eq!(failed.status, StatusCode::CONFLICT);
        assert_eq!(
            DB::count_effects(&app.pool, "unkeyed-fail").await,
            0,
            "rolled back"
        );
        assert_eq!(
            DB::count_records(&app.pool).await,
            0,
            "no records without a key"
        );
        app.dispose().await;
    }

    pub(crate) async fn unkeyed_requests_follow_the_layers_classification<DB: Db>() {
        // A rule that keeps nothing of a 201: the unkeyed path rolls it back as the keyed one
        // would, rather than committing by its own idea of success.
        let app = serve_fresh::<DB>(16, |layer| {
            layer.classify(|status| {
                if status == StatusCode::CREATED {
                    Classification::Retryable
                } else {
                    Classification::of_status(status)
                }
            })
        })
        .await;
        let headers = [
            ("authorization", "Bearer alice".to_owned()),
            ("content-type", "application/json".to_owned()),
        ];
        let answered = app
            .send("PUT", "/unkeyed", &headers, body("classified").into_bytes())
            .await;
        assert_eq!(answered.status, StatusCode::CREATED);
        assert_eq!(
            DB::count_effects(&app.pool, "classified").await,
            0,
            "classified retryable: rolled back"
        );
        app.dispose().await;
    }

    /// A job's scope and fingerprint, chosen equal to those of `POST /effects` with `body(label)`
    /// under that key, so HTTP duplicates meet the job's claim.
    fn job(label: &str) -> (String, Scope, Fingerprint) {
        let key = unique(label);
        let scope = Scope::new(
            "alice",
            "POST",
            "/effects",
            key.parse::<IdempotencyKey>().expect("key"),
        );
        let (parts, _) = Request::post("/effects")
            .header("content-type", "application/json")
            .body(())
            .expect("request")
            .into_parts();
        (
            key,
            scope,
            Fingerprinter::new().fingerprint(&parts, body(label).as_bytes()),
        )
    }

    pub(crate) async fn leased_work_runs_once_while_duplicates_wait_then_replay<DB: Db>() {
        let app = app::<DB>().await;
        let engine = app.layer.engine().clone();
        let (key, scope, fingerprint) = job("leased");
        let runs = Arc::new(AtomicUsize::new(0));
        let attempt = || {
            let (engine, scope, runs) = (engine.clone(), scope.clone(), runs.clone());
            async move {
                engine
                    .run_leased(
                        &scope,
                        fingerprint,
                        Duration::from_millis(600),
                        || async { None::<&str> },
                        move |_lease| async move {
                            runs.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(1500)).await;
                            (StatusCode::CREATED, "settled")
                        },
                    )
                    .await
            }
        };
        let first = tokio::spawn(attempt());
        tokio::time::sleep(Duration::from_millis(100)).await;
        let during = attempt().await;
        assert!(
            matches!(
                during,
                Err(RunError::Rejected(Rejection::InProgress { .. }))
            ),
            "{during:?}"
        );
        let over_http = app
            .post("/effects", Some("alice"), Some(&key), &body("leased"))
            .await;
        assert_eq!(
            over_http.status,
            StatusCode::CONFLICT,
            "the live lease holds HTTP duplicates off too"
        );
        let first = first.await.expect("join").expect("first run");
        assert_eq!(first.outcome, Outcome::Executed);
        let after = attempt().await.expect("replay");
        assert_eq!(after.outcome, Outcome::Replayed);
        assert_eq!(after.response.body().as_ref(), b"settled");
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "renewal kept the lease past its 600 ms while the work ran"
        );
        app.dispose().await;
    }

    pub(crate) async fn holder_that_dies_mid_work_is_taken_over_after_its_lease<DB: Db>() {
        let app = app::<DB>().await;
        let engine = app.layer.engine().clone();
        let (_, scope, fingerprint) = job("dies");
        let died = engine
            .run_leased(
                &scope,
                fingerprint,
                Duration::from_millis(2000),
                || async { None::<&str> },
                |_l| async {
                    panic!("the holder dies mid-work");
                    #[allow(unreachable_code)]
                    "unreachable"
                },
            )
            .await;
        assert!(matches!(died, Err(RunError::Panicked)), "{died:?}");
        let soon = engine
            .run_leased(
                &scope,
                fingerprint,
                Duration::from_millis(300),
                || async { None::<&str> },
                |_l| async { "too early" },
            )
            .await;
        assert!(
            matches!(soon, Err(RunError::Rejected(Rejection::InProgress { .. }))),
            "the dead holder's lease still counts: {soon:?}"
        );
        tokio::time::sleep(Duration::from_millis(2300)).await;
        let taken = engine
            .run_leased(
                &scope,
                fingerprint,
                Duration::from_millis(300),
                || async { None::<&str> },
                |_l| async { "finished by the next worker" },
            )
            .await
            .expect("taken over");
        assert_eq!(taken.outcome, Outcome::Executed);
        assert_eq!(
            taken.response.body().as_ref(),
            b"finished by the next worker"
        );
        app.dispose().await;
    }
}
